"""Triton-level helpers shared by the kernel bodies: the mask value, Triton's size rules, the device's SM count
(`sm_count`, which the kernels' launch heuristics read), the padded query group of a decode kernel, and
`masked_scatter`, the one place where interpret mode and compiled Triton code differ (its docstring says why).
No dependency on the rocketkv_jax core."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Scores of masked entries before the softmax. A large finite negative keeps exp() at exactly 0
# without producing inf - inf = NaN in the online-softmax correction.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Triton's dot needs every dimension >= 16.
MIN_DOT_DIM = 16

# The SM count where no GPU is visible (CPU tests, interpret mode, lowering for an abstract device): the H200's,
# the GPU the launch heuristics were tuned on.
DEFAULT_SM_COUNT = 132


def sm_count() -> int:
  """Streaming multiprocessors of the first device when it is a GPU (its `core_count`), else DEFAULT_SM_COUNT.
  The kernels' grids aim at a few waves of programs over them."""
  device = jax.devices()[0]
  count = getattr(device, "core_count", None) if device.platform == "gpu" else None
  return int(count) if count else DEFAULT_SM_COUNT


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pow2_pieces(n: int, unit: int) -> tuple[tuple[int, int], ...]:
  """n rounded up to a multiple of `unit` (a power of two), as consecutive power-of-two pieces, largest
  first: (start, size) each (n=539, unit=32: (0, 512), (512, 32); n=67, unit=16: (0, 64), (64, 16))."""
  total, out, start = cdiv(n, unit) * unit, [], 0
  for bit in reversed(range(total.bit_length())):
    if total & (1 << bit):
      out.append((start, 1 << bit))
      start += 1 << bit
  return tuple(out)


def row_blocks(arrays) -> list:
  """BlockSpecs of a (B, K) grid taking each array's (b, k) row whole (arrays: anything with a .shape of at
  least 2 dims, [B, K, ...])."""
  return [pl.BlockSpec((None, None) + tuple(x.shape[2:]), lambda b, k, n=len(x.shape) - 2: (b, k) + (0,) * n)
          for x in arrays]


def with_absent_refs(kernel, present):
  """A pallas_call body that runs kernel(*refs) with None in place of the refs not passed: `present` holds one
  bool per parameter of `kernel` (inputs, then outputs, in order), False where that ref is absent (an optional
  input left out of the call, such as a per-row value given as None)."""
  def body(*refs):
    it = iter(refs)
    kernel(*[next(it) if p else None for p in present])

  return body


def dot_precision(dtype):
  """float32 operands: full precision (no TF32); bf16: the native tensor-core path."""
  return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def page_slots(length, page, page_size: int):
  """Valid slots of page `page` for a sequence of `length` valid slots (page_size at most, 0 past it)."""
  return jnp.clip(length - page * page_size, 0, page_size)


def load_query_group(q_ref, cols=None):
  """The group's G query rows [G, H] (or their columns `cols`, a pl.ds), padded to Gp >= 16 rows for
  Triton's dot (pads are 0), and the [Gp] mask of real rows."""
  G, _ = q_ref.shape
  Gp = max(MIN_DOT_DIM, next_pow2(G))
  row_ok = jnp.arange(Gp) < G
  cols = slice(None) if cols is None else cols
  return pltriton.load(q_ref.at[pl.ds(0, Gp), cols], mask=row_ok[:, None], other=0), row_ok


def masked_scatter(ref, idx, value, mask, *, interpret: bool) -> None:
  """ref[idx[i]] = value[i] for every lane i where mask[i]; lanes where mask is False write nothing, so
  their index may be out of range or equal to a written lane's. idx: an index array (ref 1-D), or a tuple of
  one broadcasting index array per dimension of ref.

  Compiled, this is Triton's masked store, which drops the masked lanes. Interpret mode discharges a masked
  store as one XLA scatter of every lane (the old value where masked), so a masked lane that shares its
  index with a written lane may win (XLA leaves the order of duplicate updates open): there the masked lanes
  are sent out of range, where the scatter drops them. Masked loads, gathers by two broadcasting index
  arrays, and masked stores of contiguous blocks behave the same in both modes and need no helper.
  """
  idxs = idx if isinstance(idx, tuple) else (idx,)
  if interpret:
    idxs = tuple(jnp.where(mask, i, ref.shape[d]) for d, i in enumerate(idxs))
  pltriton.store(ref.at[idxs if len(idxs) > 1 else idxs[0]], value, mask=mask)

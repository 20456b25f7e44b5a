"""Small helpers shared by the Pallas kernels (no dependency on the rocketkv_jax core)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Scores of masked entries before the softmax. A large finite negative keeps exp() at exactly 0
# without producing inf - inf = NaN in the online-softmax correction.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Triton's dot needs every dimension >= 16.
MIN_DOT_DIM = 16

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e5m2))


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_dtype(name: str, dtype, allowed) -> None:
  if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in allowed):
    raise ValueError(f"{name}.dtype={jnp.dtype(dtype)} must be one of {[str(jnp.dtype(d)) for d in allowed]}")


def dot_precision(dtype):
  """float32 operands: full precision (no TF32); bf16: the native tensor-core path."""
  return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def page_slots(length, page, page_size: int):
  """Valid slots of page `page` for a sequence of `length` valid slots (page_size at most, 0 past it)."""
  return jnp.clip(length - page * page_size, 0, page_size)


_INT_MIN = -(2 ** 31)


def order_key(x):
  """int32 keys ordered as the float32 values x (-0 just below +0); NaN is not expected."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def best_units_take(key, weight, m):
  """Sort-free top-m inside a kernel. Entry i holds weight[i] >= 0 units that all score key[i] (an
  `order_key`); the m best units are taken, best key first, ties toward the lower index. Returns take[i]
  in [0, weight[i]] with sum(take) = min(m, sum(weight)).

  The m-th best key tau (the largest t with weight(key >= t) >= m) is found by bisection over the key
  bits (the sign bit, then bits 30..0: 32 masked sums); every unit above tau is taken, and of the units
  at tau the lowest entries, by an exclusive cumsum, until m are taken.
  """
  def weight_at_least(t):
    return jnp.sum(jnp.where(key >= t, weight, 0))

  tau = jnp.where(weight_at_least(jnp.int32(0)) >= m, jnp.int32(0), jnp.int32(_INT_MIN))

  def bit_step(i, t):
    cand = t | lax.shift_left(jnp.int32(1), jnp.int32(30) - i)
    return jnp.where(weight_at_least(cand) >= m, cand, t)

  tau = lax.fori_loop(0, 31, bit_step, tau)
  gt = key > tau
  eq_w = jnp.where(key == tau, weight, 0)
  need = m - jnp.sum(jnp.where(gt, weight, 0))
  eq_before = jnp.cumsum(eq_w) - eq_w
  return jnp.where(gt, weight, jnp.clip(need - eq_before, 0, eq_w))


def check_qkv(q_BKGH, k_BKSH, v_BKSH) -> tuple[int, int, int, int, int]:
  """Validates a decode-attention call's q [B, K, G, H] and cache k/v [B, K, S, H]; returns (B, K, G, H, S)."""
  if q_BKGH.ndim != 4 or k_BKSH.ndim != 4:
    raise ValueError(f"q_BKGH.shape={q_BKGH.shape} and k_BKSH.shape={k_BKSH.shape} must be 4-D")
  B, K, G, H = q_BKGH.shape
  S = k_BKSH.shape[2]
  if k_BKSH.shape != (B, K, S, H) or v_BKSH.shape != k_BKSH.shape:
    raise ValueError(f"k_BKSH.shape={k_BKSH.shape} and v_BKSH.shape={v_BKSH.shape} must both be "
                     f"(B, K, S, H) = ({B}, {K}, S, {H}) to match q_BKGH.shape={q_BKGH.shape}")
  if H & (H - 1):
    raise ValueError(f"head dim H={H} must be a power of two (64 or 128 supported)")
  if S < 1:
    raise ValueError(f"cache slots S={S} must be >= 1")
  check_dtype("q_BKGH", q_BKGH.dtype, FLOAT_DTYPES)
  if k_BKSH.dtype != q_BKGH.dtype or v_BKSH.dtype != q_BKGH.dtype:
    raise ValueError(f"k/v dtypes {k_BKSH.dtype}/{v_BKSH.dtype} must equal q dtype {q_BKGH.dtype}")
  return B, K, G, H, S


def check_kt_pages(kt_min_BKHP, kt_max_BKHP) -> tuple[int, int, int, int]:
  """Validates the channel-major KT min/max pages [B, K, H, P]; returns (B, K, H, P)."""
  if kt_min_BKHP.ndim != 4 or kt_max_BKHP.shape != kt_min_BKHP.shape:
    raise ValueError(f"kt_min_BKHP.shape={kt_min_BKHP.shape} and kt_max_BKHP.shape="
                     f"{kt_max_BKHP.shape} must be equal (B, K, H, P)")
  B, K, H, P = kt_min_BKHP.shape
  if H & (H - 1):
    raise ValueError(f"head dim H={H} must be a power of two (64 or 128 supported)")
  check_dtype("kt_min_BKHP", kt_min_BKHP.dtype, KT_DTYPES)
  if kt_max_BKHP.dtype != kt_min_BKHP.dtype:
    raise ValueError(f"kt_max dtype {kt_max_BKHP.dtype} must equal kt_min dtype {kt_min_BKHP.dtype}")
  return B, K, H, P


def split_grid(n: int, block: int, num_splits: int | None, target_programs: int, rows: int) -> tuple[int, int]:
  """(split length, splits) cutting `n` items into splits of whole `block`s: `num_splits` if given, else
  enough for about `target_programs` programs over `rows` (b, k) rows; never an empty split."""
  blocks = cdiv(n, block)
  if num_splits is None:
    num_splits = cdiv(target_programs, rows)
  num_splits = max(1, min(num_splits, blocks))
  split_len = cdiv(blocks, num_splits) * block
  return split_len, cdiv(n, split_len)


def masked_attention_reference(q_BKGH, k_BKMH, v_BKMH, valid_BKM):
  """Exact softmax attention (scale 1/sqrt(H), f32, full precision) of each query head of a KV group over
  the rows where `valid`; rows that are not valid never enter (NaN there is safe); no valid row gives 0."""
  H = q_BKGH.shape[-1]
  mask = valid_BKM[:, :, None, :]
  k = jnp.where(valid_BKM[..., None], k_BKMH.astype(jnp.float32), 0.0)
  v = jnp.where(valid_BKM[..., None], v_BKMH.astype(jnp.float32), 0.0)
  s = jnp.einsum("BKGH,BKMH->BKGM", q_BKGH.astype(jnp.float32), k,
                 precision=lax.Precision.HIGHEST) / math.sqrt(H)
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("BKGM,BKMH->BKGH", p, v, precision=lax.Precision.HIGHEST)
  o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
  return o.astype(q_BKGH.dtype)


def load_query_group(q_ref):
  """The group's G query rows [G, H], padded to Gp >= 16 rows for Triton's dot (pads are 0), and the
  [Gp] mask of real rows."""
  G, _ = q_ref.shape
  Gp = max(MIN_DOT_DIM, next_pow2(G))
  row_ok = jnp.arange(Gp) < G
  return pltriton.load(q_ref.at[pl.ds(0, Gp), :], mask=row_ok[:, None], other=0), row_ok


def partial_specs(G: int, H: int):
  """Block specs of a split-K decode kernel's per-split partials (o [G, H], running max m [G], sum l [G])
  on a (B, K, splits) grid."""
  return [pl.BlockSpec((None, None, None, G, H), lambda b, k, s: (b, k, s, 0, 0)),
          pl.BlockSpec((None, None, None, G), lambda b, k, s: (b, k, s, 0)),
          pl.BlockSpec((None, None, None, G), lambda b, k, s: (b, k, s, 0))]


def partial_shapes(B: int, K: int, num_splits: int, G: int, H: int):
  return [jax.ShapeDtypeStruct((B, K, num_splits, G, H), jnp.float32),
          jax.ShapeDtypeStruct((B, K, num_splits, G), jnp.float32),
          jax.ShapeDtypeStruct((B, K, num_splits, G), jnp.float32)]


def combine_partials(o_BKNGH, m_BKNG, l_BKNG, dtype):
  """Merges per-split (o, m, l) partials; a head with no valid slot at all gets 0."""
  m = m_BKNG.max(axis=2, keepdims=True)
  alpha = jnp.exp(m_BKNG - m)
  l = (l_BKNG * alpha).sum(axis=2)
  o = (o_BKNGH * alpha[..., None]).sum(axis=2)
  out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return out.astype(dtype)


def init_partials(Gp: int, H: int):
  """(o, m, l) of an online softmax over no slot yet, for Gp query rows."""
  return (jnp.zeros((Gp, H), jnp.float32), jnp.full((Gp,), MASK_VALUE, jnp.float32),
          jnp.zeros((Gp,), jnp.float32))


def online_softmax_update(carry, q, k, v, ok, sm_scale: float, prec):
  """Folds one block of keys/values (rows where `ok` is False are ignored) into the running (o, m, l)."""
  o, m, l = carry
  s = jnp.dot(q, k.T, precision=prec, preferred_element_type=jnp.float32) * sm_scale
  s = jnp.where(ok[None, :], s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=-1))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
  l = alpha * l + p.sum(axis=-1)
  o = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
  return o, m_new, l


def store_partials(o_ref, m_ref, l_ref, partials, row_ok):
  """Writes the real (unpadded) query rows of (o, m, l)."""
  o, m, l = partials
  gp = row_ok.shape[0]
  pltriton.store(o_ref.at[pl.ds(0, gp), :], o, mask=row_ok[:, None])
  pltriton.store(m_ref.at[pl.ds(0, gp)], m, mask=row_ok)
  pltriton.store(l_ref.at[pl.ds(0, gp)], l, mask=row_ok)


def split_outputs(B: int, K: int, num_splits: int, G: int, H: int, dtype):
  """(out_specs, out_shape) of a split-K decode kernel on a (B, K, splits) grid: each split's partials
  (o, m, l), or with a single split the normalised output [B, K, G, H] in `dtype` itself, so that no XLA
  epilogue (`combine_partials`) runs after the kernel."""
  if num_splits == 1:
    return ([pl.BlockSpec((None, None, G, H), lambda b, k, s: (b, k, 0, 0))],
            [jax.ShapeDtypeStruct((B, K, G, H), dtype)])
  return partial_specs(G, H), partial_shapes(B, K, num_splits, G, H)


def store_split_outputs(out_refs, partials, row_ok):
  """Stores what `split_outputs` laid out: the partials, or (one split) o / l, 0 where no slot was valid."""
  if len(out_refs) == 3:
    store_partials(*out_refs, partials, row_ok)
    return
  (out_ref,) = out_refs
  o, _, l = partials
  out = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
  pltriton.store(out_ref.at[pl.ds(0, row_ok.shape[0]), :], out.astype(out_ref.dtype), mask=row_ok[:, None])


def finish_split_outputs(outs, dtype):
  """The attention output from the kernel's outputs: merged partials, or the single split's output."""
  return outs[0] if len(outs) == 1 else combine_partials(*outs, dtype)

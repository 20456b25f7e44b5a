"""Split-K (flash-decoding) plumbing shared by the dense and sparse decode kernels: the (B, K, splits) grid,
the online softmax over blocks of keys, each split's (o, m, l) partials, and their merge in XLA (or, with a
single split, the normalised output written by the kernel itself)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.triton_util import MASK_VALUE, cdiv


def splits_for(target_programs: int, rows: int) -> int:
  """Splits per (b, k) row for about `target_programs` programs over `rows` rows (the launch heuristics')."""
  return cdiv(target_programs, rows)


def split_grid(n: int, block: int, num_splits: int) -> tuple[int, int]:
  """(split length, splits) cutting `n` items into at most `num_splits` splits of whole `block`s; never an
  empty split."""
  blocks = cdiv(n, block)
  num_splits = max(1, min(num_splits, blocks))
  split_len = cdiv(blocks, num_splits) * block
  return split_len, cdiv(n, split_len)


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
  """Merges per-split (o, m, l) partials; a head with no valid slot at all gets 0, a NaN partial gives NaN."""
  m = m_BKNG.max(axis=2, keepdims=True)
  alpha = jnp.exp(m_BKNG - m)
  l = (l_BKNG * alpha).sum(axis=2)
  o = (o_BKNGH * alpha[..., None]).sum(axis=2)
  out = jnp.where(l[..., None] == 0, 0.0, o / jnp.where(l == 0, 1.0, l)[..., None])
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
  """Stores what `split_outputs` laid out: the partials, or (one split) o / l, 0 where no slot was valid. A NaN
  score of a valid slot (a NaN key) makes l NaN, and the output NaN (l == 0 is tested, never l > 0, which would
  store 0 for it: `jax.nn.dot_product_attention`'s NaN in, NaN out, at no cost)."""
  if len(out_refs) == 3:
    store_partials(*out_refs, partials, row_ok)
    return
  (out_ref,) = out_refs
  o, _, l = partials
  out = jnp.where(l[:, None] == 0, 0.0, o / jnp.where(l == 0, 1.0, l)[:, None])
  pltriton.store(out_ref.at[pl.ds(0, row_ok.shape[0]), :], out.astype(out_ref.dtype), mask=row_ok[:, None])


def finish_split_outputs(outs, dtype):
  """The attention output from the kernel's outputs: merged partials, or the single split's output."""
  return outs[0] if len(outs) == 1 else combine_partials(*outs, dtype)


def scale_inputs(kernel, n_inputs: int, k_scale_BK, v_scale_BK):
  """(arrays, block specs, kernel) for a decode kernel's optional FP8 scale inputs on a (B, K, splits) grid.
  The kernel takes its `n_inputs` inputs, then k_scale_ref and v_scale_ref ([] float32 each, or None), then its
  outputs. Without scales (None) nothing is added to the launch: the bf16 kernel is unchanged."""
  if k_scale_BK is None:
    return [], [], lambda *refs: kernel(*refs[:n_inputs], None, None, *refs[n_inputs:])
  spec = pl.BlockSpec((None, None), lambda b, k, s: (b, k))
  return [k_scale_BK, v_scale_BK], [spec, spec], kernel


def scale_values(partials, v_scale_ref):
  """The partials (o, m, l) with o times the head's value scale (an FP8 cache; None: unchanged): o is linear in
  the values, so scaling it once equals scaling every value row."""
  if v_scale_ref is None:
    return partials
  o, m, l = partials
  return o * v_scale_ref[...], m, l

"""Splits the fused q/k/v projection of one decode token into heads and applies rotate-half RoPE to q and
k, in one launch.

qkv[b] is laid out as N query heads, then K key heads, then K value heads, H channels each. Channel i < H/2
of a q or k head pairs with channel i + H/2 (the HF convention): with angle = pos[b] * inv_freq[i] in
float32, out[i] = x[i] cos - x[i + H/2] sin and out[i + H/2] = x[i + H/2] cos + x[i] sin, computed in
float32 and rounded to the input dtype; v heads are copied. The grid is (B, (N + 2K) / hp): each program
takes hp heads of a row (all q, all k or all v: hp divides N and K), loads the two halves separately (no
concatenate), computes the row's cos/sin once and stores to q, k or v. In decode XLA ran this as three
launch-bound kernels (a rope fusion each for q and k, a slice copy for v) per layer on the H200; here it is one.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from rocketkv_jax.kernels.checks import FLOAT_DTYPES, check_dtype


def rope_reference(x_XH, pos, inv_freq_half):
  """Rotate-half RoPE of heads x [..., X, H] at positions pos [...] (x's leading axes): with angle = pos *
  inv_freq[i] in float32, out[i] = x[i] cos - x[i + H/2] sin, out[i + H/2] = x[i + H/2] cos + x[i] sin,
  computed in float32 and rounded to x's dtype. The model's prefill rotates with this too."""
  ang = pos.astype(jnp.float32)[..., None] * inv_freq_half.astype(jnp.float32)  # [..., H/2]
  cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
  x1, x2 = jnp.split(x_XH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_XH.dtype)


def qkv_rope_reference(qkv_BX, pos_B, inv_freq_half, *, n_heads: int, n_kv_heads: int, head_dim: int,
                       **unused_tuning):
  """(q [B, N, H], k [B, K, H], v [B, K, H]) in qkv's dtype: q and k rotated at position pos[b]
  (`rope_reference`), v as is."""
  del unused_tuning
  B = qkv_BX.shape[0]
  N, K, H = n_heads, n_kv_heads, head_dim
  heads_BXH = qkv_BX.reshape(B, N + 2 * K, H)
  return (rope_reference(heads_BXH[:, :N], pos_B, inv_freq_half),
          rope_reference(heads_BXH[:, N:N + K], pos_B, inv_freq_half), heads_BXH[:, N + K:])


# Token rows (B) from which each program takes a group of heads (`heads_per_program`) instead of one: at large
# batch one program per head is 48 x B tiny programs per layer (8B shape), each computing its own cos/sin.
GROUP_HEADS_MIN_ROWS = 64


def heads_per_program(B: int, n_heads: int, n_kv_heads: int) -> int:
  """hp: 1 below GROUP_HEADS_MIN_ROWS rows, else the largest power of two dividing both N and K (8 for
  Llama-3.1-8B's 32 and 8 heads; 1 for SmolLM2's 9 and 3)."""
  if B < GROUP_HEADS_MIN_ROWS:
    return 1
  g = math.gcd(n_heads, n_kv_heads)
  return g & -g


def _qkv_rope_kernel(
    # inputs
    x_ref,  # [hp, H], heads [j * hp, (j + 1) * hp) of the row
    pos_ref,  # []
    inv_freq_ref,  # [H/2] float32
    # outputs
    q_ref,  # [hp, H], q's block min(j, N/hp - 1)
    k_ref,  # [hp, H], k's block clip(j - N/hp, 0, K/hp - 1)
    v_ref,  # [hp, H], v's block clip(j - (N + K)/hp, 0, K/hp - 1)
    *,
    n_heads: int,
    n_kv_heads: int,
):
  hp, H = x_ref.shape
  half = H // 2
  heads, lo, hi = pl.ds(0, hp), pl.ds(0, half), pl.ds(half, half)
  j = pl.program_id(1)
  # Only the output whose heads this program holds gets a store; the other two refs point at a neighbour's
  # block and are left alone.

  def rope_into(out_ref):
    ang = pos_ref[...].astype(jnp.float32) * inv_freq_ref[...]
    cos, sin = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
    x1 = x_ref[heads, lo].astype(jnp.float32)
    x2 = x_ref[heads, hi].astype(jnp.float32)
    pltriton.store(out_ref.at[heads, lo], (x1 * cos - x2 * sin).astype(out_ref.dtype))
    pltriton.store(out_ref.at[heads, hi], (x2 * cos + x1 * sin).astype(out_ref.dtype))

  @pl.when(j < n_heads // hp)
  def _():
    rope_into(q_ref)

  @pl.when((j >= n_heads // hp) & (j < (n_heads + n_kv_heads) // hp))
  def _():
    rope_into(k_ref)

  @pl.when(j >= (n_heads + n_kv_heads) // hp)
  def _():
    pltriton.store(v_ref.at[heads, pl.ds(0, H)], x_ref[...])


def _check_args(qkv_BX, pos_B, inv_freq_half, n_heads, n_kv_heads, head_dim):
  for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  H = head_dim
  if H < 2 or H & (H - 1):
    raise ValueError(f"head_dim={H} must be a power of two >= 2 (64 or 128 in practice)")
  if qkv_BX.ndim != 2:
    raise ValueError(f"qkv_BX.shape={qkv_BX.shape} must be 2-D (B, (N + 2K) * H)")
  B, X = qkv_BX.shape
  want = (n_heads + 2 * n_kv_heads) * H
  if X != want:
    raise ValueError(f"qkv_BX.shape={qkv_BX.shape}: width {X} must be (n_heads + 2 * n_kv_heads) * head_dim "
                     f"= ({n_heads} + 2 * {n_kv_heads}) * {H} = {want}")
  check_dtype("qkv_BX", qkv_BX.dtype, FLOAT_DTYPES)
  if pos_B.shape != (B,):
    raise ValueError(f"pos_B.shape={pos_B.shape} must be ({B},)")
  if not jnp.issubdtype(pos_B.dtype, jnp.integer):
    raise ValueError(f"pos_B.dtype={pos_B.dtype} must be an integer dtype")
  if inv_freq_half.shape != (H // 2,):
    raise ValueError(f"inv_freq_half.shape={inv_freq_half.shape} must be ({H // 2},) = (head_dim // 2,)")
  check_dtype("inv_freq_half", inv_freq_half.dtype, (jnp.float32,))


@functools.partial(jax.jit, static_argnames=["n_heads", "n_kv_heads", "head_dim", "interpret"])
def qkv_rope(qkv_BX, pos_B, inv_freq_half, *, n_heads: int, n_kv_heads: int, head_dim: int,
             interpret: bool = False):
  """Returns (q_BNH, k_BKH, v_BKH) of the fused projection qkv_BX [B, (N + 2K) * H] of one token per row
  at absolute position pos_B[b]: q and k rotated (rotate-half RoPE with the per-pair inverse frequencies
  inv_freq_half [H/2], float32, e.g. with Llama-3 scaling), v copied; all in qkv's dtype. Equal to
  `qkv_rope_reference` up to the float32 cos/sin and multiply-add rounding of the compiler."""
  _check_args(qkv_BX, pos_B, inv_freq_half, n_heads, n_kv_heads, head_dim)
  B = qkv_BX.shape[0]
  N, K, H = n_heads, n_kv_heads, head_dim
  hp = heads_per_program(B, N, K)
  nq, nk = N // hp, K // hp  # blocks of hp heads
  dtype = qkv_BX.dtype
  out_shape = [jax.ShapeDtypeStruct((B, N, H), dtype), jax.ShapeDtypeStruct((B, K, H), dtype),
               jax.ShapeDtypeStruct((B, K, H), dtype)]
  out_specs = [pl.BlockSpec((None, hp, H), lambda b, j: (b, jnp.minimum(j, nq - 1), 0)),
               pl.BlockSpec((None, hp, H), lambda b, j: (b, jnp.clip(j - nq, 0, nk - 1), 0)),
               pl.BlockSpec((None, hp, H), lambda b, j: (b, jnp.clip(j - nq - nk, 0, nk - 1), 0))]
  in_specs = [pl.BlockSpec((None, hp, H), lambda b, j: (b, j, 0)),
              pl.BlockSpec((None,), lambda b, j: (b,)),
              pl.BlockSpec((H // 2,), lambda b, j: (0,))]
  return tuple(pl.pallas_call(
      functools.partial(_qkv_rope_kernel, n_heads=N, n_kv_heads=K),
      grid=(B, nq + 2 * nk),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="rocketkv_qkv_rope",
  )(qkv_BX.reshape(B, N + 2 * K, H), pos_B.astype(jnp.int32), inv_freq_half))

"""The model's own ops (RMSNorm with its residual add, q/k RoPE): their semantics and their kernels.

The same contract as the KV core's table (`rocketkv_jax.ops`), kept apart from it because no KV-cache method
uses them: each op's XLA path is its kernel module's `*_reference` (plain jnp, f32 accumulation), and `impl`
("xla", "pallas", "interpret", "auto") picks the reference or the kernel through the core's one dispatch rule
(`ops.run`). The model's prefill rotates and normalises whole prompts with the references (`rope`, `rms_norm`),
so prefill and the fused decode kernels share one semantics.
"""
from __future__ import annotations

from rocketkv_jax import ops
from rocketkv_jax.kernels import qkv_rope as qkv_rope_kernel, rms_norm as rms_norm_kernel

OPS = {
    "add_rms_norm": ops.Op(rms_norm_kernel.add_rms_norm_reference, rms_norm_kernel.add_rms_norm),
    "qkv_rope": ops.Op(qkv_rope_kernel.qkv_rope_reference, qkv_rope_kernel.qkv_rope),
}


def add_rms_norm(x_BD, delta_BD, w_D, *, eps, impl):
  """(h, normed): h = x + delta (x when delta is None), normed = RMSNorm(h) * w."""
  return ops.run(OPS["add_rms_norm"], x_BD, delta_BD, w_D, eps=eps, impl=impl)


def qkv_rope(qkv_BX, pos_B, inv_freq_half, *, n_heads, n_kv_heads, head_dim, impl):
  """One token's fused projection split into q [B, N, H], k, v [B, K, H], q and k rotated at pos[b]."""
  return ops.run(OPS["qkv_rope"], qkv_BX, pos_B, inv_freq_half, n_heads=n_heads, n_kv_heads=n_kv_heads,
                 head_dim=head_dim, impl=impl)


def rope(x_XH, pos, inv_freq_half):
  """Rotate-half RoPE of heads x [..., X, H] at positions pos [...] (XLA: the semantics `qkv_rope` fuses; the
  model's prefill rotates whole prompts with it)."""
  return qkv_rope_kernel.rope_reference(x_XH, pos, inv_freq_half)


def rms_norm(x_D, w_D, *, eps):
  """RMSNorm(x) * w over the last axis (XLA: `add_rms_norm`'s semantics with no residual add)."""
  return rms_norm_kernel.add_rms_norm_reference(x_D, None, w_D, eps=eps)[1]

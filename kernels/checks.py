"""Shape and dtype validation shared by the kernel wrappers: errors name the offending value."""
from __future__ import annotations

import jax.numpy as jnp

from rocketkv_jax.kernels.kv_quant import KV_CACHE_DTYPES

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e5m2))
# KT pages per row are padded to a multiple of this many: each channel row then starts 16-byte aligned in every
# KT dtype, so the HSA scoring kernel's loads vectorise along the pages (H200, 32k context, t=256, 391 x 8 rows:
# 539 pages 200 us, padded to 544 pages 103 us; benchmarks/results/stage2_h200_2026-12-02/). The pad pages
# never hold a valid slot.
KT_PAGE_ALIGN = 16


def kt_num_pages(num_slots: int, page_size: int) -> int:
  """KT pages of a cache of `num_slots` slots: ceil(num_slots / page_size), rounded up to KT_PAGE_ALIGN."""
  pages = -(-num_slots // page_size)
  return -(-pages // KT_PAGE_ALIGN) * KT_PAGE_ALIGN


def check_page_count(P: int, num_slots: int, page_size: int, *, row_page_sizes: bool = False) -> None:
  """ValueError unless a selection's P pages cover `num_slots` slots: ceil(num_slots / page_size), or up to
  `kt_num_pages` (a cache's KT rows, padded with pages that hold no slot). row_page_sizes (each row has its own
  page size, at most page_size): any P from ceil(num_slots / page_size) up, since a row of smaller pages uses
  more of them (its pages past its valid slots hold no slot)."""
  if row_page_sizes:
    if P < -(-num_slots // page_size):
      raise ValueError(f"P={P} pages must be at least ceil(num_slots={num_slots} / page_size={page_size}) "
                       f"(page_size: the largest page size of any row)")
    return
  if not -(-num_slots // page_size) <= P <= kt_num_pages(num_slots, page_size):
    raise ValueError(f"P={P} pages must be ceil(num_slots={num_slots} / page_size={page_size}), or up to "
                     f"kt_num_pages={kt_num_pages(num_slots, page_size)} (KT pages padded with empty ones)")


def check_row_values(name: str, x_B, B: int) -> None:
  """ValueError unless x_B, a per-row value (`page_size_B`, `topr_B`), is None or a [B] integer array. Its
  values are data and are not checked: each must lie in the range its docstring gives."""
  if x_B is None:
    return
  if tuple(x_B.shape) != (B,):
    raise ValueError(f"{name}.shape={tuple(x_B.shape)} must be ({B},)")
  if not jnp.issubdtype(x_B.dtype, jnp.integer):
    raise ValueError(f"{name}.dtype={x_B.dtype} must be an integer dtype")


def check_dtype(name: str, dtype, allowed) -> None:
  if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in allowed):
    raise ValueError(f"{name}.dtype={jnp.dtype(dtype)} must be one of {[str(jnp.dtype(d)) for d in allowed]}")


def check_qkv(q_BKGH, k_BKSH, v_BKSH, k_scale_BK=None, v_scale_BK=None) -> tuple[int, int, int, int, int]:
  """Validates a decode-attention call's q [B, K, G, H] and cache k/v [B, K, S, H] (with scales: an FP8 cache,
  `check_kv_scales`); returns (B, K, G, H, S)."""
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
  if check_kv_scales(k_BKSH, v_BKSH, k_scale_BK, v_scale_BK):
    return B, K, G, H, S
  if k_BKSH.dtype != q_BKGH.dtype or v_BKSH.dtype != q_BKGH.dtype:
    raise ValueError(f"k/v dtypes {k_BKSH.dtype}/{v_BKSH.dtype} must equal q dtype {q_BKGH.dtype}")
  return B, K, G, H, S


def check_kv_scales(k_BKSH, v_BKSH, k_scale_BK, v_scale_BK) -> bool:
  """Whether the cache k/v [B, K, S, H] is quantized: False when both scales are None (then k/v must not be FP8);
  True when both are float32 [B, K] and k/v both hold the same FP8 dtype (`kv_quant.KV_CACHE_DTYPES`). Any other
  combination is a ValueError naming it."""
  if k_scale_BK is None and v_scale_BK is None:
    if jnp.dtype(k_BKSH.dtype) in KV_CACHE_DTYPES or jnp.dtype(v_BKSH.dtype) in KV_CACHE_DTYPES:
      raise ValueError(f"k/v dtypes {k_BKSH.dtype}/{v_BKSH.dtype} are FP8: pass k_scale_BK and v_scale_BK")
    return False
  B, K = k_BKSH.shape[:2]
  for name, x in (("k_scale_BK", k_scale_BK), ("v_scale_BK", v_scale_BK)):
    if x is None or tuple(x.shape) != (B, K) or x.dtype != jnp.float32:
      got = None if x is None else f"{tuple(x.shape)} {x.dtype}"
      raise ValueError(f"{name} must be float32 of shape ({B}, {K}) with an FP8 cache; got {got}")
  check_dtype("k_BKSH", k_BKSH.dtype, KV_CACHE_DTYPES)
  if v_BKSH.dtype != k_BKSH.dtype:
    raise ValueError(f"v dtype {v_BKSH.dtype} must equal k dtype {k_BKSH.dtype}")
  return True


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

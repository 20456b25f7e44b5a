"""HSA token selection (RocketKV stage 2, ALGORITHM.md section 3) in ONE Pallas Triton launch: the page scores
of `hsa_scores` and the top-k of `page_topk`.

At small batch the two-kernel path (`hsa_scores.hsa_page_partials` then `page_topk.hsa_page_topk`) is two
launch/latency-bound kernels per layer with the partials round-tripping through HBM. Here one launch does both,
on one of two grids (`split_pages`):

- one program per (b, k) row (grid (B, K, 1), the default):
  1. the scoring of `hsa_scores`' rank layout, the same code (`hsa_scores.rank_score_blocks`), walking all the
     row's page blocks:
     the group's channels chosen once, then per page block each head's s/tau and the block's softmax partials
     (max, weighted sum), stored to scratch outputs of this call (the row's s [G, P_pad] and m, l [G, NB]: a
     few KB, L2-resident; Triton has no scratch memory). The per-head s is kept, not recomputed;
  2. a block-wide barrier (`pltriton.debug_barrier`, a `bar.sync`): the scratch was stored by other threads
     than the ones that read it back in another layout, and a `__syncthreads` makes a block's global stores
     visible to the whole block;
  3. `page_topk`'s selection body on the scratch: each head normalised over all page blocks, the group mean,
     the sort-free bisection top-k, idx [M] written in ascending slot order.
- one program per page block (grid (B, K, NB), as the scoring kernel's): each program scores its block into the
  row's scratch, then counts itself done on a zeroed per-row counter (barrier, then one acquire-release
  atomic); the program that completes the row runs step 3. All SMs score, one launch.

With the same page blocks and warps the indices are bit-for-bit the two-kernel path's (ties toward the lower
slot). Other page blocks only change how each head's softmax denominator is summed (one common factor per
head), so only near-ties within float32 rounding can differ.

Status: an experiment, not wired into `ops` (the decode path runs the two kernels). Tested in interpret mode
and lowered for the H200, never timed compiled except once: the row grid at B=8 (64 rows, 32k context,
t=256) took 38 us per layer on the H200 (2026-12-01), against ~25 us for the two kernels, so it does not pay
as it stands. The page-block grid (one launch, all SMs, the row's last program selecting) is untimed; its
cross-program handoff (barrier + one atomic) is the part to check first on the GPU. Command:
`python3 benchmarks/kernels.py --only select --lengths 32768 --budgets 256 --batches 1,8,32`. The same
one-row-program fusion with the gather layout's scoring (the decode path's at the largest batch) was also
slower, in the decode step: 32k batch 391 16.42 -> 16.49 ms, 128k batch 489 19.30 -> 19.69 (A/B in one process;
the diff and the results: benchmarks/results/grid_h200_2026-12-03/); not kept.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.interpreters import mlir

from rocketkv_jax.kernels.checks import FLOAT_DTYPES, check_dtype, check_kt_pages, check_page_count
from rocketkv_jax.kernels.hsa_scores import hsa_page_scores_reference, rank_score_blocks
from rocketkv_jax.kernels.page_topk import MAX_PAGES, hsa_page_topk_body, page_topk_reference
from rocketkv_jax.kernels.triton_util import MIN_DOT_DIM, cdiv, next_pow2


def _register_interpret_barrier():
  """Interpret mode runs a program's statements in order, one program at a time, so a block barrier is a
  no-op there; JAX registers no CPU lowering for it. Registering one keeps the kernel body free of interpret
  branches (tests/kernels/test_interpret_parity.py)."""
  try:
    from jax._src.pallas.triton.primitives import debug_barrier_p  # not exported; pltriton.debug_barrier binds it
  except ImportError:  # another jax layout: interpret mode of this kernel then fails, nothing else does
    return
  mlir.register_lowering(debug_barrier_p, lambda ctx: [], platform="cpu")


_register_interpret_barrier()

# Default page block: a [H, block_p] KT tile of this many elements per thread (block_p = 64 at H = 128 and 8
# warps: a 539-page row is 9 loop steps). On the H200 one program walking its row's blocks costs ~1.6 us per
# step at 32 elements per thread ([128, 32] tiles, 4 warps) but ~5 us at 64 (hsa_scores split_pages=False,
# benchmarks/results/kernels_2026-12-01_s2.jsonl): more warps, not more elements per thread, for fewer steps.
# Unmeasured for this kernel; tune with block_p / num_warps / num_stages (benchmarks/kernels.py --only select).
_TILE_ELEMS_PER_THREAD = 32
# hsa_page_partials' target of programs to fill the H200's 132 SMs (split_pages=True copies its grid).
_TARGET_PROGRAMS = 2 * 132


def hsa_select_fused_reference(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr: int, page_size: int, k: int,
                               num_slots: int, **unused_tuning):
  """`page_topk_reference` of `hsa_page_scores_reference`: idx [B, K, M], M = min(k, num_slots), the
  min(k, length) best slots ascending (ties toward the lower slot), then 0s."""
  del unused_tuning
  scores = hsa_page_scores_reference(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, topr=topr, page_size=page_size)
  return page_topk_reference(scores, length_B, page_size=page_size, k=k, num_slots=num_slots)


def _hsa_select_fused_kernel(
    # inputs
    q_ref,  # [G, H]
    kt_min_ref,  # [H, P]
    kt_max_ref,  # [H, P]
    length_ref,  # []
    # outputs
    idx_ref,  # [M] int32
    s_ref,  # [G, P_pad] float32 scratch: each head's s/tau per page
    m_ref,  # [G, NB] float32 scratch: per page block, max of s/tau
    l_ref,  # [G, NB] float32 scratch: per page block, sum of n[p] * exp(s/tau - max)
    *,
    select_kw,
    **score_kw,
):
  """One program per row (grid (B, K, 1)): all the row's page blocks, a block barrier, the selection."""
  rank_score_blocks(q_ref, kt_min_ref, kt_max_ref, length_ref, s_ref, m_ref, l_ref, first_block=0,
                    num_blocks=m_ref.shape[1], store_from=0, **score_kw)
  pltriton.debug_barrier()  # phase 2 reads what other threads of the block stored
  hsa_page_topk_body(s_ref, m_ref, l_ref, length_ref, idx_ref, **select_kw)


def _hsa_select_split_kernel(
    # inputs
    q_ref,  # [G, H]
    kt_min_ref,  # [H, P]
    kt_max_ref,  # [H, P]
    length_ref,  # []
    count_in_ref,  # [1] int32, 0: aliased to count_ref
    # outputs: as _hsa_select_fused_kernel (the row's whole scratch in every program), and
    idx_ref, s_ref, m_ref, l_ref,
    count_ref,  # [1] int32: page blocks of the row scored so far
    *,
    select_kw,
    **score_kw,
):
  """One program per page block (grid (B, K, NB)); the row's last block to finish selects. Its blocks' stores
  are ordered before the count (a block barrier, then the count's acquire-release atomic at GPU scope, done
  by one thread); the program that brings the count to NB reads every block's partials after its own atomic."""
  del count_in_ref
  block = pl.program_id(2)
  rank_score_blocks(q_ref, kt_min_ref, kt_max_ref, length_ref, s_ref, m_ref, l_ref, first_block=block,
                    num_blocks=1, store_from=block, **score_kw)
  pltriton.debug_barrier()
  done_before = pltriton.atomic_add(count_ref, jnp.int32(0), jnp.int32(1))
  lax.cond(done_before == m_ref.shape[1] - 1,
           lambda: hsa_page_topk_body(s_ref, m_ref, l_ref, length_ref, idx_ref, **select_kw), lambda: None)


@functools.partial(jax.jit, static_argnames=["topr", "page_size", "k", "num_slots", "interpret", "block_p",
                                             "split_pages", "num_warps", "num_stages"])
def hsa_select_fused(q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B, *, topr: int, page_size: int, k: int,
                     num_slots: int, interpret: bool = False, block_p: int | None = None, split_pages: bool = False,
                     num_warps: int | None = None, num_stages: int = 1):
  """The HSA selection of one decode step in one launch: `hsa_page_partials` + `hsa_page_topk` fused.

  Args:
    q_BKGH: queries (bf16 or f32), the new token already appended to the cache.
    kt_min_BKHP, kt_max_BKHP: per-page key min / max, channel-major, P = ceil(num_slots / page_size) (or up
      to `kt_num_pages`) <= page_topk.MAX_PAGES pages, f32, bf16 or float8_e5m2. Pages with no valid slot may
      hold junk.
    length_B: int32 valid slots per sequence (clipped to [0, num_slots]).
    topr: channels scored, the group's top-r of sum_g |q_g| (ties toward the lower channel), in [1, H].
    page_size: slots per page; k: tokens to select; num_slots: cache slots.
    split_pages: False: one program per (b, k) row walks the row's page blocks, then selects (grid (B, K, 1));
      default block_p a [H, block_p] tile of _TILE_ELEMS_PER_THREAD elements per thread, 8 warps.
      True: one program per page block, the last of a row to finish selects (grid (B, K, NB), a zeroed
      counter per row); default block_p and 4 warps as `hsa_page_partials` (its grid, bit-for-bit).
    block_p: pages per page block (a power of two >= 16).
  Returns:
    idx_BKM int32, M = min(k, num_slots): the min(k, length) chosen slots in ascending order, then 0s; ties
    toward the lower slot. Bit-for-bit the two-kernel path's output at the same block_p and num_warps.
  """
  if q_BKGH.ndim != 4:
    raise ValueError(f"q_BKGH.shape={q_BKGH.shape} must be 4-D")
  B, K, G, H = q_BKGH.shape
  if check_kt_pages(kt_min_BKHP, kt_max_BKHP)[:3] != (B, K, H):
    raise ValueError(f"kt_min_BKHP.shape={kt_min_BKHP.shape} must be (B, K, H, P) = ({B}, {K}, {H}, P)")
  P = kt_min_BKHP.shape[-1]
  check_dtype("q_BKGH", q_BKGH.dtype, FLOAT_DTYPES)
  if not 1 <= topr <= H:
    raise ValueError(f"topr={topr} must be in [1, H={H}]")
  if page_size < 1 or k < 1 or num_slots < 1:
    raise ValueError(f"page_size={page_size}, k={k} and num_slots={num_slots} must be >= 1")
  check_page_count(P, num_slots, page_size)
  if P > MAX_PAGES:
    raise ValueError(f"P={P} pages is above the selection's MAX_PAGES={MAX_PAGES}; use the two-kernel path")
  if length_B.shape != (B,):
    raise ValueError(f"length_B.shape={length_B.shape} must be ({B},)")
  if num_warps is None:
    num_warps = 4 if split_pages else 8
  if block_p is None and split_pages:
    # As hsa_page_partials (in-kernel channel ranking): enough page blocks to fill the GPU, between 32 pages
    # and an [H, block_p] tile of 8192 elements.
    want = cdiv(P, max(1, cdiv(_TARGET_PROGRAMS, B * K)))
    block_p = min(max(32, 8192 // H), max(32, next_pow2(want)))
  elif block_p is None:
    block_p = max(MIN_DOT_DIM, next_pow2(_TILE_ELEMS_PER_THREAD * 32 * num_warps // H))
  if block_p < MIN_DOT_DIM or block_p & (block_p - 1):
    raise ValueError(f"block_p={block_p} must be a power of two >= {MIN_DOT_DIM}")
  NB = cdiv(P, block_p)
  M = min(k, num_slots)
  # As hsa_page_partials: bf16 queries against bf16 or float8 pages multiply exactly in a bf16 dot.
  exact_in_bf16 = (jnp.dtype(q_BKGH.dtype) == jnp.dtype(jnp.bfloat16) and
                   jnp.dtype(kt_min_BKHP.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e5m2)))
  kw = dict(topr=topr, block_p=block_p, page_size=page_size, num_pages=P,
            dot_dtype=jnp.bfloat16 if exact_in_bf16 else jnp.float32,
            select_kw=dict(page_size=page_size, k=k, num_pages=P, num_slots=num_slots, interpret=interpret))
  row = lambda b, h, j: (b, h, 0, 0)  # noqa: E731  (every program of a row sees the row's whole scratch)
  in_specs = [
      pl.BlockSpec((None, None, G, H), row),
      pl.BlockSpec((None, None, H, P), row),
      pl.BlockSpec((None, None, H, P), row),
      pl.BlockSpec((None,), lambda b, h, j: (b,)),
  ]
  out_specs = [
      pl.BlockSpec((None, None, M), lambda b, h, j: (b, h, 0)),
      pl.BlockSpec((None, None, G, NB * block_p), row),
      pl.BlockSpec((None, None, G, NB), row),
      pl.BlockSpec((None, None, G, NB), row),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((B, K, M), jnp.int32),
      jax.ShapeDtypeStruct((B, K, G, NB * block_p), jnp.float32),
      jax.ShapeDtypeStruct((B, K, G, NB), jnp.float32),
      jax.ShapeDtypeStruct((B, K, G, NB), jnp.float32),
  ]
  args = [q_BKGH, kt_min_BKHP, kt_max_BKHP, length_B.astype(jnp.int32)]  # length clipped in the kernel
  if split_pages:
    count = pl.BlockSpec((None, None, 1), lambda b, h, j: (b, h, 0))
    in_specs.append(count)
    out_specs.append(count)
    out_shape.append(jax.ShapeDtypeStruct((B, K, 1), jnp.int32))
    args.append(jnp.zeros((B, K, 1), jnp.int32))
  outs = pl.pallas_call(
      functools.partial(_hsa_select_split_kernel if split_pages else _hsa_select_fused_kernel, **kw),
      grid=(B, K, NB if split_pages else 1),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases={4: 4} if split_pages else {},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="rocketkv_hsa_select_split" if split_pages else "rocketkv_hsa_select_fused",
  )(*args)
  return outs[0]

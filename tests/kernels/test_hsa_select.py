"""Fused HSA selection kernel (scores + top-k in one launch: one program per row, or per page block with the
row's last block selecting) against the two-kernel path (bit-for-bit at the same block_p and warps) and
against its jnp reference (equal up to near-ties of the page scores)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_near_ties_only, lower_for_h200, needs_gpu
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.hsa_scores import hsa_page_partials, hsa_page_scores_reference
from rocketkv_jax.kernels.hsa_select import hsa_select_fused, hsa_select_fused_reference
from rocketkv_jax.kernels.page_topk import MAX_PAGES, hsa_page_topk


def lengths_for(rng, B, num_slots, page_size):
  """Ragged lengths: the full cache, 0, 1, one exactly at a page boundary, then random in [0, num_slots]."""
  P = -(-num_slots // page_size)
  base = [num_slots, 0, 1, page_size * max(1, P // 2)]
  return jnp.asarray([base[i] if i < len(base) else int(rng.integers(0, num_slots + 1)) for i in range(B)],
                     jnp.int32)


def make_inputs(seed, B, K, G, H, num_slots, page_size, q_dtype, kt_dtype, ties=False, aligned=False):
  """Random q and KT pages; pages with no valid slot hold junk (NaN, +-inf, huge); with ties, every page
  repeats one of three columns so whole pages tie exactly (the choice falls to the lower slot)."""
  rng = np.random.default_rng(seed)
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  P = kt_num_pages(num_slots, page_size) if aligned else -(-num_slots // page_size)  # aligned: as caches hold them
  q = jax.random.normal(ks[0], (B, K, G, H), jnp.float32).astype(q_dtype)
  a, b = jax.random.normal(ks[1], (B, K, H, P)), jax.random.normal(ks[2], (B, K, H, P))
  if ties:
    a, b = a[..., np.arange(P) % 3], b[..., np.arange(P) % 3]
  length = lengths_for(rng, B, num_slots, page_size)
  empty = (jnp.arange(P)[None, :] * page_size >= length[:, None])[:, None, None, :]
  junk = jnp.asarray(rng.choice(np.array([np.nan, np.inf, -np.inf, 3e38, -3e38], np.float32), (B, K, H, P)))
  kt_min = jnp.where(empty, junk, jnp.minimum(a, b)).astype(kt_dtype)
  kt_max = jnp.where(empty, junk[..., ::-1], jnp.maximum(a, b)).astype(kt_dtype)
  return q, kt_min, kt_max, length


# Jitted: eager vmapped references cost seconds of CPU per call.
_reference = jax.jit(hsa_select_fused_reference, static_argnames=["topr", "page_size", "k", "num_slots"])
_scores_reference = jax.jit(hsa_page_scores_reference, static_argnames=["topr", "page_size"])


def check(seed, B, K, G, H, num_slots, page_size, k, topr, q_dtype, kt_dtype, interpret, block_p=None,
          ties=False, split_pages=False, aligned=False, **tuning):
  q, kt_min, kt_max, length = make_inputs(seed, B, K, G, H, num_slots, page_size, q_dtype, kt_dtype, ties, aligned)
  kw = dict(topr=topr, page_size=page_size)
  sel = dict(page_size=page_size, k=k, num_slots=num_slots)
  out = np.asarray(hsa_select_fused(q, kt_min, kt_max, length, topr=topr, k=k, num_slots=num_slots,
                                    page_size=page_size, interpret=interpret, block_p=block_p,
                                    split_pages=split_pages, **tuning))
  M = min(k, num_slots)
  assert out.dtype == np.int32 and out.shape == (B, K, M)
  # Bit-for-bit the two-kernel path when both walk the same page blocks with as many warps (the warps set how
  # a block's softmax sum is reduced).
  # (split_pages: by default the scoring kernel's own grid and warps.)
  warps = tuning.get("num_warps", 4 if split_pages else 8)
  bp = block_p if block_p is not None or split_pages else max(16, 32 * 32 * warps // H)
  # (Rows here are few, so the scoring kernel ranks channels in the kernel, as the fused kernel does.)
  s, m, l = hsa_page_partials(q, kt_min, kt_max, length, interpret=interpret, block_p=bp, num_warps=warps, **kw)
  two = np.asarray(hsa_page_topk(s, m, l, length, interpret=interpret, num_warps=warps, **sel))
  np.testing.assert_array_equal(out, two)
  # The reference, up to near-ties (the page scores only where they differ).
  ref = np.asarray(_reference(q, kt_min, kt_max, length, **kw, k=k, num_slots=num_slots))
  if not np.array_equal(out, ref):
    scores = np.asarray(_scores_reference(q, kt_min, kt_max, length, **kw))
    assert_near_ties_only(out, ref, scores, np.asarray(length), page_size=page_size, k=k)
  # The first min(k, length) entries are distinct valid slots, ascending; the rest are 0.
  n = np.minimum(np.asarray(length), M)
  for b in range(B):
    for h in range(K):
      chosen = out[b, h, :n[b]]
      assert (np.diff(chosen) > 0).all() and (chosen < length[b]).all()
      assert (out[b, h, n[b]:] == 0).all()
  return out


F32, BF16, F8 = jnp.float32, jnp.bfloat16, jnp.float8_e5m2

# (B, K, G, H, num_slots, page_size, k, topr, q dtype, KT dtype, block_p, split_pages, ties): G in {1, 3, 4}, H
# in {64, 128}, every KT dtype, k above and below the cache, one or several page blocks per row, both grids;
# "ties": whole pages tie exactly, so the choice falls to the tie-break toward the lower slot.
CASES = [
    pytest.param(4, 2, 4, 128, 150, 3, 20, 30, BF16, BF16, 16, False, True, id="ties-G4H128-bf16-bf16-bp16"),
    pytest.param(4, 1, 1, 64, 67, 4, 200, 7, F32, F32, 16, False, False, id="G1H64-f32-f32-k>S"),
    pytest.param(5, 1, 3, 128, 130, 1, 32, 64, F32, F8, 32, False, False, id="G3H128-f32-f8-ps1"),
    pytest.param(4, 1, 4, 64, 301, 3, 45, 13, BF16, F8, None, False, False, id="G4H64-bf16-f8-default-bp"),
    pytest.param(4, 2, 3, 64, 50, 16, 17, 64, BF16, F32, 16, False, False, id="G3H64-bf16-f32-allR"),
    pytest.param(4, 2, 4, 128, 100, 3, 16, 21, BF16, F8, 16, True, False, id="split-G4H128-bf16-f8-bp16"),
    pytest.param(4, 1, 1, 64, 301, 3, 45, 13, F32, BF16, None, True, True, id="split-ties-G1H64-f32-bf16"),
    pytest.param(5, 1, 3, 128, 130, 1, 200, 64, BF16, F32, 32, True, False, id="split-G3H128-bf16-f32-k>S"),
]


@pytest.mark.parametrize("B,K,G,H,num_slots,page_size,k,topr,q_dtype,kt_dtype,block_p,split_pages,ties", CASES)
def test_matches_two_kernels_and_reference_interpret(B, K, G, H, num_slots, page_size, k, topr, q_dtype, kt_dtype,
                                                     block_p, split_pages, ties):
  check(num_slots, B, K, G, H, num_slots, page_size, k, topr, q_dtype, kt_dtype, interpret=True, block_p=block_p,
        split_pages=split_pages, ties=ties)


def test_rejects_bad_arguments():
  q, kt, length = jnp.ones((1, 2, 4, 64)), jnp.ones((1, 2, 64, 10)), jnp.ones((1,), jnp.int32)
  kw = dict(topr=8, page_size=3, k=4, num_slots=30)
  with pytest.raises(ValueError, match="kt_max_BKHP.shape"):
    hsa_select_fused(q, kt, jnp.ones((1, 2, 64, 11)), length, **kw)
  with pytest.raises(ValueError, match="topr=65"):
    hsa_select_fused(q, kt, kt, length, **{**kw, "topr": 65})
  with pytest.raises(ValueError, match="P=10 pages must be ceil"):
    hsa_select_fused(q, kt, kt, length, **{**kw, "num_slots": 40})
  with pytest.raises(ValueError, match="k=0"):
    hsa_select_fused(q, kt, kt, length, **{**kw, "k": 0})
  with pytest.raises(ValueError, match="length_B.shape"):
    hsa_select_fused(q, kt, kt, jnp.ones((2,), jnp.int32), **kw)
  with pytest.raises(ValueError, match="block_p=24"):
    hsa_select_fused(q, kt, kt, length, **kw, block_p=24)
  big = jnp.ones((1, 1, 64, MAX_PAGES + 1))
  with pytest.raises(ValueError, match="MAX_PAGES"):
    hsa_select_fused(q[:, :1], big, big, length, topr=8, page_size=1, k=4, num_slots=MAX_PAGES + 1)


@pytest.mark.parametrize("G,H,num_slots,k,topr,q_dtype,kt_dtype,tuning", [
    (4, 128, 1617, 128, 60, BF16, F8, {}),  # Llama-3.1-8B at 32k, t=256: 539 pages of 3
    (4, 128, 1617, 128, 60, BF16, F8, dict(split_pages=True)),
    (3, 64, 301, 45, 20, F32, BF16, dict(split_pages=True, block_p=16)),
    (4, 128, 1617, 128, 60, BF16, BF16, dict(block_p=128, num_warps=16, num_stages=2)),
    (4, 128, 1617, 128, 60, BF16, F8, dict(block_p=256, num_warps=32)),
    (3, 64, 301, 45, 20, F32, F32, {}),
    (1, 128, 3 * MAX_PAGES, 1024, 128, BF16, BF16, {}),
])
def test_lowers_for_h200_through_triton(G, H, num_slots, k, topr, q_dtype, kt_dtype, tuning):
  P = -(-num_slots // 3)
  q = jax.ShapeDtypeStruct((2, 8, G, H), q_dtype)
  kt = jax.ShapeDtypeStruct((2, 8, H, P), kt_dtype)
  text = lower_for_h200(lambda *a: hsa_select_fused(*a, topr=topr, page_size=3, k=k, num_slots=num_slots,
                                                    **tuning),
                        q, kt, kt, jax.ShapeDtypeStruct((2,), jnp.int32))
  assert ("rocketkv_hsa_select_split" if tuning.get("split_pages") else "rocketkv_hsa_select_fused") in text


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,G,H,num_slots,page_size,k,topr,q_dtype,kt_dtype", [
    (1, 8, 4, 128, 1617, 3, 128, 60, BF16, F8), (8, 8, 4, 128, 1617, 3, 128, 60, BF16, BF16),
    (8, 8, 4, 128, 6471, 3, 512, 40, BF16, F8), (4, 3, 3, 64, 1031, 2, 64, 20, F32, F32),
    (5, 2, 1, 128, 777, 3, 100, 64, F32, BF16), (2, 1, 3, 128, 130, 1, 16, 61, BF16, F8)])
def test_matches_two_kernels_and_reference_gpu(B, K, G, H, num_slots, page_size, k, topr, q_dtype, kt_dtype):
  needs_gpu()
  args = (B, K, G, H, num_slots, page_size, k, topr, q_dtype, kt_dtype)
  check(num_slots + 1, *args, interpret=False)
  check(num_slots + 2, *args, interpret=False, block_p=32)
  check(num_slots + 3, *args, interpret=False, block_p=128, num_warps=16, num_stages=2)
  check(num_slots + 4, *args, interpret=False, block_p=256, num_warps=32)
  check(num_slots + 5, *args, interpret=False, ties=True)
  check(num_slots + 6, *args, interpret=False, split_pages=True)
  check(num_slots + 7, *args, interpret=False, split_pages=True, block_p=64)
  check(num_slots + 8, *args, interpret=False, split_pages=True, ties=True)


def test_padded_kt_pages_interpret():
  """KT rows padded to kt_num_pages, as every cache holds them: the pad pages hold junk and never a slot."""
  check(11, 3, 2, 4, 64, 37, 3, 8, 21, jnp.float32, jnp.float32, interpret=True, aligned=True)

"""Top-k-from-pages kernel against its jnp reference (lax.top_k over the per-slot scores, then sorted)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_near_ties_only, lower_for_h200, needs_gpu, ragged_lengths
from rocketkv_jax.kernels.page_topk import MAX_PAGES, page_topk, page_topk_reference
from tests.helpers.data import keys, normal


def make_inputs(seed, B, K, num_slots, page_size, ties: bool):
  rng = np.random.default_rng(seed)
  P = -(-num_slots // page_size)
  if ties:  # few distinct values: most of the choice is the tie-break toward the lower slot
    scores = rng.integers(-2, 3, (B, K, P)).astype(np.float32)
  else:
    scores = rng.standard_normal((B, K, P)).astype(np.float32) * 10.0 ** rng.integers(-30, 30, (B, K, P))
  length = ragged_lengths(rng, B, num_slots)
  empty = np.arange(P)[None, :] * page_size >= np.asarray(length)[:, None]
  scores = np.where(empty[:, None, :], np.nan, scores)  # junk on pages with no valid slot
  scores[0, 0, 0] = -np.inf  # a valid page may score -inf (and -0.0 / +0.0 below)
  scores[-1, -1, -1] = -0.0
  return jnp.asarray(scores), length


def check(seed, B, K, num_slots, page_size, k, ties, interpret, dtype=jnp.float32):
  scores, length = make_inputs(seed, B, K, num_slots, page_size, ties)
  scores = scores.astype(dtype)
  out = page_topk(scores, length, page_size=page_size, k=k, num_slots=num_slots, interpret=interpret)
  ref = page_topk_reference(scores, length, page_size=page_size, k=k, num_slots=num_slots)
  out, ref = np.asarray(out), np.asarray(ref)
  assert out.dtype == np.int32 and out.shape == ref.shape == (B, K, min(k, num_slots))
  np.testing.assert_array_equal(out, ref)
  # The first min(k, length) entries are distinct valid slots, ascending; the rest are 0.
  n = np.minimum(np.asarray(length), out.shape[-1])
  for b in range(B):
    for h in range(K):
      chosen = out[b, h, :n[b]]
      assert (np.diff(chosen) > 0).all() and (chosen < length[b]).all()
      assert (out[b, h, n[b]:] == 0).all()


CASES = [  # (B, K, num_slots, page_size, k)
    (2, 2, 37, 3, 8), (3, 1, 100, 1, 16), (2, 2, 67, 4, 200), (1, 3, 130, 3, 128), (4, 2, 1617, 3, 128),
    (2, 1, 50, 16, 17), (5, 1, 9, 2, 1),
]


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("B,K,num_slots,page_size,k", CASES)
def test_matches_reference_interpret(B, K, num_slots, page_size, k, ties):
  check(seed=num_slots, B=B, K=K, num_slots=num_slots, page_size=page_size, k=k, ties=ties,
        interpret=True)


@pytest.mark.parametrize("B,K,num_slots,page_size,k", CASES)
def test_row_chunks_cover_the_row_interpret(B, K, num_slots, page_size, k):
  """The row is held in power-of-two chunks, in order, covering P with under 32 lanes to spare; ties across a
  chunk boundary go to the lower slot as well (the tie-heavy scores put equal pages on both sides)."""
  from rocketkv_jax.kernels.page_topk import row_chunks
  P = -(-num_slots // page_size)
  chunks = row_chunks(P)
  assert chunks[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
  assert P <= sum(n for _, n in chunks) < P + 32 and all(n & (n - 1) == 0 for _, n in chunks)
  check(seed=num_slots + 5, B=B, K=K, num_slots=num_slots, page_size=page_size, k=k, ties=True,
        interpret=True)


def test_bfloat16_scores():
  check(seed=3, B=2, K=2, num_slots=301, page_size=3, k=64, ties=False, interpret=True, dtype=jnp.bfloat16)


def test_rejects_bad_arguments():
  s = jnp.zeros((1, 2, 10))
  length = jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match="P=10 pages must be ceil"):
    page_topk(s, length, page_size=3, k=4, num_slots=40)
  with pytest.raises(ValueError, match="k=0"):
    page_topk(s, length, page_size=3, k=0, num_slots=30)
  with pytest.raises(ValueError, match="MAX_PAGES"):
    page_topk(jnp.zeros((1, 1, MAX_PAGES + 1)), length, page_size=1, k=4, num_slots=MAX_PAGES + 1)
  with pytest.raises(ValueError, match="length_B.shape"):
    page_topk(s, jnp.ones((2,), jnp.int32), page_size=3, k=4, num_slots=30)
  with pytest.raises(ValueError, match="scores_BKP.dtype"):
    page_topk(s.astype(jnp.int32), length, page_size=3, k=4, num_slots=30)


@pytest.mark.parametrize("num_slots,page_size,k", [(1617, 3, 128), (6471, 3, 512), (37, 16, 8), (301, 3, 45),
                                                   (3 * MAX_PAGES, 3, 1024)])
def test_lowers_for_h200_through_triton(num_slots, page_size, k):
  P = -(-num_slots // page_size)
  text = lower_for_h200(lambda s, l: page_topk(s, l, page_size=page_size, k=k, num_slots=num_slots),
                        jax.ShapeDtypeStruct((2, 8, P), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32))
  assert "rocketkv_page_topk" in text


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,num_slots,page_size,k", CASES + [(8, 8, 6471, 3, 512), (256, 1, 70, 3, 16),
                                                                (3, 2, 301, 3, 45)])
def test_matches_reference_gpu(B, K, num_slots, page_size, k):
  needs_gpu()
  check(seed=num_slots + 1, B=B, K=K, num_slots=num_slots, page_size=page_size, k=k, ties=True,
        interpret=False)
  check(seed=num_slots + 2, B=B, K=K, num_slots=num_slots, page_size=page_size, k=k, ties=False,
        interpret=False)


# ---------------------------------------------------------------- selection straight from HSA partials

def hsa_partials(seed, B, K, G, H, num_slots, page_size, topr, block_p=None):
  """Real partials of the HSA kernel (interpret mode) on random queries and KT pages, junk on empty pages."""
  from rocketkv_jax.kernels.hsa_scores import Tuning, hsa_page_partials
  rng = np.random.default_rng(seed)
  ks = keys(seed, 3)
  P = -(-num_slots // page_size)
  q = normal(ks[0], (B, K, G, H))
  a, b = normal(ks[1], (B, K, H, P)), normal(ks[2], (B, K, H, P))
  length = ragged_lengths(rng, B, num_slots)
  empty = (jnp.arange(P)[None, :] * page_size >= length[:, None])[:, None, None, :]
  kt_min = jnp.where(empty, jnp.nan, jnp.minimum(a, b))
  kt_max = jnp.where(empty, jnp.inf, jnp.maximum(a, b))
  return hsa_page_partials(q, kt_min, kt_max, length, topr=topr, page_size=page_size, interpret=True,
                           tuning=Tuning(block_p=block_p)), length


def check_hsa(seed, B, K, G, H, num_slots, page_size, k, topr, interpret, block_p=None, sink=0, recent=0,
              num_warps=None):
  from rocketkv_jax.kernels.hsa_scores import normalize_partials
  from rocketkv_jax.kernels.page_topk import force_pages, hsa_page_topk, hsa_page_topk_reference
  (s, m, l), length = hsa_partials(seed, B, K, G, H, num_slots, page_size, topr, block_p)
  kw = dict(page_size=page_size, k=k, num_slots=num_slots, sink=sink, recent=recent)
  out = np.asarray(hsa_page_topk(s, m, l, length, interpret=interpret, num_warps=num_warps, **kw))
  ref = np.asarray(hsa_page_topk_reference(s, m, l, length, **kw))
  assert out.shape == ref.shape == (B, K, min(k, num_slots))
  n = np.minimum(np.asarray(length), num_slots)
  for b in range(B):  # the forced slots are always taken (their pages fit in k in these cases)
    must = {x for x in range(n[b]) if x < -(-sink // page_size) * page_size or
            (recent and x // page_size * page_size + page_size > n[b] - recent)}
    for h in range(K):
      assert must <= set(out[b, h, :min(n[b], k)].tolist()), (b, h)
  if np.array_equal(out, ref):
    return
  # The kernel normalises in another order than XLA: a differing choice must be a near tie of the scores.
  P = -(-num_slots // page_size)
  scores = normalize_partials(s[..., :P], m, l, jnp.minimum(length, num_slots), page_size=page_size)
  scores = np.asarray(force_pages(scores, jnp.minimum(length, num_slots), page_size=page_size, sink=sink,
                                  recent=recent))
  assert_near_ties_only(out, ref, scores, length, page_size=page_size, k=k)


@pytest.mark.parametrize("B,K,G,H,num_slots,page_size,k,topr,block_p", [
    (2, 2, 4, 64, 37, 3, 8, 21, 16), (3, 1, 3, 128, 100, 1, 16, 64, 32), (2, 2, 1, 64, 67, 4, 200, 7, 16),
    (1, 2, 8, 128, 1617, 3, 128, 61, None)])
def test_hsa_page_topk_matches_reference_interpret(B, K, G, H, num_slots, page_size, k, topr, block_p):
  check_hsa(num_slots, B, K, G, H, num_slots, page_size, k, topr, interpret=True, block_p=block_p)


@pytest.mark.parametrize("B,K,G,H,num_slots,page_size,k,topr,sink,recent", [
    (3, 2, 4, 64, 97, 2, 24, 21, 0, 8), (2, 1, 3, 64, 130, 3, 32, 16, 4, 5), (2, 2, 2, 64, 50, 1, 12, 9, 2, 0)])
def test_hsa_page_topk_forced_pages_interpret(B, K, G, H, num_slots, page_size, k, topr, sink, recent):
  """RocketKV's hsa_sink_tokens / hsa_recent_tokens inside the selection kernel: the forced slots always taken,
  the rest as the reference (ragged lengths, junk on empty pages)."""
  check_hsa(num_slots + 7, B, K, G, H, num_slots, page_size, k, topr, interpret=True, sink=sink, recent=recent)


def test_hsa_page_topk_lowers_for_h200_through_triton():
  from rocketkv_jax.kernels.page_topk import hsa_page_topk
  P, NB, P_pad = 540, 17, 17 * 32
  text = lower_for_h200(
      lambda s, m, l, n: hsa_page_topk(s, m, l, n, page_size=3, k=128, num_slots=1618),
      jax.ShapeDtypeStruct((2, 8, 4, P_pad), jnp.float32), jax.ShapeDtypeStruct((2, 8, 4, NB), jnp.float32),
      jax.ShapeDtypeStruct((2, 8, 4, NB), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32))
  assert "rocketkv_hsa_page_topk" in text and P <= P_pad


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,G,H,num_slots,page_size,k,topr", [
    (1, 8, 4, 128, 1618, 3, 128, 60), (8, 8, 4, 128, 6471, 3, 512, 40), (4, 3, 3, 64, 1031, 2, 64, 20)])
def test_hsa_page_topk_matches_reference_gpu(B, K, G, H, num_slots, page_size, k, topr):
  needs_gpu()
  check_hsa(num_slots + 1, B, K, G, H, num_slots, page_size, k, topr, interpret=False)
  check_hsa(num_slots + 2, B, K, G, H, num_slots, page_size, k, topr, interpret=False, sink=2, recent=8)
  for warps in (1, 4):
    check_hsa(num_slots + 3, B, K, G, H, num_slots, page_size, k, topr, interpret=False, num_warps=warps)
  check_hsa(num_slots + 5, B, K, G, H, num_slots, page_size, k, topr, interpret=False, sink=2, recent=8,
            num_warps=1)

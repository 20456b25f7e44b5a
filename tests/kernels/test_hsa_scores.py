"""HSA page-scoring kernel against its jnp reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CASES, GPU_CASES, lower_for_h200, needs_gpu, ragged_lengths, rel_err
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.hsa_scores import (GATHER_ROW_PROGRAMS_MIN_ROWS, Tuning, hsa_page_scores,
                                             hsa_page_scores_reference, pick_tuning, row_channels,
                                             row_channels_reference)
from rocketkv_jax.kernels.triton_util import pow2_pieces
from tests.helpers.data import key, keys, normal

KT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e5m2]


def make_inputs(c, seed, page_size, R, kt_dtype, aligned=False):
  rng = np.random.default_rng(seed)
  ks = keys(seed, 3)
  B, K, G, H, S, dt = c["B"], c["K"], c["G"], c["H"], c["S"], c["dtype"]
  P = kt_num_pages(S, page_size) if aligned else -(-S // page_size)  # aligned: as a cache holds them
  q = normal(ks[0], (B, K, G, H), dt)
  a = normal(ks[1], (B, K, H, P))
  b = normal(ks[2], (B, K, H, P))
  kt_min, kt_max = jnp.minimum(a, b), jnp.maximum(a, b)
  length = ragged_lengths(rng, B, S)
  n = jnp.clip(length[:, None] - jnp.arange(P) * page_size, 0, page_size)
  empty = (n == 0)[:, None, None, :]
  kt_min = jnp.where(empty, jnp.nan, kt_min).astype(kt_dtype)
  kt_max = jnp.where(empty, jnp.inf, kt_max).astype(kt_dtype)
  return q, kt_min, kt_max, length, n


def check(c, seed, page_size, R, kt_dtype, interpret, aligned=False, **tuning):
  q, kt_min, kt_max, length, n = make_inputs(c, seed, page_size, R, kt_dtype, aligned)
  out = hsa_page_scores(q, kt_min, kt_max, length, topr=R, page_size=page_size, interpret=interpret,
                        tuning=Tuning(**tuning))
  ref = hsa_page_scores_reference(q, kt_min, kt_max, length, topr=R, page_size=page_size)
  out, ref, n = np.asarray(out), np.asarray(ref), np.asarray(n)
  assert out.dtype == np.float32 and out.shape == ref.shape
  live = np.broadcast_to((n > 0)[:, None, :], out.shape)
  assert (out[~live] == -np.inf).all(), "empty pages must score -inf"
  # Scores are probabilities computed in f32 from the same upcast inputs in both versions.
  assert rel_err(out, ref, where=live) < 1e-4
  total = np.where(live, out, 0.0) * n[:, None, :]
  np.testing.assert_allclose(total.sum(-1), 1.0, rtol=1e-4)


# Each shape of the table with one (page_size, R, KT dtype) set, cycling, to keep CPU time down.
_KT_SETS = [(3, 21, jnp.bfloat16), (1, 64, jnp.float32), (4, 7, jnp.float8_e5m2),
            (2, 128, jnp.float8_e5m2)]


@pytest.mark.parametrize("c,page_size,R,kt_dtype",
                         [pytest.param(c.values[0], *_KT_SETS[i % len(_KT_SETS)],
                                       id=f"{c.id}-{_KT_SETS[i % len(_KT_SETS)][0]}-"
                                          f"{_KT_SETS[i % len(_KT_SETS)][1]}-"
                                          f"{jnp.dtype(_KT_SETS[i % len(_KT_SETS)][2]).name}")
                          for i, c in enumerate(CASES)])
def test_matches_reference_interpret(c, page_size, R, kt_dtype):
  check(c, seed=1, page_size=page_size, R=min(R, c["H"]), kt_dtype=kt_dtype, interpret=True,
        block_p=16)


@pytest.mark.parametrize("c", [CASES[1].values[0], CASES[3].values[0]], ids=[CASES[1].id, CASES[3].id])
def test_one_program_per_row_walking_its_pages(c):
  """split_pages=False: one program per row loops over its page blocks."""
  check(c, seed=5, page_size=3, R=min(21, c["H"]), kt_dtype=jnp.bfloat16, interpret=True, block_p=16,
        split_pages=False)


@pytest.mark.parametrize("c,page_size,R,kt_dtype,split_pages",
                         [pytest.param(c.values[0], *_KT_SETS[(i + 1) % len(_KT_SETS)], i % 2 == 0, id=c.id)
                          for i, c in enumerate(CASES)])
def test_aligned_pages_match_reference_interpret(c, page_size, R, kt_dtype, split_pages):
  """KT rows padded to a multiple of 16 pages, as a cache holds them: the loads take every page of the array,
  junk pages too (NaN / inf here), whose scores must stay out."""
  check(c, seed=6, page_size=page_size, R=min(R, c["H"]), kt_dtype=kt_dtype, interpret=True, block_p=16,
        split_pages=split_pages, aligned=True)


@pytest.mark.parametrize("R", [17, 40, 67, 100])
def test_gather_scores_chosen_rows_in_pieces_interpret(R):
  """The gather kernel scores the top-r rounded up to 16 as power-of-two pieces (40: 32 + 16, 67: 64 + 16,
  100: 64 + 32 + 16), one dot each: a piece dropped or misplaced changes the scores."""
  c = dict(B=1, K=2, G=3, H=128, S=70, dtype=jnp.bfloat16)
  check(c, seed=9, page_size=2, R=R, kt_dtype=jnp.bfloat16, interpret=True, block_p=16, split_pages=True,
        aligned=True)


def test_pow2_pieces():
  assert pow2_pieces(67, 16) == ((0, 64), (64, 16))
  assert pow2_pieces(100, 16) == ((0, 64), (64, 32), (96, 16))
  assert pow2_pieces(539, 32) == ((0, 512), (512, 32))
  assert pow2_pieces(64, 16) == ((0, 64),)
  assert pow2_pieces(1, 16) == ((0, 16),)


def check_row_channels(q, topr, dot_dtype, interpret, **tuning):
  got = row_channels(q, topr, dot_dtype, interpret=interpret, **tuning)
  want = row_channels_reference(q, topr, dot_dtype)
  for name, g, w in zip(("q", "ch", "use_max"), got[:3], want[:3]):  # exact: a chosen value, an index, a sign
    assert g.shape == w.shape and g.dtype == w.dtype, name
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)),
                                  err_msg=name)
  np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-6)  # 1 / tau: summation order


@pytest.mark.parametrize("G,H,topr,dtype,dot_dtype", [(4, 128, 60, jnp.bfloat16, jnp.bfloat16),
                                                      (1, 64, 13, jnp.float32, jnp.float32),
                                                      (8, 128, 128, jnp.bfloat16, jnp.float32),
                                                      (2, 64, 16, jnp.float32, jnp.float32),
                                                      (3, 64, 21, jnp.float32, jnp.float32),  # SmolLM2's group
                                                      (7, 128, 60, jnp.bfloat16, jnp.bfloat16)])  # Qwen2.5's
def test_row_channels_kernel_matches_reference_interpret(G, H, topr, dtype, dot_dtype):
  """The row_channels kernel gives lax.top_k's channels in its order, their signs (pads -1) and the group's
  query on them exactly; ties of |q| sums (every channel with a twin) go to the lower channel; a zero query
  row (tau 1) and a zero group (every channel tied at 0, summed sign 0: kt_min) too."""
  q = normal(key(G + topr), (3, 2, G, H), jnp.float32)
  q = q.at[1].set(q[1].at[..., 1::2].set(q[1][..., 0::2]))  # ties
  q = q.at[2, 0].set(0.0).at[2, 1, 0].set(0.0)
  check_row_channels(q.astype(dtype), topr, dot_dtype, interpret=True)


def test_pick_tuning_by_rows():
  """One program per page block below GATHER_ROW_PROGRAMS_MIN_ROWS rows of B * K, one per row from there, with
  the grid's warps and stages; fields given are kept; the channel choice is the row_channels kernel (no XLA
  sort) when none is given; a block_p that is no power of two raises."""
  rows = GATHER_ROW_PROGRAMS_MIN_ROWS
  below, at = pick_tuning(rows - 1, 1, 544, 60), pick_tuning(rows, 1, 544, 60)
  assert below.split_pages and not at.split_pages
  assert (below.num_warps, below.num_stages) == (2, 1) and (at.num_warps, at.num_stages) == (2, 2)
  assert pick_tuning(391, 8, 544, 60).block_p == 64  # 32k, t=256 at batch 391: a [64, 64] tile
  assert pick_tuning(1, 8, 544, 60, Tuning(block_p=16, num_warps=8)) == Tuning(16, True, 8, 1)
  traced = str(jax.make_jaxpr(lambda *a: hsa_page_scores(*a, topr=9, page_size=3, interpret=True))(
      jnp.zeros((3, 1, 4, 64)), jnp.zeros((3, 1, 64, 14)), jnp.zeros((3, 1, 64, 14)), jnp.zeros((3,), jnp.int32)))
  assert "top_k" not in traced and "rocketkv_hsa_row_channels" in traced
  with pytest.raises(ValueError, match="block_p=24"):
    hsa_page_scores(jnp.ones((1, 1, 4, 64)), jnp.ones((1, 1, 64, 5)), jnp.ones((1, 1, 64, 5)),
                    jnp.ones((1,), jnp.int32), topr=8, page_size=2, tuning=Tuning(block_p=24))


def test_a_given_choice_is_used_as_it_is_interpret():
  """choice= (e.g. made by `cache_append`'s kernel): the same scores as choosing in the call; a wrong choice
  (another top-r) changes them; bad shapes raise."""
  from rocketkv_jax.kernels.hsa_scores import choice_dot_dtype
  c = dict(B=2, K=2, G=4, H=64, S=40, dtype=jnp.bfloat16)
  q, kt_min, kt_max, length, _ = make_inputs(c, 9, 3, 9, jnp.bfloat16, aligned=True)
  run = lambda **kw: np.asarray(hsa_page_scores(q, kt_min, kt_max, length, topr=9, page_size=3, interpret=True,
                                                **kw))
  dot = choice_dot_dtype(q.dtype, kt_min.dtype)
  want = run()
  live = np.isfinite(want)
  np.testing.assert_array_equal(run(choice=row_channels_reference(q, 9, dot)), want)
  assert rel_err(run(choice=row_channels(q, 9, dot, interpret=True)), want, where=live) < 1e-6
  other = row_channels_reference(q, 3, dot)  # 3 channels padded to the same 16 slots: a valid, different choice
  assert not np.allclose(run(choice=other)[live], want[live])
  with pytest.raises(ValueError, match="choice shapes"):
    run(choice=row_channels_reference(q, 40, dot))


def test_channel_choice_ties_toward_the_lower_channel_interpret():
  """The in-kernel channel choice (the row_channels kernel's, as the append kernel's) gives the reference's
  channels when |q| sums tie exactly (every channel has a twin): an odd top-r splits a tied pair, which the
  lower channel must win."""
  c = dict(B=2, K=2, G=4, H=64, S=60, dtype=jnp.bfloat16)
  q, kt_min, kt_max, length, n = make_inputs(c, 13, 3, 21, jnp.bfloat16, aligned=True)
  q = q.at[..., 1::2].set(q[..., 0::2])
  out = np.asarray(hsa_page_scores(q, kt_min, kt_max, length, topr=21, page_size=3, interpret=True,
                                   tuning=Tuning(block_p=16)))
  ref = np.asarray(hsa_page_scores_reference(q, kt_min, kt_max, length, topr=21, page_size=3))
  live = np.isfinite(ref)
  assert (np.isfinite(out) == live).all() and rel_err(out, ref, where=live) < 1e-5


def test_single_channel_and_all_channels():
  c = dict(B=2, K=2, G=4, H=64, S=50, dtype=jnp.float32)
  check(c, seed=2, page_size=5, R=1, kt_dtype=jnp.float32, interpret=True)
  check(c, seed=3, page_size=5, R=64, kt_dtype=jnp.float32, interpret=True)


def test_rejects_bad_shapes():
  q = jnp.ones((1, 2, 4, 64))
  kt = jnp.ones((1, 2, 64, 5))
  length = jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match="kt_max_BKHP.shape"):
    hsa_page_scores(q, kt, jnp.ones((1, 2, 64, 6)), length, topr=8, page_size=2)
  with pytest.raises(ValueError, match="topr=65"):
    hsa_page_scores(q, kt, kt, length, topr=65, page_size=2)
  with pytest.raises(ValueError, match="topr=0"):
    hsa_page_scores(q, kt, kt, length, topr=0, page_size=2)
  with pytest.raises(ValueError, match="page_size=0"):
    hsa_page_scores(q, kt, kt, length, topr=8, page_size=0)


@pytest.mark.parametrize("split_pages", [True, False])
@pytest.mark.parametrize("H,G,R,kt_dtype,q_dtype", [(64, 1, 13, jnp.float32, jnp.bfloat16),
                                                    (128, 4, 61, jnp.bfloat16, jnp.bfloat16),
                                                    (128, 8, 128, jnp.float8_e5m2, jnp.bfloat16),
                                                    (128, 4, 40, jnp.bfloat16, jnp.float32),
                                                    (128, 7, 60, jnp.bfloat16, jnp.bfloat16)])
def test_lowers_for_h200_through_triton(H, G, R, kt_dtype, q_dtype, split_pages):
  q = jax.ShapeDtypeStruct((2, 2, G, H), q_dtype)
  kt = jax.ShapeDtypeStruct((2, 2, H, 333), kt_dtype)
  length = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = lower_for_h200(
      lambda *a: hsa_page_scores(*a, topr=R, page_size=3, tuning=Tuning(split_pages=split_pages)), q, kt, kt, length)
  assert "rocketkv_hsa_scores_gather" in text
  assert "rocketkv_hsa_row_channels" in text


@pytest.mark.gpu
@pytest.mark.parametrize("split_pages", [True, False])
def test_gather_scores_chosen_rows_in_pieces_gpu(split_pages):
  """Compiled: top-r 67 (64 + 16, the 32k t=1024 and 64k t=256 decode shapes) and 100 (64 + 32 + 16)."""
  needs_gpu()
  c = dict(B=3, K=8, G=4, H=128, S=2053, dtype=jnp.bfloat16)
  for R, kt_dtype in ((67, jnp.bfloat16), (100, jnp.float8_e5m2)):
    check(c, seed=11, page_size=4, R=R, kt_dtype=kt_dtype, interpret=False, aligned=True, split_pages=split_pages)


@pytest.mark.gpu
@pytest.mark.parametrize("c,kt_dtype", [pytest.param(c.values[0], KT_DTYPES[i % 3],
                                                     id=f"{c.id}-{jnp.dtype(KT_DTYPES[i % 3]).name}")
                                        for i, c in enumerate(GPU_CASES)])
def test_matches_reference_gpu(c, kt_dtype):
  needs_gpu()
  check(c, seed=3, page_size=3, R=min(61, c["H"]), kt_dtype=kt_dtype, interpret=False)
  check(c, seed=4, page_size=1, R=c["H"] // 2, kt_dtype=kt_dtype, interpret=False, block_p=32)
  check(c, seed=5, page_size=3, R=min(40, c["H"]), kt_dtype=kt_dtype, interpret=False, split_pages=False)
  for split in (True, False):  # aligned pages, as a cache holds them: the vectorised loads
    check(c, seed=8, page_size=3, R=min(61, c["H"]), kt_dtype=kt_dtype, interpret=False, split_pages=split,
          aligned=True)


@pytest.mark.gpu
def test_row_channels_kernel_matches_reference_gpu():
  needs_gpu()
  q = normal(key(0), (5, 8, 4, 128), jnp.float32)
  q = q.at[1].set(q[1].at[..., 1::2].set(q[1][..., 0::2])).at[2, 0].set(0.0)
  for dtype, topr, dot_dtype in ((jnp.bfloat16, 60, jnp.bfloat16), (jnp.float32, 61, jnp.float32),
                                 (jnp.bfloat16, 128, jnp.float32)):
    for warps in (2, 4):  # num_warps None picks one of these by rows
      check_row_channels(q.astype(dtype), topr, dot_dtype, interpret=False, num_warps=warps)
  q7 = normal(key(1), (3, 4, 7, 128), jnp.bfloat16)  # a group of 7 (Qwen2.5)
  check_row_channels(q7, 60, jnp.bfloat16, interpret=False)


def test_row_channels_lowers_for_h200_through_triton():
  text = lower_for_h200(lambda q: row_channels(q, 60, jnp.bfloat16),
                        jax.ShapeDtypeStruct((2, 8, 4, 128), jnp.bfloat16))
  assert "rocketkv_hsa_row_channels" in text

"""Per-row stage-2 plans: each row of a batch with its own HSA page size (`page_size_B`) and top-r (`topr_B`),
the static `page_size` / `topr` the largest. The property held for every kernel and XLA path: each row's output
is what that row gives alone (a batch of one) with static page_size = ps_b and topr = r_b, on the same arrays;
and per-row values all equal to the static ones give bitwise the output of None.

The rows share the KT arrays' P pages, so a row of smaller pages uses more of them (length_b <= P * ps_b). Run
alone, a row's static page size needs ceil(S / ps_b) pages: its KT arrays are padded with junk pages for that
(pages past its length, which nothing may read).

Interpret-mode compiles dominate the CPU time, one per static configuration, and each row alone is one: a row
alone runs through the reference (jitted XLA, the ops' semantics, which the kernel tests hold each kernel to
at static values) except where a kernel alone is cheap to add."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_near_ties_only, lower_for_h200, needs_gpu
from rocketkv_jax import ops
from rocketkv_jax.kernels.cache_append import cache_append, cache_append_reference
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.hsa_scores import (Tuning, chosen_slots, hsa_page_partials, hsa_page_scores,
                                             hsa_page_scores_reference, normalize_partials, row_channels,
                                             row_channels_reference)
from rocketkv_jax.kernels.page_topk import (force_pages, hsa_page_topk, hsa_page_topk_reference, page_topk,
                                            page_topk_reference)
from tests.helpers.data import normal

# One batch of plans: page sizes 1, 2, 3, 5 (static 5) and top-r 40, 7, 17, 1 (static 40: the gather layout's
# pieces 32 + 16), S = 37 slots, P = kt_num_pages(37, 5) = 16 KT pages shared by the rows. Lengths: a row of
# pages of 1 filling its 16 pages, whole pages of 2, the whole cache in pages of 3, a partial page of 5.
PLAN = dict(S=37, page_size=5, topr=40, ps=(1, 2, 3, 5), r=(40, 7, 17, 1), length=(16, 32, 37, 21))


def plan_arrays(plan=PLAN):
  P = kt_num_pages(plan["S"], plan["page_size"])
  ps = jnp.asarray(plan["ps"], jnp.int32)
  r = jnp.asarray(plan["r"], jnp.int32)
  length = jnp.asarray(plan["length"], jnp.int32)
  return P, ps, r, length


def junk_pages(x_BKHP, length_B, ps_B, value):
  """`value` on each row's pages that hold no valid slot (page * ps_b >= length_b)."""
  P = x_BKHP.shape[-1]
  empty = jnp.arange(P)[None, :] * ps_B[:, None] >= length_B[:, None]
  return jnp.where(empty[:, None, None, :], value, x_BKHP)


def alone_pages(x_BKHP, b, num_pages, value):
  """Row b's KT array [1, K, H, num_pages]: its P pages, padded with `value` junk to num_pages."""
  x = x_BKHP[b:b + 1]
  return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, num_pages - x.shape[-1])), constant_values=value)


def hsa_inputs(seed, B, K, G, H, P, length, ps, dtype=jnp.float32, kt_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = normal(rng, (B, K, G, H), dtype)
  a, b = normal(rng, (B, K, H, P)), normal(rng, (B, K, H, P))
  kt_min = junk_pages(jnp.minimum(a, b), length, ps, jnp.nan).astype(kt_dtype)
  kt_max = junk_pages(jnp.maximum(a, b), length, ps, jnp.inf).astype(kt_dtype)
  return q, kt_min, kt_max


def assert_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


# ---------------------------------------------------------------- the channel choice


def check_choice_rows(got, alone, r):
  """A row's choice against the row's alone (Rp_b = chosen_slots(r_b) slots): the same first Rp_b slots, pads
  after (q 0, ch 0, use_max -1), 1 / tau from the row's r_b channels."""
  q, ch, use_max, inv_tau = (np.asarray(x.astype(jnp.float32)) for x in got)
  aq, ach, ause, ainv = (np.asarray(x.astype(jnp.float32)) for x in alone)
  Rb = chosen_slots(r)
  np.testing.assert_array_equal(q[..., :Rb], aq)
  np.testing.assert_array_equal(ch[..., :Rb], ach)
  np.testing.assert_array_equal(use_max[..., :Rb], ause)
  assert (q[..., Rb:] == 0).all() and (ch[..., Rb:] == 0).all() and (use_max[..., Rb:] == -1).all()
  np.testing.assert_allclose(inv_tau, ainv, rtol=1e-6)


def test_row_channels_per_row_topr_interpret():
  """The choice kernel with topr_B against its reference, and the reference against each row alone at top-r
  r_b (tied |q| sums in row 1, a zero group in row 3: every channel tied at 0)."""
  _, _, r, _ = plan_arrays()
  q = normal(np.random.default_rng(0), (4, 2, 3, 64))
  q = q.at[1].set(q[1].at[..., 1::2].set(q[1][..., 0::2])).at[3, 1].set(0.0).astype(jnp.bfloat16)
  want = row_channels_reference(q, 40, jnp.bfloat16, topr_B=r)
  got = row_channels(q, 40, jnp.bfloat16, interpret=True, topr_B=r)
  assert_bits(got[:3], want[:3])
  np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-6)
  for b, rb in enumerate(PLAN["r"]):
    check_choice_rows([x[b:b + 1] for x in want], row_channels_reference(q[b:b + 1], rb, jnp.bfloat16), rb)
  assert_bits(row_channels_reference(q, 40, jnp.bfloat16, topr_B=jnp.full((4,), 40, jnp.int32)),
              row_channels_reference(q, 40, jnp.bfloat16))


# ---------------------------------------------------------------- the token append


def append_inputs(seed, B, K, S, H, P, slot_BK, dtype, kt_dtype):
  """A cache with NaN junk past each (b, k)'s slot, KT pages [B, K, H, P] and fresh rows."""
  rng = np.random.default_rng(seed)
  k, v = (normal(rng, (B, K, S, H), dtype) for _ in range(2))
  junk = (jnp.arange(S)[None, None, :] > slot_BK[..., None])[..., None]
  k, v = jnp.where(junk, jnp.nan, k), jnp.where(junk, jnp.nan, v)
  k_new, v_new = (normal(rng, (B, K, H), dtype) for _ in range(2))
  a, b = normal(rng, (B, K, H, P)), normal(rng, (B, K, H, P))
  return k, v, k_new, v_new, slot_BK, jnp.minimum(a, b).astype(kt_dtype), jnp.maximum(a, b).astype(kt_dtype)


# The reference jitted: one compile per row's static plan (eager, every op of it compiles per shape).
jit_append_reference = jax.jit(cache_append_reference, static_argnames=["page_size", "topr"])


def check_append(fn, seed, slot_BK, fold, dtype=jnp.bfloat16, kt_dtype=jnp.bfloat16, S=PLAN["S"], H=64,
                 G=3, alone_fn=jit_append_reference, rows=range(4), static=True, batch_ref=False):
  """fn(*args, page_size, choose_q, topr, page_size_B, topr_B) -> (k, v, kt_min, kt_max, *choice) against
  `rows` alone through alone_fn (same arguments; the reference unless given), bitwise; with batch_ref, the
  reference's per-row plans on the batch too; with `static`, bitwise None's output at the static plan.
  slot_BK [B, K] or [B]. fold: float32 keys, which the kernel folds into the page (else, of the cache's dtype,
  it rebuilds the page from its rows)."""
  P, ps, r, _ = plan_arrays()
  B, K = 4, 2
  args = append_inputs(seed, B, K, S, H, P, jnp.broadcast_to(slot_BK.reshape(B, -1), (B, K)), dtype, kt_dtype)
  args = args[:4] + (slot_BK,) + args[5:]
  if fold:
    args = args[:2] + tuple(x.astype(jnp.float32) for x in args[2:4]) + args[4:]
  q = normal(np.random.default_rng(seed + 1), (B, K, G, H), dtype)
  kw = {}
  out = fn(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"], page_size_B=ps, topr_B=r, **kw)
  if batch_ref:
    ref = jit_append_reference(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"], page_size_B=ps,
                               topr_B=r, **kw)
    assert_bits(out[:-1], ref[:-1])
    np.testing.assert_allclose(np.asarray(out[-1]), np.asarray(ref[-1]), rtol=1e-6)  # 1 / tau: summation order
  for b in rows:
    psb, rb = PLAN["ps"][b], PLAN["r"][b]
    Pb = kt_num_pages(S, psb)
    row = [x[b:b + 1] for x in args[:5]] + [alone_pages(x, b, Pb, 0.0) for x in args[5:]]
    alone = alone_fn(*row, page_size=psb, choose_q=q[b:b + 1], topr=rb, **kw)
    # The alone run's pad pages past P are dropped (a slot there has no page in the batch's arrays).
    assert_bits([x[b:b + 1] for x in out[:2]], alone[:2])
    assert_bits([x[b:b + 1] for x in out[2:4]], [x[..., :P] for x in alone[2:4]])
    check_choice_rows([x[b:b + 1] for x in out[4:]], alone[4:], rb)
  if not static:
    return
  static = fn(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"], **kw)
  full = fn(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"],
            page_size_B=jnp.full((B,), PLAN["page_size"], jnp.int32), topr_B=jnp.full((B,), PLAN["topr"], jnp.int32),
            **kw)
  assert_bits(full, static)


# Per row (pages of 1, 2, 3, 5): slots inside pages (pages of 1: every slot starts one), and per KV head fresh
# pages, a page's last slot, slots out of range (-1, S) and a row of pages of 1 at slot 20 >= P = 16: K/V
# written, no KT page.
APPEND_SLOTS = [np.array([10, 5, 8, 17]), np.array([[13, 20], [4, -1], [36, 35], [PLAN["S"], 19]])]


@pytest.mark.parametrize("slots,fold", [(0, True), (1, False)], ids=["slot_B-fold", "slot_BK-rows"])
def test_cache_append_per_row_plans_interpret(slots, fold):
  """The kernel and the reference with per-row plans: each row as the reference alone (bitwise, as the kernel
  tests hold the kernel to the reference at static values)."""
  kernel = functools.partial(cache_append, interpret=True)
  check_append(kernel, seed=3 + slots, slot_BK=jnp.asarray(APPEND_SLOTS[slots], jnp.int32), fold=fold,
               batch_ref=True)


def test_cache_append_kernel_alone_interpret():
  """The kernel against the kernel alone, the "rows" rebuild at the row's page size (f8 pages): the rows of
  pages of 2 and 3 (a slot mid-page, one at a page's last slot, one out of range)."""
  kernel = functools.partial(cache_append, interpret=True)
  check_append(kernel, seed=7, slot_BK=jnp.asarray(APPEND_SLOTS[1], jnp.int32), fold=False,
               kt_dtype=jnp.float8_e5m2, alone_fn=kernel, rows=(1, 2), static=False)


def test_cache_append_xla_per_row_plans():
  """The ops XLA path (the scatters, a fold), per-head slots: each row as the XLA path alone."""
  slot = jnp.asarray(APPEND_SLOTS[1], jnp.int32)
  xla = functools.partial(ops.cache_append, impl="xla")
  check_append(xla, seed=6, slot_BK=slot, fold=False, dtype=jnp.float32, kt_dtype=jnp.float32, alone_fn=xla)


# ---------------------------------------------------------------- HSA scoring and selection

# A row alone through the XLA path (jitted: one compile per row's static plan): (scores, idx).
@functools.partial(jax.jit, static_argnames=["topr", "page_size", "k", "num_slots", "sink", "recent"])
def xla_select(q, kt_min, kt_max, length, *, topr, page_size, **kw):
  scores = hsa_page_scores_reference(q, kt_min, kt_max, length, topr=topr, page_size=page_size,
                                     page_size_B=kw.get("page_size_B"), topr_B=kw.get("topr_B"))
  return scores, ops.hsa_select(q, kt_min, kt_max, length, topr=topr, page_size=page_size, impl="xla", **kw)


FULL = dict(page_size_B=jnp.full((4,), PLAN["page_size"], jnp.int32), topr_B=jnp.full((4,), PLAN["topr"], jnp.int32))


def row_alone(b, psb, q, kt_min, kt_max, length, P_min=0):
  """Row b's arguments alone: its KT arrays padded with junk to the pages its static page size needs."""
  Pb = max(P_min, kt_num_pages(PLAN["S"], psb))
  return q[b:b + 1], alone_pages(kt_min, b, Pb, jnp.nan), alone_pages(kt_max, b, Pb, jnp.inf), length[b:b + 1]


def check_hsa_rows(seed, sink=0, recent=0, k=12, G=3, H=64, interpret=True, dtype=jnp.float32,
                   kt_dtype=jnp.float32, **tuning):
  """hsa_page_partials -> hsa_page_topk with per-row plans: idx as the reference selection of the same partials
  (exactly), each row's normalised scores as the reference alone (float tolerance) and its idx as the XLA
  selection alone (exactly); bitwise None's output at the static plan."""
  P, ps, r, length = plan_arrays()
  S, page_size, topr = PLAN["S"], PLAN["page_size"], PLAN["topr"]
  q, kt_min, kt_max = hsa_inputs(seed, 4, 2, G, H, P, length, ps, dtype, kt_dtype)
  args = (q, kt_min, kt_max, length)
  tune = dict(interpret=interpret, tuning=Tuning(**tuning))
  select = dict(k=k, num_slots=S, sink=sink, recent=recent)
  s, m, l = hsa_page_partials(*args, topr=topr, page_size=page_size, page_size_B=ps, topr_B=r, **tune)
  idx = hsa_page_topk(s, m, l, length, page_size=page_size, page_size_B=ps, num_pages=P, interpret=interpret,
                      **select)
  ref = jax.jit(functools.partial(hsa_page_topk_reference, page_size=page_size, num_pages=P, **select))(
      s, m, l, length, page_size_B=ps)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))
  scores = np.asarray(normalize_partials(s[..., :P], m, l, length, page_size=page_size, page_size_B=ps))
  for b, (psb, rb) in enumerate(zip(PLAN["ps"], PLAN["r"])):
    row = row_alone(b, psb, *args)
    want, alone = (np.asarray(x) for x in xla_select(*row, topr=rb, page_size=psb, **select))
    want = want[0]
    live = np.isfinite(want[..., :P])
    assert (np.isfinite(scores[b]) == live).all() and (want[..., P:] == -np.inf).all()
    np.testing.assert_allclose(scores[b][live], want[..., :P][live], rtol=1e-4)
    if interpret or np.array_equal(idx[b:b + 1], alone):
      np.testing.assert_array_equal(np.asarray(idx[b:b + 1]), alone, err_msg=f"row {b}")
    else:  # compiled, the kernels sum in another order than XLA: a differing choice must be a near tie
      forced = force_pages(jnp.asarray(want[None]), length[b:b + 1], page_size=psb, sink=sink, recent=recent)
      assert_near_ties_only(np.asarray(idx[b:b + 1]), alone, np.asarray(forced), np.asarray(length[b:b + 1]),
                            page_size=psb, k=k)
  # Every row's plan the static one: bitwise the output of None. (But l, a sum: interpret mode compiles the
  # kernel body with XLA, which may sum in another order when the page size is a constant: 1 ulp, seen.)
  static = hsa_page_partials(*args, topr=topr, page_size=page_size, **tune)
  same = hsa_page_partials(*args, topr=topr, page_size=page_size, **FULL, **tune)
  assert_bits(same[:2], static[:2])
  np.testing.assert_allclose(np.asarray(same[2]), np.asarray(static[2]), rtol=1e-6)
  P0 = -(-S // page_size)  # None's pages: ceil(S / page_size); the same pages passed as num_pages
  assert_bits(hsa_page_topk(*static, length, page_size=page_size, page_size_B=FULL["page_size_B"], num_pages=P0,
                            interpret=interpret, **select),
              hsa_page_topk(*static, length, page_size=page_size, interpret=interpret, **select))


def test_hsa_partials_and_page_topk_forced_pages_interpret():
  """The forced sink / recent pages at each row's page size."""
  check_hsa_rows(seed=11, sink=2, recent=3)


def test_hsa_partials_and_page_topk_pieces_interpret():
  """The choice kernel with topr_B (pads load nothing), pieces 32 + 16, pages of 16."""
  check_hsa_rows(seed=12, block_p=16)


def test_hsa_page_topk_kernel_alone_interpret():
  """The selection kernel against the kernel alone, on the same partials (a row's page size the static one);
  num_pages None selects from all the partials' pages (32 here), the same idx as from the KT's 16."""
  P, ps, _, length = plan_arrays()
  s = normal(np.random.default_rng(13), (4, 2, 3, 32))
  ok = jnp.arange(32)[None, :] * ps[:, None] < length[:, None]
  s = jnp.where(ok[:, None, None, :], s, -0.7 * float(jnp.finfo(jnp.float32).max))
  m = s.max(-1, keepdims=True)
  l = (jnp.exp(s - m) * jnp.clip(length[:, None] - jnp.arange(32) * ps[:, None], 0, ps[:, None])[:, None, None]).sum(
      -1, keepdims=True)
  kw = dict(k=12, num_slots=PLAN["S"], sink=1, recent=4, interpret=True)
  idx = hsa_page_topk(s, m, l, length, page_size=PLAN["page_size"], page_size_B=ps, num_pages=P, **kw)
  assert_bits(hsa_page_topk(s, m, l, length, page_size=PLAN["page_size"], page_size_B=ps, **kw), idx)
  for b in (1, 2):  # pages of 2 and 3 (alone, pages of 1 would need 37 pages of partials: the batch has 32)
    psb = PLAN["ps"][b]
    alone = hsa_page_topk(s[b:b + 1], m[b:b + 1], l[b:b + 1], length[b:b + 1], page_size=psb, **kw)
    np.testing.assert_array_equal(np.asarray(idx[b:b + 1]), np.asarray(alone), err_msg=f"row {b}")


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_ops_hsa_select_per_row_plans(impl):
  """ops.hsa_select: the XLA path against each row alone through the XLA path; the kernels against the XLA
  path's batch (the kernels' own per-row tests are above); bitwise None's output at the static plan."""
  check_ops_hsa_select(impl)


def check_ops_hsa_select(impl):
  P, ps, r, length = plan_arrays()
  S, page_size, topr = PLAN["S"], PLAN["page_size"], PLAN["topr"]
  args = hsa_inputs(11, 4, 2, 3, 64, P, length, ps) + (length,)
  kw = dict(k=12, num_slots=S, sink=2, recent=3)
  idx = ops.hsa_select(*args, topr=topr, page_size=page_size, page_size_B=ps, topr_B=r, impl=impl, **kw)
  want = xla_select(*args, topr=topr, page_size=page_size, page_size_B=ps, topr_B=r, **kw)[1]
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
  if impl == "xla":
    for b, (psb, rb) in enumerate(zip(PLAN["ps"], PLAN["r"])):
      alone = xla_select(*row_alone(b, psb, *args), topr=rb, page_size=psb, **kw)[1]
      np.testing.assert_array_equal(np.asarray(idx[b:b + 1]), np.asarray(alone), err_msg=f"row {b}")
  assert_bits(ops.hsa_select(*args, topr=topr, page_size=page_size, impl=impl, **FULL, **kw),
              ops.hsa_select(*args, topr=topr, page_size=page_size, impl=impl, **kw))


def test_ops_hsa_select_uses_every_kt_page():
  """With page_size_B the selection takes all the KT arrays' pages, past kt_num_pages(S, page_size) too: 32
  pages of which the row of pages of 1 fills 31 (not 16). The kernels give the XLA path's idx; each row is the
  XLA path alone (a row whose static page size allows fewer pages passes it as a batch of one's page_size_B)."""
  P, ps, r, _ = plan_arrays()
  P, length = 2 * P, jnp.array([31, 32, 37, 21], jnp.int32)
  args = hsa_inputs(23, 4, 2, 3, 64, P, length, ps) + (length,)
  kw = dict(k=12, num_slots=PLAN["S"], sink=0, recent=0)
  idx = np.asarray(xla_select(*args, topr=PLAN["topr"], page_size=PLAN["page_size"], page_size_B=ps, topr_B=r,
                              **kw)[1])
  kernels = ops.hsa_select(*args, topr=PLAN["topr"], page_size=PLAN["page_size"], page_size_B=ps, topr_B=r,
                           impl="interpret", **kw)
  np.testing.assert_array_equal(np.asarray(kernels), idx)
  assert idx[0].max() >= 16  # row 0 chose slots on pages past the first 16
  for b, (psb, rb) in enumerate(zip(PLAN["ps"], PLAN["r"])):
    row = row_alone(b, psb, *args, P_min=P)
    own = {} if row[1].shape[-1] == kt_num_pages(PLAN["S"], psb) else dict(page_size_B=jnp.array([psb]))
    alone = xla_select(*row, topr=rb, page_size=psb, **own, **kw)[1]
    np.testing.assert_array_equal(idx[b:b + 1], np.asarray(alone), err_msg=f"row {b}")


def test_hsa_page_scores_per_row_plans_interpret():
  """The scores normalised in XLA (the path above the selection kernel's page limit) against the reference,
  both per-row: each row's probabilities sum to 1 over its valid slots."""
  P, ps, r, length = plan_arrays()
  q, kt_min, kt_max = hsa_inputs(31, 4, 2, 3, 64, P, length, ps)
  kw = dict(topr=PLAN["topr"], page_size=PLAN["page_size"], page_size_B=ps, topr_B=r)
  got = np.asarray(hsa_page_scores(q, kt_min, kt_max, length, interpret=True, tuning=Tuning(block_p=16), **kw))
  want = np.asarray(hsa_page_scores_reference(q, kt_min, kt_max, length, **kw))
  n = np.clip(np.asarray(length)[:, None] - np.arange(P) * np.asarray(ps)[:, None], 0, np.asarray(ps)[:, None])
  live = np.broadcast_to((n > 0)[:, None, :], got.shape)
  assert (got[~live] == -np.inf).all() and (want[~live] == -np.inf).all()
  np.testing.assert_allclose(got[live], want[live], rtol=1e-5)
  np.testing.assert_allclose((np.where(live, got, 0) * n[:, None, :]).sum(-1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------- page top-k

xla_page_topk = jax.jit(page_topk_reference, static_argnames=["page_size", "k", "num_slots"])
xla_best_pages = jax.jit(ops.page_topk_best_pages, static_argnames=["page_size", "k", "num_slots"])


def page_scores(seed, B, K, P, length, ps, ties):
  rng = np.random.default_rng(seed)
  if ties:  # few distinct values: most of the choice is the tie-break toward the lower slot
    scores = rng.integers(-2, 3, (B, K, P)).astype(np.float32)
  else:
    scores = rng.standard_normal((B, K, P)).astype(np.float32)
  scores[0, 0, 0] = -np.inf  # a valid page may score -inf
  return junk_pages(jnp.asarray(scores)[:, :, None, :], length, ps, jnp.nan)[:, :, 0, :]


@pytest.mark.parametrize("ties,ks", [(True, (1, 12, 64)), (False, (12,))], ids=["ties", "distinct"])
def test_page_topk_per_row_page_sizes(ties, ks):
  """The kernel, the reference, ops' XLA path and the best-pages variant with page_size_B: each row as the
  reference alone (k past the slots too); bitwise None's output when every row has the static page size."""
  P, ps, _, length = plan_arrays()
  S, page_size = PLAN["S"], PLAN["page_size"]
  scores = page_scores(41, 4, 2, P, length, ps, ties)
  fns = {"kernel": functools.partial(page_topk, interpret=True), "reference": xla_page_topk,
         "best_pages": xla_best_pages}
  for k in ks:
    kw = dict(page_size=page_size, k=k, num_slots=S)
    want = []
    for b, psb in enumerate(PLAN["ps"]):
      row = jnp.pad(scores[b:b + 1], ((0, 0), (0, 0), (0, kt_num_pages(S, psb) - P)), constant_values=jnp.nan)
      want.append(np.asarray(xla_page_topk(row, length[b:b + 1], page_size=psb, k=k, num_slots=S)))
    if k == 12:
      fns["ops_xla"] = functools.partial(ops.page_topk, impl="xla")
    for name, fn in fns.items():
      np.testing.assert_array_equal(np.asarray(fn(scores, length, page_size_B=ps, **kw)), np.concatenate(want),
                                    err_msg=f"{name} k={k}")
  P0 = -(-S // page_size)
  kw = dict(page_size=page_size, k=12, num_slots=S)
  for name, fn in fns.items():
    assert_bits(fn(scores[..., :P0], length, page_size_B=jnp.full((4,), page_size, jnp.int32), **kw),
                fn(scores[..., :P0], length, **kw))


def test_rejects_bad_row_values():
  P, ps, r, length = plan_arrays()
  q, kt_min, kt_max = hsa_inputs(0, 4, 2, 3, 64, P, length, ps)
  with pytest.raises(ValueError, match=r"page_size_B.shape=\(3,\)"):
    hsa_page_partials(q, kt_min, kt_max, length, topr=40, page_size=5, page_size_B=ps[:3], interpret=True)
  with pytest.raises(ValueError, match="topr_B.dtype=float32"):
    hsa_page_partials(q, kt_min, kt_max, length, topr=40, page_size=5, topr_B=r.astype(jnp.float32),
                      interpret=True)
  with pytest.raises(ValueError, match="P=7 pages must be at least"):
    page_topk(jnp.zeros((4, 2, 7)), length, page_size=5, k=4, num_slots=37, page_size_B=ps, interpret=True)
  kv = jnp.zeros((4, 2, 37, 64))
  with pytest.raises(ValueError, match="P >= ceil"):
    cache_append(kv, kv, kv[:, :, 0], kv[:, :, 0], length, kt_min[..., :7], kt_max[..., :7], page_size=5,
                 page_size_B=ps, interpret=True)


# ---------------------------------------------------------------- Triton lowering and the GPU


def test_lower_for_h200_with_per_row_plans():
  """The per-row code paths lower through Triton (a scalar load of the row's values per program)."""
  sd = jax.ShapeDtypeStruct
  B, K, G, H, S, P = 8, 8, 4, 128, 1617, 544
  row = sd((B,), jnp.int32)
  q, kt = sd((B, K, G, H), jnp.bfloat16), sd((B, K, H, P), jnp.bfloat16)
  kv, new = sd((B, K, S, H), jnp.bfloat16), sd((B, K, H), jnp.bfloat16)
  text = lower_for_h200(lambda *a: cache_append(*a[:7], page_size=3, choose_q=a[7], topr=60, page_size_B=a[8],
                                                topr_B=a[9]), kv, kv, new, new, row, kt, kt, q, row, row)
  assert "rocketkv_cache_append" in text
  text = lower_for_h200(lambda *a: hsa_page_partials(*a[:4], topr=60, page_size=3, page_size_B=a[4], topr_B=a[5]),
                        q, kt, kt, row, row, row)
  assert "rocketkv_hsa_scores" in text
  NB, bp = 17, 32
  f32 = lambda *s: sd(s, jnp.float32)  # noqa: E731
  text = lower_for_h200(lambda s, m, l, n, p: hsa_page_topk(s, m, l, n, page_size=3, k=128, num_slots=S, sink=4,
                                                            recent=8, page_size_B=p, num_pages=P),
                        f32(B, K, G, NB * bp), f32(B, K, G, NB), f32(B, K, G, NB), row, row)
  assert "rocketkv_hsa_page_topk" in text
  text = lower_for_h200(lambda s, n, p: page_topk(s, n, page_size=3, k=128, num_slots=S, page_size_B=p),
                        f32(B, K, P), row, row)
  assert "rocketkv_page_topk" in text


@pytest.mark.gpu
def test_per_row_plans_gpu():
  needs_gpu()
  check_append(cache_append, seed=3, slot_BK=jnp.asarray(APPEND_SLOTS[1], jnp.int32), fold=False)
  check_append(cache_append, seed=4, slot_BK=jnp.asarray(APPEND_SLOTS[0], jnp.int32), fold=True)
  check_hsa_rows(seed=11, sink=2, recent=3, interpret=False, H=128, G=4, dtype=jnp.bfloat16, kt_dtype=jnp.bfloat16)
  P, ps, _, length = plan_arrays()
  scores = page_scores(41, 4, 2, P, length, ps, ties=True)
  kw = dict(page_size=PLAN["page_size"], k=12, num_slots=PLAN["S"], page_size_B=ps)
  np.testing.assert_array_equal(np.asarray(page_topk(scores, length, **kw)),
                                np.asarray(page_topk_reference(scores, length, **kw)))

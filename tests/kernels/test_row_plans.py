"""Per-row stage-2 plans: each row of a batch with its own HSA page size (`page_size_B`) and top-r (`topr_B`),
the static `page_size` / `topr` the largest. The property held for every kernel and XLA path: each row's output
is what that row gives alone (a batch of one) with static page_size = ps_b and topr = r_b, on the same arrays;
and per-row values all equal to the static ones give bitwise the output of None.

The rows share the KT arrays' P pages, so a row of smaller pages uses more of them (length_b <= P * ps_b). Run
alone, a row's static page size needs ceil(S / ps_b) pages: its KT arrays are padded with junk pages for that
(pages past its length, which nothing may read)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200, needs_gpu
from rocketkv_jax import ops
from rocketkv_jax.kernels.cache_append import cache_append, cache_append_reference
from rocketkv_jax.kernels.checks import kt_num_pages
from rocketkv_jax.kernels.hsa_scores import (chosen_slots, hsa_page_partials, hsa_page_scores,
                                             hsa_page_scores_reference, row_channels, row_channels_reference)
from rocketkv_jax.kernels.page_topk import hsa_page_topk, hsa_page_topk_reference, page_topk, page_topk_reference

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
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (B, K, G, H), jnp.float32).astype(dtype)
  a, b = jax.random.normal(ks[1], (B, K, H, P)), jax.random.normal(ks[2], (B, K, H, P))
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


@pytest.mark.parametrize("dtype,dot_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16)])
def test_row_channels_per_row_topr_interpret(dtype, dot_dtype):
  """The choice kernel and its reference with topr_B: each row as the row alone at top-r r_b (ties included)."""
  _, _, r, _ = plan_arrays()
  q = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 3, 64), jnp.float32)
  q = q.at[1].set(q[1].at[..., 1::2].set(q[1][..., 0::2])).astype(dtype)  # tied |q| sums in row 1
  for fn in (functools.partial(row_channels, interpret=True), row_channels_reference):
    got = fn(q, 40, dot_dtype, topr_B=r)
    for b, rb in enumerate(PLAN["r"]):
      check_choice_rows([x[b:b + 1] for x in got], row_channels_reference(q[b:b + 1], rb, dot_dtype), rb)
    assert_bits(fn(q, 40, dot_dtype, topr_B=jnp.full((4,), 40, jnp.int32)), fn(q, 40, dot_dtype))


# ---------------------------------------------------------------- the token append


def append_inputs(seed, B, K, S, H, P, slot_BK, dtype, kt_dtype):
  """A cache with NaN junk past each (b, k)'s slot, KT pages [B, K, H, P] and fresh rows."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  k, v = (jax.random.normal(x, (B, K, S, H), jnp.float32).astype(dtype) for x in ks[:2])
  junk = (jnp.arange(S)[None, None, :] > slot_BK[..., None])[..., None]
  k, v = jnp.where(junk, jnp.nan, k), jnp.where(junk, jnp.nan, v)
  k_new, v_new = (jax.random.normal(x, (B, K, H), jnp.float32).astype(dtype) for x in ks[2:4])
  a, b = jax.random.normal(ks[4], (B, K, H, P)), jax.random.normal(ks[5], (B, K, H, P))
  return k, v, k_new, v_new, slot_BK, jnp.minimum(a, b).astype(kt_dtype), jnp.maximum(a, b).astype(kt_dtype)


def check_append(fn, seed, slot_BK, kt_update, dtype=jnp.bfloat16, kt_dtype=jnp.bfloat16, S=PLAN["S"], H=64,
                 G=3):
  """fn(*args, page_size, choose_q, topr, page_size_B, topr_B) -> (k, v, kt_min, kt_max, *choice) against each
  row alone. slot_BK [B, K] or [B]."""
  P, ps, r, _ = plan_arrays()
  B, K = 4, 2
  args = append_inputs(seed, B, K, S, H, P, jnp.broadcast_to(slot_BK.reshape(B, -1), (B, K)), dtype, kt_dtype)
  args = args[:4] + (slot_BK,) + args[5:]
  q = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, K, G, H), jnp.float32).astype(dtype)
  kw = dict(kt_update=kt_update) if kt_update else {}
  out = fn(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"], page_size_B=ps, topr_B=r, **kw)
  for b, (psb, rb) in enumerate(zip(PLAN["ps"], PLAN["r"])):
    Pb = kt_num_pages(S, psb)
    row = [x[b:b + 1] for x in args[:5]] + [alone_pages(x, b, Pb, 0.0) for x in args[5:]]
    alone = fn(*row, page_size=psb, choose_q=q[b:b + 1], topr=rb, **kw)
    # The alone run's pad pages past P are dropped (a slot there has no page in the batch's arrays).
    assert_bits([x[b:b + 1] for x in out[:2]], alone[:2])
    assert_bits([x[b:b + 1] for x in out[2:4]], [x[..., :P] for x in alone[2:4]])
    check_choice_rows([x[b:b + 1] for x in out[4:]], alone[4:], rb)
  static = fn(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"], **kw)
  full = fn(*args, page_size=PLAN["page_size"], choose_q=q, topr=PLAN["topr"],
            page_size_B=jnp.full((B,), PLAN["page_size"], jnp.int32), topr_B=jnp.full((B,), PLAN["topr"], jnp.int32),
            **kw)
  assert_bits(full, static)


# Per row (pages of 1, 2, 3, 5): slots inside pages (pages of 1: every slot starts one), and per KV head fresh
# pages, a page's last slot, slots out of range (-1, S) and a row of pages of 1 at slot 20 >= P = 16: K/V
# written, no KT page.
APPEND_SLOTS = [np.array([10, 5, 8, 17]), np.array([[13, 20], [4, -1], [36, 35], [PLAN["S"], 19]])]


@pytest.mark.parametrize("kt_update", ["rows", "fold"])
@pytest.mark.parametrize("slots", [0, 1], ids=["slot_B", "slot_BK"])
def test_cache_append_per_row_plans_interpret(slots, kt_update):
  kernel = functools.partial(cache_append, interpret=True)
  check_append(kernel, seed=3 + slots, slot_BK=jnp.asarray(APPEND_SLOTS[slots], jnp.int32), kt_update=kt_update)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_cache_append_xla_per_row_plans(impl):
  """The reference ("rows" and "fold") and the ops XLA path (the scatters, a fold), per-head slots."""
  slot = jnp.asarray(APPEND_SLOTS[1], jnp.int32)
  if impl == "reference":
    for kt_update in ("rows", "fold"):
      check_append(cache_append_reference, seed=5, slot_BK=slot, kt_update=kt_update)
  else:
    check_append(functools.partial(ops.cache_append, impl="xla"), seed=6, slot_BK=slot, kt_update=None,
                 dtype=jnp.float32, kt_dtype=jnp.float32)


# ---------------------------------------------------------------- HSA scoring and selection


def check_hsa_rows(seed, layout, sink=0, recent=0, k=12, G=3, H=64, block_p=16, interpret=True, dtype=jnp.float32,
                   kt_dtype=jnp.float32):
  """hsa_page_partials -> hsa_page_topk with per-row plans against each row alone: the partials (to float
  tolerance) and the selection (exactly)."""
  P, ps, r, length = plan_arrays()
  S = PLAN["S"]
  q, kt_min, kt_max = hsa_inputs(seed, 4, 2, G, H, P, length, ps, dtype, kt_dtype)
  tune = dict(block_p=block_p, layout=layout, interpret=interpret)
  select = dict(k=k, num_slots=S, sink=sink, recent=recent, interpret=interpret)
  s, m, l = hsa_page_partials(q, kt_min, kt_max, length, topr=PLAN["topr"], page_size=PLAN["page_size"],
                              page_size_B=ps, topr_B=r, **tune)
  idx = hsa_page_topk(s, m, l, length, page_size=PLAN["page_size"], page_size_B=ps, num_pages=P, **select)
  ref = hsa_page_topk_reference(s, m, l, length, page_size=PLAN["page_size"], page_size_B=ps, num_pages=P,
                                **select)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))
  NB = m.shape[-1]
  for b, (psb, rb) in enumerate(zip(PLAN["ps"], PLAN["r"])):
    Pb = kt_num_pages(S, psb)
    row = (q[b:b + 1], alone_pages(kt_min, b, Pb, jnp.nan), alone_pages(kt_max, b, Pb, jnp.inf), length[b:b + 1])
    sb, mb, lb = hsa_page_partials(*row, topr=rb, page_size=psb, **tune)
    live = np.asarray(s[b, ..., :P]) > -1e30  # the pages with a valid slot
    assert (live == (np.asarray(sb[0, ..., :P]) > -1e30)).all()
    np.testing.assert_allclose(np.asarray(s[b])[live], np.asarray(sb[0, ..., :P])[live], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(m[b]), np.asarray(mb[0, ..., :NB]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l[b]), np.asarray(lb[0, ..., :NB]), rtol=1e-5)
    alone = hsa_page_topk(sb, mb, lb, length[b:b + 1], page_size=psb, **select)
    np.testing.assert_array_equal(np.asarray(idx[b:b + 1]), np.asarray(alone), err_msg=f"row {b}")
  # Every row's plan the static one: bitwise the output of None. (But l, a sum: interpret mode compiles the
  # kernel body with XLA, which may sum in another order when the page size is a constant: 1 ulp, seen.)
  full = dict(page_size_B=jnp.full((4,), PLAN["page_size"], jnp.int32), topr_B=jnp.full((4,), PLAN["topr"], jnp.int32))
  args = (q, kt_min, kt_max, length)
  static = hsa_page_partials(*args, topr=PLAN["topr"], page_size=PLAN["page_size"], **tune)
  same = hsa_page_partials(*args, topr=PLAN["topr"], page_size=PLAN["page_size"], **full, **tune)
  assert_bits(same[:2], static[:2])
  np.testing.assert_allclose(np.asarray(same[2]), np.asarray(static[2]), rtol=1e-6)
  P0 = -(-S // PLAN["page_size"])  # None's pages: ceil(S / page_size); the same pages passed as num_pages
  assert_bits(hsa_page_topk(*static, length, page_size=PLAN["page_size"], page_size_B=full["page_size_B"],
                            num_pages=P0, **select),
              hsa_page_topk(*static, length, page_size=PLAN["page_size"], **select))


@pytest.mark.parametrize("layout,sink,recent", [("rank", 0, 0), ("gather", 0, 0), ("rank", 2, 3),
                                                ("gather", 4, 1)])
def test_hsa_partials_and_page_topk_per_row_plans_interpret(layout, sink, recent):
  """Both scoring layouts; the forced sink / recent pages at each row's page size."""
  check_hsa_rows(seed=11, layout=layout, sink=sink, recent=recent)


def check_ops_hsa_select(impl, seed, sink=0, recent=0, k=12, G=3, H=64, plan=PLAN, P_extra=0):
  """ops.hsa_select (page_size_B, topr_B) against each row alone through the same impl. P_extra: more KT pages
  than the cache needs (a row of small pages uses them; alone, such a row passes its page size as a batch of one's
  page_size_B, since its static page size allows no more pages than kt_num_pages)."""
  P, ps, r, length = plan_arrays(plan)
  P += P_extra
  S = plan["S"]
  q, kt_min, kt_max = hsa_inputs(seed, 4, 2, G, H, P, length, ps)
  kw = dict(k=k, num_slots=S, sink=sink, recent=recent, impl=impl)
  idx = ops.hsa_select(q, kt_min, kt_max, length, topr=plan["topr"], page_size=plan["page_size"], page_size_B=ps,
                       topr_B=r, **kw)
  for b, (psb, rb) in enumerate(zip(plan["ps"], plan["r"])):
    Pb = max(P, kt_num_pages(S, psb))
    row = (q[b:b + 1], alone_pages(kt_min, b, Pb, jnp.nan), alone_pages(kt_max, b, Pb, jnp.inf), length[b:b + 1])
    if Pb > kt_num_pages(S, psb):  # more pages than the row's static page size allows alone: as the batch
      alone = ops.hsa_select(*row, topr=rb, page_size=psb, page_size_B=jnp.array([psb]), **kw)
    else:
      alone = ops.hsa_select(*row, topr=rb, page_size=psb, **kw)
    np.testing.assert_array_equal(np.asarray(idx[b:b + 1]), np.asarray(alone), err_msg=f"row {b}")
  full = dict(page_size_B=jnp.full((4,), plan["page_size"], jnp.int32), topr_B=jnp.full((4,), plan["topr"], jnp.int32))
  args = (q, kt_min, kt_max, length)
  if not P_extra:
    assert_bits(ops.hsa_select(*args, topr=plan["topr"], page_size=plan["page_size"], **full, **kw),
                ops.hsa_select(*args, topr=plan["topr"], page_size=plan["page_size"], **kw))
  return idx


@pytest.mark.parametrize("impl,sink,recent", [("xla", 0, 0), ("xla", 2, 3), ("interpret", 0, 0),
                                              ("interpret", 4, 1)])
def test_ops_hsa_select_per_row_plans(impl, sink, recent):
  check_ops_hsa_select(impl, seed=21, sink=sink, recent=recent)


def test_ops_hsa_select_uses_every_kt_page():
  """With page_size_B, the selection takes all the KT arrays' pages, past kt_num_pages(S, page_size) too: here 32
  pages of which the row of pages of 1 fills 31 (not 16); the XLA path and the kernels agree."""
  plan = dict(PLAN, length=(31, 32, 37, 21))
  xla = check_ops_hsa_select("xla", seed=23, plan=plan, P_extra=16)
  kernels = check_ops_hsa_select("interpret", seed=23, plan=plan, P_extra=16)
  np.testing.assert_array_equal(np.asarray(xla), np.asarray(kernels))
  assert int(np.asarray(xla)[0].max()) >= 16  # row 0 chose slots on pages past the first 16


def test_hsa_page_scores_per_row_plans_interpret():
  """The scores normalised in XLA (the path above the selection kernel's page limit) against the reference,
  both per-row: each row's probabilities sum to 1 over its valid slots."""
  P, ps, r, length = plan_arrays()
  q, kt_min, kt_max = hsa_inputs(31, 4, 2, 3, 64, P, length, ps)
  kw = dict(topr=PLAN["topr"], page_size=PLAN["page_size"], page_size_B=ps, topr_B=r)
  got = np.asarray(hsa_page_scores(q, kt_min, kt_max, length, interpret=True, block_p=16, **kw))
  want = np.asarray(hsa_page_scores_reference(q, kt_min, kt_max, length, **kw))
  n = np.clip(np.asarray(length)[:, None] - np.arange(P) * np.asarray(ps)[:, None], 0, np.asarray(ps)[:, None])
  live = np.broadcast_to((n > 0)[:, None, :], got.shape)
  assert (got[~live] == -np.inf).all() and (want[~live] == -np.inf).all()
  np.testing.assert_allclose(got[live], want[live], rtol=1e-5)
  np.testing.assert_allclose((np.where(live, got, 0) * n[:, None, :]).sum(-1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------- page top-k


def page_scores(seed, B, K, P, length, ps, ties):
  rng = np.random.default_rng(seed)
  if ties:
    scores = rng.integers(-2, 3, (B, K, P)).astype(np.float32)
  else:
    scores = rng.standard_normal((B, K, P)).astype(np.float32)
  scores[0, 0, 0] = -np.inf  # a valid page may score -inf
  return junk_pages(jnp.asarray(scores)[:, :, None, :], length, ps, jnp.nan)[:, :, 0, :]


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_page_topk_per_row_page_sizes(ties):
  """The kernel, the reference, ops' XLA path and the best-pages variant with page_size_B: each row as the row
  alone; bitwise None's output when every row has the static page size."""
  P, ps, _, length = plan_arrays()
  S, page_size = PLAN["S"], PLAN["page_size"]
  scores = page_scores(41, 4, 2, P, length, ps, ties)
  for k in (1, 12, 64):
    kw = dict(page_size=page_size, k=k, num_slots=S)
    fns = {"kernel": functools.partial(page_topk, interpret=True), "reference": page_topk_reference,
           "best_pages": ops.page_topk_best_pages, "ops_xla": functools.partial(ops.page_topk, impl="xla")}
    want = None
    for name, fn in fns.items():
      got = np.asarray(fn(scores, length, page_size_B=ps, **kw))
      if want is None:
        want = got
        for b, psb in enumerate(PLAN["ps"]):
          row = jnp.pad(scores[b:b + 1], ((0, 0), (0, 0), (0, kt_num_pages(S, psb) - P)), constant_values=jnp.nan)
          alone = page_topk_reference(row, length[b:b + 1], page_size=psb, k=k, num_slots=S)
          np.testing.assert_array_equal(got[b:b + 1], np.asarray(alone), err_msg=f"{name} k={k} row {b}")
      np.testing.assert_array_equal(got, want, err_msg=f"{name} k={k}")
      P0 = -(-S // page_size)
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
  for layout in ("rank", "gather"):
    text = lower_for_h200(lambda *a: hsa_page_partials(*a[:4], topr=60, page_size=3, layout=layout,
                                                       page_size_B=a[4], topr_B=a[5]), q, kt, kt, row, row, row)
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
  check_append(cache_append, seed=3, slot_BK=jnp.asarray(APPEND_SLOTS[1], jnp.int32), kt_update="rows")
  check_append(cache_append, seed=4, slot_BK=jnp.asarray(APPEND_SLOTS[0], jnp.int32), kt_update="fold")
  for layout in ("rank", "gather"):
    check_hsa_rows(seed=11, layout=layout, sink=2, recent=3, interpret=False, H=128, G=4, dtype=jnp.bfloat16,
                   kt_dtype=jnp.bfloat16, block_p=32)
  check_ops_hsa_select("pallas", seed=21, sink=2, recent=3)

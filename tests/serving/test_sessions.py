"""Sessions and context reuse on a tiny random Llama: a prefill that continues a host K/V history equals the
prefill of the whole prompt; the engine's history makes a next turn prefill only its new tokens with the same
answer; the history is a prefix tree (shared prefixes stored once) within its memory limits (LRU drop, disk
spill); query-agnostic contexts answer many questions from copies of one compressed cache; saving and loading
(orbax) round-trips and refuses another model, another method or a damaged file."""

import fcntl
import glob
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rk
from rocketkv_jax.models import llama
from rocketkv_jax.models.params import from_params
from rocketkv_jax.models.loop import LoopConfig, decode_loop
from rocketkv_jax.serving import Engine, EngineConfig, Request, SamplingParams
from rocketkv_jax.serving.history import HistoryStore
from rocketkv_jax.serving.saved import SavedFileError
from rocketkv_jax.serving.sessions import DirError, SessionsDir, check_writable
from tests.models.conftest import tiny_config, tiny_params
from tests.helpers.engine import Tok

warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")

KW = dict(method="rocketkv", token_budget=32, max_slots=2, max_prompt_tokens=256, max_new_tokens=24,
          steps_per_call=4, prefill_buckets=(64, 128, 256))
HISTORY = 1 << 30


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config()
  return from_params(cfg, tiny_params(cfg))


def ids(n, seed):
  return np.random.default_rng(seed).integers(3, 128, n).tolist()


def held_bytes(x: np.ndarray) -> int:
  """Bytes of the buffer a host array keeps alive (its root base's), which its own nbytes may not show."""
  while isinstance(x.base, np.ndarray):
    x = x.base
  return x.nbytes


def answer(engine, prompt, rid="r", max_tokens=12, context=None):
  """(tokens, cached_tokens, prompt_tokens) of one greedy request run alone."""
  engine.submit(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), context=context))
  toks, cached, pt = [], None, None
  while engine.has_work():
    for e in engine.step():
      toks += e.token_ids
      cached, pt = e.cached_tokens, e.prompt_tokens
  return toks, cached, pt


# ----------------------------------------------------------------------------- prefill_extend


@pytest.mark.parametrize("method", ["rocketkv", "snapkv", "full", "quest", "streaming_llm", "sparq"])
def test_prefill_extend_equals_whole_prefill(model, method):
  """History of the first r tokens (itself made by prefill_extend from nothing), then the rest over it: the
  logits and every cache leaf equal one prefill of the whole prompt (stage 1 evicts: 200 > the budget)."""
  cfg = model.config
  L, r, T = 200, 150, 256
  config = rk.make_config(method, token_budget=32, prompt_len=T, max_new_tokens=16, head_dim=cfg.head_dim,
                          max_len=cfg.max_len)
  assert L - r >= (config.prompt_queries or 0)
  toks = np.zeros((1, T), np.int32)
  toks[0, :L] = ids(L, 1)
  want_logits, want = llama.prefill(model, toks, np.array([L]), config)
  _, _, first = llama.prefill_extend(model, toks[:, :r], np.array([r]), [None] * cfg.n_layers, np.array([0]), config,
                                     seq_len=T)
  hist = []
  for k, v in first:
    hk, hv = (np.zeros((1, T) + k.shape[2:], np.float32) for _ in range(2))
    hk[:, :r], hv[:, :r] = np.asarray(k), np.asarray(v)
    hist.append((hk, hv))
  new = np.zeros((1, 64), np.int32)
  new[0, :L - r] = toks[0, r:L]
  logits, got, new_kv = llama.prefill_extend(model, new, np.array([L - r]), hist, np.array([r]), config)
  np.testing.assert_allclose(logits, want_logits, atol=2e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-5)
  assert got[0].spec == want[0].spec
  assert new_kv[0][0].shape == (1, 64, cfg.n_kv_heads, cfg.head_dim)


def test_extend_attention_matches_a_numpy_reference(monkeypatch):
  """Rows with different starts, T not a power of two, scores split over several query chunks."""
  monkeypatch.setattr(llama, "EXTEND_SCORES_MAX", 4 * 2 * 40 * 2)  # chunks of 2 queries
  rng = np.random.default_rng(0)
  B, T, N, K, H, S = 2, 5, 4, 2, 8, 40
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  start = np.array([3, 30], np.int32)
  got = np.asarray(llama.extend_attention(q, k, v, start))
  for b in range(B):
    for i in range(T):
      for n in range(N):
        seen = start[b] + i + 1
        logits = k[b, :seen, n // 2] @ q[b, i, n] / np.sqrt(H)
        p = np.exp(logits - logits.max())
        np.testing.assert_allclose(got[b, i, n], (p / p.sum()) @ v[b, :seen, n // 2], rtol=1e-5, atol=1e-5)


def test_prefill_extend_rejects_a_wrong_history(model):
  config = rk.make_config("rocketkv", token_budget=32, prompt_len=64, max_new_tokens=8, head_dim=16, max_len=512)
  with pytest.raises(ValueError, match="history has 1 layers; the model has 2"):
    llama.prefill_extend(model, np.zeros((1, 8), np.int32), [8], [(np.zeros((1, 64, 2, 16)),) * 2], [0], config)


# ----------------------------------------------------------------------------- the engine's history


@pytest.mark.parametrize("method,reused", [("rocketkv", 150), ("full", 150), ("h2o", 0)])
def test_next_turn_reuses_the_history_and_answers_the_same(model, method, reused):
  """Turn 2 (turn 1's prompt + 50 new tokens) prefills only the new tokens over the stored history, and its
  tokens equal an engine without history. H2O reads every prompt query, so it reuses nothing."""
  p1 = ids(150, 2)
  p2 = p1 + ids(50, 3)
  plain = Engine(model, Tok(), EngineConfig(**dict(KW, method=method)))
  hist = Engine(model, Tok(), EngineConfig(**dict(KW, method=method), history_bytes=HISTORY))
  assert answer(plain, p1)[0] == answer(hist, p1)[0]
  want, _, _ = answer(plain, p2)
  got, cached, pt = answer(hist, p2)
  assert got == want and pt == 200 and cached == reused
  st = hist.stats()
  assert st["prompt_tokens_reused"] == reused and st["prompt_tokens_prefilled"] == 350 - reused
  assert st["history_store_seconds"] > 0 and plain.stats()["history_store_seconds"] == 0
  assert st["kv_bytes_host"] == 200 * hist.history.token_bytes()  # turn 2 stored only its 50 new tokens


def test_the_history_store_is_off_the_first_token_path(model):
  """A prompt's copy into the host history runs on the store worker: the request's first tokens come while its
  store is still held; the next queued request is admitted only once that store ends (one in flight), while
  the first keeps decoding; then it reuses the stored prompt. A store that fails loses only its history."""
  import threading
  engine = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  release, entered, add = threading.Event(), threading.Event(), engine.history.add

  def held_add(*args, **kw):
    entered.set()
    assert release.wait(60)
    return add(*args, **kw)

  engine.history.add = held_add
  p1 = ids(150, 2)
  engine.submit(Request("a", p1, SamplingParams(max_tokens=20)))
  got = []
  for _ in range(3):
    got += [e for e in engine.step() if e.request_id == "a"]
  assert entered.is_set() and not release.is_set()
  assert sum(len(e.token_ids) for e in got) > 0  # a's tokens came while its store was held
  engine.submit(Request("b", p1 + ids(40, 3), SamplingParams(max_tokens=4)))
  for _ in range(2):
    assert all(e.request_id != "b" for e in engine.step())
  assert engine.stats()["queue_depth"] == 1 and engine.stats()["active_slots"] == 1  # b waits, a decodes
  release.set()
  events = []
  while engine.has_work():
    events += engine.step()
  b = [e for e in events if e.request_id == "b" and e.finished]
  assert b and b[0].cached_tokens == 150 and engine.stats()["history_store_seconds"] > 0
  for seg in engine.history.segments:  # each holds its own rows, not its prompt's padded bucket (64 / 128 / 256)
    for x in (*seg.k, *seg.v):
      assert held_bytes(x) == x.nbytes == len(seg.tokens) * x[0].nbytes

  def failing_add(*args, **kw):
    raise OSError("no memory for the history")

  engine.history.add = failing_add
  toks, cached, _ = answer(engine, ids(100, 5), "c", max_tokens=3)
  assert len(toks) == 3 and engine.history.match(ids(100, 5))[1] == 0 and not engine.has_work()


def test_reuse_leaves_the_window_to_prefill(model):
  """A turn that adds fewer than the window's tokens re-prefills the window's last tokens (their queries are
  not stored), and at least the last token; the answer still equals a plain engine's."""
  eng = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  W = eng.method_config.prompt_queries
  p1 = ids(180, 4)
  answer(eng, p1)
  p2 = p1 + ids(5, 5)
  assert eng.reusable(p2) == len(p2) - W
  got, cached, _ = answer(eng, p2)
  plain = Engine(model, Tok(), EngineConfig(**KW))
  assert got == answer(plain, p2)[0] and cached == len(p2) - W
  assert eng.reusable(p1) == len(p1) - W  # an exact repeat still recomputes the window


def test_engine_compiles_are_bounded_with_history(model):
  """Fresh and continuing prompts of many lengths: one extend executable per (whole, new) bucket pair at most,
  plus insert and decode; prompts in pairs already seen compile nothing."""
  eng = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  long = ids(250, 7)
  for n in (20, 100, 120, 250):  # 100 fresh, then 120 and 250 continue it
    answer(eng, long[:n], rid=f"r{n}")
  answer(eng, ids(60, 8), rid="other")
  compiles = eng.stats()["compiles"]
  n_buckets = len(KW["prefill_buckets"])
  assert compiles <= 2 + n_buckets * (n_buckets + 1) // 2
  for n, seed in ((40, 9), (110, 10), (90, 11)):  # fresh prompts in buckets already compiled
    answer(eng, ids(n, seed), rid=f"s{n}")
  assert eng.stats()["compiles"] == compiles


def test_question_in_window_reuse_of_a_remembered_context(model):
  """remember(context), then questions whose prompts start with it: each prefills only its question (stage 1
  re-runs over context + question, the window on the question) and answers as a plain engine does; the
  context is stored once, not once per question."""
  eng = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  plain = Engine(model, Tok(), EngineConfig(**KW))
  ctx = ids(160, 10)
  assert eng.remember(ctx) == 160
  for i in range(3):
    q = ctx + ids(40, 20 + i)
    got, cached, _ = answer(eng, q, rid=f"q{i}")
    assert got == answer(plain, q, rid=f"q{i}")[0] and cached == 160
  assert eng.stats()["kv_bytes_host"] == (160 + 3 * 40) * eng.history.token_bytes()


# ----------------------------------------------------------------------------- the history store


def _kv(n, layers=2):
  rng = np.random.default_rng(n)
  return ([rng.standard_normal((n, 2, 4)).astype(np.float32) for _ in range(layers)],
          [rng.standard_normal((n, 2, 4)).astype(np.float32) for _ in range(layers)])


def test_history_store_prefix_tree_and_views():
  store = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20)
  a = list(range(10))
  ka, va = _kv(10)
  store.add(a, ka, va, reused=0)
  b = a[:6] + [99, 98, 97]  # branches off inside a's path
  kb, vb = _kv(9)
  seg, n = store.match(b)
  assert n == 6
  store.add(b, [k[6:] for k in kb], [v[6:] for v in vb], reused=6)
  assert store.host_bytes() == (10 + 3) * store.token_bytes()  # the shared 6 tokens are stored once
  seg, n = store.match(b + [5])
  assert n == 9
  view = store.view(seg, 9, 12)
  k0, v0 = view[0]
  assert k0.shape == (1, 12, 2, 4)
  np.testing.assert_array_equal(k0[0, :6], ka[0][:6])
  np.testing.assert_array_equal(k0[0, 6:9], kb[0][6:])
  assert not k0[0, 9:].any()
  np.testing.assert_array_equal(view[1][1][0, :6], va[1][:6])
  assert store.add(a, ka, va, reused=0) is store.match(a)[0]  # already stored: nothing added
  assert len(store.segments) == 2


@pytest.mark.parametrize("parent_on_host", [False, True])
def test_device_tier_views_equal_the_host_ones(parent_on_host):
  """The device tier assembles a view on the device (one jitted call per layer): the same arrays as a host store's
  view, for a path all on the device and for a host parent under a device child (a view within the host parent is
  a host view); the batch-of-one arrays the engine hands over are kept as their rows only."""
  host = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20)
  dev = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20, max_device_bytes=1 << 20)
  a, b = list(range(10)), list(range(6)) + [99, 98, 97]
  ka, va = _kv(10)
  kb, vb = _kv(9)
  host.add(a, ka, va, reused=0)
  host.add(b, [k[6:] for k in kb], [v[6:] for v in vb], reused=6)
  batched = lambda xs, pad: [jnp.pad(jnp.asarray(x), ((0, pad), (0, 0), (0, 0)))[None] for x in xs]  # noqa: E731
  dev.add(a, batched(ka, 6), batched(va, 6), reused=0)
  if parent_on_host:
    dev._to_host(dev.segments[0])  # noqa: SLF001 - as the tier does past its limit
  dev.add(b, batched([k[6:] for k in kb], 2), batched([v[6:] for v in vb], 2), reused=6)
  assert [s.on_device for s in dev.segments] == [not parent_on_host, True]
  assert all(x.shape[0] == len(s.tokens) for s in dev.segments for x in (*s.k, *s.v))
  assert dev.device_bytes() + dev.host_bytes() == host.host_bytes()
  for n in (9, 4):
    want, got = host.view(host.match(b)[0], n, 12), dev.view(dev.match(b)[0], n, 12)
    for layer in range(2):
      for w, g in zip(want[layer], got[layer]):
        assert g.shape == (1, 12, 2, 4) and (isinstance(g, jax.Array) or (parent_on_host and n == 4))
        np.testing.assert_array_equal(np.asarray(g), w)


def test_match_equals_comparing_every_stored_path():
  """`match` counts each segment's shared prefix from its parent's and its own tokens; it equals comparing the
  prompt with every stored path in full (paths rebuilt here from the tree), over random trees of branching
  conversations, documents with questions and prompts that leave a path inside a segment or before its
  first token."""
  rng = np.random.default_rng(7)
  for trial in range(20):
    store = HistoryStore(1, (1, 1), np.float32, max_bytes=1 << 30)
    prompts = []
    for _ in range(12):
      if prompts and rng.random() < 0.8:  # continue or branch off a stored prompt
        base = prompts[rng.integers(len(prompts))]
        cut = int(rng.integers(1, len(base) + 1))
        p = base[:cut] + rng.integers(0, 5, int(rng.integers(1, 6))).tolist()
      else:
        p = rng.integers(0, 5, int(rng.integers(1, 8))).tolist()
      seg, common = store.match(p)
      reused = min(common, len(p) - 1)
      n = len(p) - reused
      store.add(p, [np.zeros((n, 1, 1), np.float32)], [np.zeros((n, 1, 1), np.float32)], reused)
      prompts.append(p)

    def path(seg):
      return (path(seg.parent)[:seg.start] if seg.parent is not None else []) + seg.tokens.tolist()

    def shared(a, b):
      return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for _ in range(30):
      base = prompts[rng.integers(len(prompts))]
      q = base[:int(rng.integers(0, len(base) + 1))] + rng.integers(0, 5, int(rng.integers(0, 4))).tolist()
      want = max((shared(path(s), q) for s in store.segments), default=0)
      seg, got = store.match(q)
      assert got == want, (trial, q)
      assert got == 0 or shared(path(seg), q) == got


def test_admission_benchmark_runs_small(tmp_path):
  from benchmarks import admission
  out = tmp_path / "a.jsonl"
  admission.main(["--tiny", "--methods", "rocketkv", "--doc", "200", "--question", "40", "--questions", "2",
                  "--buckets", "64,256", "--profile", str(tmp_path / "trace"), "--profiled", "1", "--top", "3",
                  "--out", str(out)])
  (r,) = [json.loads(x) for x in out.read_text().splitlines()]
  assert r["cached_tokens"] == 200 and r["admission_s_p50"] > 0 and len(r["top_ops"]) == 3


def test_history_match_benchmark_runs_small():
  from benchmarks import history_match
  r = history_match.measure(5, doc=64, q=4, reps=2)
  assert r["questions"] == 5 and r["match_ms"] > 0 and r["held_mib"] > 0


def test_a_stored_segment_holds_only_its_tokens_memory():
  """The history keeps a prompt's rows of its padded prefill buffer as their own memory: a view would keep the
  whole bucket alive while host_bytes counts only the tokens (the limit then exceeded by bucket / tokens; a chat
  server at its 48 GiB history limit was killed on a 128 GB host). An exact, owned buffer is kept as it is."""
  store = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20)
  padded = [np.asarray(jnp.ones((1, 64, 2, 4)))[0] for _ in range(2)]  # as the engine hands them: views of [1, T, ..]
  seg = store.add(list(range(10)), padded, padded, reused=0)
  for x in (*seg.k, *seg.v):
    assert x.shape == (10, 2, 4) and held_bytes(x) == x.nbytes
  assert store.host_bytes() == 10 * store.token_bytes()
  exact = [np.ones((5, 2, 4), np.float32) for _ in range(2)]
  seg = store.add(list(range(100, 105)), exact, exact, reused=0)
  assert all(np.shares_memory(x, y) for x, y in zip(seg.k, exact))  # no copy needed


def test_history_store_drops_least_recently_used_within_its_limit(tmp_path):
  one = 2 * 2 * 10 * 2 * 4 * 4  # bytes of a 10-token path
  store = HistoryStore(2, (2, 4), np.float32, max_bytes=2 * one)
  for i in range(3):
    store.add([100 * i + j for j in range(10)], *_kv(10), reused=0)
  assert store.host_bytes() <= 2 * one and store.dropped == 1
  assert store.match(list(range(10)))[1] == 0  # the oldest went
  spill = HistoryStore(2, (2, 4), np.float32, max_bytes=one, spill_dir=str(tmp_path), max_disk_bytes=one)
  k, v = _kv(10)
  spill.add(list(range(10)), k, v, reused=0)
  spill.add(list(range(100, 110)), *_kv(10), reused=0)
  assert spill.host_bytes() == one and spill.disk_bytes() == one
  seg, n = spill.match(list(range(10)))
  assert n == 10 and seg.on_disk
  np.testing.assert_array_equal(spill.view(seg, 10, 10)[1][0][0], k[1])
  spill.close()
  assert not os.path.exists(spill.spill_dir)


def test_history_store_add_never_stores_a_path_with_a_hole():
  store = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20)
  assert store.add(list(range(10)), *_kv(4), reused=6) is None  # positions [0, 6) are not stored
  assert not store.segments


# ----------------------------------------------------------------------------- contexts (query-agnostic)


def test_context_answers_many_questions_from_copies(model):
  """compress_context once; each question is fed through decode steps onto a copy of its cache. The result
  equals the same thing done by hand with the one decode loop (teacher forcing), the context's cache is left
  as it was, and asking twice gives the same answer."""
  eng = Engine(model, Tok(), EngineConfig(**KW))
  ctx_ids = ids(200, 30)
  ctx = eng.compress_context(ctx_ids)
  before = [np.asarray(x).copy() for x in jax.tree.leaves(ctx.caches)]
  q1, q2 = ids(7, 31), ids(5, 32)
  a1, cached, pt = answer(eng, q1, rid="q1", context=ctx)
  assert cached == 200 and pt == 207
  a2, _, _ = answer(eng, q2, rid="q2", context=ctx)
  assert answer(eng, q1, rid="q1b", context=ctx)[0] == a1
  for x, y in zip(before, jax.tree.leaves(ctx.caches)):
    np.testing.assert_array_equal(x, np.asarray(y))
  # by hand: the context's cache, the whole question forced through the loop in one call (the engine feeds
  # it in power-of-two chunks: 4 + 2 + 1), then greedy tokens
  caches = jax.tree.map(jnp.copy, ctx.caches)
  fed = decode_loop(model, ctx.logits, caches, eng.method_config, LoopConfig(max_new_tokens=len(q1), carry_logits=True),
                    forced_BT=np.array([q1], np.int32))
  out = decode_loop(model, fed.logits_BV, fed.caches, eng.method_config, LoopConfig(max_new_tokens=12))
  assert a1 == np.asarray(out.tokens)[0].tolist() and a1 != a2


def test_context_prompt_must_fit_the_new_token_room(model):
  eng = Engine(model, Tok(), EngineConfig(**KW))
  ctx = eng.compress_context(ids(50, 33))
  with pytest.raises(ValueError, match="prompt of 20 tokens \\+ max_tokens=12 exceeds the engine's max_new_tokens=24"):
    eng.submit(Request("x", ids(20, 34), SamplingParams(max_tokens=12), context=ctx))


# ----------------------------------------------------------------------------- saving and loading


def test_save_and_load_context_and_history(model, tmp_path):
  eng = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  ctx = eng.compress_context(ids(120, 40))
  q = ids(6, 41)
  want = answer(eng, q, rid="a", context=ctx)[0]
  eng.save_context(ctx, tmp_path / "ctx")
  again = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  assert answer(again, q, rid="b", context=again.load_context(tmp_path / "ctx"))[0] == want

  p1 = ids(150, 42)
  p2 = p1 + ids(40, 43)
  answer(eng, p1, rid="t1")
  want2 = answer(eng, p2, rid="t2")
  assert eng.save_history(tmp_path / "hist") == 2
  assert answer(again, p2, rid="t2")[1] == 0  # nothing stored yet
  fresh = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  assert fresh.load_history(tmp_path / "hist") == 2
  got = answer(fresh, p2 + ids(40, 44), rid="t3")
  assert got[1] == 190  # the whole saved path reused
  assert answer(fresh, p2, rid="t2")[0] == want2[0]


def test_load_refuses_another_model_method_or_a_damaged_file(model, tmp_path):
  eng = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  ctx = eng.compress_context(ids(80, 50))
  eng.save_context(ctx, tmp_path / "ctx")
  answer(eng, ids(100, 51))
  eng.save_history(tmp_path / "hist")

  snap = Engine(model, Tok(), EngineConfig(**dict(KW, method="snapkv"), history_bytes=HISTORY))
  with pytest.raises(SavedFileError, match="method: file has 'rocketkv"):
    snap.load_context(tmp_path / "ctx")
  assert snap.load_history(tmp_path / "hist") == 1  # a history is the model's K/V: any method may use it

  cfg = tiny_config()
  other = Engine(from_params(cfg, tiny_params(cfg, seed=1)), Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  for load, name in ((other.load_context, "ctx"), (other.load_history, "hist")):
    with pytest.raises(SavedFileError, match="saved for something else; refusing it: model"):
      load(tmp_path / name)

  with pytest.raises(SavedFileError, match="no meta.json"):
    eng.load_context(tmp_path / "nothing")
  # flip bytes in the middle of every array data file, sizes kept
  for f in glob.glob(str(tmp_path / "hist" / "arrays" / "**" / "d" / "*"), recursive=True):
    data = bytearray(open(f, "rb").read())
    mid = len(data) // 2
    data[mid:mid + 8] = bytes(255 - b for b in data[mid:mid + 8])
    open(f, "wb").write(bytes(data))
  with pytest.raises(SavedFileError, match="damaged|cannot be read"):
    eng.load_history(tmp_path / "hist")
  meta = tmp_path / "ctx" / "meta.json"
  meta.write_text(meta.read_text()[:-20])
  with pytest.raises(SavedFileError, match="meta.json is damaged"):
    eng.load_context(tmp_path / "ctx")


# ----------------------------------------------------------------------------- sessions on disk (sessions.py)

STAMP = dict(kind="history", model="test")


def _two_segment_store(**kw):
  store = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20, **kw)
  store.add(list(range(10)), *_kv(10), reused=0)
  store.add(list(range(10)) + [50, 51, 52], *_kv(3), reused=10)
  assert [s.start for s in store.segments] == [0, 10]
  return store


def _edit_table(folder, edit):
  meta = os.path.join(folder, "meta.json")
  with open(meta) as f:
    body = json.load(f)
  edit(body["meta"]["segments"])
  with open(meta, "w") as f:
    json.dump(body, f)


@pytest.mark.parametrize("edit, field", [
    (lambda t: t[1].update(start=999), r"meta\.segments\[1\]\.start = 999 must be in \(0, 10\]"),  # was used as is
    (lambda t: t[1].update(parent=7), r"meta\.segments\[1\]\.parent = 7 must be null or"),  # was an IndexError
    (lambda t: t[1].update(start="10"), r"meta\.segments\[1\]\.start = '10' must be an integer"),
    (lambda t: t.append(dict(parent=None, start=0)), r"meta\.segments lists 3 segments but the arrays hold"),
    (lambda t: t[0].update(start=3), r"meta\.segments\[0\]\.start = 3 must be 0"),
])
def test_load_refuses_an_edited_segment_table_naming_the_file_and_field(tmp_path, edit, field):
  _two_segment_store().save(tmp_path / "h", stamp=STAMP)
  _edit_table(str(tmp_path / "h"), edit)
  fresh = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20)
  with pytest.raises(SavedFileError, match=field) as e:
    fresh.load(tmp_path / "h", stamp=STAMP)
  assert str(tmp_path / "h" / "meta.json") in str(e.value)
  assert not fresh.segments  # nothing of a bad file is used


def test_load_refuses_arrays_that_disagree_with_the_table(tmp_path):
  store = _two_segment_store()
  store.segments[1].k[0] = store.segments[1].k[0][:2]  # 2 rows for 3 tokens (checksums are of what is saved)
  store.save(tmp_path / "h", stamp=STAMP)
  with pytest.raises(SavedFileError, match=r"arrays s1\.k\[0\] is \(2, 2, 4\) float32; segment 1 has 3 tokens"):
    HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20).load(tmp_path / "h", stamp=STAMP)


def test_spill_files_are_private_removed_when_dropped_and_at_close(tmp_path):
  one = 2 * 2 * 10 * 2 * 4 * 4
  spill_dir = tmp_path / "spill"
  stale = spill_dir / "history-dead"  # a crashed process's: lock file free
  stale.mkdir(parents=True)
  (stale / ".lock").write_text("")
  (stale / "seg1-k0.npy").write_bytes(b"x")
  alive = spill_dir / "history-alive"  # another live server's: locked
  alive.mkdir()
  fd = os.open(alive / ".lock", os.O_RDWR | os.O_CREAT)
  fcntl.flock(fd, fcntl.LOCK_EX)
  try:
    store = HistoryStore(2, (2, 4), np.float32, max_bytes=one, spill_dir=str(spill_dir), max_disk_bytes=one)
    assert not stale.exists() and alive.exists()
    store.add(list(range(10)), *_kv(10), reused=0)
    store.add(list(range(100, 110)), *_kv(10), reused=0)
    files = glob.glob(os.path.join(store.spill_dir, "*.npy"))
    assert len(files) == 4 and all(os.stat(f).st_mode & 0o777 == 0o600 for f in files)
    assert os.stat(store.spill_dir).st_mode & 0o777 == 0o700
    store.add(list(range(200, 210)), *_kv(10), reused=0)  # the spilled one no longer fits on disk: dropped
    assert len(glob.glob(os.path.join(store.spill_dir, "*.npy"))) == 4 and store.dropped == 1
    store.clear()
    assert not glob.glob(os.path.join(store.spill_dir, "*.npy"))
    store.close()
    assert not os.path.exists(store.spill_dir) and alive.exists()
  finally:
    os.close(fd)


class _HistoryEngine:
  """What SessionsDir needs of an Engine: a HistoryStore and save_history / load_history."""

  def __init__(self):
    self.history = HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20)

  def save_history(self, path):
    return self.history.save(path, stamp=STAMP)

  def load_history(self, path):
    return self.history.load(path, stamp=STAMP)


def test_sessions_dir_locks_saves_atomically_and_loads(tmp_path):
  folder = tmp_path / "sessions"
  first = SessionsDir(str(folder / "new"))  # created when missing
  with pytest.raises(DirError, match=rf"--sessions-dir=.*{os.getpid()}"):
    SessionsDir(str(folder / "new"))  # one server per folder: the other's pid named
  eng = _HistoryEngine()
  eng.history.add(list(range(10)), *_kv(10), reused=0)
  assert first.save(eng) == 1 and first.save(eng) is None  # unchanged: not written again
  eng.history.add(list(range(20, 30)), *_kv(10), reused=0)
  assert first.save(eng) == 2
  names = sorted(os.listdir(folder / "new"))
  assert names == [".lock", "CURRENT", (folder / "new" / "CURRENT").read_text().strip()]  # the old one removed
  (folder / "new" / ".saving-killed").mkdir()  # what a killed save leaves
  first.close()
  again = SessionsDir(str(folder / "new"))
  assert not (folder / "new" / ".saving-killed").exists()
  other = _HistoryEngine()
  assert again.load(other) == 2
  again.close()
  with pytest.raises(DirError, match=r"--sessions-dir='/dev/null/x': cannot use"):
    SessionsDir("/dev/null/x")
  with pytest.raises(DirError, match=r"--history-spill-dir="):
    check_writable("/dev/null/x", "--history-spill-dir")


def test_a_failed_save_is_kept_and_logged_not_raised(tmp_path, caplog):
  s = SessionsDir(str(tmp_path / "s"))
  eng = _HistoryEngine()
  eng.history.add(list(range(10)), *_kv(10), reused=0)
  (tmp_path / "s" / "CURRENT").mkdir()  # the pointer cannot be replaced: the save fails
  with caplog.at_level("ERROR", logger="rocketkv_jax.serving"):
    assert s.save(eng) is None
  assert isinstance(s.failed, OSError) and "FAILED to save" in caplog.text
  os.rmdir(tmp_path / "s" / "CURRENT")
  assert s.save(eng) == 1 and s.failed is None
  s.close()


def test_runner_calls_periodic_work_on_the_engine_thread():
  import threading
  import time

  from rocketkv_jax.serving.runner import EngineRunner

  class Idle:
    def has_work(self):
      return False

    def stats(self):
      return {}

  seen = []
  runner = EngineRunner(Idle()).every(0.05, lambda: seen.append(threading.current_thread().name))
  runner.start()
  t0 = time.monotonic()
  while len(seen) < 2 and time.monotonic() - t0 < 10:
    time.sleep(0.05)
  runner.shutdown()
  assert len(seen) >= 2 and set(seen) == {"rocketkv-engine"}


def test_an_empty_store_saves_and_loads(tmp_path):
  HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20).save(tmp_path / "h", stamp=STAMP)
  assert HistoryStore(2, (2, 4), np.float32, max_bytes=1 << 20).load(tmp_path / "h", stamp=STAMP) == 0


def test_periodic_saves_keep_the_sessions_of_a_crashed_server(model, tmp_path):
  """The runner saves on the engine thread between steps; without any shutdown save (a crash), a new engine
  loads what the last periodic save wrote."""
  import time

  from rocketkv_jax.serving.runner import EngineRunner
  eng = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  sessions = SessionsDir(str(tmp_path / "s"), save_every_s=0.1)
  runner = EngineRunner(eng).every(sessions.save_every_s, lambda: sessions.save(eng)).start()
  events = []
  runner.submit(Request("r", ids(70, 60), SamplingParams(max_tokens=4)), events.append).result(60)
  t0 = time.monotonic()
  while not any(getattr(e, "finished", False) for e in events) and time.monotonic() - t0 < 60:
    time.sleep(0.05)
  time.sleep(1.0)  # several save intervals after the prompt joined the history
  runner.shutdown()  # no save here: as if the process died
  sessions.close()
  assert any(getattr(e, "finished", False) for e in events)
  fresh = Engine(model, Tok(), EngineConfig(**KW, history_bytes=HISTORY))
  assert SessionsDir(str(tmp_path / "s")).load(fresh) == 1

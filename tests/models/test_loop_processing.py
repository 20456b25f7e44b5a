"""Per-row logit processing and logprobs in the one decode loop (models/loop.py): penalties, logit bias and
min_tokens against a NumPy step-by-step reference on a tiny random Llama, neutral values change nothing, and
the returned logprobs are the raw distribution's."""

import numpy as np
import pytest

from rocketkv_jax import make_config
from rocketkv_jax.models import LoopConfig, decode, decode_loop, prefill
from rocketkv_jax.models.loop import RowProcessing, RowSampling

P, V, N = 24, 128, 7  # prompt tokens, vocabulary, new tokens


def _start(model, seed=1):
  toks = np.random.default_rng(seed).integers(3, V, (2, P)).astype(np.int32)
  config = make_config("full", token_budget=64, prompt_len=P, max_new_tokens=N, head_dim=16, impl="xla")
  logits, caches = prefill(model, toks, np.array([P, P]), config)
  return toks, config, logits, caches


def _rows(temperature=(0.0, 0.0), seed=(1, 2)):
  return RowSampling(temperature=np.array(temperature, np.float32), top_p=np.ones(2, np.float32),
                     top_k=np.zeros(2, np.int32), seed=np.array(seed, np.uint32), index=np.zeros(2, np.int32))


def _proc(toks, presence=(0, 0), frequency=(0, 0), repetition=(1, 1), min_tokens=(0, 0), bias=({}, {}),
          stops=((), ())):
  L, S = 4, 3
  bias_ids, bias_v = np.full((2, L), V, np.int32), np.zeros((2, L), np.float32)
  stop_ids = np.full((2, S), V, np.int32)
  mask = np.zeros((2, V), bool)
  for b in range(2):
    for j, (i, x) in enumerate(bias[b].items()):
      bias_ids[b, j], bias_v[b, j] = i, x
    stop_ids[b, :len(stops[b])] = stops[b]
    mask[b, toks[b]] = True
  return RowProcessing(presence=np.array(presence, np.float32), frequency=np.array(frequency, np.float32),
                       repetition=np.array(repetition, np.float32), min_tokens=np.array(min_tokens, np.int32),
                       bias_ids=bias_ids, bias=bias_v, stop_ids=stop_ids, counts=np.zeros((2, V), np.int32),
                       prompt_mask=mask)


def _reference(model, proc: RowProcessing):
  """Greedy tokens under processing, one decode step at a time, the processing written out in NumPy."""
  _, config, logits, caches = _start(model)
  counts = np.zeros((2, V), np.int64)
  out = []
  for i in range(N):
    x = np.asarray(logits, np.float64).copy()
    for b in range(2):
      for j, bias in zip(proc.bias_ids[b], proc.bias[b]):
        if j < V:
          x[b, j] += bias
      if i < proc.min_tokens[b]:
        for j in proc.stop_ids[b]:
          if j < V:
            x[b, j] = -np.inf
      seen = proc.prompt_mask[b] | (counts[b] > 0)
      r = proc.repetition[b]
      x[b] = np.where(seen, np.where(x[b] > 0, x[b] / r, x[b] * r), x[b])
      x[b] -= proc.frequency[b] * counts[b] + proc.presence[b] * (counts[b] > 0)
    tok = x.argmax(-1)
    counts[np.arange(2), tok] += 1
    out.append(tok)
    if i < N - 1:
      logits, caches = decode(model, tok.astype(np.int32), caches, config)
  return np.stack(out, 1), counts


def test_neutral_processing_changes_nothing(tiny_model):
  toks, config, logits, caches = _start(tiny_model)
  plain = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N),
                      rows=_rows((0.0, 1.0)))
  toks, config, logits, caches = _start(tiny_model)
  proc = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N), rows=_rows((0.0, 1.0)),
                     process=_proc(toks))
  np.testing.assert_array_equal(np.asarray(proc.tokens), np.asarray(plain.tokens))
  counts = np.zeros((2, V), np.int32)
  for b in range(2):
    np.add.at(counts[b], np.asarray(plain.tokens)[b], 1)
  np.testing.assert_array_equal(np.asarray(proc.counts), counts)


@pytest.mark.parametrize("case", ["penalties", "bias_and_min_tokens"])
def test_processing_equals_the_numpy_reference(tiny_model, case):
  toks, config, logits, caches = _start(tiny_model)
  greedy = np.asarray(decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N)).tokens)
  if case == "penalties":  # row 0: repetition; row 1: frequency and a negative presence (the loop takes any
    # value; the engine bounds them), strong enough that row 1 repeats a token, which greedy here never does
    kw = dict(repetition=(3.0, 1.0), frequency=(0.0, 0.5), presence=(0.0, -100.0))
  else:  # row 0 is pushed to token 5; row 1 may not end with its first greedy token before 3 tokens
    kw = dict(bias=({5: 100.0}, {int(greedy[1, 1]): -3.0}), min_tokens=(0, 3),
              stops=((), (int(greedy[1, 0]), int(greedy[1, 2]))))
  toks, config, logits, caches = _start(tiny_model)
  proc = _proc(toks, **kw)
  want, counts = _reference(tiny_model, proc)
  got = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N), rows=_rows(), process=proc)
  np.testing.assert_array_equal(np.asarray(got.tokens), want)
  np.testing.assert_array_equal(np.asarray(got.counts), counts)
  assert (want != greedy).any(axis=1).all()  # each row's processing changed its answer
  if case == "bias_and_min_tokens":
    assert (want[0] == 5).all()
    assert greedy[1, 0] not in want[1, :3]


def test_logprobs_are_the_raw_distribution(tiny_model):
  """token_logprobs / top ids and logprobs: log_softmax of the model's logits at each step, before processing
  and temperature; carried logits split a call without changing them."""
  toks, config, logits, caches = _start(tiny_model)
  proc = _proc(toks, repetition=(2.0, 1.0))
  rows = _rows((0.0, 0.7))
  k = 3
  out = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N, return_logprobs=True,
                                                                     top_logprobs=k), rows=rows, process=proc)
  lp = np.asarray(out.logprobs)  # [B, N, V]: the teacher's raw log-probs of each step
  tokens = np.asarray(out.tokens)
  np.testing.assert_allclose(np.asarray(out.token_logprobs), np.take_along_axis(lp, tokens[..., None], -1)[..., 0],
                             atol=1e-5)
  want_ids = np.argsort(-lp, -1)[..., :k]
  np.testing.assert_array_equal(np.asarray(out.top_ids), want_ids)
  np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(lp, want_ids, -1), atol=1e-5)
  assert out.top_ids.shape == (2, N, k)
  # k = 0: the chosen token's logprob only
  toks, config, logits, caches = _start(tiny_model)
  zero = decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N, top_logprobs=0), rows=rows,
                     process=_proc(toks, repetition=(2.0, 1.0)))
  assert zero.top_ids.shape == (2, N, 0)
  np.testing.assert_allclose(np.asarray(zero.token_logprobs), np.asarray(out.token_logprobs), atol=1e-5)


def test_processing_needs_rows(tiny_model):
  toks, config, logits, caches = _start(tiny_model)
  with pytest.raises(ValueError, match="needs rows"):
    decode_loop(tiny_model, logits, caches, config, LoopConfig(max_new_tokens=N), process=_proc(toks))
  with pytest.raises(ValueError, match="top_logprobs=-1"):
    LoopConfig(max_new_tokens=N, top_logprobs=-1)


@pytest.mark.parametrize("method", ["full", "rocketkv"])
def test_prompt_scores_equal_the_dense_forward(tiny_model, method, monkeypatch):
  """prefill(score=k): entry t scores token t + 1 under log_softmax of the dense forward's logits at t (every
  method: the scores come from the dense prefill, before any compression), over several chunks."""
  from rocketkv_jax.models import forward_full
  from rocketkv_jax.models import llama
  monkeypatch.setattr(llama, "SCORE_CHUNK_TOKENS", 10)  # 3 chunks, the last partial
  toks = np.random.default_rng(3).integers(3, V, (2, P)).astype(np.int32)
  config = make_config(method, token_budget=64, prompt_len=P, max_new_tokens=N, head_dim=16, impl="xla")
  lengths = np.array([P, P - 5])
  logits, _, scores = prefill(tiny_model, toks, lengths, config, score=4)
  plain, _ = prefill(tiny_model, toks, lengths, config)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), atol=1e-5)
  full = np.asarray(forward_full(tiny_model, toks), np.float64)
  lp = full - full.max(-1, keepdims=True)
  lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
  for b, n in enumerate(lengths):
    want = lp[b, np.arange(n - 1), toks[b, 1:n]]
    np.testing.assert_allclose(np.asarray(scores.token_logprobs)[b, :n - 1], want, atol=1e-4)
    ids = np.argsort(-lp[b, :n - 1], -1)[:, :4]
    np.testing.assert_array_equal(np.asarray(scores.top_ids)[b, :n - 1], ids)
    np.testing.assert_allclose(np.asarray(scores.top_logprobs)[b, :n - 1],
                               np.take_along_axis(lp[b, :n - 1], ids, -1), atol=1e-4)


def test_prompt_scores_hold_one_chunk_of_logits(monkeypatch):
  """Scoring a prompt keeps about one chunk's [B, chunk, V] float32 logits alive, not the prompt's: XLA kept every
  unrolled chunk's logits at once (33 GiB at a 32k bucket and Llama-3's vocabulary), and `rocketkv serve
  --max-prompt-tokens 32768` ran out of memory warming up its scored prefill on an 80 GB H100. Read from the
  compiled executable's memory analysis (32 chunks of 64 tokens, a 32k vocabulary: 268 MB for all of them)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from rocketkv_jax.models import llama
  from rocketkv_jax.models.params import from_params
  from tests.models.conftest import tiny_config, tiny_params
  monkeypatch.setattr(llama, "SCORE_CHUNK_TOKENS", 64)
  cfg = tiny_config(vocab_size=32768)
  graphdef, state = nnx.split(from_params(cfg, tiny_params(cfg)))
  B, T = 1, 2048
  score = jax.jit(lambda st, x, t: llama.score_tokens(nnx.merge(graphdef, st), x, t, 4))
  compiled = score.lower(state, jnp.zeros((B, T, cfg.dim)), jnp.zeros((B, T), jnp.int32)).compile()
  chunk_bytes = B * 64 * cfg.vocab_size * 4
  assert compiled.memory_analysis().temp_size_in_bytes < 4 * chunk_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("start", [0, 37, 90])
@pytest.mark.parametrize("parts", [1, 3, 4])
def test_offset_attention_merge_equals_masked(dtype, start, parts):
  """offset_attention's sentinel merge (cuDNN's on a GPU; here the same merge on XLA) equals the masked reference
  within bf16 attention's own error, for an empty history, a short one and one that fills the buffer, with the
  history whole and in parts (3 does not divide it; at start 37 a part is partly valid and later ones empty)."""
  import jax.numpy as jnp
  from rocketkv_jax.models.llama import offset_attention
  rng = np.random.default_rng(start)
  B, T, S, N, K, H = 2, 16, 128, 4, 2, 16
  x = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
  q, k, v = x(B, T, N, H, sc=2.0), x(B, T, K, H, sc=2.0), x(B, T, K, H)
  hk, hv = x(B, S, K, H, sc=2.0), x(B, S, K, H)
  st = jnp.asarray([start, min(start + 5, S - T)], jnp.int32)
  want = np.asarray(offset_attention(q.astype(jnp.float32), hk.astype(jnp.float32), hv.astype(jnp.float32),
                                     k.astype(jnp.float32), v.astype(jnp.float32), st, impl="masked"))
  got = np.asarray(offset_attention(q, hk, hv, k, v, st, impl="sentinel-xla", parts=parts), np.float32)
  tol = 1e-5 if dtype == "float32" else 3e-2
  np.testing.assert_allclose(got, want, atol=tol)
  if dtype == "float32":  # junk past `start` in the history is never read
    junk = hk.at[:, start + 5:].set(1e4)
    got2 = np.asarray(offset_attention(q, junk, hv, k, v, st, impl="sentinel-xla", parts=parts))
    np.testing.assert_allclose(got2, want, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [None, 1])
def test_offset_attention_cudnn_equals_masked_gpu(parts):
  """The cuDNN path compiled on the GPU at doc-qa's shape (a 128-token bucket over a 33k buffer, Llama-3.1-8B's
  heads; 8 parts by default) against the masked reference in float32."""
  import jax
  import jax.numpy as jnp
  from rocketkv_jax.models.llama import offset_attention
  if jax.default_backend() != "gpu":
    pytest.skip("no GPU")
  rng = np.random.default_rng(5)
  B, T, S, N, K, H = 1, 128, 33792, 32, 8, 128
  x = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.bfloat16)  # noqa: E731
  q, k, v = x(B, T, N, H, sc=2.0), x(B, T, K, H, sc=2.0), x(B, T, K, H)
  hk, hv = x(B, S, K, H, sc=2.0), x(B, S, K, H)
  st = jnp.asarray([32768], jnp.int32)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  want = np.asarray(jax.jit(lambda *a: offset_attention(*a, impl="masked"))(f32(q), f32(hk), f32(hv), f32(k),
                                                                             f32(v), st))
  got = jax.jit(lambda *a: offset_attention(*a, impl="cudnn", parts=parts))(q, hk, hv, k, v, st)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)


def test_history_parts_split_few_queries_over_long_histories():
  """A question over a 33k document (the doc-qa admission) gets 8 parts; a long prompt's chunk (many query blocks
  already) and a short history none."""
  from rocketkv_jax.models.llama import history_parts
  assert history_parts(1, 128, 32, 33792) == 8
  assert history_parts(1, 2048, 32, 33792) == 1
  assert history_parts(1, 128, 32, 2048) == 1
  assert history_parts(4, 128, 32, 33792) == 2

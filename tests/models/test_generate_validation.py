"""generate() and the demo refuse bad values with a ValueError (TypeError for an unknown keyword) naming the
value, before anything compiles: sampling values, token ids outside the vocabulary, keywords that are neither
generate's nor the method config's, an empty method list."""

import math

import pytest

from rocketkv_jax.models import generate
from rocketkv_jax.models.demo import check_demo_args
from rocketkv_jax.models.generate import check_sampling, finish_reason

from .test_llama_generation import IdTokenizer, prompts


@pytest.mark.parametrize("kw, shown", [
    (dict(temperature=math.nan), "temperature=nan"), (dict(temperature=math.inf), "temperature=inf"),
    (dict(temperature=-0.5), "temperature=-0.5"), (dict(temperature="1"), "temperature='1'"),
    (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"), (dict(top_p=math.nan), "top_p=nan"),
    (dict(seed=-1), "seed=-1"), (dict(seed=2**32), f"seed={2**32}"), (dict(seed=1.5), "seed=1.5"),
    (dict(seed=True), "seed=True")])
def test_bad_sampling_values_are_refused(tiny_model, kw, shown):
  with pytest.raises(ValueError, match=shown.replace("(", r"\(")):
    check_sampling(**kw)
  with pytest.raises(ValueError, match=shown.replace("(", r"\(")):
    generate(tiny_model, IdTokenizer(), prompts([5]), method="full", max_new_tokens=2, **kw)


def test_good_sampling_values_pass():
  check_sampling(temperature=0, top_p=1, seed=0)
  check_sampling(temperature=0.7, top_p=1e-6, seed=2**32 - 1)


@pytest.mark.parametrize("bad, shown", [(128, "token id 128 is outside"), (-1, "token id -1 is outside"),
                                        (1.0, "must be ints")])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_model, bad, shown):
  assert tiny_model.config.vocab_size == 128
  ps = prompts([4, 6])
  ps[1][3] = bad
  with pytest.raises(ValueError, match=shown):
    generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=2)


def test_prompts_must_be_a_list_of_prompts(tiny_model):
  with pytest.raises(TypeError, match=r"\[ids\]"):
    generate(tiny_model, IdTokenizer(), [5, 6, 7], method="full", max_new_tokens=2)
  with pytest.raises(ValueError, match="empty"):
    generate(tiny_model, IdTokenizer(), [], method="full", max_new_tokens=2)


def test_unknown_keyword_names_generates_and_the_configs_parameters(tiny_model):
  with pytest.raises(TypeError) as e:
    generate(tiny_model, IdTokenizer(), prompts([5]), method="rocketkv", max_new_tokens=2, stop=["\n"])
  msg = str(e.value)
  assert "['stop']" in msg and "generate's own keywords" in msg and "'max_new_tokens'" in msg
  assert "'rocketkv' method's config" in msg and "'prompt_budget'" in msg and "'window_size'" in msg


def test_finish_reasons_and_stop_id(tiny_model):
  res = generate(tiny_model, IdTokenizer(), prompts([9]), method="full", max_new_tokens=4)
  assert res.finish_reasons == ["length"] and len(res.token_ids[0]) == 4
  assert res.stats.compression_ratio == pytest.approx(1 - res.stats.kv_bytes / res.stats.full_kv_bytes)
  assert finish_reason([5, 2], (2,)) == "stop" and finish_reason([], (2,)) == "length"


@pytest.mark.parametrize("methods, shown", [((), "empty"), (("full", "bogus"), "'bogus'"), ("full", "one string")])
def test_demo_refuses_bad_methods(methods, shown):
  with pytest.raises(ValueError, match=shown):
    check_demo_args(methods, 256, 24)
  assert check_demo_args(["full", "rocketkv", "full"], 256, 24) == ("full", "rocketkv")
  with pytest.raises(ValueError, match="token_budget=8"):
    check_demo_args(["full"], 8, 24)


def test_fp8_kv_cache_through_generate(tiny_model):
  """generate passes kv_cache_dtype to the method's config: the caches hold FP8 K/V (half of float32's bytes per
  K/V element is a quarter), the reference bytes stay the model's, and the greedy text is produced."""
  ps = prompts([9, 12])
  full = generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=3, impl="xla")
  fp8 = generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=3, impl="xla",
                 kv_cache_dtype="float8_e4m3fn")
  assert fp8.stats.full_kv_bytes == full.stats.full_kv_bytes
  assert fp8.stats.kv_bytes < full.stats.kv_bytes
  assert all(1 <= len(t) <= 3 for t in fp8.token_ids)
  with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
    generate(tiny_model, IdTokenizer(), ps, method="full", max_new_tokens=2, kv_cache_dtype="fp8")

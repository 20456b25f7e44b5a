"""What a newcomer meets first: the README's `generate` call answers, and no method holds more KV than `full`."""
import pathlib
import re

import jax.numpy as jnp
import pytest

from rocketkv_jax import METHODS, get_method, plan_limits, plan_static
from rocketkv_jax.models.generate import encode_prompts, generate

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_generate_call() -> str:
  """The README's `res = generate(...)` statement, as written (it may span lines)."""
  text = README.read_text()
  m = re.search(r"^res = generate\(model, tok,.*?\)\n(?=\S)", text, re.S | re.M)
  assert m, "README.md has no `res = generate(model, tok, ...)` example"
  return m.group(0)


def test_readme_generate_example_answers(smollm2):
  """The README's call, run as written on the embedded model, answers the question (it printed '' when strings went
  to the instruct model as raw text), and its cache holds no more than full's for the same tokens."""
  model, tok = smollm2
  scope = {"generate": generate, "model": model, "tok": tok}
  exec(readme_generate_call(), scope)  # noqa: S102 (the README's own code)
  res = scope["res"]
  assert "Paris" in res.texts[0], res.texts
  s = res.stats
  assert s.kv_bytes <= s.full_kv_bytes * 1.001, (s.kv_bytes, s.full_kv_bytes)
  assert s.kept_whole == [True] and s.method == "rocketkv"


def test_conversation_prompts_take_the_chat_template(smollm2):
  """A list of messages goes through the chat template (as chat=True does for a string); chat=False refuses it."""
  _, tok = smollm2
  q = "What is the capital of France?"
  conv = [{"role": "user", "content": q}]
  assert encode_prompts(tok, [conv], None) == encode_prompts(tok, [q], True) == [tok.encode(q, chat=True)]
  assert encode_prompts(tok, [q], None) == [tok.encode(q)]  # a string: raw text by default
  with pytest.raises(ValueError, match="chat=False"):
    encode_prompts(tok, [conv], False)
  with pytest.raises(ValueError, match="message 0"):
    encode_prompts(tok, [[{"role": "user"}]], None)


@pytest.mark.parametrize("prompt_len,new", [(7, 32), (64, 32), (200, 64), (300, 16), (1000, 64), (4000, 256)])
def test_no_method_holds_more_than_full(prompt_len, new):
  """For every method and a range of short to long sequences, the static config a batch or engine runs under
  (`plan_static`) holds at most full's bytes; where compression pays, the method itself is kept."""
  K, H, dtype = 3, 64, jnp.bfloat16
  kw = dict(token_budget=64, max_prompt_len=prompt_len, max_new_tokens=new, head_dim=H, max_len=8192)
  full = plan_limits("full", **kw).cache_bytes(1, K, H, dtype)
  for method in METHODS:
    try:
      config = plan_static(method, n_kv_heads=K, model_dtype=dtype, **kw)
    except ValueError:  # a plan this budget cannot make (e.g. a window larger than the prompt budget)
      continue
    assert config.cache_bytes(1, K, H, dtype) <= full, (method, prompt_len, new)
    if prompt_len >= 1000 and get_method(method).evicts:
      assert config.method == method  # long prompts are compressed, not kept whole

"""The serving engine on a tiny random Llama: a tokenizer whose ids are the text (`Tok`), the engine settings
and the model (`KW`, `tiny_engine_model`), random prompts, and a loop that steps an engine through a schedule
of submissions (`run`)."""

import numpy as np

from rocketkv_jax.models.params import from_params
from rocketkv_jax.models.tokenizer import TextTokenizer
from tests.models.conftest import tiny_config, tiny_params


class Tok(TextTokenizer):
  """Ids are the text: token i prints as "<i>", so stop strings are unambiguous."""

  chat_eos_id = None

  def __init__(self):
    super().__init__(tokenizer=None, bos_id=1, eos_id=2)

  def decode(self, ids, *, skip_special=True):
    return "".join(f"<{i}>" for i in ids)


KW = dict(method="rocketkv", token_budget=32, max_slots=4, max_prompt_tokens=200, max_new_tokens=24,
          steps_per_call=4)


def tiny_engine_model():
  """The tiny random Llama the engine tests serve."""
  cfg = tiny_config()
  return from_params(cfg, tiny_params(cfg))


def prompt(n, seed):
  """n random token ids (3 to 127) from `seed`."""
  return np.random.default_rng(seed).integers(3, 128, n).tolist()


def collect(out, seen, k, events):
  """Adds one step's events to out {request_id: dict(tokens, text, reason, completion, deltas)} and seen
  {request_id: [steps with an event]}."""
  for ev in events:
    o = out.setdefault(ev.request_id, dict(tokens=[], text="", reason=None, completion=0, deltas=[]))
    assert o["reason"] is None, f"event after the final one: {ev}"
    o["tokens"] += ev.token_ids
    o["text"] += ev.text
    o["deltas"].append(ev.text)
    o["reason"], o["completion"] = ev.finish_reason, ev.completion_tokens
    seen.setdefault(ev.request_id, []).append(k)


def run(engine, schedule, out=None):
  """schedule: {step number: [requests submitted before that step]}. Steps until no work is left; returns
  (out, seen) as `collect` fills them."""
  out, seen, k = ({} if out is None else out), {}, 0
  while k <= max(schedule) or engine.has_work():
    for r in schedule.get(k, []):
      engine.submit(r)
    collect(out, seen, k, engine.step())
    k += 1
    assert k < 200
  assert engine.stats()["active_slots"] == 0 and engine.free_slots() == list(range(engine.config.max_slots))
  return out, seen

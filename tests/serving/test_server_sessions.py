"""Sessions through the server: a three-turn chat with the official `openai` client whose third question needs
a fact given only in the first turn (answered, with the earlier turns reused rather than prefilled again:
`usage.prompt_tokens_details.cached_tokens`), and the histories saved at shutdown, loaded by a restarted server
and reused by the conversation's next turn. SmolLM2 on the CPU, a real server on 127.0.0.1."""

import os

import pytest

from tests.helpers.server import MODEL, STORY, Served

pytest.importorskip("openai")

ENGINE = dict(method="rocketkv", token_budget=96, max_slots=2, max_prompt_tokens=512, max_new_tokens=48,
              steps_per_call=4, prefill_buckets=(64, 128, 256, 512), history_bytes=1 << 30)
# the fact, then a story long enough that the third turn's prompt (about 280 tokens) is past stage 1's prompt
# budget (its own plan at t=96 and 48 new tokens keeps 177): the fact must survive the compression. At t=128 the
# slots (sized for 512 + 48 tokens) would hold more bytes than full's, so the engine would keep every request whole
# (`plan_static`) and nothing would be evicted
FACT = "My name is Ada and I live in a small town called Brindlewick. Remember that. Here is a story I like: " + STORY * 2
TURNS = [FACT, "What is the capital of France?", "What is the name of the town where I live?"]


def chat(client, messages):
  # a cache_salt makes the conversation a tenant's: only then does usage report cached_tokens
  r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                     extra_body={"cache_salt": "ada"})
  return r.choices[0].message.content, r.usage


def turn(served, messages, text):
  messages.append({"role": "user", "content": text})
  answer, usage = chat(served.client, messages)
  messages.append({"role": "assistant", "content": answer})
  return answer, usage


def test_three_turn_conversation_reuses_earlier_turns(smollm2):
  model, tok = smollm2
  s = Served(model, tok, **ENGINE)
  try:
    messages, usages = [], []
    for text in TURNS:
      usages.append(turn(s, messages, text)[1])
    answer = messages[-1]["content"]
    assert "brindlewick" in answer.lower(), answer
    # turn 1 prefilled everything; turns 2 and 3 reused every token of the previous turn's prompt that the
    # window allows (prompt_queries: the last W prompt tokens are always recomputed)
    W = s.engine.method_config.prompt_queries
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for prev, cur in zip(usages, usages[1:]):
      cached = cur.prompt_tokens_details.cached_tokens
      assert cached == min(prev.prompt_tokens, cur.prompt_tokens - W), (prev, cur)
    # the last prompt is past its own plan's prompt budget: stage 1 evicted, and the fact survived
    assert s.engine.method_config.method == "rocketkv"
    assert usages[-1].prompt_tokens > s.engine.plan(usages[-1].prompt_tokens, 48).prompt_budget[0]
    m = s.metrics()
    assert m["rocketkv_kv_bytes_host"] > 0 and m["rocketkv_prompt_tokens_reused_total"] == sum(
        u.prompt_tokens_details.cached_tokens for u in usages)
  finally:
    s.stop()


def test_sessions_survive_a_restart(smollm2, tmp_path):
  """Two turns, shutdown (the histories are saved with orbax), a new server on the same folder loads them,
  and the third turn reuses the saved prefix and answers from the first turn's fact."""
  model, tok = smollm2
  folder = str(tmp_path / "sessions")
  first = Served(model, tok, server_kw=dict(history_dir=folder), **ENGINE)
  try:
    messages = []
    for text in TURNS[:2]:
      _, usage = turn(first, messages, text)
  finally:
    first.stop()
  with open(os.path.join(folder, "CURRENT")) as f:  # sessions.py's layout: the pointer names the saved folder
    assert os.path.isfile(os.path.join(folder, f.read().strip(), "meta.json"))
  second = Served(model, tok, server_kw=dict(history_dir=folder), **ENGINE)
  try:
    assert second.engine.stats()["history_segments"] == 2
    answer, usage3 = turn(second, messages, TURNS[2])
    W = second.engine.method_config.prompt_queries
    assert usage3.prompt_tokens_details.cached_tokens == min(usage.prompt_tokens, usage3.prompt_tokens - W) > 0
    assert "brindlewick" in answer.lower(), answer
  finally:
    second.stop()

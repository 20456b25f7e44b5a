"""Tenant isolation of prefix reuse (issue 39): the digit-guessing attack through `cached_tokens` recovers a
secret when both clients are one tenant, and nothing when they hold different API keys or send different
cache salts; a key's own next turn still reuses its history."""

import json

import pytest

pytest.importorskip("uvicorn")

from tests.helpers.server import MODEL, Served  # noqa: E402

pytestmark = pytest.mark.xla_opt  # many decode steps: run with XLA's default optimization (conftest)

SECRET = "735"
LEAD = "The vault code of the bank is "
# every prompt ends in a tail longer than the method's window (stage 1 reads the last prompt_queries tokens'
# queries, which the history does not keep), so what precedes it is reusable
TAIL = " and then a long tail of other words to fill the window of the method, several dozen tokens of it, " * 3


@pytest.fixture(scope="module")
def two_keys(smollm2_lite):
  s = Served(*smollm2_lite, method="rocketkv", token_budget=64, max_slots=2, max_prompt_tokens=256, max_new_tokens=4,
             steps_per_call=4, max_queue=16, history_bytes=2**26, server_kw=dict(api_key=("key-alice", "key-bob")))
  try:
    yield s
  finally:
    s.stop()


def _cached(served, key, prompt, salt=None) -> int:
  body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
  if salt is not None:
    body["cache_salt"] = salt
  status, text = served.http("POST", "/v1/completions", json.dumps(body),
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
  assert status == 200, text
  return json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _attack(served, victim_key, attacker_key, victim_salt=None, attacker_salt=None) -> str:
  """The victim sends a prompt holding the secret; the attacker guesses it digit by digit, keeping the digit whose
  prompt reuses the most cached tokens (ties: no digit learned)."""
  _cached(served, victim_key, LEAD + SECRET + ". Please keep it safe." + TAIL, victim_salt)
  found = ""
  for _ in SECRET:
    scores = {d: _cached(served, attacker_key, LEAD + found + d + TAIL, attacker_salt) for d in "0123456789"}
    best = max(scores.values())
    if list(scores.values()).count(best) > 1:
      break
    found += max(scores, key=scores.get)
  return found


def test_one_tenant_leaks_and_two_keys_do_not(two_keys):
  # one key on both sides: the same tenant, reuse is shared: the attack's premise holds on this server ...
  assert _attack(two_keys, "key-alice", "key-alice", "same", "same") == SECRET
  # ... another key learns nothing, ...
  assert _attack(two_keys, "key-alice", "key-bob") == ""
  # ... nor does a different cache salt under the same key
  assert _attack(two_keys, "key-bob", "key-bob", victim_salt="v", attacker_salt="a") == ""


def test_a_key_reuses_its_own_history(two_keys):
  prompt = LEAD + "42, and the rest of a conversation" + TAIL
  _cached(two_keys, "key-bob", prompt, "turns")
  assert _cached(two_keys, "key-bob", prompt + " and a next turn", "turns") > 10
  assert _cached(two_keys, "key-alice", prompt + " and a next turn", "turns") == 0


def test_several_keys_authenticate(two_keys):
  for key, status in (("key-alice", 200), ("key-bob", 200), ("key-eve", 401)):
    code, _ = two_keys.http("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert code == status


def test_serve_takes_several_keys(monkeypatch):
  from rocketkv_jax.serving.cli import api_key, build_parser
  monkeypatch.delenv("ROCKETKV_API_KEY", raising=False)
  parse = build_parser().parse_args
  assert api_key(parse(["serve", "--api-key", "a", "--api-key", "b"])) == ("a", "b")
  assert api_key(parse(["serve", "--api-key", "a"])) == "a"
  assert api_key(parse(["serve"])) is None
  monkeypatch.setenv("ROCKETKV_API_KEY", "env-key")
  assert api_key(parse(["serve"])) == "env-key"

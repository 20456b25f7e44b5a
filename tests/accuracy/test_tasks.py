"""Generators are seeded, deterministic, exactly as long as asked, and hide their answers in the prompt."""
import pytest

from rocketkv_jax.eval import tasks as T


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("chat", [False, True])
def test_generator_deterministic_exact_length_answers_in_prompt(tiny_tokenizer, task, chat):
  a = T.GENERATORS[task](tiny_tokenizer, 512, 3, chat=chat)
  b = T.GENERATORS[task](tiny_tokenizer, 512, 3, chat=chat)
  c = T.GENERATORS[task](tiny_tokenizer, 512, 4, chat=chat)
  assert a.ids == b.ids and a.answers == b.answers
  assert a.ids != c.ids
  assert len(a.ids) == 512 and len(c.ids) == 512
  text = tiny_tokenizer.decode(list(a.ids), skip_special=False)
  for ans in a.answers:
    assert ans in text
  assert a.question in text
  # needles sit where the metadata says, in depth order
  pos = a.meta["needle_token_pos"]
  assert all(0 < p < 512 for p in pos)
  assert ("<|im_start|>" in text) == chat


def test_multikey_has_distractors_and_one_answer(tiny_tokenizer):
  s = T.make_multikey(tiny_tokenizer, 512, 0)
  text = tiny_tokenizer.decode(list(s.ids))
  assert len(s.answers) == 1 and len(set(s.meta["values"])) == 4
  for v in s.meta["values"]:
    assert v in text


def test_vartrack_chain_and_distractor(tiny_tokenizer):
  s = T.make_vartrack(tiny_tokenizer, 512, 1)
  text = tiny_tokenizer.decode(list(s.ids))
  assert len(s.answers) == 5
  assert f"VAR {s.answers[1]} = VAR {s.answers[0]}." in text
  assert s.meta["distractor_value"] in text and not set(s.meta["distractor_chain"]) & set(s.answers)


def test_lengths_follow_the_context_and_haystack_wraps_only_when_too_short(tiny_tokenizer):
  for n in (300, 700, 1000):
    assert len(T.make_passkey(tiny_tokenizer, n, 0).ids) == n
  total = sum(T.sentence_lengths(tiny_tokenizer))
  # the start sentence is drawn so that the context fits without wrapping
  for seed in range(40):
    ids, meta = T.fidelity_text(tiny_tokenizer, total - 50, seed)
    assert len(ids) == total - 50 and meta["repeats"] == 0
  ids, meta = T.fidelity_text(tiny_tokenizer, total + 100, 0)  # longer than the text: wraps around
  assert len(ids) == total + 100 and meta["repeats"] >= 1
  assert T.fidelity_text(tiny_tokenizer, total + 100, 0)[0] == ids


def test_question_tokens_are_the_prompts_tail(tiny_tokenizer):
  for task in T.TASKS:
    s = T.GENERATORS[task](tiny_tokenizer, 512, 0)
    n = s.meta["question_tokens"]
    ends = s.meta["needle_token_end"]
    assert 0 < n < 200 and all(p < e <= 512 - n for p, e in zip(s.meta["needle_token_pos"], ends))
    assert tiny_tokenizer.decode(list(s.ids[512 - n:])).lstrip().startswith(s.question)


def test_too_short_context_is_rejected(tiny_tokenizer):
  with pytest.raises(ValueError, match="too short"):
    T.make_vartrack(tiny_tokenizer, 60, 0)


def test_make_samples_rejects_unknown_task(tiny_tokenizer):
  with pytest.raises(ValueError, match="unknown tasks"):
    T.make_samples(tiny_tokenizer, ["nope"], 512, 1)


def test_score_exact_match_of_each_answer():
  assert T.score(" 41072.", ["41072"]) == 1.0
  assert T.score("4107", ["41072"]) == 0.0
  assert T.score("68249, 29813", ["28716", "68249", "29813"]) == pytest.approx(2 / 3)
  with pytest.raises(ValueError):
    T.score("x", [])

"""Seeded long-context tasks in the spirit of RULER, over a haystack of real prose, and their scoring.

Every generator takes (tokenizer, context_tokens, seed) and returns a `Sample` whose token ids have
exactly `context_tokens` ids: the haystack is filled sentence by sentence and the last sentence is cut in
token space, so all samples of one context length share one prompt length (one compile per config).

Tasks (RULER names in brackets):
  passkey     [niah_single_2]   one 5-digit pass key hidden in the prose.
  multikey    [niah_multikey_1] four "special magic numbers" for four different keys; one is asked for,
                                the other three are distractors.
  multivalue  [niah_multivalue] three numbers for one key at three depths; all three are asked for.
  vartrack    [vt]              a chain of four variable assignments (VAR A = 12345, VAR B = VAR A, ...)
                                spread over the prose, plus a distractor chain; all names in the chain
                                of the asked value are expected.

Scoring is exact string match of each expected answer in the generated text (RULER's string_match_all):
a sample scores the fraction of its answers found (0 or 1 for single-answer tasks).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import random
import re
from typing import Callable, Sequence

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TASKS = ("passkey", "multikey", "multivalue", "vartrack")

# Keys for the multi-key tasks: a word list of our own (adjective-noun pairs are RULER's style).
_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
        "lucky", "mellow", "noble", "odd", "proud", "quiet", "rusty", "silent", "tidy", "vivid", "wild")
_NOUN = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tower",
         "violin", "walnut")


@dataclasses.dataclass(frozen=True)
class Sample:
  """One prompt: `ids` (exactly the context length), the answers expected in the output, metadata."""

  task: str
  seed: int
  ids: tuple[int, ...]
  answers: tuple[str, ...]
  question: str
  meta: dict = dataclasses.field(default_factory=dict, compare=False)


# ----------------------------------------------------------------------------- haystack


def haystack_files(data_dir: str = DATA_DIR) -> list[str]:
  """The haystack's files: data/*.txt in name order, except SOURCES.txt (where they come from)."""
  return sorted(n for n in os.listdir(data_dir) if n.endswith(".txt") and n != "SOURCES.txt")


@functools.lru_cache(maxsize=4)
def haystack_sentences(data_dir: str = DATA_DIR) -> tuple[str, ...]:
  """The prose of every haystack file (`haystack_files`), whitespace collapsed, split into sentences.

  Chapter headings are dropped; a sentence ends at . ! or ? (optionally followed by a closing quote)."""
  names = haystack_files(data_dir)
  if not names:
    raise FileNotFoundError(f"no haystack *.txt files in {data_dir}")
  text = " ".join(open(os.path.join(data_dir, n), encoding="utf-8").read() for n in names)
  text = re.sub(r"CHAPTER [IVXLC]+\.[^\n]*\n", " ", text)
  text = re.sub(r"\s+", " ", text).strip()
  parts = re.split(r"(?<=[.!?])(?:(?<=[.!?])['\"’”)]?)\s+(?=['\"‘“(]?[A-Z])", text)
  return tuple(p.strip() for p in parts if p.strip())


class _Encoder:
  """Encodes text pieces (each with a leading space, so BPE word boundaries stay put) with a cache."""

  def __init__(self, tokenizer):
    self.tok = tokenizer
    self.sentence_lengths: list[int] | None = None  # of the haystack's sentences, once asked for
    self._cache: dict[str, list[int]] = {}

  def __call__(self, text: str) -> list[int]:
    if text not in self._cache:
      self._cache[text] = list(self.tok.tokenizer.encode(text, add_special_tokens=False).ids)
    return self._cache[text]


_ENCODERS: dict[int, _Encoder] = {}


def _encoder(tokenizer) -> _Encoder:
  enc = _ENCODERS.get(id(tokenizer))
  if enc is None or enc.tok is not tokenizer:
    enc = _ENCODERS[id(tokenizer)] = _Encoder(tokenizer)
  return enc


def sentence_lengths(tokenizer) -> list[int]:
  """Token count of every haystack sentence (as haystack_ids encodes it: with a leading space)."""
  enc = _encoder(tokenizer)
  if enc.sentence_lengths is None:
    enc.sentence_lengths = [len(enc(" " + x)) for x in haystack_sentences()]
  return enc.sentence_lengths


def haystack_ids(tokenizer, n_tokens: int, rng: random.Random) -> tuple[list[list[int]], dict]:
  """Consecutive haystack sentences (token ids, one list per sentence) from a seeded start, cut to exactly
  n_tokens ids in total. The start is drawn among the sentences from which the rest of the text holds
  n_tokens, so the prose does not wrap; only when the whole text is shorter does it wrap around to the start
  (meta["repeats"] counts wraps)."""
  sents = haystack_sentences()
  enc = _encoder(tokenizer)
  lens = sentence_lengths(tokenizer)
  # starts that fit: the suffix from sentence i holds >= n_tokens tokens (a prefix of the sentence list)
  suffix, fits = 0, 0
  for i in range(len(sents) - 1, -1, -1):
    suffix += lens[i]
    if suffix >= n_tokens:
      fits = i + 1
      break
  start = rng.randrange(fits or len(sents))
  out, total, i = [], 0, 0
  while total < n_tokens:
    ids = enc(" " + sents[(start + i) % len(sents)])
    take = ids[: n_tokens - total]
    out.append(take)
    total += len(take)
    i += 1
  return out, {"start_sentence": start, "sentences": i, "repeats": (start + i - 1) // len(sents)}


# ----------------------------------------------------------------------------- prompt assembly

_INSTRUCTION = ("Some special information is hidden inside the following text. Read it carefully and "
                "remember it; you will be asked about it afterwards.")


def _wrap(tokenizer, chat: bool) -> tuple[list[int], Callable[[str, str], list[int]]]:
  """Token ids before the haystack and a function (question, answer_prefix) -> ids after it."""
  enc = _encoder(tokenizer)
  if chat:
    full = tokenizer.apply_chat([{"role": "user", "content": "\x00"}])
    before, after = full.split("\x00")
    head = tokenizer.tokenizer.encode(before + _INSTRUCTION, add_special_tokens=False).ids
    def tail(q, prefix):
      return enc(f"\n\n{q}{after}{prefix}")
  else:
    head = tokenizer.tokenizer.encode(_INSTRUCTION, add_special_tokens=False).ids
    def tail(q, prefix):
      return enc(f"\n\n{q}\nAnswer: {prefix}")
  bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
  return bos + list(head), tail


def _assemble(tokenizer, context: int, rng: random.Random, needles: Sequence[str], depths: Sequence[float],
              question: str, answer_prefix: str, chat: bool) -> tuple[list[int], dict]:
  """head + haystack with `needles` inserted between sentences at relative `depths` + tail; exactly
  `context` ids. Needles are whole sentences, never cut."""
  enc = _encoder(tokenizer)
  head, tail_fn = _wrap(tokenizer, chat)
  tail = tail_fn(question, answer_prefix)
  needle_ids = [enc(" " + n) for n in needles]
  n_hay = context - len(head) - len(tail) - sum(len(x) for x in needle_ids)
  if n_hay < 16:
    raise ValueError(f"context={context} tokens is too short for this task's needles and question")
  hay, meta = haystack_ids(tokenizer, n_hay, rng)
  # insertion points: before haystack sentence j (0..len(hay)), by depth; keep order of needles by depth
  order = sorted(range(len(needles)), key=lambda i: depths[i])
  slots = {}
  for i in order:
    j = min(len(hay), int(round(depths[i] * len(hay))))
    slots.setdefault(j, []).append(i)
  ids: list[int] = list(head)
  needle_pos = [0] * len(needles)
  for j in range(len(hay) + 1):
    for i in slots.get(j, []):
      needle_pos[i] = len(ids)
      ids += needle_ids[i]
    if j < len(hay):
      ids += hay[j]
  ids += tail
  assert len(ids) == context, (len(ids), context)
  # question_tokens: the prompt's last ids after the haystack (question + answer prefix), which the
  # query-agnostic mode feeds only after compressing the rest
  meta.update(needle_token_pos=needle_pos, needle_token_end=[p + len(x) for p, x in zip(needle_pos, needle_ids)],
              depths=list(depths), question_tokens=len(tail))
  return ids, meta


def _number(rng: random.Random, digits: int = 5) -> str:
  return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _distinct(rng: random.Random, n: int, make: Callable[[], str]) -> list[str]:
  out: list[str] = []
  while len(out) < n:
    x = make()
    if x not in out:
      out.append(x)
  return out


def make_passkey(tokenizer, context: int, seed: int, *, chat: bool = False) -> Sample:
  rng = random.Random(f"passkey/{context}/{seed}")
  key = _number(rng)
  needle = f"The pass key is {key}. Remember it. {key} is the pass key."
  q = "What is the pass key?"
  ids, meta = _assemble(tokenizer, context, rng, [needle], [rng.uniform(0.05, 0.95)], q,
                        "The pass key is", chat)
  return Sample("passkey", seed, tuple(ids), (key,), q, meta)


def make_multikey(tokenizer, context: int, seed: int, *, chat: bool = False, n_keys: int = 4) -> Sample:
  rng = random.Random(f"multikey/{context}/{seed}")
  keys = _distinct(rng, n_keys, lambda: f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}")
  vals = _distinct(rng, n_keys, lambda: _number(rng))
  needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, vals)]
  depths = [rng.uniform(0.05, 0.95) for _ in keys]
  ask = rng.randrange(n_keys)
  q = f"What is the special magic number for {keys[ask]} mentioned in the provided text?"
  ids, meta = _assemble(tokenizer, context, rng, needles, depths, q,
                        f"The special magic number for {keys[ask]} mentioned in the provided text is", chat)
  meta.update(asked=ask, keys=keys, values=vals)
  return Sample("multikey", seed, tuple(ids), (vals[ask],), q, meta)


def make_multivalue(tokenizer, context: int, seed: int, *, chat: bool = False, n_values: int = 3) -> Sample:
  rng = random.Random(f"multivalue/{context}/{seed}")
  key = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
  vals = _distinct(rng, n_values, lambda: _number(rng))
  needles = [f"One of the special magic numbers for {key} is: {v}." for v in vals]
  depths = [rng.uniform(0.05, 0.95) for _ in vals]
  q = f"What are all the special magic numbers for {key} mentioned in the provided text?"
  ids, meta = _assemble(tokenizer, context, rng, needles, depths, q,
                        f"The special magic numbers for {key} mentioned in the provided text are", chat)
  return Sample("multivalue", seed, tuple(ids), tuple(vals), q, meta)


def make_vartrack(tokenizer, context: int, seed: int, *, chat: bool = False, hops: int = 4) -> Sample:
  rng = random.Random(f"vartrack/{context}/{seed}")
  letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
  names = _distinct(rng, 2 * (hops + 1), lambda: "".join(rng.choice(letters) for _ in range(5)))
  chain, other = names[: hops + 1], names[hops + 1:]
  value, other_value = _distinct(rng, 2, lambda: _number(rng))
  def links(ns, v):
    return [f"VAR {ns[0]} = {v}."] + [f"VAR {ns[i]} = VAR {ns[i - 1]}." for i in range(1, len(ns))]
  needles = links(chain, value) + links(other, other_value)
  # each chain's links in order of depth, the two chains interleaved
  d1 = sorted(rng.uniform(0.05, 0.95) for _ in chain)
  d2 = sorted(rng.uniform(0.05, 0.95) for _ in other)
  q = f"Find all variables that are assigned the value {value} in the text above."
  ids, meta = _assemble(tokenizer, context, rng, needles, d1 + d2, q,
                        f"According to the chain(s) of variable assignment in the text above, {len(chain)} "
                        f"variables are assigned the value {value}, they are:", chat)
  meta.update(distractor_chain=other, distractor_value=other_value)
  return Sample("vartrack", seed, tuple(ids), tuple(chain), q, meta)


GENERATORS = {"passkey": make_passkey, "multikey": make_multikey, "multivalue": make_multivalue,
              "vartrack": make_vartrack}


def make_samples(tokenizer, tasks: Sequence[str], context: int, n: int, *, chat: bool = False,
                 seed0: int = 0) -> list[Sample]:
  """n samples of every task at one context length (seeds seed0 .. seed0 + n - 1)."""
  bad = [t for t in tasks if t not in GENERATORS]
  if bad:
    raise ValueError(f"unknown tasks {bad}; choose from {TASKS}")
  return [GENERATORS[t](tokenizer, context, seed0 + i, chat=chat) for t in tasks for i in range(n)]


def score(output: str, answers: Sequence[str]) -> float:
  """Fraction of the expected answers that occur verbatim in the output (RULER string_match_all)."""
  if not answers:
    raise ValueError("a sample needs at least one expected answer")
  return sum(a in output for a in answers) / len(answers)


def fidelity_text(tokenizer, n_tokens: int, seed: int) -> tuple[list[int], dict]:
  """n_tokens ids of plain haystack prose (no needles) from a seeded start, for teacher-forced fidelity."""
  rng = random.Random(f"fidelity/{n_tokens}/{seed}")
  hay, meta = haystack_ids(tokenizer, n_tokens, rng)
  return [t for s in hay for t in s], meta

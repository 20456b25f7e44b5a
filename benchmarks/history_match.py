"""Host cost of the sessions history's prefix lookup (`HistoryStore.match`) at document-QA scale: one stored
document and N stored questions after it (each a segment of the prefix tree), then the time of one `match` of a
new question and the host memory the stored token paths take (tracemalloc). CPU only, no model.

  python -m benchmarks.history_match --questions 100,1000,4000 [--doc 32768] [--question-tokens 40]
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from rocketkv_jax.serving.history import HistoryStore


def measure(n_questions: int, doc: int, q: int, reps: int = 20) -> dict:
  store = HistoryStore(1, (1, 1), np.float32, max_bytes=1 << 40)  # K/V of one float each: the paths dominate
  rng = np.random.default_rng(0)
  document = rng.integers(0, 50_000, doc).tolist()

  def kv(n):
    return [np.zeros((n, 1, 1), np.float32)]

  tracemalloc.start()
  store.add(document, kv(doc), kv(doc), 0)
  for _ in range(n_questions):
    store.add(document + rng.integers(0, 50_000, q).tolist(), kv(q), kv(q), doc)
  held = tracemalloc.get_traced_memory()[0]
  tracemalloc.stop()
  prompt = document + rng.integers(0, 50_000, q).tolist()
  t0 = time.perf_counter()
  for _ in range(reps):
    seg, n = store.match(prompt)
  assert n == doc
  return dict(questions=n_questions, match_ms=(time.perf_counter() - t0) / reps * 1e3, held_mib=held / 2**20)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--questions", default="100,1000,4000", help="comma-separated counts of stored questions")
  ap.add_argument("--doc", type=int, default=32768, help="document tokens")
  ap.add_argument("--question-tokens", type=int, default=40)
  a = ap.parse_args(argv)
  for n in (int(x) for x in a.questions.split(",")):
    r = measure(n, a.doc, a.question_tokens)
    print(f"{r['questions']:>6} stored questions: match {r['match_ms']:.2f} ms, paths and tokens held "
          f"{r['held_mib']:.0f} MiB", flush=True)


if __name__ == "__main__":
  main()

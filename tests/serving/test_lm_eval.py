"""A standard harness, unchanged, against the server: EleutherAI's `lm_eval --model local-completions` runs tiny
local tasks (tests/serving/lm_eval_task/) through `/v1/completions` of a real server on 127.0.0.1: a generate_until
task, and a multiple_choice (log-likelihood) task.

lm_eval runs as a subprocess, as a user would run it, with no network (HF_*_OFFLINE; the datasets are local JSON-lines
files) and without torch or transformers: the generation task with no tokenizer (`tokenizer_backend=none`,
`tokenized_requests=False`: plain-text prompts), the log-likelihood task with the server's own tokenizer
(`tokenizer_backend=remote`: vLLM's `/tokenizer_info`, `/tokenize`, `/detokenize`) and token-id prompts, scored
with `echo: true, logprobs: 1, max_tokens: 1`."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("aiohttp") is None:
  pytest.skip("lm-eval[api] is not installed (pip install -e '.[test]')", allow_module_level=True)

from tests.helpers.server import MODEL, serving  # noqa: E402

TASK_DIR = pathlib.Path(__file__).parent / "lm_eval_task"
TASK = "rocketkv_smoke"
METRIC = "exact_match,first_word"  # metric,filter as lm_eval names it in the results
N = 8                              # items in lm_eval_task/smoke.jsonl


@pytest.fixture(scope="module")
def lm_served(smollm2):
  with serving(*smollm2, max_new_tokens=32) as s:
    yield s


def _ok_requests(served) -> float:
  return served.metrics().get('rocketkv_requests_total{outcome="ok"}', 0.0)


def _lm_eval(served, tmp_path, task: str, limit: int, tokenizer: list[str]) -> tuple[pathlib.Path, str]:
  """Runs `lm_eval --model local-completions` on a local task against `served`: (output folder, log tail)."""
  out = tmp_path / "out"
  env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
             OPENAI_API_KEY="none", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
  model_args = ",".join([f"base_url=http://127.0.0.1:{served.port}/v1/completions", f"model={MODEL}",
                         "num_concurrent=4", *tokenizer, "max_retries=1", "timeout=120"])
  cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", task, "--include_path", str(TASK_DIR), "--output_path", str(out), "--limit", str(limit),
         "--log_samples"]
  # cwd: the task's `data_files` is relative to the working directory
  p = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=240)
  log = (p.stdout + p.stderr)[-6000:]
  assert p.returncode == 0, log
  return out, log


def test_lm_eval_local_completions(lm_served, tmp_path):
  ok_before = _ok_requests(lm_served)
  out, log = _lm_eval(lm_served, tmp_path, TASK, N, ["tokenizer_backend=none", "tokenized_requests=False"])

  results = sorted(out.rglob("results_*.json"))
  assert len(results) == 1, (results, log)
  r = json.loads(results[0].read_text())
  value = r["results"][TASK][METRIC]
  assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), r["results"]
  assert 0.0 <= value <= 1.0
  assert r["n-samples"][TASK] == {"original": N, "effective": N}

  samples_files = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
  assert len(samples_files) == 1, (samples_files, log)
  samples = [json.loads(line) for line in samples_files[0].read_text().splitlines() if line.strip()]
  assert sorted(s["doc_id"] for s in samples) == list(range(N))
  texts = [s["resps"][0][0] for s in samples]
  assert all(isinstance(t, str) for t in texts), texts
  assert sum(bool(t.strip()) for t in texts) >= N - 1, texts
  # the answers went through our server, one request each, all answered
  assert _ok_requests(lm_served) - ok_before == N
  # a loose sanity check that the prompts reached the model intact: greedy SmolLM2 gets all 8 today
  assert value >= 0.5, [(s["doc"]["prompt"], s["resps"][0][0], s["target"]) for s in samples]


MC_TASK = "rocketkv_mc"
MC_N, MC_CHOICES = 6, 3  # lm_eval_task/mc.jsonl: 6 questions of 3 choices


def test_lm_eval_loglikelihood_multiple_choice(lm_served, tmp_path):
  """A log-likelihood task: one `echo: true, logprobs: 1, max_tokens: 1` request per choice, prompts as token
  ids from the server's tokenizer; each choice's log-likelihood is finite and negative, and greedy SmolLM2 picks
  the obvious answers."""
  ok_before = _ok_requests(lm_served)
  out, log = _lm_eval(lm_served, tmp_path, MC_TASK, MC_N, ["tokenizer_backend=remote", "tokenized_requests=True"])
  (results,) = sorted(out.rglob("results_*.json"))
  r = json.loads(results.read_text())
  acc = r["results"][MC_TASK]["acc,none"]
  assert r["n-samples"][MC_TASK] == {"original": MC_N, "effective": MC_N}
  (samples_file,) = sorted(out.rglob(f"samples_{MC_TASK}_*.jsonl"))
  samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
  assert sorted(s["doc_id"] for s in samples) == list(range(MC_N))
  for s in samples:
    scores = [float(resp[0][0]) for resp in s["resps"]]
    assert len(scores) == MC_CHOICES and all(math.isfinite(x) and x < 0 for x in scores), s["resps"]
  assert _ok_requests(lm_served) - ok_before == MC_N * MC_CHOICES
  assert acc >= 5 / 6, [(s["doc"]["question"], s["resps"], s["target"]) for s in samples]

"""benchmarks/serve_load.py (the HTTP load benchmark, guidellm driving the traffic): the tokenizer folder it hands
guidellm, the run config it writes, the figures it reads back from guidellm's report, the side-by-side table;
then, where guidellm is installed (the `bench` extra; not the suite's `test` one: it brings torch), a tiny doc-qa
run against a `rocketkv serve` it launches itself."""

import importlib.util
import json
import os

import pytest

from benchmarks import serve_load

pytestmark = pytest.mark.xla_opt  # the launched server decodes for many steps: XLA's default optimization (conftest)

# FP8 K/V (the serving recommendation): the server and the record's label carry it
SERVER = ("--model smollm2 --method rocketkv --token-budget 64 --max-prompt-tokens 512 --max-slots 4 "
          "--max-new-tokens 16 --kv-cache-dtype fp8 --no-warmup --log-level warning")


def _has_guidellm() -> bool:
  try:
    serve_load.guidellm_command(None)
    return True
  except RuntimeError:
    return False


def test_metrics_parse_keeps_the_engine_stats():
  text = ("# HELP rocketkv_tokens_generated_total x\n# TYPE rocketkv_tokens_generated_total counter\n"
          "rocketkv_tokens_generated_total 42.0\nrocketkv_tokens_generated_created 1.7e9\n"
          'rocketkv_requests_total{outcome="ok"} 3.0\nrocketkv_active_slots 2.0\nrocketkv_tokens_per_s 3.5\n')
  assert serve_load.parse_metrics(text) == {"tokens_generated": 42, "active_slots": 2, "tokens_per_s": 3.5}


@pytest.mark.parametrize("source", ["smollm2", "random:tiny"])
def test_the_tokenizer_folder_encodes_as_the_project_does(source, tmp_path):
  """The folder guidellm loads as its processor: tokenizer.json gives the project tokenizer's ids, and
  tokenizer_config.json its special tokens and chat template (transformers, where installed, renders it alike)."""
  from tokenizers import Tokenizer

  from rocketkv_jax.models.weights import load_tokenizer
  tok = load_tokenizer(source)  # smollm2: from the GGUF's metadata (about 7 s: gguf's reader), no weights read
  folder = tok.save_hf(str(tmp_path / "tok"))
  assert serve_load.processor_dir(folder, str(tmp_path / "unused")) == folder  # a folder is taken as it is
  if source.startswith("random:"):  # a model source gets a folder written from its tokenizer
    written = serve_load.processor_dir(source, str(tmp_path / "written"))
    assert sorted(os.listdir(written)) == ["tokenizer.json", "tokenizer_config.json"]
  text = "Alice was beginning to get very tired of sitting by her sister on the bank. Ünïcode 42"
  hf = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
  assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text)
  with open(os.path.join(folder, "tokenizer_config.json")) as f:
    cfg = json.load(f)
  assert cfg["chat_template"] == tok.chat_template and cfg["eos_token"] == tok.tokenizer.id_to_token(tok.eos_id)
  assert cfg["add_bos_token"] is bool(tok.add_bos and tok.bos_id is not None)
  if importlib.util.find_spec("transformers") is None:  # the bench extra's; checked by hand with 5.25.0
    return
  from transformers import AutoTokenizer
  auto = AutoTokenizer.from_pretrained(folder)
  assert auto.encode(text, add_special_tokens=False) == tok.encode(text)
  chat = [{"role": "user", "content": "hi"}]
  assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == tok.apply_chat(chat)


def test_each_workload_is_a_guidellm_config(tmp_path):
  args = serve_load.parse_args(["--url", "http://x", "--tiny", "--profile", "poisson", "--rate", "2",
                                "--max-concurrency", "3", "--data", "prompt_tokens_stdev=4"])
  for name, w in serve_load.TINY.items():
    cfg = serve_load.scenario(w, url="http://127.0.0.1:1", model="m", processor="/tok", profile="poisson", rate=2.0,
                              requests=3, duration=None, salt="s-1", seed=0, report=str(tmp_path / "r.json"),
                              args=args)["spec"]
    assert cfg["backend"]["request_format"] == ("/v1/chat/completions" if name == "chat" else "/v1/completions")
    assert cfg["backend"]["extras"]["body"] == {"cache_salt": "s-1", "temperature": 0.0}
    assert cfg["profile"] == {"kind": "poisson", "rate": [2.0], "max_concurrency": 3}
    assert cfg["constraints"] == [{"kind": "max_requests", "count": 3 * w.turns}]  # guidellm counts turns
    data = cfg["data"][0]
    assert (data["prompt_tokens"], data["output_tokens"], data["prompt_tokens_stdev"]) == (
        w.prompt_tokens, w.output_tokens, 4)
    assert data.get("prefix_tokens", 0) == w.prefix_tokens and data.get("turns", 1) == w.turns
    assert cfg["metrics"]["slo"] == {"ttft_ms": 30000.0, "tpot_ms": 1000.0}  # --tiny's CPU bounds
    if importlib.util.find_spec("guidellm"):  # guidellm's own schema takes it, where it is importable here
      from guidellm.schemas.benchmark import BenchmarkScenario
      BenchmarkScenario.model_validate({"spec": cfg})
  # the full-size presets keep their lengths: 8k/2k, a 32k document, 8 turns past 32k, 32k/128
  full = serve_load.WORKLOADS
  assert (full["long-gen"].prompt_tokens, full["long-gen"].output_tokens) == (8192, 2048)
  assert full["doc-qa"].prefix_tokens == 32768 and full["chat"].turns == 8 and full["chat"].max_prompt() > 32768
  assert (full["prefill-heavy"].prompt_tokens, full["prefill-heavy"].output_tokens) == (32768, 128)
  with pytest.raises(SystemExit):
    serve_load.parse_args(["--url", "http://x", "--profile", "poisson"])  # a rate is needed


def _request(ttft_ms, itl_ms, *, ok=True, out=4):
  return {"info": {"conversation_id": "c" * 36, "turn_index": 0, "error": None if ok else "boom"},
          "time_to_first_token_ms": ttft_ms, "inter_token_latency_ms": itl_ms, "request_latency": 1.0,
          "prompt_tokens": 10, "output_tokens": out, "cached_tokens": 5, "request_start_time": 100.0}


def _dist(values):
  return {"successful": {"count": len(values), "mean": sum(values) / len(values),
                         "percentiles": {"p50": values[0], "p90": values[-1], "p99": values[-1]}}}


def test_goodput_counts_the_requests_meeting_both_bounds():
  """guidellm's shape (requests by status, metrics as distributions): percentiles and throughput are its own;
  goodput is counted here, a one-token answer (no ITL) by its TTFT alone."""
  ok = [_request(1000, 10), _request(6000, 10), _request(1000, 200), _request(500, None, out=1)]
  bench = {"duration": 2.0, "requests": {"successful": ok, "errored": [_request(None, None, ok=False)],
                                         "incomplete": [_request(100, None)]},
           "metrics": {"time_to_first_token_ms": _dist([1000, 6000]), "inter_token_latency_ms": _dist([10, 200]),
                       "request_latency": _dist([1.0, 1.0]), "requests_per_second": {"successful": {"mean": 2.0}},
                       "output_tokens_per_second": {"successful": {"mean": 6.5}}, "slo_attainment": 0.5}}
  s = serve_load.summarize(bench, slo_ttft=5.0, slo_tpot=0.05, expected_tokens=4)
  assert (s["requests"], s["requests_ok"], s["requests_failed"], s["requests_incomplete"]) == (6, 4, 1, 1)
  assert s["good_requests"] == 2  # an incomplete request (cut off by --duration) is not good
  assert s["goodput"] == 1.0 and s["request_throughput"] == 2.0 and s["errors"] == {"boom": 1}
  assert (s["ttft_s_p50"], s["ttft_s_p99"], s["tpot_ms_p50"], s["tpot_ms_p99"]) == (1.0, 6.0, 10.0, 200.0)
  assert s["output_tokens_exact"] is False and s["cached_fraction"] == 0.5  # the one-token answer
  assert [q["status"] for q in s["per_request"]] == ["ok"] * 4 + ["errored", "incomplete"]
  assert s["per_request"][0]["start_s"] == 0.0


def test_the_table_puts_methods_side_by_side(capsys):
  from rich.console import Console

  def rec(method, rate, goodput, profile="poisson"):
    return dict(kind="serve_load", method=method, label=method, workload="doc-qa", rate=rate, profile=profile,
                goodput=goodput, good_requests=int(goodput * 10), requests=10, requests_ok=10, ttft_s_p50=1.0,
                ttft_s_p99=2.0, tpot_ms_p50=10.0, tpot_ms_p99=20.0, e2e_s_p50=3.0, e2e_s_p99=4.0,
                request_throughput=goodput, output_tokens_per_s=100.0, engine_stats={"max_slots": 4})
  old = dict(rec("full", None, 0.5), profile=None)  # a record of the earlier client: a burst
  records = [rec("full", 1.0, 0.8), rec("rocketkv", 1.0, 1.6), old, rec("rocketkv", None, 0.5, "synchronous")]
  console = Console(width=240)
  serve_load.print_table(records, console)
  serve_load.compare_table(records, console)
  shown = capsys.readouterr().out
  assert "2.00x" in shown and "rocketkv goodput" in shown and "burst" in shown and "synchronous" in shown


@pytest.mark.slow
@pytest.mark.skipif(not _has_guidellm(), reason="guidellm is not installed (pip install -e '.[bench]')")
def test_tiny_doc_qa_against_a_launched_server(tmp_path, capsys):
  out, log = tmp_path / "load.jsonl", tmp_path / "serve.log"
  rc = serve_load.main(["--tiny", "--workload", "doc-qa", "--profile", "synchronous", "--requests", "2",
                        "--no-warmup-pass", "--out", str(out), "--reports", str(tmp_path / "reports"),
                        "--server-log", str(log), "--launch", SERVER])
  records = serve_load.read_records(str(out))
  assert rc == 0, (records and records[-1].get("errors"), log.read_text()[-3000:])
  (r,) = records
  w = serve_load.TINY["doc-qa"]
  assert r["requests_ok"] == r["requests"] == 2 and r["requests_failed"] == 0
  assert r["ttft_s_p50"] <= r["ttft_s_p99"] and r["tpot_ms_p50"] > 0 and 0 < r["goodput"] <= r["request_throughput"]
  assert r["output_tokens_exact"] is True  # ignore_eos: every answer its full length
  # the primed document served every question from the server's history, under the point's salt
  assert r["prime"]["ok"] and r["prime"]["cached_tokens"] == 0 and r["cache_salt"].endswith("synchronous-0")
  for q in r["per_request"]:
    assert q["prompt_tokens"] >= w.prefix_tokens + w.prompt_tokens - 2 and q["cached_tokens"] >= w.prefix_tokens // 2
  assert r["engine_delta"]["tokens_generated"] >= 2 * w.output_tokens and r["engine_delta"]["prompt_tokens_reused"] > 0
  assert r["engine_stats"]["max_slots"] == 4 and r["label"] == "rocketkv[kv_cache_dtype=float8_e4m3fn]"
  assert os.path.exists(r["guidellm_report"])
  capsys.readouterr()
  assert serve_load.main(["--table", str(out)]) == 0
  assert "doc-qa" in capsys.readouterr().out

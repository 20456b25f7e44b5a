"""benchmarks/serve_load.py (the HTTP load benchmark) in its --tiny mode against a real `rocketkv serve` (the
embedded SmolLM2, launched by the benchmark itself on a free port): doc-qa and chat, a handful of requests,
and the records it writes checked; then --table and --plot over the file."""

import json
import math
import random

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")

from benchmarks import serve_load  # noqa: E402

pytestmark = pytest.mark.xla_opt  # many decode steps: run with XLA's default optimization (conftest)

# FP8 K/V (the serving recommendation): the server, its sessions and the record's label carry it
SERVER = ("--model smollm2 --method rocketkv --token-budget 64 --max-prompt-tokens 512 --max-slots 4 "
          "--max-new-tokens 16 --kv-cache-dtype fp8 --no-warmup --log-level warning")


def test_percentile_matches_linear_interpolation():
  np = pytest.importorskip("numpy")
  rng = random.Random(0)
  for n in (1, 2, 3, 10, 101):
    xs = [rng.random() for _ in range(n)]
    for q in (0, 50, 90, 99, 100):
      assert math.isclose(serve_load.percentile(xs, q), float(np.percentile(xs, q)), rel_tol=1e-12)
  assert serve_load.percentile([], 50) is None


def test_summary_goodput_counts_requests_meeting_both_bounds():
  def req(ttft, tpot, ok=True):
    return dict(ok=ok, error=None if ok else "x", ttft_s=ttft, tpot_s=tpot, e2e_s=(ttft or 0) + 1, prompt_tokens=10,
                output_tokens=4, cached_tokens=0, expected_tokens=4)
  rs = [req(1.0, 0.01), req(6.0, 0.01), req(1.0, 0.2), req(None, None, ok=False), req(0.5, None)]
  s = serve_load.summarize(rs, 2.0, slo_ttft=5.0, slo_tpot=0.05)
  assert (s["requests"], s["requests_ok"], s["requests_failed"], s["good_requests"]) == (5, 4, 1, 2)
  assert s["goodput"] == 1.0 and s["request_throughput"] == 2.0 and s["errors"] == {"x": 1}
  assert s["output_tokens_exact"] is True and s["output_tokens_per_s"] == 8.0


def test_metrics_parse_keeps_the_engine_stats():
  text = ("# HELP rocketkv_tokens_generated_total x\n# TYPE rocketkv_tokens_generated_total counter\n"
          "rocketkv_tokens_generated_total 42.0\nrocketkv_tokens_generated_created 1.7e9\n"
          'rocketkv_requests_total{outcome="ok"} 3.0\nrocketkv_active_slots 2.0\nrocketkv_tokens_per_s 3.5\n')
  assert serve_load.parse_metrics(text) == {"tokens_generated": 42, "active_slots": 2, "tokens_per_s": 3.5}


def test_plot_takes_a_repeated_point(tmp_path):
  """Two records of one method at one rate (a rerun in the same file) plot in run order; they once raised
  TypeError (records compared as dicts)."""
  pytest.importorskip("matplotlib")
  rec = dict(workload="prefill-heavy", method="rocketkv", rate=0.1, ttft_s_p50=3.9, ttft_s_p99=4.1, tpot_ms_p50=11.0,
             tpot_ms_p99=11.1, goodput=0.08, request_throughput=0.08, slo_ttft_s=5.0, slo_tpot_s=0.05,
             rate_unit="requests/s")
  serve_load.plot([rec, dict(rec, ttft_s_p50=2.8, ttft_s_p99=2.9)], str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 0


def test_tiny_load_against_a_launched_server(tmp_path, capsys):
  out, png, log = tmp_path / "load.jsonl", tmp_path / "load.png", tmp_path / "serve.log"
  rc = serve_load.main(["--tiny", "--workload", "doc-qa,chat", "--requests", "3", "--rate", "8", "--seed", "1",
                        "--out", str(out), "--plot", str(png), "--server-log", str(log), "--launch", SERVER])
  records = serve_load.read_records(str(out))
  assert rc == 0, (records and records[-1].get("errors"), log.read_text()[-3000:])
  assert [r["workload"] for r in records] == ["doc-qa", "chat"]
  for r in records:
    name = r["workload"]
    spec = serve_load.TINY[name]
    reqs = r["per_request"]
    # every request succeeded, and the point counted them
    assert r["requests_failed"] == 0 and r["requests_ok"] == r["requests"] == len(reqs), r["errors"]
    assert all(q["ok"] and q["error"] is None for q in reqs)
    assert r["requests"] == (3 * spec.turns if name == "chat" else 3)
    # percentiles ordered, goodput within throughput
    for key in ("ttft_s", "tpot_ms", "e2e_s"):
      assert r[f"{key}_p50"] is not None and r[f"{key}_p50"] <= r[f"{key}_p90"] <= r[f"{key}_p99"], (name, key)
    assert 0 <= r["goodput"] <= r["request_throughput"] and r["good_requests"] <= r["requests_ok"]
    assert (r["slo_ttft_s"], r["slo_tpot_s"]) == (30.0, 1.0)  # --tiny's CPU bounds
    good = [q for q in reqs if q["ttft_s"] <= r["slo_ttft_s"] and q["tpot_s"] <= r["slo_tpot_s"]]
    assert r["good_requests"] == len(good) and math.isclose(r["goodput"], len(good) / r["wall_s"], rel_tol=1e-2)
    assert r["output_tokens_per_s"] > 0 and r["wall_s"] > 0
    for q in reqs:
      assert 0 < q["ttft_s"] <= q["e2e_s"] and q["tpot_s"] > 0 and 0 <= q["max_gap_s"] <= q["e2e_s"]
    # ignore_eos forced every answer to its full length
    assert r["ignore_eos"] and r["output_tokens_exact"] is True
    assert all(q["output_tokens"] == spec.output_tokens == q["expected_tokens"] for q in reqs)
    assert all(q["finish_reason"] == "length" for q in reqs)
    # the record says what served it
    assert r["method"] == "rocketkv" and r["token_budget"] == 64 and r["served_model"] == "smollm2"
    assert r["kv_cache_dtype"] == "float8_e4m3fn" and r["label"] == "rocketkv[kv_cache_dtype=float8_e4m3fn]"
    assert r["server_version"]["version"] and r["server_models"]["data"][0]["id"] == "smollm2"
    assert r["engine_stats"]["max_slots"] == 4 and r["engine_stats"]["engine_alive"] == 1
    assert r["engine_delta"]["tokens_generated"] >= sum(q["output_tokens"] for q in reqs)
    assert r["engine_delta"]["prompt_tokens_reused"] > 0
  doc, chat = records
  # doc-qa: the priming request prefilled the document; every question then reused it through the server
  assert doc["prime"]["ok"] and doc["prime"]["prompt_tokens"] == serve_load.TINY["doc-qa"].doc_tokens
  assert doc["prime"]["cached_tokens"] == 0
  for q in doc["per_request"]:
    assert q["prompt_tokens"] > serve_load.TINY["doc-qa"].doc_tokens
    assert q["cached_tokens"] >= serve_load.TINY["doc-qa"].doc_tokens // 2, q
  assert len({q["prompt_tokens"] for q in doc["per_request"]}) >= 2  # different questions
  # chat: each session's history grows, and each later turn reuses the earlier turns' K/V
  for s in range(3):
    turns = sorted((q for q in chat["per_request"] if q["session"] == s), key=lambda q: q["turn"])
    assert [q["turn"] for q in turns] == list(range(serve_load.TINY["chat"].turns))
    for prev, q in zip(turns, turns[1:]):
      assert q["prompt_tokens"] > prev["prompt_tokens"] + prev["output_tokens"]
      assert q["cached_tokens"] >= prev["prompt_tokens"] // 2, (prev, q)
  assert png.stat().st_size > 10_000
  capsys.readouterr()
  # the side-by-side table reads the file back
  assert serve_load.main(["--table", str(out)]) == 0
  shown = capsys.readouterr().out
  assert "doc-qa" in shown and "chat" in shown and "rocketkv goodput" in shown
  json.dumps(records)  # records are plain JSON

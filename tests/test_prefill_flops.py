"""benchmarks/prefill_flops.py on the toy model: it runs, counts FLOPs as documented and times both prefills."""

import json

from benchmarks import prefill_flops
from benchmarks.decode import TINY


def test_prefill_flops_tiny(tmp_path):
  out = tmp_path / "p.jsonl"
  prefill_flops.main(["--tiny", "--contexts", "256", "--chunk-tokens", "96", "--reps", "1", "--out", str(out)])
  (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert rec["status"] == "ok" and rec["prefill_s"] > 0 and rec["chunked_prefill_s"] > 0
  c = TINY
  per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim + 3 * c.dim * c.ffn_dim
  want = 2 * 256 * per_layer * c.n_layers + 2 * 256 ** 2 * c.n_heads * c.head_dim * c.n_layers + 2 * c.dim * c.vocab_size
  assert prefill_flops.prefill_flops(c, 256) == want
  assert rec["of_matmul"] > 0
  assert abs(rec["chunked_of_whole"] - rec["chunked_prefill_s"] / rec["prefill_s"]) < 0.01 * rec["chunked_of_whole"] + 1e-3

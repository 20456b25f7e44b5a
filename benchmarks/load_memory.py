"""Peak host memory while loading a Llama-3.1-8B-shaped bf16 safetensors checkpoint (`load` streams it).

Writes a checkpoint with the 8B's shapes (dim 4096, 32 query / 8 KV heads, MLP 14336, vocab 128256, untied
head) and `--layers` layers (default 32: the whole 8B, 16 GB) as HF-style shards of about 2 GB, then loads it
in a fresh subprocess per dtype and reports its peak resident memory (ru_maxrss) against the model's own bytes
and the largest single tensor. On a CPU the model's bytes live in host memory, so the overhead is what the
load adds on top; on a GPU they do not count at all.

  python -m benchmarks.load_memory --layers 4 --out benchmarks/results/load_memory_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPE = dict(vocab=128256, dim=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)


def write_checkpoint(d: str, layers: int, shard_bytes: int = 2 << 30) -> int:
  """An 8B-shaped bf16 checkpoint of random bits in shards; returns its bytes."""
  import ml_dtypes
  from safetensors.numpy import save_file
  s = SHAPE
  D, N, K, H, F, V = s["dim"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"], s["vocab"]
  tensors = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
  for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
                    p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                    p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                    p + "mlp.down_proj.weight": (D, F)})
  rng = np.random.default_rng(0)
  shards, cur, size = [], {}, 0
  for name, shape in tensors.items():
    cur[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    size += cur[name].nbytes
    if size >= shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
  if cur:
    shards.append(cur)
  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(d, fn))
    weight_map.update({n: fn for n in shard})
    total += sum(x.nbytes for x in shard.values())
  json.dump({"weight_map": weight_map}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
  json.dump(dict(model_type="llama", vocab_size=V, hidden_size=D, num_hidden_layers=layers, num_attention_heads=N,
                 num_key_value_heads=K, intermediate_size=F, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, max_position_embeddings=131072, torch_dtype="bfloat16"),
            open(os.path.join(d, "config.json"), "w"))
  from rocketkv_jax.models.tokenizer import tokenizer_from_gguf_metadata
  tokenizer_from_gguf_metadata(["a", "b", "c"], [1, 1, 1], [], "default").save(os.path.join(d, "tokenizer.json"))
  return total


def peak_rss() -> int:
  """This process's peak resident bytes (VmHWM: ru_maxrss survives exec, so a child would report its parent's)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path: str, dtype: str) -> None:
  """Loads and prints one JSON line: peak RSS before and after, the model's bytes, the time."""
  import jax
  from rocketkv_jax.models import load
  jax.devices()
  before = peak_rss()
  t = time.perf_counter()
  model, _ = load(path, dtype=dtype)
  leaves = jax.tree.leaves(__import__("flax").nnx.state(model))
  jax.block_until_ready(leaves)
  secs = time.perf_counter() - t
  print(json.dumps(dict(dtype=dtype, peak_rss_before=before, peak_rss=peak_rss(), model_bytes=int(sum(x.nbytes for x in leaves)),
      device=jax.devices()[0].device_kind, load_s=round(secs, 2))))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=int, default=32)
  ap.add_argument("--dtypes", default="auto")
  ap.add_argument("--dir", default=None, help="write the checkpoint here (default: a temp folder, removed)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    return child(*args.child)
  tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="ckpt8b-")
  d = args.dir or tmp.name
  os.makedirs(d, exist_ok=True)
  t = time.perf_counter()
  ckpt = write_checkpoint(d, args.layers)
  print(f"wrote {ckpt / 2**30:.2f} GiB in {time.perf_counter() - t:.0f}s", file=sys.stderr)
  V, D = SHAPE["vocab"], SHAPE["dim"]
  largest = V * D * 2
  rows = []
  for dtype in args.dtypes.split(","):
    out = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--child", d, dtype], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    r.update(kind="load_memory", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             layers=args.layers, checkpoint_bytes=ckpt, largest_tensor_bytes=largest,
             overhead_bytes=r["peak_rss"] - r["model_bytes"], argv=["python", "-m", "benchmarks.load_memory"] + (argv or sys.argv[1:]))
    rows.append(r)
    print(json.dumps(r))
    print(f"{dtype}: peak RSS {r['peak_rss'] / 2**30:.2f} GiB for a model of {r['model_bytes'] / 2**30:.2f} GiB "
          f"on {r['device']}: {r['overhead_bytes'] / 2**30:.2f} GiB beyond it (largest tensor "
          f"{largest / 2**30:.2f} GiB)", file=sys.stderr)
  if args.out:
    with open(args.out, "a") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
  if tmp:
    tmp.cleanup()
  return rows


if __name__ == "__main__":
  main()

"""Reading jax.profiler traces without TensorBoard: per-op device time from the xplane.pb."""
from __future__ import annotations

import collections
import glob
import os


def latest_xplane(trace_dir: str) -> str:
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
  return max(files, key=os.path.getmtime)


def device_op_times(trace_dir: str) -> dict[str, tuple[float, int]]:
  """{op or kernel name: (total microseconds, count)} over the GPU planes of the newest trace.

  Uses the "XLA Ops" line where the plane has one (one event per HLO op / Pallas call, named as in
  the HLO or by `pallas_call(name=...)`), else every stream line. On CPU, the host XLA threads.
  """
  from jax.profiler import ProfileData
  data = ProfileData.from_file(latest_xplane(trace_dir))
  totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  gpu_planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
  for plane in gpu_planes or [p for p in data.planes if p.name == "/host:CPU"]:
    lines = list(plane.lines)
    chosen = [l for l in lines if l.name == "XLA Ops"] or (
        [l for l in lines if l.name.startswith("Stream")] if gpu_planes else
        [l for l in lines if "XLA" in l.name and "Eigen" not in l.name])
    for line in chosen:
      for ev in line.events:
        if ev.name.startswith(("ThreadpoolListener", "end: ")):
          continue
        t = totals[ev.name]
        t[0] += ev.duration_ns / 1e3
        t[1] += 1
  return {k: (v[0], v[1]) for k, v in totals.items()}


def top_ops(trace_dir: str, n: int = 15, steps: int = 1) -> list[dict]:
  """The n ops with the most device time, per decode step (divide by `steps` traced)."""
  times = device_op_times(trace_dir)
  total = sum(t for t, _ in times.values()) or 1.0
  rows = sorted(times.items(), key=lambda kv: -kv[1][0])[:n]
  return [dict(op=name, us_per_step=round(t / steps, 2), calls_per_step=round(c / steps, 1),
               share=round(t / total, 4)) for name, (t, c) in rows]


def op_group(name: str) -> str:
  """The group an op of a decode trace belongs to: "matmul" (XLA's GEMM fusions, cuBLAS's kernels: nvjet_*,
  cublasLt's split-K reduce), a Pallas kernel's own name (`pallas_call(name="rocketkv_...")`), "copy" (memcpy /
  copy ops) or "other" (XLA's elementwise, reduce, scatter and concatenate fusions)."""
  low = name.lower()
  if low.startswith("rocketkv_"):
    return name
  if any(s in low for s in ("gemm", "cublas", "nvjet", "cutlass", "xmma", "_dot_")) or low.startswith("dot"):
    return "matmul"
  if low.startswith(("memcpy", "copy")):
    return "copy"
  return "other"


def group_times(times) -> dict[str, float]:
  """(op name, microseconds) pairs summed by `op_group`, largest first, with their sum under "total"."""
  groups: dict[str, float] = collections.defaultdict(float)
  for name, us in times:
    groups[op_group(name)] += us
  out = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
  out["total"] = sum(groups.values())
  return out


def op_groups(trace_dir: str, steps: int = 1) -> dict[str, float]:
  """Device microseconds per decode step by `op_group` (`group_times`, to 0.1 us): where a step's time goes (the
  weights' matmuls against each kernel), over every op of the trace, not only the top."""
  times = group_times((name, t / steps) for name, (t, _) in device_op_times(trace_dir).items())
  return {k: round(v, 1) for k, v in times.items()}

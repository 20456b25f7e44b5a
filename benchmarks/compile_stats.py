"""Where the CPU test suite's time goes in XLA (issue 38): a pytest plugin that counts, per test module, the compile
requests JAX makes (persistent-cache hits apart) and the seconds spent tracing, lowering and compiling, by program
name; and a report over a run's files (one per process: each xdist worker writes its own).

The suite is compile-bound: on 2 cores, 2026-12-06, the first part's in-process work compiled 8,299 programs in
790 s of backend compile (plus 111 s lowering, 83 s tracing) of about 1,470 worker-seconds; 6,130 of those programs
were single eager ops, 166 s (a `jnp` call or a `jax.random` draw on a shape not seen before, 20-110 ms each;
`benchmarks/results/suite_compiles_cpu_2026-12-06.txt`). Servers, CLIs and the multi-device runs that tests start
in subprocesses are not counted (their processes load no plugin).

  python -m pytest -n 2 --dist loadfile -p benchmarks.compile_stats -m "not gpu and not xla_opt"   # writes the files
  python -m benchmarks.compile_stats [DIR] [--top 40]                                              # the tables

$COMPILE_STATS_DIR (default /tmp/compile_stats) holds the files; a run's plugin clears nothing, so start from an
empty folder. JAX records a compile request's seconds whether XLA compiled or the persistent compile cache answered
(a hit costs about 2 ms): the tables count the hits apart. Run with $ROCKETKV_TEST_JAX_CACHE set to an empty
folder (or "off") to see a cold run.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import os
import re
import sys

DIR_ENV = "COMPILE_STATS_DIR"
DEFAULT_DIR = "/tmp/compile_stats"
# JAX's monitoring events (seconds) the plugin sums per module
EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/jaxpr_trace_duration": "trace"}
HIT_EVENT = "/jax/compilation_cache/cache_hits"  # counted as kind "hits"
_FINISHED = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.e+-]+) sec")

_module = [None]  # the test module running now
_events = collections.defaultdict(lambda: [0, 0.0])    # (module, kind) -> [count, seconds]
_programs = collections.defaultdict(lambda: [0, 0.0])  # (module, program name) -> [count, seconds]


class _CompileLog(logging.Handler):
  """JAX's "Finished XLA compilation of NAME in T sec" lines (jax_log_compiles), by program name."""

  def emit(self, record):
    m = _FINISHED.search(record.getMessage())
    if m:
      entry = _programs[(_module[0], m.group(1))]
      entry[0] += 1
      entry[1] += float(m.group(2))


def _on_duration(event: str, duration: float, **_):
  kind = EVENTS.get(event)
  if kind:
    entry = _events[(_module[0], kind)]
    entry[0] += 1
    entry[1] += duration


def _on_event(event: str, **_):
  if event == HIT_EVENT:
    _events[(_module[0], "hits")][0] += 1


def pytest_configure(config):
  import jax
  from jax import monitoring
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)
  handler = _CompileLog(logging.DEBUG)
  logging.getLogger("jax").addHandler(handler)  # one handler on the root of JAX's loggers: each line counted once
  jax.config.update("jax_log_compiles", True)


def pytest_runtest_setup(item):
  _module[0] = item.nodeid.split("::")[0]


def pytest_sessionfinish(session):
  out = os.environ.get(DIR_ENV, DEFAULT_DIR)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"compile_stats.{os.getpid()}.json"), "w") as f:
    json.dump({"events": [[m, k, n, s] for (m, k), (n, s) in _events.items()],
               "programs": [[m, p, n, s] for (m, p), (n, s) in _programs.items()]}, f)


def is_eager(name: str) -> bool:
  """A program JAX compiled for one eager op: `jit(<primitive>)`, or a jnp / jax.random function JAX jits
  internally (`jit(_where)`, `jit(_normal)`)."""
  inner = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
  return inner in _PRIMITIVES or inner in _JNP_INTERNALS


_PRIMITIVES = set("""abs add and argmax argmin bitcast_convert_type broadcast_in_dim clamp concatenate
convert_element_type copy cos cumsum dynamic_slice dynamic_update_slice eq equal exp floor gather ge greater gt
integer_pow iota le less log lt max min mul multiply ne negative not not_equal or pad pow reduce_max reduce_min
reduce_sum reshape rsqrt scatter select_n sign sin sort sqrt squeeze stack sub subtract tanh top_k transpose
true_divide unstack xla_select""".split())
_JNP_INTERNALS = set("""_where _normal _uniform _randint _threefry_split _threefry_seed _reduce_sum _reduce_max
_reduce_min _einsum _pad _take _cumsum _mean _var _argmax _argmin _sort _clip _roll _gather""".split())


def load(folder: str) -> dict:
  """Every process's file in `folder`, summed: {"events": {(module, kind): [n, s]}, "programs": {(module, name):
  [n, s]}}."""
  files = sorted(glob.glob(os.path.join(folder, "compile_stats.*.json")))
  if not files:
    raise SystemExit(f"no compile_stats.*.json in {folder!r}: run pytest with -p benchmarks.compile_stats first")
  events, programs = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
  for path in files:
    with open(path) as f:
      d = json.load(f)
    for table, rows in ((events, d["events"]), (programs, d["programs"])):
      for m, k, n, s in rows:
        table[(m, k)][0] += n
        table[(m, k)][1] += s
  return {"events": dict(events), "programs": dict(programs)}


def report(stats: dict, top: int = 30) -> str:
  ev, pr = stats["events"], stats["programs"]
  lines = []
  totals = collections.defaultdict(lambda: [0, 0.0])
  for (_, kind), (n, s) in ev.items():
    totals[kind][0] += n
    totals[kind][1] += s
  lines.append("seconds  count  what (all modules)")
  for kind in ("compile", "lower", "trace"):
    n, s = totals.get(kind, (0, 0.0))
    lines.append(f"{s:7.1f} {n:6d}  {kind}" + (" requests" if kind == "compile" else ""))
  lines.append(f"{'':7} {totals.get('hits', (0, 0.0))[0]:6d}  of which persistent-cache hits")
  eager = [(n, s) for (_, p), (n, s) in pr.items() if is_eager(p)]
  lines.append(f"{sum(s for _, s in eager):7.1f} {sum(n for n, _ in eager):6d}  of which single eager ops "
               "(compile log)")
  by_name = collections.defaultdict(lambda: [0, 0.0])
  for (_, p), (n, s) in pr.items():
    by_name[p][0] += n
    by_name[p][1] += s
  lines += ["", f"seconds  count  program (compile requests by name, from the compile log; top {top})"]
  lines += [f"{s:7.1f} {n:6d}  {p}" for p, (n, s) in sorted(by_name.items(), key=lambda x: -x[1][1])[:top]]
  by_module = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])  # requests, compile s, lower s, trace s, hits
  column = {"compile": 1, "lower": 2, "trace": 3}
  for (m, kind), (n, s) in ev.items():
    row = by_module[m]
    if kind == "hits":
      row[4] += n
    else:
      row[column[kind]] += s
      row[0] += n if kind == "compile" else 0
  lines += ["", f"compile s  requests  cache hits  lower s  trace s  module (top {top})"]
  lines += [f"{c:9.1f} {n:9d} {h:11d} {lo:8.1f} {tr:8.1f}  {m}"
            for m, (n, c, lo, tr, h) in sorted(by_module.items(), key=lambda x: -x[1][1])[:top]]
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("dir", nargs="?", default=os.environ.get(DIR_ENV, DEFAULT_DIR),
                  help="the folder the plugin wrote to ($COMPILE_STATS_DIR, default %(default)s)")
  ap.add_argument("--top", type=int, default=30, help="rows per table")
  args = ap.parse_args(argv)
  print(report(load(args.dir), args.top))


if __name__ == "__main__":
  sys.exit(main())

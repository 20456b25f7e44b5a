"""`benchmarks/compile_stats.py`: the plugin counts a module's compiled programs by name, and the report reads them."""
import os
import subprocess
import sys

from benchmarks.compile_stats import is_eager, load, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plugin_counts_a_modules_programs(tmp_path):
  (tmp_path / "test_toy.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def test_one():\n"
      "  f = jax.jit(lambda x: x * 2 + 1)\n"
      "  assert float(f(jnp.float32(1))) == 3.0\n"
      "  assert float(jnp.where(jnp.ones(3) > 0, 1.0, 0.0).sum()) == 3.0\n")
  out = tmp_path / "stats"
  env = dict(os.environ, COMPILE_STATS_DIR=str(out), PYTHONPATH=ROOT, JAX_ENABLE_COMPILATION_CACHE="false")
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.compile_stats", "-p", "no:cacheprovider",
                      str(tmp_path / "test_toy.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  stats = load(str(out))
  mod = "test_toy.py"
  names = {p: n for (m, p), (n, s) in stats["programs"].items() if m == mod}
  assert names.get("jit(<lambda>)") == 1, names
  assert any(is_eager(p) for p in names), names
  n_compiled, seconds = stats["events"][(mod, "compile")]
  assert n_compiled == sum(names.values()) and seconds > 0
  assert (mod, "hits") not in stats["events"]
  text = report(stats)
  assert "jit(<lambda>)" in text and mod in text and "single eager ops" in text


def test_persistent_cache_hits_are_counted_apart(tmp_path):
  """A request the persistent compile cache answers is still a compile request to JAX (its seconds recorded): the
  plugin counts it as a hit."""
  (tmp_path / "test_toy.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def test_one():\n"
      "  x = jnp.ones(3)\n"
      "  f = lambda x: x * 2 + 1\n"
      "  jax.jit(f)(x).block_until_ready()\n"
      "  jax.clear_caches()\n"
      "  assert float(jax.jit(f)(x)[0]) == 3.0\n")
  out = tmp_path / "stats"
  env = dict(os.environ, COMPILE_STATS_DIR=str(out), PYTHONPATH=ROOT,
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.compile_stats", "-p", "no:cacheprovider",
                      str(tmp_path / "test_toy.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  stats = load(str(out))
  assert stats["events"][("test_toy.py", "hits")][0] == 1, stats["events"]
  names = {p: n for (m, p), (n, s) in stats["programs"].items() if m == "test_toy.py"}
  assert names.get("jit(<lambda>)") == 2, names  # requested twice: compiled once, then answered by the cache
  assert "persistent-cache hits" in report(stats)


def test_eager_names():
  assert is_eager("jit(broadcast_in_dim)") and is_eager("jit(_where)") and is_eager("jit(_normal)")
  assert not is_eager("jit(_decode_jit)") and not is_eager("jit(decode_loop_jit)") and not is_eager("jit(<lambda>)")

"""Where the package comes from: a plain checkout on sys.path (nothing installed) imports the kernels and the
model from the repository's top-level `kernels/` and `models/`; a wheel built from the checkout carries them
inside the package, with the accuracy suite's data, and `rocketkv eval` runs from it. Each check runs in a fresh
Python with this environment's editable install of the project taken out of the import system, so only the
checkout, or only the wheel, can answer."""
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run first in the child: drop the editable install's finders and path hooks (and the checkout, when it is on the
# path), then put SOURCE first on sys.path.
ISOLATE = textwrap.dedent("""
    import sys
    sys.path = [p for p in sys.path if p and p.rstrip("/") != {root!r}]
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path_hooks = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
    sys.path_importer_cache.clear()
    sys.path.insert(0, {source!r})
    """)


def _run(source: pathlib.Path, body: str, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
  code = ISOLATE.format(root=str(ROOT), source=str(source)) + textwrap.dedent(body)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)


def test_a_plain_checkout_imports_the_kernels_and_the_model(tmp_path):
  r = _run(ROOT, """
      import rocketkv_jax, rocketkv_jax.kernels.cache_append as ca, rocketkv_jax.models as m
      from rocketkv_jax.models import generate, load
      from rocketkv_jax.serving import Engine
      import importlib.util
      print(rocketkv_jax.__file__, ca.__file__, m.__file__, importlib.util.find_spec("rocketkv_jax.tests"))
      """, cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  pkg, kernel, model, tests = r.stdout.split()
  assert pkg == str(ROOT / "rocketkv_jax" / "__init__.py")
  assert kernel == str(ROOT / "kernels" / "cache_append.py") and model == str(ROOT / "models" / "__init__.py")
  assert tests == "None"  # only the two top-level folders are mapped into the package


def test_a_built_wheel_carries_the_package_and_runs_eval(tmp_path):
  src, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
  # a copy of what the wheel is built from, so that setuptools' build/ and egg-info stay out of the checkout
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy2(ROOT / name, src / name)
  for name in ("rocketkv_jax", "kernels", "models"):
    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
  build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(wheels), str(src)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stderr[-3000:]
  # the data folders are packages of their own in pyproject.toml, so setuptools has no "Package would be ignored"
  assert "would be ignored" not in build.stdout + build.stderr, (build.stdout + build.stderr)[-3000:]
  (wheel,) = wheels.glob("rocketkv_jax-*.whl")
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(n for n in names if "dist-info" in n)
  assert "rocketkv_jax/models/data/alice_chapter1.txt" in names and "rocketkv_jax/eval/data/SOURCES.txt" in names
  inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                         str(wheel)], capture_output=True, text=True, timeout=300)
  assert inst.returncode == 0, inst.stderr[-3000:]
  for sub in ("kernels/cache_append.py", "models/llama.py", "eval/runner.py", "serving/cli.py"):
    assert (target / "rocketkv_jax" / sub).is_file(), sub
  r = _run(target, """
      import rocketkv_jax, rocketkv_jax.kernels, rocketkv_jax.models
      from rocketkv_jax.eval import tasks
      print(rocketkv_jax.__file__, rocketkv_jax.kernels.__file__, rocketkv_jax.models.__file__,
            len(tasks.haystack_files()), flush=True)
      from rocketkv_jax.serving.cli import main
      sys.argv = ["rocketkv", "eval", "--help"]
      main()
      """, cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  first, _, usage = r.stdout.partition("\n")
  pkg, kernels, models, n_files = first.split()
  inside = str(target / "rocketkv_jax")
  assert pkg.startswith(inside) and kernels.startswith(inside) and models.startswith(inside), first
  assert int(n_files) >= 1
  assert "--contexts" in usage and "--methods" in usage, usage[-2000:]

"""The accuracy suite ships in the wheel (`rocketkv eval` runs from an installed package): pyproject names
rocketkv_jax.eval among the packages, and its package data covers every file of the haystack folder."""
import fnmatch
import pathlib
import tomllib

from rocketkv_jax.eval import tasks as T

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_suite_and_its_haystack_are_in_the_wheel():
  tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
  assert "rocketkv_jax.eval" in tool["packages"]
  patterns = tool["package-data"]["rocketkv_jax.eval"]
  data = pathlib.Path(T.DATA_DIR)
  files = sorted(p.relative_to(data.parent).as_posix() for p in data.iterdir())
  assert len(files) >= 2 and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), files
  assert T.haystack_files() and all((data / f).is_file() for f in T.haystack_files())

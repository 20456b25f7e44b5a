"""The accuracy suite ships in the wheel (`rocketkv eval` runs from an installed package): pyproject names
rocketkv_jax.eval and its data folder (rocketkv_jax.eval.data) among the packages, and the data folder's package data
covers every file of the haystack folder."""
import fnmatch
import pathlib
import tomllib

from rocketkv_jax.eval import tasks as T

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_suite_and_its_haystack_are_in_the_wheel():
  tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
  assert {"rocketkv_jax.eval", "rocketkv_jax.eval.data"} <= set(tool["packages"])
  patterns = tool["package-data"]["rocketkv_jax.eval.data"]
  data = pathlib.Path(T.DATA_DIR)
  assert data.name == "data" and data.parent.name == "eval", data
  files = sorted(p.name for p in data.iterdir() if p.name != "__pycache__")
  assert len(files) >= 2 and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), files
  assert T.haystack_files() and all((data / f).is_file() for f in T.haystack_files())

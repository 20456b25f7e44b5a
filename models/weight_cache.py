"""The converted-weights cache: a GGUF's converted weights saved with orbax (one checkpoint per layer), since
dequantizing is slow, under `default_cache_dir()` keyed by the source's path, size and mtime (`cache_key`).

A cache folder is checked against its manifest (size and sha256 of every file) on each load (`verify_cache`)
and rebuilt from the source when it fails (`CacheIntegrityWarning`); temp folders of killed saves are removed
(`remove_stale_temps`).
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time

import numpy as np

from . import catalog
from .llama import LlamaConfig
from .tokenizer import TextTokenizer

CACHE_FORMAT = 2  # 2: the module's fused layout (wqkv, w_gate_up), one orbax checkpoint per layer


default_cache_dir = catalog.default_cache_dir  # $ROCKETKV_CACHE, else ~/.cache/rocketkv_jax


def cache_key(path: str, dtype_name: str) -> str:
  paths = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*")))
  h = hashlib.sha256(f"v{CACHE_FORMAT}|{dtype_name}".encode())
  for p in paths:
    st = os.stat(p)
    h.update(f"|{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
  base = os.path.basename(os.path.normpath(path)).replace(".", "_")
  return f"{base}-{dtype_name}-{h.hexdigest()[:16]}"


# A cache folder holds config.json, the tokenizer files, params/ (orbax) and MANIFEST: every other file's
# size and sha256, checked on each load; a save writes into "<key>.tmp<pid>-<random>" (OWNER inside says
# which process), renamed to "<key>" when complete.
MANIFEST = "manifest.json"
OWNER = "owner.json"
STALE_TMP_S = 3600.0  # a temp folder untouched this long whose owner cannot be checked is stale
_TMP_NAME = re.compile(r"^.+-[0-9a-f]{16}\.tmp(?P<pid>\d+)(?:-[0-9a-f]+)?$")


class CacheIntegrityWarning(UserWarning):
  """A converted-weights cache failed its check (damaged, edited, incomplete or unreadable); it is rebuilt."""


def _cache_files(dirname: str) -> list[str]:
  """Every file under dirname ("/"-separated relative paths), less the manifest and the owner record."""
  out = []
  for root, _, files in os.walk(dirname):
    for fn in files:
      rel = os.path.relpath(os.path.join(root, fn), dirname).replace(os.sep, "/")
      if rel not in (MANIFEST, OWNER):
        out.append(rel)
  return sorted(out)


def _digests(dirname: str, rels) -> dict:
  """{rel: sha256} over threads (hashlib releases the GIL on large blocks)."""
  rels = list(rels)
  workers = max(1, min(8, os.cpu_count() or 1, len(rels)))
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    return dict(zip(rels, ex.map(lambda r: catalog.sha256_file(os.path.join(dirname, r)), rels)))


def _write_manifest(dirname: str) -> None:
  rels = _cache_files(dirname)
  digests = _digests(dirname, rels)
  files = {r: {"size": os.path.getsize(os.path.join(dirname, r)), "sha256": digests[r]} for r in rels}
  with open(os.path.join(dirname, MANIFEST), "w") as f:
    json.dump({"format": CACHE_FORMAT, "files": files}, f, indent=0)


def verify_cache(dirname: str) -> list[str]:
  """What is wrong with a cache folder against its manifest (empty: intact): missing, unexpected,
  resized or changed files, or a missing or unreadable manifest."""
  mpath = os.path.join(dirname, MANIFEST)
  if not os.path.isfile(mpath):
    return [f"no {MANIFEST} (an older version's cache, or an incomplete one)"]
  try:
    with open(mpath) as f:
      manifest = json.load(f)
    if manifest.get("format") != CACHE_FORMAT:
      return [f"{MANIFEST} is for cache format {manifest.get('format')!r}, expected {CACHE_FORMAT}"]
    want = {str(r): (int(e["size"]), str(e["sha256"])) for r, e in manifest["files"].items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    return [f"{MANIFEST} is unreadable: {type(e).__name__}: {e}"]
  have = set(_cache_files(dirname))
  problems = [f"{r}: missing" for r in sorted(set(want) - have)]
  problems += [f"{r}: not in the manifest" for r in sorted(have - set(want))]
  same_size = []
  for r in sorted(set(want) & have):
    size = os.path.getsize(os.path.join(dirname, r))
    if size != want[r][0]:
      problems.append(f"{r}: size {size} bytes, manifest says {want[r][0]}")
    else:
      same_size.append(r)
  if problems:  # no need to read the rest
    return problems
  for r, digest in _digests(dirname, same_size).items():
    if digest != want[r][1]:
      problems.append(f"{r}: contents changed (sha256 differs from the manifest)")
  return problems


def _proc_start(pid: int):
  """The process's start time (clock ticks since boot, from /proc), or None where it cannot be read."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def _pid_alive(pid: int) -> bool:
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  except OSError:
    return False
  return True


def _newest_mtime(path: str) -> float:
  newest = os.lstat(path).st_mtime
  for root, dirs, files in os.walk(path):
    for n in dirs + files:
      try:
        newest = max(newest, os.lstat(os.path.join(root, n)).st_mtime)
      except OSError:
        pass
  return newest


def _tree_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for n in files:
      try:
        total += os.lstat(os.path.join(root, n)).st_size
      except OSError:
        pass
  return total


def _stale_reason(path: str, name_pid: int, now: float):
  """Why the temp folder `path` (a save's, named with pid `name_pid`) is stale, or None to keep it.

  Its owner record gives pid, host and process start time. On this host a folder is stale when its pid
  is not running, or runs with another start time (the pid was reused); a live owner's folder is kept.
  Where the owner cannot be checked (another host, no owner record: an older version's save, or no start
  time to compare) the folder is stale only once nothing in it has changed for STALE_TMP_S."""
  try:
    with open(os.path.join(path, OWNER)) as f:
      owner = json.load(f)
    pid, host, start = int(owner["pid"]), str(owner["host"]), owner.get("start")
  except (OSError, ValueError, KeyError, TypeError):
    pid, host, start = name_pid, None, None
  checkable = host in (None, socket.gethostname())
  if checkable and not _pid_alive(pid):
    return f"its process {pid} is not running"
  if checkable and start is not None:
    now_start = _proc_start(pid)
    if now_start is not None:
      return None if now_start == start else f"its process {pid} is gone (the pid now names another process)"
  idle = now - _newest_mtime(path)
  if idle > STALE_TMP_S:
    who = f"process {pid} on {host}" if host else f"process {pid}"
    return f"unchanged for {idle / 3600:.1f} h ({who} cannot be checked)"
  return None


def remove_stale_temps(cache_root: str, log) -> None:
  """Removes temp folders that killed saves left in cache_root; never a running save's."""
  try:
    names = os.listdir(cache_root)
  except OSError:
    return
  now = time.time()
  for name in names:
    m = _TMP_NAME.match(name)
    path = os.path.join(cache_root, name)
    if m is None or not os.path.isdir(path) or os.path.islink(path):
      continue
    try:
      reason = _stale_reason(path, int(m["pid"]), now)
      if reason is None:
        continue
      size = _tree_bytes(path)
      shutil.rmtree(path)
      log(f"removed stale temp folder {path} ({size / 1e6:.0f} MB): {reason}")
    except OSError as e:  # another process removed it first, or no permission: leave it
      log(f"could not remove stale temp folder {path}: {e}")


def save_cache(dirname: str, cfg: LlamaConfig, params: dict, tok: TextTokenizer) -> None:
  import orbax.checkpoint as ocp
  tmp = f"{dirname}.tmp{os.getpid()}-{secrets.token_hex(4)}"
  os.makedirs(tmp)
  try:
    with open(os.path.join(tmp, OWNER), "w") as f:  # first, so a later load can tell whose folder this is
      json.dump({"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()),
                 "created": time.time()}, f)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      f.write(cfg.to_json())
    tok.save(tmp)
    # one orbax checkpoint per layer (and one for the rest): orbax holds a copy of what it writes, so
    # writing a 1.5B model at once would need twice its host memory
    ckpt = _checkpointer()
    groups = {}
    for k, v in params.items():
      groups.setdefault(_group(k), {})[k.replace("/", ".")] = np.asarray(v)
    for g, flat in groups.items():
      ckpt.save(os.path.join(os.path.abspath(tmp), "params", g), args=ocp.args.StandardSave(flat))
    _write_manifest(tmp)
    os.remove(os.path.join(tmp, OWNER))
    shutil.rmtree(dirname, ignore_errors=True)
    os.rename(tmp, dirname)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def load_cache(dirname: str, dtype):
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  with open(os.path.join(dirname, "config.json")) as f:
    cfg = LlamaConfig.from_json(f.read())
  tok = TextTokenizer.load(dirname)
  ckpt = _checkpointer()
  params = {}
  root = os.path.join(os.path.abspath(dirname), "params")
  for g in sorted(os.listdir(root)):
    meta = ckpt.metadata(os.path.join(root, g))
    tree = getattr(meta, "item_metadata", meta)
    target = {k: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for k, v in dict(tree).items()}
    flat = ckpt.restore(os.path.join(root, g), args=ocp.args.StandardRestore(target))
    for k in list(flat):  # onto the device group by group: one host copy of a group at a time
      params[k.replace(".", "/")] = jnp.asarray(flat.pop(k), dtype)
  return cfg, params, tok


def _checkpointer():
  """A synchronous orbax checkpointer that keeps about 1 GB in flight while saving or restoring."""
  import orbax.checkpoint as ocp
  return ocp.Checkpointer(ocp.StandardCheckpointHandler(save_concurrent_gb=1, restore_concurrent_gb=1))


def _group(name: str) -> str:
  """The cache checkpoint a parameter is written to: "layer_0007" for "layers/7/...", else "model"."""
  parts = name.split("/")
  return f"layer_{int(parts[1]):04d}" if parts[0] == "layers" and len(parts) > 2 else "model"

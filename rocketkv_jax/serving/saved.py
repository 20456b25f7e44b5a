"""Saving arrays to disk with orbax, stamped and checksummed, and refusing what does not match on load.

A saved folder holds `arrays/` (an orbax PyTree checkpoint of NumPy arrays) and `meta.json`: the format
version, a stamp (what the arrays belong to: the model's fingerprint, the method's cache spec, dtypes; the
caller decides), the caller's own metadata and a SHA-256 per array. `load` checks the stamp before reading
any array and every checksum after, and raises `SavedFileError` naming what differs: a file from another
model or method, or a damaged or partial one, is never used. `save` writes a temporary folder next to `path`,
fsyncs every file and folder, then renames it into place (over an existing `path`, the old folder is moved
aside first: `sessions.py` writes new folders and swaps a pointer file instead, which is atomic throughout).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import jax
import numpy as np

__all__ = ["FORMAT", "SavedFileError", "fsync_tree", "load", "save"]

FORMAT = "rocketkv-jax/saved/1"


class SavedFileError(ValueError):
  """A saved file that is missing, damaged, or made for another model / method."""


def _digest(x: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(x).view(np.uint8).reshape(-1).tobytes()).hexdigest()


def _flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def fsync_tree(root) -> None:
  """Flushes every file and folder under `root` (and `root` itself) to the disk."""
  for folder, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(folder, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fsync_dir(folder)


def fsync_dir(folder) -> None:
  fd = os.open(folder, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def save(path, tree, *, stamp: dict, meta: dict | None = None) -> None:
  """Writes a pytree of NumPy arrays (dicts and lists) with its stamp and metadata; replaces `path` only once
  everything is written and fsynced (a killed save leaves the old folder, or nothing, never half a file)."""
  path = os.path.abspath(os.fspath(path))
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  import orbax.checkpoint as ocp  # here, not at import: the engine imports this module, most runs never save
  tmp = tempfile.mkdtemp(prefix=".saving-", dir=parent)
  try:
    with ocp.PyTreeCheckpointer() as ckpt:
      ckpt.save(os.path.join(tmp, "arrays"), tree)
    body = dict(format=FORMAT, stamp=stamp, meta=meta or {},
                checksums={k: _digest(v) for k, v in _flat(tree).items()})
    with open(os.path.join(tmp, "meta.json"), "w") as f:
      json.dump(body, f, indent=1, sort_keys=True)
    fsync_tree(tmp)
    old = None
    if os.path.exists(path):  # a folder cannot be renamed over a full one: move the old one aside first
      old = tempfile.mkdtemp(prefix=".old-", dir=parent)
      os.replace(path, os.path.join(old, "x"))
    os.replace(tmp, path)
    fsync_dir(parent)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _differences(found: dict, expected: dict) -> list[str]:
  return [f"{k}: file has {found.get(k)!r}, expected {expected.get(k)!r}"
          for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k)]


def load(path, *, stamp: dict) -> tuple[object, dict]:
  """(tree of NumPy arrays, metadata) of a saved folder. SavedFileError when it is missing, its stamp differs
  from `stamp` (each differing entry named), or any array's checksum fails."""
  path = os.path.abspath(os.fspath(path))
  meta_file = os.path.join(path, "meta.json")
  if not os.path.isfile(meta_file):
    raise SavedFileError(f"{path} is not a saved rocketkv-jax file (no meta.json)")
  try:
    with open(meta_file) as f:
      body = json.load(f)
  except (OSError, ValueError) as e:
    raise SavedFileError(f"{meta_file} is damaged: {e}") from None
  if not isinstance(body, dict) or body.get("format") != FORMAT:
    raise SavedFileError(f"{path}: format {body.get('format') if isinstance(body, dict) else None!r} is not "
                         f"{FORMAT!r}")
  diff = _differences(body.get("stamp", {}), stamp)
  if diff:
    raise SavedFileError(f"{path} was saved for something else; refusing it: " + "; ".join(diff))
  import orbax.checkpoint as ocp
  try:
    with ocp.PyTreeCheckpointer() as ckpt:
      tree = ckpt.restore(os.path.join(path, "arrays"))
  except Exception as e:  # orbax / tensorstore raise many types for a damaged folder
    raise SavedFileError(f"{path}: the arrays cannot be read ({type(e).__name__}: {e})") from None
  got = _flat(tree)
  sums = body.get("checksums", {})
  if set(got) != set(sums):
    raise SavedFileError(f"{path}: arrays {sorted(set(got) ^ set(sums))[:4]} are missing or extra")
  bad = [k for k, v in got.items() if _digest(v) != sums[k]]
  if bad:
    raise SavedFileError(f"{path} is damaged: checksum mismatch in {bad[:4]}")
  return tree, body.get("meta", {})

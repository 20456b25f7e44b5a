"""The sessions folder (`rocketkv serve --sessions-dir DIR`): the engine's prompt histories kept across restarts,
owned by one server at a time.

DIR holds `.lock` (an exclusive `fcntl.flock` for the life of the owning process, with its pid inside: a second
server on DIR is refused at start-up, naming that pid), `CURRENT` (the name of the saved folder to load) and
that folder, `history-<n>/` (`saved.py`: orbax arrays, stamped with the model, checksummed). A save writes a new
`history-<n+1>/` (temporary folder, fsync, rename), then replaces `CURRENT` the same way, then removes the older
folder: a crash at any point leaves the previous state loadable. Saves run at shutdown and, every
`save_every_s`, on the engine thread between steps (`EngineRunner.every`), so a crash loses at most one interval.
A failed save is logged as an error and remembered (`failed`): the CLI then exits non-zero.

A folder of the older layout (meta.json directly in DIR) is loaded once and replaced by the new one at the first
save.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time

from . import saved

__all__ = ["DirError", "SessionsDir", "check_writable"]

log = logging.getLogger("rocketkv_jax.serving")

LOCK = ".lock"
POINTER = "CURRENT"


class DirError(ValueError):
  """A folder named by a flag that cannot be used: not creatable, not writable, or another server's."""


def check_writable(path: str, flag: str) -> str:
  """The absolute path of folder `path`, created if missing; DirError naming `flag` when it cannot be created
  or written (tried by creating and removing a file in it)."""
  full = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(full, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=full)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise DirError(f"{flag}={path!r}: cannot use {full} as a writable folder: {e.strerror or e}") from None
  return full


def _write_atomic(path: str, text: str) -> None:
  folder = os.path.dirname(path)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    saved.fsync_dir(folder)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


class SessionsDir:
  """An opened (checked, locked) sessions folder; see the module doc. `save_every_s`: seconds between periodic
  saves (0: at shutdown only). `flag`: how errors name the folder."""

  def __init__(self, path: str, *, save_every_s: float = 60.0, flag: str = "--sessions-dir"):
    if not save_every_s >= 0:
      raise ValueError(f"{save_every_s=} must be >= 0")
    self.path = check_writable(path, flag)
    self.save_every_s = float(save_every_s)
    self.failed: BaseException | None = None  # the last save's error, None once a save succeeds
    self._saved_version = None
    lock = os.path.join(self.path, LOCK)
    self._fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      try:
        other = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
      finally:
        os.close(self._fd)
        self._fd = None
      raise DirError(f"{flag}={path!r}: {self.path} is in use by another server (pid {other}); two servers on one "
                     f"sessions folder would overwrite each other's sessions. Stop it or use another folder") from None
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
    self._sweep()

  # --- layout

  def current(self) -> str | None:
    """The saved folder to load: the one CURRENT names, the older layout's DIR itself, or None."""
    pointer = os.path.join(self.path, POINTER)
    if os.path.isfile(pointer):
      with open(pointer) as f:
        name = f.read().strip()
      if not name.startswith("history-") or os.sep in name or not os.path.isdir(os.path.join(self.path, name)):
        raise saved.SavedFileError(f"{pointer} names {name!r}, which is not a saved folder in {self.path}")
      return os.path.join(self.path, name)
    if os.path.isfile(os.path.join(self.path, "meta.json")):
      return self.path
    return None

  def _sweep(self) -> None:
    """Removes what a killed save left (temporary folders, folders CURRENT does not name); we hold the lock."""
    try:
      keep = self.current()
    except saved.SavedFileError:
      return  # load() reports it
    for name in os.listdir(self.path):
      full = os.path.join(self.path, name)
      stale = name.startswith((".saving-", ".old-", ".tmp-")) or (name.startswith("history-") and full != keep)
      if stale:
        shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.unlink(full)

  # --- loading and saving

  def load(self, engine) -> int:
    """Adds the saved histories to `engine` (0 when there are none). SavedFileError naming the file and field
    when the file is for another model, damaged, or inconsistent: it is never used as is."""
    try:
      folder = self.current()
      if folder is None:
        return 0
      n = engine.load_history(folder)
    except saved.SavedFileError as e:
      log.error(f"sessions: refusing the saved sessions in {self.path}: {e}")
      raise
    self._saved_version = engine.history.version
    return n

  def save(self, engine, *, force: bool = False) -> int | None:
    """Writes the engine's histories (skipped, returning None, when unchanged since the last save or load
    unless `force`). Call it on the thread that runs the engine (or once it has stopped). Never raises: a
    failure is logged as an error and kept in `failed`."""
    version = engine.history.version
    if not force and version == self._saved_version and self.failed is None:
      return None
    t0 = time.perf_counter()
    try:
      old = self.current() if os.path.isfile(os.path.join(self.path, POINTER)) else None
      name = f"history-{time.time_ns()}"
      n = engine.save_history(os.path.join(self.path, name))
      _write_atomic(os.path.join(self.path, POINTER), name + "\n")
      if old is not None:
        shutil.rmtree(old, ignore_errors=True)
      for legacy in ("meta.json", "arrays"):  # the older layout, now superseded
        full = os.path.join(self.path, legacy)
        shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else (
            os.unlink(full) if os.path.exists(full) else None)
    except Exception as e:  # noqa: BLE001 - disk full, unwritable, ...: say so loudly, keep serving
      self.failed = e
      log.error(f"sessions: FAILED to save the prompt histories to {self.path}: {type(e).__name__}: {e}")
      return None
    self.failed = None
    self._saved_version = version
    log.info(f"sessions: saved {n} prompt histories to {self.path} ({time.perf_counter() - t0:.2f}s)")
    return n

  def close(self) -> None:
    """Releases the lock (the process's exit does too)."""
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

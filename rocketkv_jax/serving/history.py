"""Sessions' full K/V history, held in host memory: RocketKV-MT (ALGORITHM.md §4) with the history off the GPU.

The device holds only each request's compressed cache. Every prompt the engine prefills leaves its tokens'
post-RoPE K/V (all layers, all KV heads) here, as a segment of a prefix tree: a segment continues its
parent's token path at `start`. A later prompt that begins with a stored path (the next turn of a
conversation, which repeats the earlier turns and answers, or a question after a stored context) reuses
that K/V instead of prefilling it again: `match` finds the longest stored prefix, `view` hands the engine
each layer's history (padded, one layer at a time, so the device never holds more than about two layers'
history), and `add` keeps the new tokens' K/V. Stage 1 then runs again over the whole history with its
window on the new tokens, which is RocketKV-MT's rebuild of the filtered set.

Generated tokens are not taken from the decode cache: when the next turn's prompt repeats an answer, the
answer's tokens are prefilled with the rest of the new turn (dense, exact K/V; the chat template may also
render them differently from what was sampled).

Device tier: with `max_device_bytes`, the most recently added segments keep their K/V on the device (the arrays the
prefill produced, never copied to the host) up to that many bytes, and a view of them is assembled on the device:
a new turn over a recent history then costs its own prefill, not a copy of the history from host memory. Past the
limit the least recently used device segments move to host memory.

Memory: at most `max_bytes` of host memory; past it, the least recently used segments without children
are dropped (or, with `spill_dir`, moved to disk as memory-mapped files, up to `max_disk_bytes`). Spill files
hold other clients' K/V: they are private (mode 0600, in a 0700 folder `spill_dir/history-*` locked by this
process), deleted when their segment is dropped and, with their folder, at `close` or interpreter exit; folders
left by a dead process (a crash) are removed when the next store opens on the same `spill_dir`.
Tenants: every segment carries its request's `cache_salt` (its parent's, for a child) and `match` looks only at
segments of the caller's salt, so one tenant's prompts are never reused for, or visible through `cached_tokens`
to, another (the same token path stored under two salts is stored twice).
`save` / `load` write and read every segment with orbax (`saved.py`: stamped, checksummed); `load` checks
every field of the segment table against the arrays and refuses a file that does not add up.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import glob
import itertools
import logging
import os
import shutil
import tempfile
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import saved

log = logging.getLogger("rocketkv_jax.serving")
_SPILL_LOCK = ".lock"  # in each history-* spill folder, flock'd by its live owner
_EMPTY = "empty"  # the one array of a saved store without segments
MAX_SALT = 320  # characters of a stored salt: a client's cache_salt (256 at most) behind the server's tenant tag

__all__ = ["HistoryStore", "HistoryView", "Segment", "device_rows", "own_rows"]


@dataclasses.dataclass(eq=False)
class Segment:
  """Tokens [start, start + n) of a path whose first `start` tokens are the parent's (None: start 0).

  k, v: per layer [n, K, H] NumPy arrays (memory-mapped once spilled to disk), or device arrays (on_device)."""

  parent: Segment | None
  start: int
  tokens: np.ndarray
  k: list
  v: list
  last_used: int = 0
  children: int = 0
  on_disk: bool = False
  salt: str = ""
  on_device: bool = False

  @property
  def end(self) -> int:
    return self.start + len(self.tokens)

  @functools.cached_property
  def nbytes(self) -> int:
    """Bytes of k and v (the same wherever they move: device, host, disk): counted once, since the store sums it
    over every segment at each add and the engine's stats every step (2 x n_layers arrays per segment)."""
    return sum(x.nbytes for x in self.k) + sum(x.nbytes for x in self.v)


def own_rows(x, lo: int, hi: int, dtype) -> np.ndarray:
  """x[lo:hi] as a host array that holds only those rows: a copy unless they are all of x's memory. A view of a
  prompt's padded buffer would keep the whole bucket alive while the history counts only its tokens (a 4k chat
  turn in an 8k bucket: twice the host memory `max_bytes` allows). The engine's store worker calls it before `add`,
  so the copy does not hold the store's lock (which the engine thread's stats take every step)."""
  a = np.asarray(x)
  rows = a[lo:hi]
  root = a
  while isinstance(root.base, np.ndarray):
    root = root.base
  if rows.dtype == dtype and rows.flags.c_contiguous and rows.nbytes == root.nbytes:
    return rows
  return np.array(rows, dtype, copy=True, order="C")


@functools.partial(jax.jit, static_argnames=("bounds", "padded_len"))
def _assemble(k_parts, v_parts, *, bounds, padded_len):
  """One layer's view on the device, one dispatch for what would be some ten eager ops (measured on an H100 with
  a 32k document: the history's eager ops were about half of a 40-token question's 0.13 s admission, most of it on
  the host): rows [lo, hi) of each piece (device or host arrays [n, K, H]) in order, zeros up to padded_len, as
  (k, v) [1, padded_len, K, H]. One compile per (piece shapes, bounds, padded_len), as the eager slices had."""
  def one(parts):
    x = jnp.concatenate([p[lo:hi] for p, (lo, hi) in zip(parts, bounds)])
    return jnp.pad(x, ((0, padded_len - x.shape[0]), (0, 0), (0, 0)))[None]
  return one(k_parts), one(v_parts)


@functools.partial(jax.jit, static_argnames=("lo", "hi", "dtype"))
def device_rows(xs, *, lo: int, hi: int, dtype):
  """Rows [lo, hi) of every device array in xs (each [n, K, H], or [1, n, K, H]: a batch of one), as dtype, in one
  dispatch (a prompt's K/V for all layers kept by the device tier)."""
  return tuple(_unbatched(x)[lo:hi].astype(dtype) for x in xs)


def _unbatched(x):
  return x[0] if x.ndim == 4 else x


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


class HistoryView:
  """The first `length` positions of a stored path, layer by layer: view[i] = (k, v) [1, padded_len, K, H],
  zeros past `length` (built when asked, so the host holds a few padded layers at a time), or None for an
  empty history."""

  def __init__(self, pieces, length: int, padded_len: int, n_layers: int, kv_shape, dtype):
    self.pieces, self.length, self.padded_len = pieces, length, padded_len
    self.n_layers, self.kv_shape, self.dtype = n_layers, kv_shape, dtype

  def __len__(self) -> int:
    return self.n_layers

  def __getitem__(self, layer: int):
    """(k, v) of one layer, or None when the history is empty (the caller uses zeros on the device)."""
    if not 0 <= layer < self.n_layers:
      raise IndexError(layer)
    if not self.pieces:
      return None
    if any(seg.on_device for seg, _, _ in self.pieces):  # assembled on the device, host pieces copied there
      # a host piece's rows are cut on the host (a view), so only they travel; a device piece is cut in the call
      parts = {name: tuple(getattr(seg, name)[layer] if seg.on_device else getattr(seg, name)[layer][lo:hi]
                           for seg, lo, hi in self.pieces) for name in ("k", "v")}
      bounds = tuple((lo, hi) if seg.on_device else (0, hi - lo) for seg, lo, hi in self.pieces)
      return _assemble(parts["k"], parts["v"], bounds=bounds, padded_len=self.padded_len)
    out = []
    for name in ("k", "v"):
      buf = np.empty((1, self.padded_len) + tuple(self.kv_shape), self.dtype)  # one pass: pieces, then zeros
      for seg, lo, hi in self.pieces:
        buf[0, seg.start + lo:seg.start + hi] = getattr(seg, name)[layer][lo:hi]
      buf[0, self.length:] = 0
      out.append(buf)
    return tuple(out)


def _remove_spill(folder: str, lock_fd: int) -> None:
  shutil.rmtree(folder, ignore_errors=True)
  try:
    os.close(lock_fd)
  except OSError:
    pass


def _remove_stale_spill(spill_dir: str) -> None:
  """Removes the history-* folders of `spill_dir` whose owner is gone (their lock file can be taken). A folder
  without a lock file (an older version's, perhaps still running) is left alone, with a warning."""
  for folder in glob.glob(os.path.join(spill_dir, "history-*")):
    lock = os.path.join(folder, _SPILL_LOCK)
    if not os.path.isfile(lock):
      log.warning(f"history spill folder {folder} has no lock file (an older server's?): left as it is")
      continue
    try:
      fd = os.open(lock, os.O_RDWR)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its owner is alive
      os.close(fd)
      continue
    n = len(os.listdir(folder)) - 1
    shutil.rmtree(folder, ignore_errors=True)
    os.close(fd)
    log.info(f"removed {n} history spill files left by a process that is gone ({folder})")


class HistoryStore:
  """The host-side K/V of every stored token path (module doc). Thread-safe."""

  def __init__(self, n_layers: int, kv_shape: tuple[int, int], dtype, *, max_bytes: int,
               spill_dir: str | None = None, max_disk_bytes: int = 0, max_device_bytes: int = 0):
    self.n_layers, self.kv_shape, self.dtype = n_layers, tuple(kv_shape), np.dtype(dtype)
    self.max_bytes, self.max_disk_bytes = int(max_bytes), int(max_disk_bytes)
    self.max_device_bytes = int(max_device_bytes)
    self.spill_dir = None
    self._spill_lock_fd = None
    if spill_dir is not None:
      os.makedirs(spill_dir, exist_ok=True)
      _remove_stale_spill(spill_dir)
      self.spill_dir = tempfile.mkdtemp(prefix="history-", dir=spill_dir)  # mode 0700
      self._spill_lock_fd = os.open(os.path.join(self.spill_dir, _SPILL_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
      fcntl.flock(self._spill_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      # a clean exit that never called close() still removes the folder; a crash leaves it to the next start
      self._finalizer = weakref.finalize(self, _remove_spill, self.spill_dir, self._spill_lock_fd)
    self.segments: list[Segment] = []
    self._clock = itertools.count(1)
    self._lock = threading.RLock()
    self.dropped = 0  # segments dropped to stay within the limits
    self.version = 0  # changes whenever the stored paths do (a saver skips an unchanged store)

  # ------------------------------------------------------------------ sizes

  def host_bytes(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self.segments if not s.on_disk and not s.on_device)

  def device_bytes(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self.segments if s.on_device)

  def disk_bytes(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self.segments if s.on_disk)

  def token_bytes(self) -> int:
    """Host bytes one token's history takes (all layers, K and V)."""
    return 2 * self.n_layers * int(np.prod(self.kv_shape)) * self.dtype.itemsize

  # ------------------------------------------------------------------ lookup

  def match(self, prompt, salt: str = "") -> tuple[Segment | None, int]:
    """(segment, n): the stored path of this salt sharing the longest prefix with `prompt`, and that prefix's
    length (None, 0 when nothing matches)."""
    prompt = np.asarray(prompt, np.int32)
    best, best_n = None, 0
    shared = {}  # id(segment) -> tokens its path shares with the prompt
    with self._lock:
      for seg in self.segments:  # a parent comes before its children (and has their salt)
        if seg.salt != salt:
          continue
        n = self._shared(seg, prompt, shared)
        if n > best_n or (n == best_n and n > 0 and seg.end < best.end):
          best, best_n = seg, n
    return best, best_n

  def _shared(self, seg: Segment, prompt: np.ndarray, shared: dict) -> int:
    """Tokens seg's path shares with the prompt, from its parent's count and its own tokens: each segment's
    tokens are compared once per match, not its whole path (one 32k document and 1,000 stored questions: a match
    took 27 ms and the stored paths 252 MiB of host memory when each segment held and compared its whole path;
    now 2.7 ms and 2 MiB: benchmarks/history_match.py, results/history_match_cpu_2026-12-06.txt)."""
    n = shared.get(id(seg))
    if n is None:
      if seg.parent is not None and (p := self._shared(seg.parent, prompt, shared)) < seg.start:
        n = p  # the prompt leaves the parent's path before this segment branches off it
      elif seg.start < len(prompt) and prompt[seg.start] == seg.tokens[0]:
        n = seg.start + _common_prefix(seg.tokens, prompt[seg.start:])
      else:  # most stored paths part from the prompt at their first token: no array compared
        n = seg.start
      shared[id(seg)] = n
    return n

  def _owner(self, seg: Segment, n: int) -> Segment | None:
    """The deepest segment of seg's chain that holds position n - 1 (None for n == 0)."""
    while seg is not None and seg.start >= n:
      seg = seg.parent
    return seg if n > 0 else None

  def _pieces(self, seg: Segment, n: int) -> list:
    """[(segment, lo, hi)] covering positions [0, n) of seg's path, root first."""
    out = []
    while seg is not None and n > 0:
      if n > seg.start:
        out.append((seg, 0, n - seg.start))
        n = seg.start
      seg = seg.parent
    return out[::-1]

  def view(self, seg: Segment | None, n: int, padded_len: int) -> HistoryView:
    """The first n positions of seg's path as per-layer padded arrays (n = 0: all zeros). Marks the chain
    recently used."""
    with self._lock:
      pieces = self._pieces(seg, n) if seg is not None else []
      now = next(self._clock)
      for s, _, _ in pieces:
        s.last_used = now
    return HistoryView(pieces, n, padded_len, self.n_layers, self.kv_shape, self.dtype)

  # ------------------------------------------------------------------ adding and dropping

  def add(self, prompt, new_k, new_v, reused: int, salt: str = "") -> Segment | None:
    """Stores the K/V of prompt positions [reused, len(prompt)) (new_k / new_v: per layer [n, K, H], or
    [1, n, K, H] as a batch of one, with n >= len(prompt) - reused, or longer, padding ignored) for requests of this
    salt. Only what no stored path of the salt already holds is kept. Device arrays stay on the device while the
    device tier has room (module doc); anything else is copied to host memory. Returns the segment that holds the whole prompt (None if it did not
    fit)."""
    prompt = np.asarray(prompt, np.int32)
    n = len(prompt)
    with self._lock:
      seg, start = self.match(prompt, salt)
      if seg is not None and start == n:
        seg.last_used = next(self._clock)
        return seg
      if start < reused:  # part of the reused history was dropped meanwhile: the path would have a hole
        self.dropped += 1
        return None
      lo, hi = start - reused, n - reused
      on_device = ((hi - lo) * self.token_bytes() <= self.max_device_bytes
                   and all(isinstance(x, jax.Array) for x in (*new_k, *new_v)))
      if on_device:  # every layer's rows in one dispatch (a slice per array was 2 x n_layers eager ops)
        keep = lambda xs: device_rows(tuple(xs), lo=lo, hi=hi, dtype=self.dtype)  # noqa: E731
      else:
        keep = lambda xs: [own_rows(_unbatched(np.asarray(x)), lo, hi, self.dtype) for x in xs]  # noqa: E731
      ks, vs = keep(new_k), keep(new_v)
      new = Segment(parent=self._owner(seg, start) if seg is not None else None, start=start,
                    tokens=prompt[start:].copy(),  # not a view, which would keep the whole prompt alive
                    k=list(ks), v=list(vs),
                    last_used=next(self._clock), salt=salt, on_device=on_device)
      if new.nbytes > self.max_bytes:
        self.dropped += 1
        return None
      if new.parent is not None:
        new.parent.children += 1
      self.segments.append(new)
      self.version += 1
      self._shrink(keep=new)
      return new

  def _shrink(self, keep: Segment | None = None) -> None:
    """Least recently used childless segments leave host memory (to disk with spill_dir, room permitting)
    until host bytes <= max_bytes; `keep` and its chain stay."""
    while self.device_bytes() > self.max_device_bytes:  # least recently used device segments to host memory
      self._to_host(min((s for s in self.segments if s.on_device), key=lambda s: s.last_used))
    protected = set()
    s = keep
    while s is not None:
      protected.add(id(s))
      s = s.parent
    while self.host_bytes() > self.max_bytes:
      leaves = [s for s in self.segments if s.children == 0 and not s.on_disk and not s.on_device
                and id(s) not in protected]
      if not leaves:
        # only chains in use (or parents of spilled segments) remain in host memory: spill parents too
        leaves = [s for s in self.segments if not s.on_disk and not s.on_device and id(s) not in protected]
        if not leaves or self.spill_dir is None:
          break
      victim = min(leaves, key=lambda s: s.last_used)
      if self.spill_dir is not None and self.disk_bytes() + victim.nbytes <= self.max_disk_bytes:
        self._spill(victim)
      elif victim.children == 0:
        self._drop(victim)
      else:
        break
    while self.disk_bytes() > self.max_disk_bytes:
      leaves = [s for s in self.segments if s.on_disk and s.children == 0]
      if not leaves:
        break
      self._drop(min(leaves, key=lambda s: s.last_used))

  def _to_host(self, seg: Segment) -> None:
    """A device segment's K/V copied to host memory (every layer's copy started before the first is waited for)."""
    for x in (*seg.k, *seg.v):
      x.copy_to_host_async()
    seg.k = [np.asarray(x) for x in seg.k]
    seg.v = [np.asarray(x) for x in seg.v]
    seg.on_device = False

  def _spill_files(self, seg: Segment) -> list[str]:
    base = os.path.join(self.spill_dir, f"seg{id(seg):x}")
    return [f"{base}-{name}{i}.npy" for name in ("k", "v") for i in range(self.n_layers)]

  def _spill(self, seg: Segment) -> None:
    files = iter(self._spill_files(seg))
    for name in ("k", "v"):
      arrays = getattr(seg, name)
      for i, x in enumerate(arrays):
        f = next(files)
        # private from the first byte: os.open's mode, not a chmod after writing (the umask may only narrow it)
        with os.fdopen(os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
          np.save(out, x)
        arrays[i] = np.load(f, mmap_mode="r")
    seg.on_disk = True

  def _unspill(self, seg: Segment) -> None:
    """Deletes a dropped segment's files (views still reading them keep their memory maps until done)."""
    if seg.on_disk and self.spill_dir is not None:
      for f in self._spill_files(seg):
        try:
          os.unlink(f)
        except FileNotFoundError:
          pass

  def _drop(self, seg: Segment) -> None:
    self.segments.remove(seg)
    if seg.parent is not None:
      seg.parent.children -= 1
    self._unspill(seg)
    self.dropped += 1
    self.version += 1

  def drop_salt(self, salt: str) -> int:
    """Forgets every segment stored for `salt` (a whole tree: a child has its parent's salt); returns how many."""
    with self._lock:
      gone = [seg for seg in self.segments if seg.salt == salt]
      for seg in reversed(gone):  # children (added after their parents) first
        self.segments.remove(seg)
        self._unspill(seg)
      if gone:
        self.version += 1
      return len(gone)

  def clear(self) -> None:
    with self._lock:
      for seg in self.segments:
        self._unspill(seg)
      self.segments.clear()
      self.version += 1

  def close(self) -> None:
    """Forgets everything and removes the spill folder (with its lock)."""
    self.clear()
    if self.spill_dir is not None:
      self._finalizer()

  # ------------------------------------------------------------------ saving

  def save(self, path, *, stamp: dict) -> int:
    """Writes every segment (tokens, per-layer K/V, the tree) to `path` with orbax; returns the count."""
    with self._lock:
      segs = list(self.segments)
      index = {id(s): i for i, s in enumerate(segs)}
      tree = {f"s{i}": dict(tokens=s.tokens, k=[np.asarray(x) for x in s.k], v=[np.asarray(x) for x in s.v])
              for i, s in enumerate(segs)}
      meta = dict(segments=[dict(parent=index.get(id(s.parent)) if s.parent is not None else None, start=s.start,
                                 salt=s.salt) for s in segs])
      tree = tree or {_EMPTY: np.zeros(1, np.int32)}  # orbax saves neither an empty tree nor a 0-size array
    saved.save(path, tree, stamp=stamp, meta=meta)
    return len(segs)

  def load(self, path, *, stamp: dict) -> int:
    """Adds the segments saved at `path` (SavedFileError when it was saved for another model, is damaged, or
    any field of its segment table disagrees with the arrays: the file and the field are named); returns how
    many were added. Nothing is added unless the whole file checks out."""
    tree, meta = saved.load(path, stamp=stamp)
    entries = self._check_table(os.path.join(os.path.abspath(os.fspath(path)), "meta.json"), tree, meta)
    made: list[Segment] = []
    with self._lock:
      for i, (parent, start, salt) in enumerate(entries):
        t = tree[f"s{i}"]
        seg = Segment(parent=made[parent] if parent is not None else None, start=start,
                      tokens=np.asarray(t["tokens"], np.int32), k=list(t["k"]), v=list(t["v"]),
                      last_used=next(self._clock), salt=salt)
        if seg.parent is not None:
          seg.parent.children += 1
        self.segments.append(seg)
        made.append(seg)
      self.version += 1
      self._shrink()
    return len(made)

  def _check_table(self, where: str, tree, meta) -> list[tuple[int | None, int, str]]:
    """[(parent index or None, start, salt)] of a loaded file, after checking every field against the arrays
    (a file saved before salts existed has none: its segments get the empty salt)."""
    def bad(field: str, why: str):
      raise saved.SavedFileError(f"{where}: {field} {why}; refusing the saved sessions")

    if not isinstance(meta, dict) or not isinstance(meta.get("segments"), list):
      bad("meta.segments", "is missing or not a list")
    entries = meta["segments"]
    if not entries and isinstance(tree, dict) and set(tree) == {_EMPTY}:
      tree = {}
    if not isinstance(tree, dict) or set(tree) != {f"s{i}" for i in range(len(entries))}:
      bad("meta.segments", f"lists {len(entries)} segments but the arrays hold "
                           f"{sorted(tree) if isinstance(tree, dict) else type(tree).__name__}"[:300])
    out, ends, starts, salts = [], [], [], []
    for i, e in enumerate(entries):
      f = f"meta.segments[{i}]"
      if not isinstance(e, dict) or set(e) - {"salt"} != {"parent", "start"}:
        bad(f, f"must be an object with keys parent, start and salt, got {e!r}"[:300])
      parent, start, salt = e["parent"], e["start"], e.get("salt", "")
      if not isinstance(salt, str) or len(salt) > MAX_SALT:
        bad(f"{f}.salt", f"= {str(salt)[:40]!r} must be a string of at most {MAX_SALT} characters")
      if parent is not None and type(parent) is int and 0 <= parent < i and salt != salts[parent]:
        bad(f"{f}.salt", f"= {salt!r} differs from its parent's {salts[parent]!r}")
      if parent is not None and (type(parent) is not int or not 0 <= parent < i):
        bad(f"{f}.parent", f"= {parent!r} must be null or the index of an earlier segment (0..{i - 1})")
      if type(start) is not int:
        bad(f"{f}.start", f"= {start!r} must be an integer")
      if parent is None and start != 0:
        bad(f"{f}.start", f"= {start} must be 0 for a segment without a parent")
      if parent is not None and not starts[parent] < start <= ends[parent]:
        bad(f"{f}.start", f"= {start} must be in ({starts[parent]}, {ends[parent]}]: after its parent's start and "
                          f"within its parent's path")
      t = tree[f"s{i}"]
      if not isinstance(t, dict) or set(t) != {"tokens", "k", "v"}:
        bad(f"arrays s{i}", "must hold tokens, k and v")
      tokens = t["tokens"]
      if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu" or not len(tokens):
        bad(f"arrays s{i}.tokens", f"must be a non-empty 1-D integer array, got "
                                   f"{getattr(tokens, 'shape', None)} {getattr(tokens, 'dtype', type(tokens))}")
      if tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max:
        bad(f"arrays s{i}.tokens", "holds token ids outside [0, 2**31)")
      n = len(tokens)
      for name in ("k", "v"):
        xs = t[name]
        if not isinstance(xs, list) or len(xs) != self.n_layers:
          bad(f"arrays s{i}.{name}", f"must be {self.n_layers} layers, got "
                                     f"{len(xs) if isinstance(xs, list) else type(xs).__name__}")
        for layer, x in enumerate(xs):
          want = (n,) + self.kv_shape
          if not isinstance(x, np.ndarray) or x.shape != want or x.dtype != self.dtype:
            bad(f"arrays s{i}.{name}[{layer}]", f"is {getattr(x, 'shape', None)} {getattr(x, 'dtype', None)}; "
                                                f"segment {i} has {n} tokens, so this model needs {want} {self.dtype}")
      out.append((parent, start, salt))
      salts.append(salt)
      starts.append(start)
      ends.append(start + n)
    return out

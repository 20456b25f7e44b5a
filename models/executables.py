"""The one compile cache: ahead-of-time compiled executables, kept so that compilation can be timed apart from
running and never repeated.

Every caller that compiles (generate and the demo, the accuracy suite's `Runner`, the serving engine) holds an
`Executables`. Two ways to look one up:

- `for_args(fn, *args, **static)`: keyed by the jit function, its static arguments and the arguments' shapes,
  dtypes and shardings (and the mesh set, if any): for callers whose shapes vary (generate's batch and bucket,
  the suite's grid of configs).
- `get(key, lower)`: keyed by the caller's own key, for a caller whose shapes are fixed by its configuration
  (the serving engine: one executable per bucket or step kind), so that a decode step does not walk the
  model's parameters to build a key.

Compiles are counted and timed (`stats`: compiles, seconds lowering, seconds in XLA's compiler, summed over
threads); lookups are thread-safe (the suite compiles in a thread pool; tracing holds the GIL, XLA's compiler
releases it). A compiled executable is called with the non-static arguments only.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from .sharding import using

__all__ = ["Executables", "SHARED"]


def _leaf_key(x) -> Any:
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):  # a placement matters only on a mesh (one device: None)
    placed = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else None
    return tuple(x.shape), str(x.dtype), placed
  if isinstance(x, np.ndarray):
    return x.shape, str(x.dtype), None
  return x  # a static value (a GraphDef, None): hashable


class Executables:
  """Compiled executables by key (module doc). mesh: set while lowering and compiling (the serving engine's);
  limit: at most this many kept (the oldest half dropped past it), None for no limit; on_compile(lower_s,
  compile_s): called after each compile, under the cache's lock."""

  def __init__(self, *, mesh=None, limit: int | None = None,
               on_compile: Callable[[float, float], None] | None = None):
    self.mesh, self.limit, self.on_compile = mesh, limit, on_compile
    self._exes: dict = {}
    self._lock = threading.Lock()
    self.stats = {"compiles": 0, "lower_s": 0.0, "compile_s": 0.0}

  def __len__(self) -> int:
    return len(self._exes)

  def __contains__(self, key) -> bool:
    """Whether `get(key, ...)` would find an executable without compiling."""
    with self._lock:
      return key in self._exes

  def get(self, key, lower: Callable[[], Any]):
    """The executable cached under `key`, else `lower()` (a `jax.stages.Lowered`) compiled and cached."""
    with self._lock:
      exe = self._exes.get(key)
    if exe is not None:
      return exe
    t0 = time.perf_counter()
    with using(self.mesh):
      lowered = lower()
      t1 = time.perf_counter()
      exe = lowered.compile()
    t2 = time.perf_counter()
    with self._lock:
      if self.limit is not None and len(self._exes) >= self.limit:  # many distinct shapes: drop the oldest half
        for old in list(self._exes)[:len(self._exes) // 2 + 1]:
          del self._exes[old]
      exe = self._exes.setdefault(key, exe)
      self.stats["compiles"] += 1
      self.stats["lower_s"] += t1 - t0
      self.stats["compile_s"] += t2 - t1
      if self.on_compile is not None:
        self.on_compile(t1 - t0, t2 - t1)
    return exe

  def for_args(self, fn, *args, **static):
    """fn (a jax.jit function) compiled for these positional arguments (arrays, ShapeDtypeStructs or static values
    such as a GraphDef, by value) and static keyword arguments; call the result with the array arguments."""
    leaves, treedef = jax.tree.flatten(args)
    key = (fn, treedef, tuple(_leaf_key(x) for x in leaves), tuple(sorted(static.items())),
           jax.sharding.get_abstract_mesh())
    return self.get(key, lambda: fn.lower(*args, **static))


# generate's and the demo's (one process-wide cache; its executables keep the models they were compiled for alive,
# so at most 64 are kept)
SHARED = Executables(limit=64)

"""Running the model over several devices: a `jax.sharding.Mesh` with a data axis (the batch) and a model axis
(tensor parallelism), and where each array lives on it.

Parameters: projections are split over "model" along their output columns (wqkv, w_gate_up, lm_head) or
their input rows (wo, w_down), the embedding along its feature axis; norms are replicated. An axis that the
model axis does not divide is left whole (replicated), so any head count runs on any mesh. Batches are split
over "data". Caches (`constrain_cache`, applied by the model right after each layer's compression while a
mesh is set with `jax.set_mesh`) are split by batch over "data" and by KV head over "model" where the KV heads
divide, else kept whole along heads. XLA (GSPMD) partitions the computation from these placements and adds
the collectives, so sharded and unsharded runs compute the same thing. Pallas kernels, which XLA cannot
partition, run per device under `jax.shard_map` (`per_shard`: the decode step's attention by batch and KV
head, the norms and RoPE by batch); tested in interpret mode on CPU devices only, so `generate` and the engine
still default to the XLA path on a mesh (pass impl="pallas" to use the kernels).

Any mesh a JAX user builds works: `jax.make_mesh` (explicit axes by default since jax 0.9, or auto) or
`jax.sharding.Mesh`, with any axis names. Every API that takes a mesh (`load`, `generate`, the serving `Engine`,
`shard_model`, `shard_batch`, `using`) first turns it into the project's own mesh with `normalize_mesh`: the
same devices, axes ("data", "model") typed `AxisType.Auto` (XLA's sharding propagation, which the placements
above rely on), the user's axes mapped by `data_axis` / `model_axis` (default "data" / "model"; a tuple merges
several axes into one, e.g. data_axis=("replica", "data")); with no mesh passed, the one set with
`jax.set_mesh` around the call is used (`resolve_mesh`), as JAX's own functions do. A mesh that cannot be mapped (an axis of size > 1
that is neither, an abstract mesh without devices) is a ValueError naming the mesh and the fix.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["DATA", "MODEL", "active_mesh", "cache_spec", "constrain_cache", "default_impl", "make_mesh",
           "host_readable", "normalize_mesh", "param_spec", "resolve_mesh", "to_host", "per_shard", "shard_batch", "shard_model", "using"]

DATA, MODEL = "data", "model"
WHOLE = "whole"  # per_shard: an argument every device gets whole
_COLUMNS = ("wqkv", "w_gate_up", "lm_head", "bqkv")  # split along the last (output) axis
_ROWS = ("wo", "w_down")                              # split along the first (input) axis


def make_mesh(dp: int = 1, tp: int = 1, devices=None):
  """A (data=dp, model=tp) mesh over the first dp * tp devices (ValueError naming what is missing)."""
  for name, v in (("dp", dp), ("tp", tp)):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{name}={v!r} must be an int >= 1")
  devices = list(jax.devices() if devices is None else devices)
  if dp * tp > len(devices):
    raise ValueError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices; {len(devices)} are visible "
                     "(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)")
  return jax.sharding.Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), (DATA, MODEL), axis_types=_AUTO)


_AUTO = (jax.sharding.AxisType.Auto,) * 2


def _axis_names(value, what: str) -> tuple[str, ...]:
  names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
  if not names or not all(isinstance(n, str) and n for n in names):
    raise ValueError(f"{what}={value!r} must be an axis name or a tuple of axis names")
  return names


def normalize_mesh(mesh, data_axis=DATA, model_axis=MODEL):
  """The mesh every placement and jit of the project runs on, from any mesh a user built (module doc): the
  same devices as a (data, model) mesh with auto axes. The user's axes named by data_axis (the batch) and
  model_axis (tensor parallelism) -- a name or a tuple of names, merged in that order -- become "data" and
  "model"; an axis named by neither must have size 1. A default name the mesh lacks is an axis of size 1
  (jax.make_mesh((8,), ("data",)) is data parallel only). None stays None; the result of this function (or
  of `make_mesh`) comes back unchanged. ValueError naming the mesh and the fix for what cannot be mapped."""
  if mesh is None:
    return None
  if isinstance(mesh, jax.sharding.AbstractMesh):
    raise ValueError(f"{mesh} has no devices: pass the concrete mesh (jax.make_mesh(...) or "
                     "jax.sharding.Mesh(devices, names)), not its abstract mesh")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f"mesh={mesh!r} is not a jax.sharding.Mesh: build one with jax.make_mesh((dp, tp), "
                     "('data', 'model')) or rocketkv_jax.models.sharding.make_mesh(dp, tp)")
  data, model = _axis_names(data_axis, "data_axis"), _axis_names(model_axis, "model_axis")
  if (mesh.axis_names == (DATA, MODEL) and tuple(mesh.axis_types) == _AUTO and data == (DATA,)
      and model == (MODEL,)):
    return mesh
  names = tuple(mesh.axis_names)
  fix = (f"name the mesh's axes with data_axis= (the batch) and model_axis= (tensor parallel), e.g. "
         f"data_axis={names[0]!r}" + (f", model_axis={names[-1]!r}" if len(names) > 1 else "") +
         ", or build it with jax.make_mesh((dp, tp), ('data', 'model'))")
  both = set(data) & set(model)
  if both:
    raise ValueError(f"mesh {mesh}: axis {sorted(both)[0]!r} is named as both the data axis and the model "
                     f"axis ({data_axis=}, {model_axis=}); {fix}")
  for group, default, what, given in ((data, DATA, "data_axis", data_axis), (model, MODEL, "model_axis", model_axis)):
    for n in group:
      if n not in names and group != (default,):
        raise ValueError(f"mesh {mesh} has no axis {n!r} ({what}={given!r}); its axes are {names}: {fix}")
  data = tuple(n for n in data if n in names)
  model = tuple(n for n in model if n in names)
  rest = tuple(n for n in names if n not in data + model)
  big = [n for n in rest if mesh.shape[n] > 1]
  if big:
    raise ValueError(f"mesh {mesh}: axis {big[0]!r} (size {mesh.shape[big[0]]}) is neither the data axis "
                     f"{data_axis!r} nor the model axis {model_axis!r}; {fix}")
  order = [names.index(n) for n in data + model + rest]
  dp = int(np.prod([mesh.shape[n] for n in data], dtype=np.int64))
  tp = int(np.prod([mesh.shape[n] for n in model], dtype=np.int64))
  devices = np.transpose(mesh.devices, order).reshape(dp, tp)
  return jax.sharding.Mesh(devices, (DATA, MODEL), axis_types=_AUTO)


def resolve_mesh(mesh=None, data_axis=DATA, model_axis=MODEL):
  """`normalize_mesh` of the mesh given, else of the one set with `jax.set_mesh` around the call (None when
  neither): what `load`, `generate` and the serving `Engine` run on."""
  if mesh is None:
    ambient = jax.sharding.get_mesh()
    mesh = None if ambient.empty else ambient
  return normalize_mesh(mesh, data_axis, model_axis)


def to_host(x) -> np.ndarray:
  """x as a numpy array, whole, on every process: an array whose shards lie in other processes too (a mesh over
  several processes, `jax.distributed.initialize`) is gathered from them (every process must call this)."""
  if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_readable(tree):
  """The pytree with its leaves of rank <= 1 that span other processes' devices (a cache's lengths: read on the
  host before a decode loop) replicated on their mesh, so every process can read them; unchanged otherwise."""
  def one(x):
    if not isinstance(x, jax.Array) or x.ndim > 1 or x.is_fully_addressable or x.is_fully_replicated:
      return x
    return jax.jit(lambda v: v, out_shardings=NamedSharding(x.sharding.mesh, P()))(x)
  return jax.tree.map(one, tree)


def _fits(mesh, axis: str, size: int) -> bool:
  return size % mesh.shape[axis] == 0


def param_spec(name: str, shape: tuple, mesh) -> P:
  """Where a parameter (flat name "layers/3/wqkv", "embed", ...) lives on the mesh."""
  last = name.rsplit("/", 1)[-1]
  if last in _COLUMNS and _fits(mesh, MODEL, shape[-1]):
    return P(*([None] * (len(shape) - 1) + [MODEL]))
  if last in _ROWS and _fits(mesh, MODEL, shape[0]):
    return P(MODEL, None)
  if last == "embed" and _fits(mesh, MODEL, shape[-1]):
    return P(None, MODEL)
  return P()


def shard_model(model, mesh, data_axis=DATA, model_axis=MODEL):
  """The model with every parameter placed on the mesh (`param_spec`; any mesh: `normalize_mesh`); returns a
  new module."""
  mesh = normalize_mesh(mesh, data_axis, model_axis)
  graphdef, state = nnx.split(model)
  flat = nnx.to_flat_state(state)
  for path, var in flat:
    name = "/".join(str(p) for p in path)
    x = var.get_value()
    var.set_value(jax.device_put(x, NamedSharding(mesh, param_spec(name, x.shape, mesh))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def shard_batch(x, mesh):
  """A batch-major array split over "data" (whole when the data axis does not divide its batch)."""
  mesh = normalize_mesh(mesh)
  x = jax.numpy.asarray(x)
  spec = P(DATA, *([None] * (x.ndim - 1))) if _fits(mesh, DATA, x.shape[0]) else P()
  return jax.device_put(x, NamedSharding(mesh, spec))


def cache_spec(shape: tuple, mesh, head_axis: int | None) -> P:
  """Batch over "data", the KV-head axis (when there is one and it divides) over "model"."""
  spec = [None] * len(shape)
  if shape and _fits(mesh, DATA, shape[0]):
    spec[0] = DATA
  if head_axis is not None and _fits(mesh, MODEL, shape[head_axis]):
    spec[head_axis] = MODEL
  return P(*spec)


def constrain_cache(cache):
  """Inside a jit under `jax.set_mesh(mesh)`: the cache's leaves constrained to `cache_spec` (leaves of rank
  >= 2 carry KV heads on axis 1: k, v and the method state's kt pages, scores, positions, v_sum; the state's
  [B] leaves go over "data" like length and pos). Outside a mesh: unchanged."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA not in mesh.axis_names:
    return cache

  def put(x):
    return jax.lax.with_sharding_constraint(x, cache_spec(x.shape, mesh, 1 if x.ndim >= 2 else None))
  return jax.tree.map(put, cache)


def using(mesh):
  """`jax.set_mesh(mesh)` (traces under it place caches and run kernels per device), or nothing for None."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(normalize_mesh(mesh))


def default_impl(mesh) -> str | None:
  """The decode path a mesh of several devices runs unless asked otherwise: "xla" (the kernels run per device
  under shard_map, but are checked in interpret mode on CPU devices only); None without such a mesh."""
  return "xla" if mesh is not None and mesh.devices.size > 1 else None


def active_mesh():
  """The mesh set with `jax.set_mesh` (with axes data and model), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA not in mesh.axis_names or MODEL not in mesh.axis_names:
    return None
  return mesh


def per_shard(fn, args, head_axes, out_head_axes, *, heads: int | None = None):
  """fn(*args) run per device with jax.shard_map over the active mesh, for functions (kernel calls) that XLA
  cannot partition: every array is split by batch (axis 0) over "data" and, where `head_axes` names an axis
  (one entry per arg pytree; None for none), by heads over "model" when the model axis divides `heads`, else
  kept whole (every model shard then computes the same thing). Without a mesh: fn(*args).

  args: a tuple of pytrees; head_axes / out_head_axes: per arg / per output pytree, an int axis or None
  (applied to every leaf of rank > that axis; leaves of rank 1 are split by batch only), or WHOLE (not split:
  weights)."""
  mesh = active_mesh()
  if mesh is None:
    return fn(*args)
  split_heads = heads is not None and heads % mesh.shape[MODEL] == 0

  def specs(tree, axis):
    def one(x):
      if axis == WHOLE:  # e.g. a norm's weight: every device gets all of it
        return P()
      return cache_spec(x.shape, mesh, axis if split_heads and axis is not None and x.ndim > axis else None)
    return jax.tree.map(one, tree)

  in_specs = tuple(specs(a, ax) for a, ax in zip(args, head_axes))
  out_shapes = jax.eval_shape(fn, *args)
  if isinstance(out_head_axes, tuple):
    out_specs = tuple(specs(o, ax) for o, ax in zip(out_shapes, out_head_axes))
  else:
    out_specs = specs(out_shapes, out_head_axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

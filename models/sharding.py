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
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["DATA", "MODEL", "active_mesh", "cache_spec", "constrain_cache", "default_impl", "make_mesh", "param_spec",
           "per_shard", "shard_batch", "shard_model", "using"]

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
  return jax.sharding.Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), (DATA, MODEL))


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


def shard_model(model, mesh):
  """The model with every parameter placed on the mesh (`param_spec`); returns a new module."""
  graphdef, state = nnx.split(model)
  flat = nnx.to_flat_state(state)
  for path, var in flat:
    name = "/".join(str(p) for p in path)
    x = var.get_value() if hasattr(var, "get_value") else var.value
    placed = jax.device_put(x, NamedSharding(mesh, param_spec(name, x.shape, mesh)))
    if hasattr(var, "set_value"):
      var.set_value(placed)
    else:
      var.value = placed
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def shard_batch(x, mesh):
  """A batch-major array split over "data" (whole when the data axis does not divide its batch)."""
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
  >= 2 carry KV heads on axis 1: k, v, kt pages, scores, positions, v_sum). Outside a mesh: unchanged."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA not in mesh.axis_names:
    return cache

  def put(x):
    return jax.lax.with_sharding_constraint(x, cache_spec(x.shape, mesh, 1 if x.ndim >= 2 else None))
  return jax.tree.map(put, cache)


def using(mesh):
  """`jax.set_mesh(mesh)` (traces under it place caches and run kernels per device), or nothing for None."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


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

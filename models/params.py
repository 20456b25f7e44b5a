"""A Llama's parameters as arrays: the loaders' layout fused into the module's (`fuse_params`, `from_params`), flat
<-> nested names, and the model's `fingerprint` (what saved caches and histories are stamped with).

The loaders (`gguf.py`, `safetensors_hf.py`) give separate q/k/v and gate/up kernels [in, out]; the module holds
them fused (wqkv, w_gate_up), so a layer's projections are one matmul each.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .llama import Llama, LlamaConfig

__all__ = ["FUSED_PARTS", "fingerprint", "flatten_params", "from_params", "fuse_params", "part_shapes",
           "unflatten_params"]


# Fused kernel -> its parts in column order, as the loaders (weights.py) name them.
FUSED_PARTS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up"), "bqkv": ("bq", "bk", "bv")}


def part_shapes(config: LlamaConfig) -> dict:
  D, N, K, H, F = config.dim, config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim
  return {"wq": (D, N * H), "wk": (D, K * H), "wv": (D, K * H), "w_gate": (D, F), "w_up": (D, F),
          "bq": (N * H,), "bk": (K * H,), "bv": (K * H,)}


def fuse_params(config: LlamaConfig, params: dict, cast=None) -> dict:
  """Flat {"layers/<i>/<name>": array} with the loaders' separate wq/wk/wv and w_gate/w_up
  concatenated along the output axis into the module's wqkv and w_gate_up (other entries and an
  already fused dict pass through). Concatenates with numpy when the parts are numpy arrays; `cast`,
  if given, is applied to each fused kernel as it is made (so one host copy is alive at a time)."""
  flat = dict(flatten_params(params))
  shapes = part_shapes(config)
  for i in range(config.n_layers):
    lp = f"layers/{i}/"
    for fused, parts in FUSED_PARTS.items():
      names = [lp + p for p in parts]
      if not any(n in flat for n in names):
        continue
      missing = [n for n in names if n not in flat]
      if missing:
        raise ValueError(f"parameter names do not match the model: missing {missing}")
      if lp + fused in flat:
        raise ValueError(f"parameter names do not match the model: unexpected {[lp + fused]} "
                         f"next to {names} (give one layout, separate or fused)")
      for n, p in zip(names, parts):
        if tuple(flat[n].shape) != shapes[p]:
          raise ValueError(f"parameter {n}: shape {tuple(flat[n].shape)}, expected {shapes[p]}")
      arrays = [flat.pop(n) for n in names]
      if all(isinstance(a, np.ndarray) for a in arrays):  # along the output axis (the last: kernels and biases)
        out = np.concatenate(arrays, axis=-1)
      else:
        out = jnp.concatenate([jnp.asarray(a) for a in arrays], axis=-1)
      flat[lp + fused] = out if cast is None else cast(out)
      del arrays, out
  return flat


def from_params(config: LlamaConfig, params: dict, dtype=jnp.float32) -> Llama:
  """Builds a Llama from a dict of arrays (nested, or flat with "/"-joined names).

  Accepts the loaders' layout (separate wq/wk/wv, w_gate/w_up; see weights.py), which is fused here
  into the module's wqkv and w_gate_up, or an already fused dict laid out as the module.
  """
  abstract = nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  want = nnx.to_pure_dict(state)
  flat_want = dict(flatten_params(want))
  flat_got = dict(flatten_params(params))
  # Check names against the layout given: when any separate part name appears, expect the separate
  # names for every layer, so errors name wq/wk/wv/w_gate/w_up rather than the fused kernels.
  separate = {p for parts in FUSED_PARTS.values() for p in parts}
  if any(k.rsplit("/", 1)[-1] in separate for k in flat_got):
    shapes = part_shapes(config)
    expect = {}
    for name, leaf in flat_want.items():
      pre, last = name.rsplit("/", 1) if "/" in name else ("", name)
      if last in FUSED_PARTS:
        expect.update({f"{pre}/{p}": shapes[p] for p in FUSED_PARTS[last]})
      else:
        expect[name] = tuple(leaf.shape)
  else:
    expect = {name: tuple(leaf.shape) for name, leaf in flat_want.items()}
  missing = sorted(set(expect) - set(flat_got))
  extra = sorted(set(flat_got) - set(expect))
  if missing or extra:
    raise ValueError(f"parameter names do not match the model: missing {missing[:8]}, unexpected {extra[:8]}")
  for name, shape in expect.items():
    if tuple(flat_got[name].shape) != shape:
      raise ValueError(f"parameter {name}: shape {tuple(flat_got[name].shape)}, expected {shape}")
  fused = fuse_params(config, flat_got, cast=lambda a: jnp.asarray(a, dtype))
  pure = unflatten_params({k: jnp.asarray(v, dtype) for k, v in fused.items()})
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def flatten_params(d, prefix=()):
  """("a/b/c", x) for every array of a nested dict {"a": {"b": {"c": x}}}."""
  for k, v in d.items():
    if isinstance(v, dict):
      yield from flatten_params(v, prefix + (k,))
    else:
      yield "/".join(str(p) for p in prefix + (k,)), v


def unflatten_params(flat: dict) -> dict:
  """{"a/b/c": x} -> {"a": {"b": {"c": x}}} (numeric keys become list indices where the module has lists)."""
  out: dict = {}
  for name, v in flat.items():
    parts = [int(p) if p.isdigit() else p for p in name.split("/")]
    node = out
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = v
  return out


def fingerprint(model: Llama) -> str:
  """A short hash naming the model: its config, dtype and a strided sample of its weights (every 4099th
  element of each array, so it is cheap at 70B and still tells two checkpoints of one config apart). Saved
  caches and histories are stamped with it."""
  h = hashlib.sha256(model.config.to_json().encode())
  for x in jax.tree.leaves(nnx.state(model)):
    h.update(f"{x.shape}{x.dtype}".encode())
    h.update(np.asarray(x.reshape(-1)[::4099].astype(jnp.float32)).tobytes())
  return h.hexdigest()[:16]

"""Checkpoint loading without torch: `load` takes the embedded SmolLM2 GGUF, any Llama GGUF, a HF checkpoint
directory (safetensors, sharded or not; Llama, Mistral, Qwen2) or a hub id from the local Hugging Face cache.

Where each part lives:
- `gguf.py`: GGUF files (`read_gguf`: dequantized to numpy; `smollm2_path`; the Q/K permutation);
- `safetensors_hf.py`: HF checkpoint directories (`stream_hf_dir`: tensor by tensor from the memory-mapped
  files to the device, cast there, so host memory stays near one tensor);
- `weight_cache.py`: the orbax cache of a GGUF's converted weights, checked against its manifest on each load
  and rebuilt when it fails; temp folders of killed saves are removed;
- `checkpoint.py`: `CheckpointError` (re-exported here) and the per-layer tensor table both formats share;
- this module: `load` (picks the source and the format, uses the cache, places the model on a mesh),
  `load_tokenizer` (the same sources, the tokenizer alone) and `checkpoint_dtype`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings

import numpy as np

from . import catalog, hub, shapes
from .checkpoint import CheckpointError
from .gguf import read_gguf, read_gguf_tokenizer, smollm2_path
from .params import from_params, fuse_params
from .safetensors_hf import stream_hf_dir
from .tokenizer import TextTokenizer, tokenizer_from_hf_dir
from .weight_cache import (CacheIntegrityWarning, cache_key, default_cache_dir, load_cache, remove_stale_temps,
                           save_cache, verify_cache)

__all__ = ["CheckpointError", "checkpoint_dtype", "load", "load_tokenizer"]


def _placed(model, mesh):
  if mesh is None:
    return model
  from .sharding import shard_model
  return shard_model(model, mesh)


def checkpoint_dtype(path: str) -> str:
  """The dtype a checkpoint's weights are stored in: a HF config's torch_dtype (or dtype), else float32."""
  cfg_path = os.path.join(path, "config.json")
  if os.path.isdir(path) and os.path.isfile(cfg_path):
    try:
      with open(cfg_path) as f:
        hf = json.load(f)
      name = hf.get("torch_dtype") or hf.get("dtype")
    except (OSError, ValueError, AttributeError):
      name = None
    if name in ("bfloat16", "float16", "float32"):
      return name
  return "float32"


def load(source: str = "smollm2", *, dtype=None, cache_dir: str | None = None, use_cache: bool = True,
         log=None, mesh=None, data_axis="data", model_axis="model"):
  """(model, tokenizer) from "smollm2", "random:<shape>" (`shapes`: random bf16 weights, for speed), an alias of
  `catalog` ("qwen2.5-1.5b": `rocketkv fetch` first), a .gguf path, a HF checkpoint directory (safetensors; model_type llama,
  mistral or qwen2), or a hub id "org/name" found in the local Hugging Face cache (`hub.resolve`: nothing is
  downloaded; HF_HUB_CACHE / HF_HOME say where the cache is).

  Safetensors stream straight to the device (no cache: it would hold the same bytes). A GGUF's converted
  weights are saved with orbax under cache_dir (default ~/.cache/rocketkv_jax or $ROCKETKV_CACHE), keyed by
  the source's path, size and mtime, so the next load skips dequantization.
  Each cache folder carries a manifest (size and sha256 of every file), checked on every load: a cache
  that fails the check (or cannot be read) is never used; it is reported (a CacheIntegrityWarning and
  `log`) and rebuilt from the source. Temp folders left by killed saves are removed.
  mesh: any `jax.sharding.Mesh` (`jax.make_mesh`, explicit or auto axes, or `sharding.make_mesh`) whose batch
  and tensor-parallel axes are named data_axis / model_axis (default "data" / "model"; `sharding.normalize_mesh`,
  which raises ValueError naming the mesh and the fix before any weight is read): the parameters are placed on
  it (`sharding.param_spec`: tensor parallel over the model axis); None: the mesh set with `jax.set_mesh`
  around the call, else the default device.
  dtype: parameter dtype (default float32); "auto" takes the checkpoint's own (a HF config's torch_dtype /
  dtype, e.g. bfloat16; float32 for GGUF, whose quantized tensors are dequantized).
  """
  import jax.numpy as jnp

  from .sharding import resolve_mesh
  mesh = resolve_mesh(mesh, data_axis, model_axis)  # before any weight is read: a mesh that cannot map fails now
  log = log or (lambda msg: None)
  if shapes.is_random(source):  # a named shape with random weights and a byte-level stand-in tokenizer
    model, tok = shapes.random_model(source, None if dtype == "auto" else dtype, mesh)
    log(f"{source}: random {jnp.dtype(model.dtype).name} weights of the {source[len(shapes.PREFIX):]} shape "
        f"(speed measurements only: its text is noise)")
    return model, tok
  path = _source_path(source, cache_dir, log)
  dtype = jnp.dtype(checkpoint_dtype(path) if dtype == "auto" else (dtype or jnp.float32))
  is_gguf = os.path.isfile(path)
  if not is_gguf and not os.path.isdir(path):
    raise CheckpointError(f"{path}: neither a file nor a directory")

  def reject(cdir, what):
    msg = f"weight cache {cdir} {what}; rebuilding it from {path}"
    warnings.warn(msg, CacheIntegrityWarning, stacklevel=3)
    log(msg)

  cdir = None
  rejected = False
  if use_cache and is_gguf:
    root = cache_dir or default_cache_dir()
    cdir = os.path.join(root, cache_key(path, dtype.name))
    remove_stale_temps(root, log)
    if os.path.isdir(cdir):
      t0 = time.perf_counter()
      problems = verify_cache(cdir)
      t_check = time.perf_counter() - t0
      if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        reject(cdir, f"failed its integrity check: {'; '.join(problems[:4])}{more}")
        rejected = True
      else:
        try:
          cfg, params, tok = load_cache(cdir, dtype)
          model = from_params(cfg, params, dtype)
          log(f"loaded converted weights from {cdir} in {time.perf_counter() - t0:.1f}s "
              f"(integrity check {t_check:.2f}s)")
          return _placed(model, mesh), tok
        except Exception as e:  # intact but unreadable (another version's layout?): rebuild it
          reject(cdir, f"is unreadable: {type(e).__name__}: {e}")
          rejected = True
  t0 = time.perf_counter()
  if not is_gguf:  # safetensors: streamed to the device, no converted copy kept (it would be the same bytes)
    model, tok = stream_hf_dir(path, dtype, log)
    log(f"loaded {path} ({dtype.name}) in {time.perf_counter() - t0:.1f}s")
    return _placed(model, mesh), tok
  cfg, params, tok = read_gguf(path, log)
  # fused into the module's layout on the host, in the target dtype, one kernel at a time (a 1.5B model is
  # 7 GB in float32): the cache holds that layout, so a cached load moves the restored arrays as they are
  params = fuse_params(cfg, params, cast=lambda a: np.ascontiguousarray(a, dtype))
  for k in list(params):
    params[k] = np.ascontiguousarray(params.pop(k), dtype)
  log(f"converted {path} in {time.perf_counter() - t0:.1f}s")
  if cdir is not None:
    try:
      save_cache(cdir, cfg, params, tok)
      log(f"saved converted weights to {cdir}")
    except Exception as e:  # caching is an optimisation; never fail a load over it
      log(f"could not save the weight cache to {cdir}: {e}")
      if rejected:  # do not leave a cache that failed its check for the next load to re-check
        shutil.rmtree(cdir, ignore_errors=True)
  for k in list(params):  # onto the device tensor by tensor, freeing each host copy
    params[k] = jnp.asarray(params.pop(k), dtype)
  model = from_params(cfg, params, dtype)
  return _placed(model, mesh), tok


def _source_path(source: str, cache_dir: str | None, log) -> str:
  """The file or folder a (non-random) model source names (`load`'s sources)."""
  if source == "smollm2":
    return smollm2_path()
  if catalog.is_alias(source):  # a model `rocketkv fetch` assembled from the package index
    try:
      path = catalog.resolve(source, os.path.join(cache_dir, "models") if cache_dir else None, log=log)
    except catalog.ModelNotFetched as e:
      raise CheckpointError(str(e)) from None
    log(f"{source}: {path}")
    return path
  if hub.is_hub_id(source):
    try:
      path = hub.resolve(source)
    except hub.HubCheckpointMissing as e:
      raise CheckpointError(str(e)) from None
    log(f"{source}: {path}")
    return path
  path = os.path.expanduser(source)
  if not os.path.exists(path):
    raise CheckpointError(f"model source {source!r} not found: expected 'smollm2', a .gguf file, a HF "
                          f"checkpoint directory or a hub id org/name (looked at {os.path.abspath(path)})")
  return path


def load_tokenizer(source: str = "smollm2", *, cache_dir: str | None = None, log=None) -> TextTokenizer:
  """The tokenizer `load(source)` would return, without reading any weight: a GGUF's from its metadata, a HF
  folder's from its tokenizer files, a random shape's byte-level stand-in."""
  log = log or (lambda msg: None)
  if shapes.is_random(source):
    shapes.shape(source)  # an unknown shape is a ValueError naming the shapes
    return shapes.ByteTokenizer()
  path = _source_path(source, cache_dir, log)
  if os.path.isfile(path):
    return read_gguf_tokenizer(path)
  config = {}
  if os.path.isfile(os.path.join(path, "config.json")):
    with open(os.path.join(path, "config.json")) as f:
      config = json.load(f)
  return tokenizer_from_hf_dir(path, config)

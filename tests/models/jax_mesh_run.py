"""Run by tests/models/test_jax_mesh.py in a fresh process with 8 fake CPU devices (the flag must be set before
jax starts): meshes built the way a JAX user builds them -- `jax.make_mesh` (explicit axes, jax's default, and
auto axes) and `jax.sharding.Mesh` with the user's own axis names -- through `load(path, mesh=)`, `generate` and
the serving `Engine`, on the tiny Llama, Qwen2 and Mistral checkpoints, against the same runs unsharded; and the
meshes that cannot map fail with a ValueError before any weight is read. Prints one JSON line: {case: passed}."""
import json
import os
import sys
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
warnings.filterwarnings("ignore")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from rocketkv_jax.models import generate, load  # noqa: E402
from rocketkv_jax.serving import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from rocketkv_jax.serving import engine as engine_mod  # noqa: E402
from rocketkv_jax.serving.engine import DeviceEngine, fit_slots, slots_for_memory  # noqa: E402

DATA = os.path.join(ROOT, "tests", "models", "data", "hf_tiny")
CHECKPOINTS = ("llama", "qwen2_untied", "qwen2_tied", "mistral")
SHAPES = ((8, 1), (4, 2), (2, 4), (4, 2))  # per checkpoint; tp=2 divides the 2 KV heads, tp=4 does not (kept whole)


def main():
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 190, n).tolist() for n in (150, 90, 190, 20, 120, 64, 180, 10)]
  kw = dict(token_budget=32, max_new_tokens=8, temperature=0.0)
  result = {}
  # one shape per checkpoint (every shape, both methods and the kernels on a mesh are tests/models/sharded_run.py's,
  # on a tiny Llama): the Qwen2 and Mistral layouts split over tp=2 (dividing the 2 KV heads) and tp=4 (not)
  for name, (dp, tp) in zip(CHECKPOINTS, SHAPES):
    path = os.path.join(DATA, name)
    model, tok = load(path)
    ref = generate(model, tok, prompts, method="rocketkv", impl="xla", **kw).token_ids
    mesh = jax.make_mesh((dp, tp), ("data", "model"))  # explicit axes: jax's default
    sharded, tok_s = load(path, mesh=mesh)
    got = generate(sharded, tok_s, prompts, method="rocketkv", mesh=mesh, **kw).token_ids
    result[f"{name} rocketkv make_mesh({dp},{tp})"] = got == ref

  path = os.path.join(DATA, "llama")
  model, tok = load(path)
  ref = generate(model, tok, prompts, method="rocketkv", impl="xla", **kw).token_ids
  # auto axes; the user's own axis names, named in the API; jax.sharding.Mesh; several axes merged into data
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  devs = np.array(jax.devices())
  cases = {
      "auto make_mesh(4,2)": (auto, {}),
      "make_mesh(2,4) named batch/tensor": (jax.make_mesh((2, 4), ("batch", "tensor")),
                                            dict(data_axis="batch", model_axis="tensor")),
      "Mesh(4,2) named dp/tp": (Mesh(devs.reshape(4, 2), ("dp", "tp")), dict(data_axis="dp", model_axis="tp")),
      "make_mesh tp-major (2,4) model/data": (jax.make_mesh((2, 4), ("model", "data")), {}),
      "make_mesh(8,) data only": (jax.make_mesh((8,), ("data",)), {}),
      "make_mesh(2,2,2) replica+data, model": (jax.make_mesh((2, 2, 2), ("replica", "data", "model")),
                                               dict(data_axis=("replica", "data"))),
  }
  for case, (mesh, axes) in cases.items():
    sharded, tok_s = load(path, mesh=mesh, **axes)
    got = generate(sharded, tok_s, prompts, method="rocketkv", mesh=mesh, **axes, **kw).token_ids
    result[case] = got == ref
  # sampling (the one per-row sampler) on a mesh: the same tokens as unsharded
  skw = dict(kw, temperature=0.7, top_p=0.9, seed=3)
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  sharded, tok_s = load(path, mesh=mesh)
  result["sampled make_mesh(4,2)"] = (generate(sharded, tok_s, prompts, method="rocketkv", mesh=mesh, **skw).token_ids
                                      == generate(model, tok, prompts, method="rocketkv", impl="xla", **skw).token_ids)
  with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"))):  # no mesh passed: the one set around the calls
    sharded, tok_s = load(path)
    result["jax.set_mesh make_mesh(4,2)"] = generate(sharded, tok_s, prompts, method="rocketkv", **kw).token_ids == ref

  # the serving engine on a user's mesh
  ekw = dict(method="rocketkv", token_budget=32, max_slots=8, max_prompt_tokens=200, max_new_tokens=16,
             steps_per_call=4, method_overrides=dict(impl="xla"), history_bytes=0)

  def serve(engine):
    for i, p in enumerate(prompts):
      engine.submit(Request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.7 if i % 2 else 0.0, seed=i)))
    out = {}
    while engine.has_work():
      for e in engine.step():
        out.setdefault(e.request_id, []).extend(e.token_ids)
    return out

  eref = serve(Engine(model, tok, EngineConfig(**ekw)))
  for dp, tp in ((2, 4),):  # (the engine on other shapes: sharded_run.py)
    mesh = jax.make_mesh((dp, tp), ("d", "m"))
    sharded, tok_s = load(path, mesh=mesh, data_axis="d", model_axis="m")
    result[f"engine make_mesh({dp},{tp}) named d/m"] = serve(
        Engine(sharded, tok_s, EngineConfig(**ekw), mesh=mesh, data_axis="d", model_axis="m")) == eref
    # --max-slots auto on this mesh: each device holds its share of a slot (KV heads over m), the slots a multiple
    # of d; the free bytes are those of the mesh's devices (patched: the CPU backend reports none)
    per_slot = DeviceEngine(model, EngineConfig(**ekw)).slot_bytes()
    seen, free = [], engine_mod.device_free_bytes
    engine_mod.device_free_bytes = lambda devices: seen.append(set(devices)) or 100 * per_slot
    try:
      n = fit_slots(sharded, EngineConfig(**ekw), reserve_bytes=0, mesh=mesh, data_axis="d", model_axis="m")
    finally:
      engine_mod.device_free_bytes = free
    result[f"fit_slots make_mesh({dp},{tp})"] = (seen == [set(mesh.devices.flat)] and n % dp == 0 and
                                                 n == dp * slots_for_memory(-(-per_slot // tp), 100 * per_slot, 0))

  # what cannot map: a ValueError naming the mesh and the fix, before the source is even looked at
  missing = os.path.join(ROOT, "no-such-checkpoint")
  bad = {
      "error unknown axis names": (jax.make_mesh((4, 2), ("dp", "tp")), {}, "axis 'dp' (size 4) is neither"),
      "error missing named axis": (jax.make_mesh((4, 2), ("dp", "tp")), dict(data_axis="dp", model_axis="x"),
                                   "has no axis 'x'"),
      "error axis named twice": (jax.make_mesh((4, 2), ("dp", "tp")), dict(data_axis="dp", model_axis="dp"),
                                 "both the data axis and the model axis"),
      "error abstract mesh": (jax.make_mesh((4, 2), ("data", "model")).abstract_mesh, {}, "has no devices"),
  }
  for case, (mesh, axes, needle) in bad.items():
    try:
      load(missing, mesh=mesh, **axes)
      result[case] = False
    except ValueError as e:
      result[case] = needle in str(e) and "Mesh" in str(e) and "jax.make_mesh" in str(e)
  print(json.dumps(result))


if __name__ == "__main__":
  main()

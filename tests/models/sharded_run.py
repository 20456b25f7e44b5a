"""Run by tests/models/test_sharding.py in a fresh process with 8 fake CPU devices (the flag must be set before
jax starts): generate and the serving engine on meshes dp=8, tp=2 x dp=4, tp=8 and dp=2 x tp=4 against the
same runs unsharded. The tiny model has 4 query and 2 KV heads, so tp=2 divides the KV heads and tp=4 / tp=8
do not; the Pallas kernels (interpret mode) run per device under shard_map. Prints one JSON line:
{case: tokens equal}."""
import json
import os
import sys
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from rocketkv_jax.models import generate  # noqa: E402
from rocketkv_jax.models.params import from_params  # noqa: E402
from rocketkv_jax.models.sharding import make_mesh, shard_model  # noqa: E402
from rocketkv_jax.serving import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from tests.models.conftest import tiny_config, tiny_params  # noqa: E402
from tests.helpers.engine import Tok  # noqa: E402

MESHES = ((8, 1), (4, 2), (1, 8), (2, 4))


def main():
  cfg = tiny_config(n_heads=4, n_kv_heads=2)
  model = from_params(cfg, tiny_params(cfg))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 128, n).tolist() for n in (150, 90, 190, 20, 120, 64, 180, 10)]
  result = {}
  for method, meshes in (("rocketkv", MESHES), ("full", ((4, 2), (1, 8)))):
    ref = generate(model, Tok(), prompts, method=method, token_budget=32, max_new_tokens=12,
                   impl="xla").token_ids
    for dp, tp in meshes:
      mesh = make_mesh(dp, tp)
      got = generate(shard_model(model, mesh), Tok(), prompts, method=method, token_budget=32, max_new_tokens=12,
                     mesh=mesh).token_ids
      result[f"generate {method} dp={dp} tp={tp}"] = got == ref

  # the Pallas kernels (interpret mode on CPU) per device under shard_map
  ref = generate(model, Tok(), prompts, method="rocketkv", token_budget=32, max_new_tokens=6,
                 impl="interpret").token_ids
  for dp, tp in ((4, 2), (1, 8)):
    mesh = make_mesh(dp, tp)
    got = generate(shard_model(model, mesh), Tok(), prompts, method="rocketkv", token_budget=32, max_new_tokens=6,
                   mesh=mesh, impl="interpret").token_ids
    result[f"generate kernels dp={dp} tp={tp}"] = got == ref

  kw = dict(method="rocketkv", token_budget=32, max_slots=8, max_prompt_tokens=200, max_new_tokens=16,
            steps_per_call=4, method_overrides=dict(impl="xla"))

  def serve(engine):
    for i, p in enumerate(prompts):
      engine.submit(Request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.7 if i % 2 else 0.0, seed=i)))
    out = {}
    while engine.has_work():
      for e in engine.step():
        out.setdefault(e.request_id, []).extend(e.token_ids)
    return out

  ref = serve(Engine(model, Tok(), EngineConfig(**kw)))
  for dp, tp in ((4, 2), (1, 8)):
    mesh = make_mesh(dp, tp)
    result[f"engine dp={dp} tp={tp}"] = serve(Engine(shard_model(model, mesh), Tok(), EngineConfig(**kw),
                                                     mesh=mesh)) == ref
  print(json.dumps(result))


if __name__ == "__main__":
  main()

"""One of the processes tests/models/test_multiprocess.py starts: `python multiprocess_run.py PROCESS_ID PORT`.
Two of them, each with 4 fake CPU devices, join with `jax.distributed.initialize` (coordinator on 127.0.0.1,
collectives over gloo) and run `generate` over meshes of all 8 devices, the way one process per host runs on
several GPU hosts. Prints one line "RESULT {case: token_ids}"."""
import json
import os
import sys
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.pop("JAX_PLATFORMS", None)
warnings.filterwarnings("ignore")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_platforms", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(process_id: int, port: int):
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                             initialization_timeout=120)
  assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
  from tests.helpers.multiprocess import CASES, prompts, tiny_model
  from rocketkv_jax.models import generate
  from rocketkv_jax.models.sharding import shard_model
  from tests.helpers.engine import Tok
  model = tiny_model()
  result = {}
  for method, dp, tp in CASES:
    mesh = jax.make_mesh((dp, tp), ("data", "model"))  # over both processes' devices
    result[f"{method} {dp}x{tp}"] = generate(shard_model(model, mesh), Tok(), prompts(), method=method,
                                             token_budget=32, max_new_tokens=8, mesh=mesh).token_ids
  from rocketkv_jax.models import load
  from tests.helpers.multiprocess import HF_TINY
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  sharded, tok = load(HF_TINY, mesh=mesh)  # a checkpoint streamed onto a mesh over both processes
  result["load rocketkv 4x2"] = generate(sharded, tok, prompts(), method="rocketkv", token_budget=32,
                                         max_new_tokens=8, mesh=mesh).token_ids
  print("RESULT " + json.dumps(result), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))

"""`python -m benchmarks.accuracy`: the accuracy suite's runner (rocketkv_jax.eval.runner), under the name the
results' recorded commands use."""
from rocketkv_jax.eval.runner import main

main(prog="python -m benchmarks.accuracy")

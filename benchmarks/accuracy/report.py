"""`python -m benchmarks.accuracy.report`: merge runs and render them (rocketkv_jax.eval.report), under the name
the results' READMEs use."""
from rocketkv_jax.eval.report import main

if __name__ == "__main__":
  main(prog="python -m benchmarks.accuracy.report")

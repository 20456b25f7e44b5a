"""`python -m rocketkv_jax.eval`: the accuracy suite's CLI (runner.main)."""
from .runner import main

main()

"""The accuracy suite lives in the package, `rocketkv_jax.eval` (so `rocketkv eval` works from an installed
wheel); `python -m benchmarks.accuracy` and `python -m benchmarks.accuracy.report` stay as its checkout front
ends. See README.md beside this file.
"""
from rocketkv_jax.eval import GENERATORS, TASKS, Sample, fidelity_text, make_samples, score

__all__ = ["GENERATORS", "TASKS", "Sample", "fidelity_text", "make_samples", "score"]

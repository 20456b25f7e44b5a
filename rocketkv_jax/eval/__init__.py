"""The accuracy suite: RULER-style long-context tasks over real prose, and fidelity to full KV, over method specs x
token budgets x context lengths. `rocketkv eval` runs it (any checkpoint); so do `python -m rocketkv_jax.eval` and,
in a checkout, `python -m benchmarks.accuracy` (benchmarks/accuracy/README.md: the method and the H200 runs).

Modules, each importing only those before it: `tasks` (haystack from data/, generators, scoring), `engine` (shared
dense prefill, ahead-of-time compilation, compression, decode through the one decode loop, the query-agnostic
mode, fidelity, the attention-mass diagnostic), `cells` (row identities and the resumable cells file),
`plot_style` (one colour per method in every plot), `report` (summary, confidence intervals, markdown, plots,
merge), `runner` (grid, method specs, `evaluate`: the one driver behind every front end).
"""
from .tasks import GENERATORS, TASKS, Sample, fidelity_text, make_samples, score

__all__ = ["GENERATORS", "TASKS", "Sample", "fidelity_text", "make_samples", "score"]

"""Accuracy suite: RULER-style long-context tasks over real prose, and fidelity to full KV.

Run `python -m benchmarks.accuracy --help` from the repository root; see README.md beside this file.
"""
from benchmarks.accuracy.tasks import GENERATORS, TASKS, Sample, fidelity_text, make_samples, score

__all__ = ["GENERATORS", "TASKS", "Sample", "fidelity_text", "make_samples", "score"]

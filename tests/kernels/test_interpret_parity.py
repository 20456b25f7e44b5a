"""The CPU suite runs the kernel bodies the GPU compiles: nothing in kernels/ branches on interpret mode
(no body, no wrapper padding for it) except `triton_util.masked_scatter`, whose docstring says why. (The
import rules of kernels/ are checked with the rest of the layering in tests/test_structure.py.)"""
from __future__ import annotations

import ast
import pathlib

import rocketkv_jax.kernels

KERNEL_DIR = pathlib.Path(rocketkv_jax.kernels.__file__).parent
MODULES = sorted(KERNEL_DIR.glob("*.py"))
# Names that mean "interpret mode" in a condition.
INTERPRET_NAMES = {"interpret", "masked_gather", "masked_scatter"}  # the flag and its former aliases


def _interpret_branches(tree):
  """Names of the functions holding an `if` (statement or expression) whose test mentions interpret."""
  found = []
  for fn in ast.walk(tree):
    if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
      continue
    for node in ast.walk(fn):
      if isinstance(node, (ast.If, ast.IfExp)):
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if names & INTERPRET_NAMES:
          found.append(getattr(fn, "name", "<lambda>"))
  return found


def test_only_masked_scatter_branches_on_interpret():
  branches = {path.name: _interpret_branches(ast.parse(path.read_text())) for path in MODULES}
  assert {name: fns for name, fns in branches.items() if fns} == {"triton_util.py": ["masked_scatter"]}

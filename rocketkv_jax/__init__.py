"""rocketkv-jax: RocketKV two-stage KV-cache compression (ICML 2025) for JAX, with Pallas GPU kernels.

prefill -> `prefill_compress` (stage 1, per layer) -> `decode_step` (stage 2, per token per layer).
Each method is one module of `rocketkv_jax.methods`; each op's semantics and kernel meet in `ops`.
"""
import importlib.abc
import importlib.util
import os
import sys


class _CheckoutLayout(importlib.abc.MetaPathFinder):
  """`rocketkv_jax.kernels` and `rocketkv_jax.models` from a checkout that is not installed.

  The repository keeps the kernels and the model at its top level (`kernels/`, `models/`); an install maps them
  into this package (pyproject.toml's package-dir). With only the checkout on sys.path, this finder maps the two
  names to those folders, the same files an install uses, and nothing else."""

  def __init__(self, root: str):
    self.root = root

  def find_spec(self, fullname, path=None, target=None):
    prefix, _, name = fullname.rpartition(".")
    if prefix != __name__ or name not in ("kernels", "models"):
      return None
    folder = os.path.join(self.root, name)
    return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])


_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(_HERE)
if (not os.path.isdir(os.path.join(_HERE, "kernels"))
    and os.path.isfile(os.path.join(_CHECKOUT, "kernels", "__init__.py"))):
  sys.meta_path.insert(0, _CheckoutLayout(_CHECKOUT))

# The package's names, after the finder (api imports the kernels).
from rocketkv_jax.api import decode_step, in_jit_checks, prefill_compress
from rocketkv_jax.budget import BudgetPlan, plan_budget
from rocketkv_jax.cache import CacheSpec, KVCache, RowPlan, cache_nbytes, concat_caches
from rocketkv_jax.methods import (METHODS, REGISTRY, BatchPlan, ExactTopKConfig, FullConfig, H2OConfig, HSAConfig,
                                  MethodConfig, QuestConfig, RocketKVConfig, RocketKVPlusConfig, SnapKVConfig,
                                  SparQConfig, StreamingLLMConfig, get_method, make_config, plan_limits, plan_rows,
                                  plan_static)

CONFIGS = REGISTRY  # name -> config class (the method)

__all__ = [
    "BatchPlan", "BudgetPlan", "CONFIGS", "CacheSpec", "ExactTopKConfig", "FullConfig", "H2OConfig", "HSAConfig", "KVCache",
    "METHODS", "MethodConfig", "QuestConfig", "REGISTRY", "RocketKVConfig", "RocketKVPlusConfig", "SnapKVConfig",
    "SparQConfig", "StreamingLLMConfig", "cache_nbytes", "concat_caches", "decode_step", "get_method", "in_jit_checks",
    "make_config", "plan_budget", "plan_limits", "plan_rows", "plan_static", "prefill_compress", "RowPlan",
]

"""rocketkv-jax: RocketKV two-stage KV-cache compression (ICML 2025) for JAX, with Pallas GPU kernels.

prefill -> `prefill_compress` (stage 1, per layer) -> `decode_step` (stage 2, per token per layer).
Each method is one module of `rocketkv_jax.methods`; each op's semantics and kernel meet in `ops`.
"""
from rocketkv_jax.api import decode_step, in_jit_checks, prefill_compress
from rocketkv_jax.budget import BudgetPlan, plan_budget
from rocketkv_jax.cache import CacheSpec, KVCache, RowPlan, cache_nbytes, concat_caches
from rocketkv_jax.methods import (METHODS, REGISTRY, BatchPlan, ExactTopKConfig, FullConfig, H2OConfig, HSAConfig,
                                  MethodConfig, QuestConfig, RocketKVConfig, RocketKVPlusConfig, SnapKVConfig,
                                  SparQConfig, StreamingLLMConfig, get_method, make_config, plan_limits, plan_rows)

CONFIGS = REGISTRY  # name -> config class (the method)

__all__ = [
    "BatchPlan", "BudgetPlan", "CONFIGS", "CacheSpec", "ExactTopKConfig", "FullConfig", "H2OConfig", "HSAConfig", "KVCache",
    "METHODS", "MethodConfig", "QuestConfig", "REGISTRY", "RocketKVConfig", "RocketKVPlusConfig", "SnapKVConfig",
    "SparQConfig", "StreamingLLMConfig", "cache_nbytes", "concat_caches", "decode_step", "get_method", "in_jit_checks",
    "make_config", "plan_budget", "plan_limits", "plan_rows", "prefill_compress", "RowPlan",
]

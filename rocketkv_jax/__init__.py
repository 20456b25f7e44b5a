"""rocketkv-jax: RocketKV two-stage KV-cache compression (ICML 2025) for JAX, with Pallas GPU kernels.

prefill -> `prefill_compress` (stage 1, per layer) -> `decode_step` (stage 2, per token per layer).
"""
from rocketkv_jax.api import decode_step, prefill_compress
from rocketkv_jax.budget import BudgetPlan, plan_budget
from rocketkv_jax.cache import KVCache, cache_nbytes, concat_caches
from rocketkv_jax.config import (CONFIGS, METHODS, ExactTopKConfig, FullConfig, H2OConfig, HSAConfig,
                                 MethodConfig, QuestConfig, RocketKVConfig, SnapKVConfig, SparQConfig,
                                 StreamingLLMConfig, make_config)

__all__ = [
    "BudgetPlan", "CONFIGS", "ExactTopKConfig", "FullConfig", "H2OConfig", "HSAConfig", "KVCache", "METHODS",
    "MethodConfig", "QuestConfig", "RocketKVConfig", "SnapKVConfig", "SparQConfig", "StreamingLLMConfig",
    "cache_nbytes", "concat_caches", "decode_step", "make_config", "plan_budget", "prefill_compress",
]

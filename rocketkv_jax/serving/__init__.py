"""Serving: the continuous-batching engine (`engine.py`) and, on top of it, the OpenAI-compatible server.

The top layer: it may import `rocketkv_jax.models` and the core; nothing imports it.
"""

from .engine import (Engine, EngineConfig, Prefilled, QueueFull, Request, SamplingParams, TokenEvent,
                     default_buckets, insert_jit)

__all__ = ["Engine", "EngineConfig", "Prefilled", "QueueFull", "Request", "SamplingParams", "TokenEvent",
           "default_buckets", "insert_jit"]

"""Serving: the device engine (`engine.py`: prefill, insert, generate over an explicit decode state), the scheduler
callers construct as `Engine` (`scheduler.py`: queue, slots, admission, session reuse), the output processor
(`output.py`), the engine's thread (`runner.py`) and the OpenAI-compatible server on top (`server.py`).

The top layer: it may import `rocketkv_jax.models` and the core; nothing imports it.
"""

from .engine import (Context, DecodeState, DeviceEngine, EngineConfig, Prefilled, Request, SamplingParams,
                     default_buckets, insert_jit)
from .output import TokenEvent
from .scheduler import Engine, QueueFull

__all__ = ["Context", "DecodeState", "DeviceEngine", "Engine", "EngineConfig", "Prefilled", "QueueFull", "Request",
           "SamplingParams", "TokenEvent", "default_buckets", "insert_jit"]

"""Flax NNX Llama models wired to the RocketKV core (installed as rocketkv_jax.models)."""

from .llama import (Llama, LlamaConfig, compress_layers, decode, forward_full, prefill,
                    prefill_dense)
from .tokenizer import TextTokenizer
from .weights import CheckpointError, gguf_permute, gguf_unpermute, load

__all__ = [
    "Llama", "LlamaConfig", "prefill", "decode", "forward_full", "prefill_dense", "compress_layers",
    "TextTokenizer", "CheckpointError", "gguf_permute", "gguf_unpermute", "load",
]
from .generate import GenerateResult, GenerateStats, generate  # noqa: E402

__all__ += ["GenerateResult", "GenerateStats", "generate"]

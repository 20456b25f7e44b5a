"""Flax NNX Llama models wired to the RocketKV core (installed as rocketkv_jax.models).

llama.py (the model: prefill, the decode step and its per-layer pieces), loop.py (the one decode loop),
generate.py (text in, text out), the loaders (weights.py: `load`, over gguf.py, safetensors_hf.py and
weight_cache.py; tokenizer.py), demo.py. The `rocketkv` CLI lives in rocketkv_jax.serving (the top layer).
"""

from .generate import GenerateResult, GenerateStats, generate
from .gguf import gguf_permute, gguf_unpermute
from .llama import (Llama, LlamaConfig, compress_layers, decode, forward_full, prefill,
                    prefill_dense)
from .loop import LoopConfig, LoopOutput, decode_loop
from .tokenizer import TextTokenizer
from .weights import CheckpointError, load

__all__ = [
    "Llama", "LlamaConfig", "prefill", "decode", "forward_full", "prefill_dense", "compress_layers",
    "LoopConfig", "LoopOutput", "decode_loop", "GenerateResult", "GenerateStats", "generate",
    "TextTokenizer", "CheckpointError", "gguf_permute", "gguf_unpermute", "load",
]

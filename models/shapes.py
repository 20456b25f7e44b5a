"""Named model shapes with random weights: `load("random:llama-3.1-8b")` (and `rocketkv serve --model
random:llama-3.1-8b`) builds the shape's model with random bf16 weights and a byte-level stand-in tokenizer, so that
speed can be measured end to end (the server under load, on a machine without the checkpoint) at the real
model's shape. Speed does not depend on the weights' values; the text such a model writes is noise.

The stand-in tokenizer (`ByteTokenizer`) is a real `tokenizers` byte-level BPE without merges: one token per
UTF-8 byte (256 ids) plus ChatML's special tokens, and a ChatML chat template. The model's vocabulary stays the
shape's (128,256 for Llama-3.1-8B: its LM head costs what the real one does); ids past the tokenizer's decode as
the byte id % 256.
"""
from __future__ import annotations

from .llama import LlamaConfig
from .tokenizer import TextTokenizer

__all__ = ["LLAMA_31_405B", "LLAMA_31_70B", "LLAMA_31_8B", "SHAPES", "TINY", "ByteTokenizer", "random_model"]

LLAMA_31_8B = LlamaConfig(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    norm_eps=1e-5, tie_embeddings=False, max_len=131072 + 1024)
LLAMA_31_70B = LlamaConfig(
    vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672,
    rope_theta=500000.0, rope_scaling=LLAMA_31_8B.rope_scaling, norm_eps=1e-5, tie_embeddings=False,
    max_len=131072 + 1024)
LLAMA_31_405B = LlamaConfig(
    vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128, ffn_dim=53248,
    rope_theta=500000.0, rope_scaling=LLAMA_31_8B.rope_scaling, norm_eps=1e-5, tie_embeddings=False,
    max_len=131072 + 1024)
TINY = LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256,
                   tie_embeddings=False, max_len=8192)
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B, "llama-3.1-405b": LLAMA_31_405B, "tiny": TINY}
PREFIX = "random:"
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def is_random(source) -> bool:
  return isinstance(source, str) and source.startswith(PREFIX)


def shape(source: str) -> LlamaConfig:
  """The LlamaConfig named by "random:<shape>" (ValueError naming the shapes)."""
  name = source[len(PREFIX):] if is_random(source) else source
  if name not in SHAPES:
    raise ValueError(f"model source {source!r}: unknown shape {name!r}; random weights come in "
                     f"{', '.join(PREFIX + s for s in SHAPES)}")
  return SHAPES[name]


class ByteTokenizer(TextTokenizer):
  """The stand-in tokenizer of random-weight models (module doc)."""

  def __init__(self):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    super().__init__(tokenizer=tok, bos_id=None, eos_id=tok.token_to_id("<|endoftext|>"), chat_template=_CHATML)
    self.n_bytes = len(alphabet)

  def decode(self, ids, *, skip_special: bool = True) -> str:
    vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
    return super().decode([i if i < vocab else i % self.n_bytes for i in ids], skip_special=skip_special)


def random_model(source: str, dtype=None, mesh=None):
  """(model with random weights of the named shape, ByteTokenizer); dtype default bfloat16."""
  import jax.numpy as jnp
  from flax import nnx

  from .llama import Llama
  from .sharding import shard_model
  cfg = shape(source)
  model = Llama(cfg, dtype=jnp.dtype(dtype or jnp.bfloat16), rngs=nnx.Rngs(0))
  if mesh is not None:
    model = shard_model(model, mesh)
  return model, ByteTokenizer()

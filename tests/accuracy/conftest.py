"""A small byte-level BPE tokenizer trained on the haystack, and a random tiny Llama over its vocabulary."""
import jax.numpy as jnp
import pytest
import tokenizers
from flax import nnx
from tokenizers import decoders, models, pre_tokenizers, trainers

from rocketkv_jax.eval.tasks import haystack_sentences
from rocketkv_jax.models import Llama, LlamaConfig, TextTokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tk.train_from_iterator(list(haystack_sentences()) + ["VAR ABCDE = 12345. 0123456789"], trainer)
  template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  return TextTokenizer(tokenizer=tk, bos_id=None, eos_id=0, chat_template=template)


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
  cfg = LlamaConfig(vocab_size=tiny_tokenizer.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=128, max_len=1024, eos_id=0)
  return Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))

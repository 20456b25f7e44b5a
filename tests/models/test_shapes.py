"""Random-weight models of a named shape (`models/shapes.py`): what `load("random:...")` and `rocketkv serve
--model random:llama-3.1-8b` run for speed measurements."""

import json

import numpy as np
import pytest

from rocketkv_jax.models import generate, load
from rocketkv_jax.models.shapes import LLAMA_31_8B, SHAPES, ByteTokenizer
from rocketkv_jax.serving.cli import main


def test_random_tiny_loads_and_generates():
  model, tok = load("random:tiny")
  assert model.config == SHAPES["tiny"] and np.dtype(model.dtype) == np.dtype("bfloat16")
  assert isinstance(tok, ByteTokenizer)
  ids = tok.encode("Ab ü")
  assert tok.decode(ids) == "Ab ü" and len(ids) == 5  # one token per UTF-8 byte
  assert tok.decode([ids[0] + 256 * 7]) == tok.decode([ids[0]])  # ids past the tokenizer: the byte id % 256
  out = generate(model, tok, ["hello"], method="full", max_new_tokens=3, chat=False)
  assert 1 <= len(out.token_ids[0]) <= 3 and all(0 <= t < SHAPES["tiny"].vocab_size for t in out.token_ids[0])


def test_the_8b_shape_is_llama_31_8b():
  c = LLAMA_31_8B
  assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == \
      (128256, 4096, 32, 32, 8, 128, 14336)


def test_unknown_shape_is_named(capsys):
  with pytest.raises(ValueError, match="random:llama-3.1-8b"):
    load("random:llama-9")
  assert main(["generate", "--model", "random:llama-9", "--prompt", "x"]) != 0
  assert "unknown shape 'llama-9'" in capsys.readouterr().err


def test_cli_generates_with_random_tiny(capsys):
  assert main(["generate", "--model", "random:tiny", "--prompt", "hi", "--max-new-tokens", "2", "--no-chat",
               "--json", "--method", "full"]) == 0
  rec = json.loads(capsys.readouterr().out)
  assert 1 <= len(rec["token_ids"]) <= 2 and rec["stats"]["method"] == "full"

"""SmolLM2-135M-Instruct against HF transformers on the same GGUF weights (fixture from
make_reference.py): logits, greedy generations of a ragged batch, tokenizer ids, chat template."""

import numpy as np

from rocketkv_jax.models import forward_full, generate


def test_tokenizer_ids_match_hf(smollm2, reference):
  _, tok = smollm2
  f, meta = reference
  for i, text in enumerate(meta["tokenizer_texts"]):
    assert tok.encode(text) == f[f"tok_ids_{i}"].tolist(), text
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_chat_template_matches_reference(smollm2, reference):
  _, tok = smollm2
  f, meta = reference
  for i, (text, chat) in enumerate(meta["greedy_prompts"]):
    assert tok.encode(text, chat=chat) == f[f"greedy_prompt_{i}"].tolist()


def test_logits_match_hf(smollm2, reference):
  model, _ = smollm2
  f, meta = reference
  sub = f["vocab_subset"]
  ids = [f[f"logits_ids_{i}"] for i in range(len(meta["logit_prompts"]))]
  T = max(len(x) for x in ids)
  batch = np.zeros((len(ids), T), np.int32)  # right-padded: valid positions are unaffected
  for b, x in enumerate(ids):
    batch[b, :len(x)] = x
  logits = np.asarray(forward_full(model, batch))
  for b, x in enumerate(ids):
    got = logits[b, :len(x)]
    want = f[f"logits_subset_{b}"]
    np.testing.assert_allclose(got[:, sub], want, atol=2e-3, rtol=1e-3)
    np.testing.assert_array_equal(got.argmax(-1), f[f"logits_argmax_{b}"])
  np.testing.assert_allclose(logits[0, len(ids[0]) - 1], f["logits_last_0"], atol=2e-3, rtol=1e-3)


def test_greedy_matches_hf_ragged_batch(smollm2, reference):
  model, tok = smollm2
  f, meta = reference
  n = len(meta["greedy_prompts"])
  # One ragged batch of all prompts (chat ones end at <|im_end|>, which is also the model's EOS).
  res = generate(model, tok, [f[f"greedy_prompt_{i}"].tolist() for i in range(n)], method="full",
                 max_new_tokens=meta["greedy_new"])
  for i in range(n):
    assert res.token_ids[i] == f[f"greedy_out_{i}"].tolist(), (i, res.texts[i])
  s = res.stats
  assert s.prompt_tokens == [len(f[f"greedy_prompt_{i}"]) for i in range(n)]
  assert s.kv_bytes > 0 and s.full_kv_bytes > 0 and s.decode_steps >= 1

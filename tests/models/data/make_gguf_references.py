"""Makes Qwen2 GGUF test data and its transformers reference outputs, for the GGUF loader (models/gguf.py).

Outputs (the reference side is HF transformers, PyTorch, CPU, float32, eager attention, loading the very .gguf file
with `from_pretrained(folder, gguf_file=name)`, so transformers' own dequantization, name mapping and GGUF
tokenizer reading are part of the reference):

  tests/models/data/gguf_tiny/qwen2_kquants.gguf        tiny random Qwen2, untied (has output.weight)
  tests/models/data/gguf_tiny/qwen2_kquants_tied.gguf   the same shapes, other seed, tied (no output.weight)
  tests/models/data/gguf_tiny/<name>_reference.npz      references for each file (below)
  tests/models/data/gguf_tiny/versions.json             library versions used
  tests/models/fixtures/qwen2_5_coder_1_5b_reference.npz   references for the real Qwen2.5-Coder-1.5B-Instruct
                                                           Q4_K_M GGUF (not shipped; its sha256 is recorded)

The tiny files are written with gguf.GGUFWriter the way llama.cpp's convert_hf_to_gguf.py writes qwen2 (metadata
keys in the same order as the real file: general.*, qwen2.*, general.file_type, tokenizer.*,
general.quantization_version), tensors token_embd / output_norm / output (untied file only) and per block
attn_norm, attn_q|k|v (+ .bias), attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down. Q and K rows are NOT permuted:
llama.cpp permutes them only for the llama architecture, and transformers un-permutes only for llama.

Tiny model: hidden 256, 2 layers, 2 query heads, 1 KV head, head_dim 128, intermediate 512, vocab 352,
context_length 512, rope.freq_base 1e6, rms eps 1e-6. Weights from a seeded numpy Generator with the distributions
of make_hf_references.py: matrices and embeddings N(0, 0.2^2), RMSNorm weights 1 + N(0, 0.2^2) (the final norm 3x
that), q/k/v biases N(0, 0.2^2). Norms and biases are F32; the matrices are spread over the types real Qwen2
GGUFs use (MATRIX_TYPES below): Q4_K, Q5_K, Q6_K (quantizers written here from the ggml block layouts: gguf-py
0.19 only dequantizes K-quants), Q5_0 and Q8_0 (gguf-py's quantizers; llama.cpp's fallback where a row is not a
multiple of 256, as in Qwen2.5-0.5B), F16 and F32. Every quantized tensor is
checked to dequantize (gguf-py) close to the float weights it came from, so the blocks are real blocks.

Tiny tokenizer, in the GGUF metadata as llama.cpp writes a Qwen2 one: tokenizer.ggml.model "gpt2",
tokenizer.ggml.pre "qwen2", tokens = the 256 byte tokens in GPT-2's byte-to-unicode order (ids 0..255, as in
Qwen2's vocab), then the results of 88 byte-level BPE merges learned here from a small fixed corpus split with
Qwen2's pre-tokenizer regex (ids 256..343), then <|endoftext|> 344, <|im_start|> 345, <|im_end|> 346 (type 3,
control), <tool_call> 347, </tool_call> 348 (type 4, user-defined), [PAD349..351] (type 5, unused), like the
real file's tail. bos = pad = 344, eos = 346, add_bos_token false, a short Qwen2 ChatML chat_template.

<name>_reference.npz (tiny):
  input_ids      int32 [2, 24]       two prompts of ordinary token ids (< 344), fixed seed, no BOS
  logits         float32 [2, 24, V]  full-sequence logits of model(input_ids)
  greedy         int32 [2, 20]       generate(do_sample=False, 20 new tokens), one prompt at a time, no eos stop
  greedy_logits  float32 [2, 20, V]  the logits each greedy token was chosen from (generate's output_logits)
  + the tokenizer reference below, and chat_texts / chat_ids / chat_offsets: apply_chat_template renderings
    (add_generation_prompt=True) of CHAT_CASES and their ids.

qwen2_5_coder_1_5b_reference.npz (real file; RAW_PROMPTS, three raw texts, no BOS, and CHAT_QUESTION rendered by
transformers' apply_chat_template from the GGUF's own template, add_generation_prompt=True):
  gguf_sha256        str                   sha256 of the GGUF the references came from
  prompts            str [4]               the texts as tokenized (the chat one after templating)
  input_ids          int32 [sum len]       prompt ids, ragged: input_ids[input_offsets[i]:input_offsets[i+1]]
  input_offsets      int32 [5]
  versions           str                   JSON of the library versions used
  greedy             int32 [4, 24]         greedy new tokens, one prompt at a time, no eos stop (eos is just a token)
  greedy_gap         float32 [4, 24]       top-1 minus top-2 logit at each greedy step (tells a mismatch from a tie;
                                           the France prompt has a near-tie, 0.0008 at step 20: compare its greedy
                                           ids only up to the first step whose gap is below the test's tolerance)
  greedy_top_ids     int32 [4, 24, 8]      the 8 highest logits at each greedy step, best first, and their values
  greedy_top_logits  float32 [4, 24, 8]
  prompt_top_ids     int32 [sum len, 8]    the same at every prompt position of model(prompt) (ragged as input_ids)
  prompt_top_logits  float32 [sum len, 8]
  + the tokenizer reference below, on the real tokenizer.

Tokenizer reference (both npz kinds): tok_texts str [n] (TOK_TEXTS), tok_ids int32 flat, tok_offsets int32 [n+1]
(string i's ids are tok_ids[tok_offsets[i]:tok_offsets[i+1]]), from AutoTokenizer.from_pretrained(dir,
gguf_file=...), add_special_tokens=False (specials written in the text are matched whole). transformers builds a
tokenizer from a GGUF with the Qwen2 split regex, byte level and NO normalizer (llama.cpp's BPE tokenizer does not
normalize either). Qwen's own tokenizer.json has an NFC normalizer, so tok_ids_nfc / tok_offsets_nfc hold the same
tokenizer with NFC added; the two differ only on strings NFC changes (here only "Cafe\\u0301 vs Caf\\u00e9").

Runs in its own venv outside the repo (torch, transformers and gguf are not project dependencies; Python 3.11
because the CPU torch wheel on this disk is cp311):
    python3.11 -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0        # the CPU wheel (torch-2.13.0+cpu); not a CUDA build
    /tmp/hfref/bin/pip install transformers==5.24.0 gguf==0.19.0 accelerate numpy safetensors tokenizers sentencepiece
    /tmp/hfref/bin/python tests/models/data/make_gguf_references.py
        [--real-gguf /tmp/qw/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf] [--skip-real] [--tiny-dir D] [--fixture F]
Made with transformers 5.24.0, torch 2.13.0+cpu, gguf 0.19.0, tokenizers 0.23.3, numpy 2.4.6, Python 3.11.7.
transformers 5.24 loads qwen2 GGUFs through its legacy path (modeling_gguf_pytorch_utils.load_gguf_checkpoint:
gguf-py dequantizes every tensor to float32, no Q/K permutation for qwen2; it needs `accelerate` installed). The
real file takes ~13 GB peak RSS and ~6 minutes on 2 cores; the tiny files a few seconds. The .npz files are written
with fixed zip timestamps, so a re-run gives identical bytes (checked: two runs, byte-identical outputs).
"""

import argparse
import collections
import copy
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import sys
import zipfile

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader shows a tqdm bar per load

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from tokenizers import Regex, normalizers, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_DIR = os.path.join(HERE, "gguf_tiny")
FIXTURE = os.path.join(os.path.dirname(HERE), "fixtures", "qwen2_5_coder_1_5b_reference.npz")
REAL_GGUF = "/tmp/qw/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
REAL_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"

# ----------------------------------------------------------------------------- tiny model

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CTX = 256, 2, 2, 1, 512, 512  # head_dim = HIDDEN / HEADS = 128
ROPE_THETA, RMS_EPS = 1e6, 1e-6
STD, FINAL_NORM = 0.2, 3.0  # as make_hf_references.py
PROMPT_LEN, N_PROMPTS, NEW_TOKENS = 24, 2, 20

# The 3 special, 2 user-defined and 3 unused tokens close the vocabulary, after the bytes and the merges.
N_BYTES, N_MERGES = 256, 88
SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4), ("</tool_call>", 4),
            ("[PAD349]", 5), ("[PAD350]", 5), ("[PAD351]", 5)]
VOCAB = N_BYTES + N_MERGES + len(SPECIALS)  # 352
ENDOFTEXT, IM_END = N_BYTES + N_MERGES, N_BYTES + N_MERGES + 2

# Every type real Qwen2 GGUFs use, each on several projections (K-quants need rows of a multiple of 256 values,
# Q5_0/Q8_0 of 32: every row here is 256 or 512 long). The tied file swaps the two layers' tables.
MATRIX_TYPES = [
    dict(attn_q=QT.Q4_K, attn_k=QT.Q5_K, attn_v=QT.Q6_K, attn_output=QT.Q5_0, ffn_gate=QT.Q8_0, ffn_up=QT.F16,
         ffn_down=QT.Q6_K),
    dict(attn_q=QT.Q5_0, attn_k=QT.Q8_0, attn_v=QT.F16, attn_output=QT.Q4_K, ffn_gate=QT.Q5_K, ffn_up=QT.F32,
         ffn_down=QT.Q4_K),
]
# name: (tied, seed, token_embd type, output type or None, layer type tables)
TINY_MODELS = {
    "qwen2_kquants": (False, 11, QT.Q4_K, QT.Q6_K, MATRIX_TYPES),  # as Q4_K_M files: embd Q4_K, output Q6_K
    "qwen2_kquants_tied": (True, 12, QT.Q8_0, None, MATRIX_TYPES[::-1]),
}

CHAT_TEMPLATE = (  # Qwen2-Instruct's ChatML template, without the tools branch
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_CASES = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what's 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3 + 3 ?"}],
]

# Qwen2's pre-tokenizer split (transformers' models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX; llama.cpp's
# "qwen2" pre): like cl100k but single digits.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# What the tiny BPE's merges are learned from: words, spaces, newlines, contractions, code, CJK, emoji.
MERGE_CORPUS = [
    "the cat sat on the mat and the dog ate the hat in the hall",
    "there then these those that this the other thing is in it",
    "don't can't won't I'll we'll you'll WE'VE I've they're it's she'd",
    "def main():\n    return 0\n\n\nif __name__ == '__main__':\n    main()\n",
    "    indented    code    with    spaces\n\n\n\t\tand tabs",
    "中文 中文测试 你好 你好世界 中文",
    "emoji 👍 👍🏽 🇫🇷 👍",
    "Café café naïve résumé",
    "hello world, hello there! hello?! hello...",
    "1 2 3 4 5 6 7 8 9 0 12345",
]

# Strings for the pre-tokenizer reference (tiny and real tokenizer).
TOK_TEXTS = [
    "Hello world",
    "12345 and 3.14159",
    "don't I'll WE'VE they're",
    "a  b\n\n  c\t\td",
    "Cafe\u0301 vs Caf\u00e9",
    "\ufb01ne \ufb01",
    "中文测试，你好世界。",
    "emoji 👍🏽 and flags 🇫🇷!",
    "!!!??? ... --- ==> (x):\n",
    "   leading spaces",
    "trailing spaces   ",
    "\n\nnewlines first\r\n",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]

# ----------------------------------------------------------------------------- real model

REAL_NEW_TOKENS, TOP_K = 24, 8
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"]
CHAT_QUESTION = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


# ----------------------------------------------------------------------------- K-quant quantizers
# Block layouts (ggml-common.h; gguf-py's quants.py dequantizes the same): QK_K = 256 values per super-block.
#   block_q4_K: f16 d, f16 dmin, u8 scales[12], u8 qs[128]            x = d*sc[j]*q - dmin*m[j], q in 0..15
#   block_q5_K: f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128] same with q in 0..31 (5th bit in qh)
#   block_q6_K: u8 ql[128], u8 qh[64], i8 scales[16], f16 d           x = d*sc[s]*(q - 32), q in 0..63
# Q4_K/Q5_K: 8 sub-blocks of 32 values with 6-bit scale sc[j] and min m[j], packed 12 bytes (get_scale_min_k4).
# Q6_K: 16 sub-blocks of 16 values with int8 scales. These quantizers are plain round-to-nearest (llama.cpp
# searches for better scales, make_qkx2_quants); the bytes are valid blocks of the type either way.

QK_K = 256


def _f16(x):
  """Rounded to float16 and back: the value a block stores."""
  return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _f16_bytes(x):
  return np.asarray(x, np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a, b):
  return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def _k_scale_min(x, qmax):
  """x [n, 8, 32] -> (d [n], dmin [n], sc [n, 8], m [n, 8], q [n, 8, 32]) with x ~ d*sc*q - dmin*m."""
  lo = np.minimum(x.min(-1), 0)
  scale, minv = (x.max(-1) - lo) / qmax, -lo  # per sub-block, both >= 0
  d, dmin = _f16(scale.max(-1) / 63), _f16(minv.max(-1) / 63)
  sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
  m = np.clip(np.rint(_safe_div(minv, dmin[:, None])), 0, 63).astype(np.uint8)
  step, off = d[:, None] * sc, dmin[:, None] * m
  q = np.clip(np.rint(_safe_div(x + off[..., None], step[..., None])), 0, qmax).astype(np.uint8)
  return d, dmin, sc, m, q


def _pack_k_scales(sc, m):
  """Inverse of get_scale_min_k4: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scale) and 4..7 (min);
  sub-blocks 4..7 with their low 4 bits in bytes 8..11 and their top 2 bits in the top bits of bytes 0..7."""
  out = np.zeros((sc.shape[0], 12), np.uint8)
  out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
  out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
  out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
  return out


def _nibbles(q):
  """q [n, 8, 32] (low 4 bits) -> qs [n, 128]: byte 32*c + l holds sub-block 2c (low) and 2c+1 (high)."""
  lo = q & 0xF
  return (lo[:, 0::2] | (lo[:, 1::2] << 4)).reshape(-1, 128)


def quantize_q4_k(blocks):
  d, dmin, sc, m, q = _k_scale_min(blocks.reshape(-1, 8, 32), 15)
  return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), _nibbles(q)], -1)


def quantize_q5_k(blocks):
  d, dmin, sc, m, q = _k_scale_min(blocks.reshape(-1, 8, 32), 31)
  # qh byte l: bit j is the 5th bit of sub-block j's value l.
  qh = sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8)
  return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh, _nibbles(q)], -1)


def quantize_q6_k(blocks):
  n = blocks.shape[0]
  sub = blocks.reshape(n, 16, 16)
  scale = np.abs(sub).max(-1) / 31  # q - 32 in -31..31
  d = _f16(scale.max(-1) / 127)
  sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
  step = d[:, None] * sc.astype(np.float32)
  q = (np.clip(np.rint(_safe_div(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
  # Each half of 128 values: ql byte 64h + l holds values l (low nibble) and 64 + l (high nibble);
  # qh byte 32h + l holds the top 2 bits of values 32k + l at bits 2k, k = 0..3.
  ql = ((q[:, :, :64] & 0xF) | ((q[:, :, 64:] & 0xF) << 4)).reshape(n, 128)
  hi = (q >> 4).reshape(n, 2, 4, 32)
  qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
  return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], -1)


K_QUANTIZERS = {QT.Q4_K: quantize_q4_k, QT.Q5_K: quantize_q5_k, QT.Q6_K: quantize_q6_k}


def quantize(w, qtype):
  """w float32 [rows, cols] -> what GGUFWriter.add_tensor takes (uint8 blocks [rows, bytes] or a float array),
  checked to dequantize (gguf-py, as transformers does) close to w."""
  if qtype == QT.F32:
    return w.astype(np.float32)
  if qtype == QT.F16:
    return w.astype(np.float16)
  if qtype in K_QUANTIZERS:
    rows, cols = w.shape
    assert cols % QK_K == 0, (cols, qtype)
    data = K_QUANTIZERS[qtype](w.reshape(-1, QK_K)).reshape(rows, -1)
    assert data.shape[1] == cols // QK_K * gguf.GGML_QUANT_SIZES[qtype][1], (data.shape, qtype)
  else:
    data = gguf.quants.quantize(w, qtype)
  back = gguf.quants.dequantize(data, qtype)
  assert back.shape == w.shape and np.isfinite(back).all(), qtype
  err = np.linalg.norm(back - w) / np.linalg.norm(w)
  limit = {QT.Q4_K: 0.12, QT.Q5_K: 0.06, QT.Q6_K: 0.03, QT.Q5_0: 0.06, QT.Q8_0: 0.01}[qtype]
  assert err < limit, (qtype.name, err)  # a mis-packed block would scramble values: error ~1
  return data


# ----------------------------------------------------------------------------- tiny tokenizer


def bytes_to_unicode():
  """GPT-2's byte -> printable character map, in GPT-2's (and Qwen2's) vocabulary order."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(
      range(ord("\u00ae"), ord("\u00ff") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def qwen2_pre_tokenizer():
  return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def learn_merges(corpus, n_merges):
  """Greedy byte-level BPE on the corpus's Qwen2 pre-tokens: the most frequent adjacent pair first, ties broken by
  the pair's spelling. Returns the merges (pairs of token strings) and the new tokens in order."""
  pre = qwen2_pre_tokenizer()
  words = collections.Counter(tuple(piece) for text in corpus for piece, _ in pre.pre_tokenize_str(text))
  known = set(bytes_to_unicode().values())
  merges, new_tokens = [], []
  while len(new_tokens) < n_merges:
    pairs = collections.Counter()
    for w, c in words.items():
      for pair in zip(w, w[1:]):
        pairs[pair] += c
    best = min(pairs, key=lambda p: (-pairs[p], p))
    merges.append(best)
    joined = best[0] + best[1]
    if joined not in known:
      known.add(joined)
      new_tokens.append(joined)
    merged = collections.Counter()
    for w, c in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == best:
          out.append(joined)
          i += 2
        else:
          out.append(w[i])
          i += 1
      merged[tuple(out)] += c
    words = merged
  return merges, new_tokens


def tiny_vocab():
  """(tokens, token_types, merges as 'a b' strings) of the tiny tokenizer."""
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
  from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode
  assert PRETOKENIZE_REGEX == QWEN2_SPLIT
  byte_tokens = list(bytes_to_unicode().values())
  assert byte_tokens == list(hf_bytes_to_unicode().values())
  merges, new_tokens = learn_merges(MERGE_CORPUS, N_MERGES)
  tokens = byte_tokens + new_tokens + [t for t, _ in SPECIALS]
  types = [1] * (N_BYTES + N_MERGES) + [k for _, k in SPECIALS]
  assert len(tokens) == len(set(tokens)) == VOCAB
  return tokens, types, [f"{a} {b}" for a, b in merges]


# ----------------------------------------------------------------------------- tiny GGUF


def tiny_weights(seed, tied):
  """HF-shaped float32 weights ([out, in] matrices) from one seeded generator, in a fixed order."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (rng.standard_normal(shape, dtype=np.float32) * np.float32(STD))
  hd = HIDDEN // HEADS
  w = {"token_embd.weight": normal(VOCAB, HIDDEN)}
  for i in range(LAYERS):
    b = f"blk.{i}."
    w[b + "attn_norm.weight"] = 1 + normal(HIDDEN)
    w[b + "attn_q.weight"], w[b + "attn_q.bias"] = normal(HEADS * hd, HIDDEN), normal(HEADS * hd)
    w[b + "attn_k.weight"], w[b + "attn_k.bias"] = normal(KV_HEADS * hd, HIDDEN), normal(KV_HEADS * hd)
    w[b + "attn_v.weight"], w[b + "attn_v.bias"] = normal(KV_HEADS * hd, HIDDEN), normal(KV_HEADS * hd)
    w[b + "attn_output.weight"] = normal(HIDDEN, HEADS * hd)
    w[b + "ffn_norm.weight"] = 1 + normal(HIDDEN)
    w[b + "ffn_gate.weight"] = normal(FFN, HIDDEN)
    w[b + "ffn_up.weight"] = normal(FFN, HIDDEN)
    w[b + "ffn_down.weight"] = normal(HIDDEN, FFN)
  w["output_norm.weight"] = FINAL_NORM * (1 + normal(HIDDEN))
  if not tied:
    w["output.weight"] = normal(VOCAB, HIDDEN)
  return w


def tensor_type(name, embd_type, out_type, layer_types):
  if name.endswith(".bias") or name.endswith("norm.weight"):
    return QT.F32
  if name == "token_embd.weight":
    return embd_type
  if name == "output.weight":
    return out_type
  layer, proj = name.split(".")[1:3]
  return layer_types[int(layer)][proj]


def write_tiny_gguf(path, name, tied, seed, embd_type, out_type, layer_types):
  tokens, types, merges = tiny_vocab()
  w = tiny_weights(seed, tied)
  writer = gguf.GGUFWriter(path, "qwen2")  # writes general.architecture first
  writer.add_type("model")
  writer.add_name(f"Qwen2 Tiny {name}")
  writer.add_basename("qwen2-tiny")
  writer.add_size_label("1.3M")
  writer.add_block_count(LAYERS)
  writer.add_context_length(CTX)
  writer.add_embedding_length(HIDDEN)
  writer.add_feed_forward_length(FFN)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  writer.add_rope_freq_base(ROPE_THETA)
  writer.add_layer_norm_rms_eps(RMS_EPS)
  writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)  # as the real file says; informational
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("qwen2")
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_eos_token_id(IM_END)
  writer.add_pad_token_id(ENDOFTEXT)
  writer.add_bos_token_id(ENDOFTEXT)
  writer.add_add_bos_token(False)
  writer.add_chat_template(CHAT_TEMPLATE)
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  for tname, arr in w.items():
    qtype = tensor_type(tname, embd_type, out_type, layer_types)
    data = quantize(arr, qtype) if arr.ndim == 2 else arr.astype(np.float32)
    writer.add_tensor(tname, data, raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


# ----------------------------------------------------------------------------- references


def save_npz(path, **arrays):
  """np.savez_compressed with fixed zip timestamps, so the same arrays give the same bytes."""
  tmp = path + ".tmp"
  with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    for key, value in arrays.items():
      value = np.asarray(value)
      assert value.dtype != object, key
      buf = io.BytesIO()
      np.lib.format.write_array(buf, value, allow_pickle=False)
      info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      info.external_attr = 0o644 << 16
      zf.writestr(info, buf.getvalue())
  os.replace(tmp, path)


def ragged(rows):
  """List of int sequences -> (flat int32, offsets int32 [n + 1])."""
  offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
  flat = np.concatenate([np.asarray(r, np.int64) for r in rows] + [np.zeros(0, np.int64)]).astype(np.int32)
  return flat, offsets


def load_model(path):
  d, name = os.path.split(path)
  return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                              attn_implementation="eager").eval()


def load_tokenizer(path):
  d, name = os.path.split(path)
  return AutoTokenizer.from_pretrained(d, gguf_file=name)


def check_config(model, **want):
  cfg = model.config
  rope = getattr(cfg, "rope_parameters", None) or {}
  got = dict(model_type=cfg.model_type, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
             head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
             intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
             rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", None)), rms_norm_eps=cfg.rms_norm_eps,
             tie_word_embeddings=cfg.tie_word_embeddings, use_sliding_window=getattr(cfg, "use_sliding_window", False))
  for k, v in want.items():
    assert got[k] == v if not isinstance(v, float) else abs(got[k] - v) <= 1e-6 * abs(v), (k, got[k], v)
  assert model.model.layers[0].self_attn.q_proj.bias is not None
  return got


GGUF_TO_HF = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
              "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
              "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
              "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
              "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}


def hf_name(gguf_name):
  if gguf_name.startswith("blk."):
    _, i, rest = gguf_name.split(".", 2)
    return f"model.layers.{i}.{GGUF_TO_HF[rest]}"
  return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}[gguf_name]


def check_weights(model, path, names=None):
  """transformers' parameters equal gguf-py's dequantization of the file's tensors: plain [out, in], no Q/K
  permutation, lm_head = token_embd when tied."""
  sd = model.state_dict()
  reader = gguf.GGUFReader(path)
  seen = set()
  for t in reader.tensors:
    if names is not None and t.name not in names:
      continue
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in t.shape[::-1]))
    got = sd[hf_name(t.name)].numpy()
    np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=t.name)
    seen.add(t.name)
  if model.config.tie_word_embeddings:
    assert "output.weight" not in seen
    np.testing.assert_array_equal(sd["lm_head.weight"].numpy(), sd["model.embed_tokens.weight"].numpy())
  return collections.Counter(t.tensor_type.name for t in reader.tensors)


def full_logits(model, ids):
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(ids)[None] if np.ndim(ids) == 1 else ids,
                                 dtype=torch.long)).logits.float().numpy()


def greedy_decode(model, prompt, new_tokens):
  """(new ids [T], logits [T, V]) of greedy decoding with no eos stop."""
  model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = None
  with torch.no_grad():
    out = model.generate(torch.as_tensor(np.asarray(prompt)[None], dtype=torch.long), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True,
                         output_logits=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         temperature=None, top_p=None, top_k=None)
  new = out.sequences[0, len(prompt):].numpy().astype(np.int32)
  logits = torch.stack(out.logits, 1)[0].float().numpy()
  assert new.shape == (new_tokens,) and np.isfinite(logits).all()
  assert (logits.argmax(-1) == new).all()
  # Self-check: one full forward over prompt + greedy tokens predicts the same tokens with the same logits.
  relogits = full_logits(model, np.concatenate([prompt, new]))[0, len(prompt) - 1:-1]
  assert (relogits.argmax(-1) == new).all()
  np.testing.assert_allclose(relogits, logits, atol=2e-3, rtol=1e-4)
  return new, logits


def top2_gap(logits):
  top2 = np.sort(logits, -1)[..., -2:]
  return (top2[..., 1] - top2[..., 0]).astype(np.float32)


def top_k(logits, k=TOP_K):
  ids = np.argsort(-logits, -1, kind="stable")[..., :k]
  return ids.astype(np.int32), np.take_along_axis(logits, ids, -1).astype(np.float32)


def tokenizer_reference(tok):
  """tok_* arrays for TOK_TEXTS: transformers' GGUF tokenizer, and the same with Qwen's NFC normalizer."""
  nfc = copy.deepcopy(tok)
  nfc.backend_tokenizer.normalizer = normalizers.NFC()
  ids, ids_nfc = [], []
  for text in TOK_TEXTS:
    a = tok.encode(text, add_special_tokens=False)
    assert tok.decode(a) == text, text  # byte level: lossless
    ids.append(a)
    ids_nfc.append(nfc.encode(text, add_special_tokens=False))
  flat, offsets = ragged(ids)
  flat_nfc, offsets_nfc = ragged(ids_nfc)
  differ = [t for t, a, b in zip(TOK_TEXTS, ids, ids_nfc) if a != b]
  return dict(tok_texts=np.array(TOK_TEXTS), tok_ids=flat, tok_offsets=offsets, tok_ids_nfc=flat_nfc,
              tok_offsets_nfc=offsets_nfc), ids, differ


def make_tiny(out_dir, name, tied, seed, embd_type, out_type, layer_types):
  path = os.path.join(out_dir, f"{name}.gguf")
  write_tiny_gguf(path, name, tied, seed, embd_type, out_type, layer_types)
  model = load_model(path)
  check_config(model, model_type="qwen2", hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, intermediate_size=FFN, vocab_size=VOCAB,
               rope_theta=ROPE_THETA, rms_norm_eps=RMS_EPS, tie_word_embeddings=tied, use_sliding_window=False)
  types = check_weights(model, path)

  rng = np.random.default_rng(1000 + seed)
  input_ids = rng.integers(0, ENDOFTEXT, size=(N_PROMPTS, PROMPT_LEN)).astype(np.int32)
  logits = full_logits(model, input_ids)
  greedy, greedy_logits = zip(*(greedy_decode(model, row, NEW_TOKENS) for row in input_ids))
  greedy, greedy_logits = np.stack(greedy), np.stack(greedy_logits)

  tok = load_tokenizer(path)
  assert len(tok) == VOCAB, len(tok)
  tok_arrays, tok_ids, differ = tokenizer_reference(tok)
  chat_texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in CHAT_CASES]
  chat_ids = [tok.encode(t, add_special_tokens=False) for t in chat_texts]
  for m, ids in zip(CHAT_CASES, chat_ids):
    direct = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(direct) == ids, (direct, ids)
  for m, ids in zip(CHAT_CASES, chat_ids):  # the specials were matched whole: one <|im_start|> per turn + 1
    assert ids.count(ENDOFTEXT + 1) == len(m) + (m[0]["role"] != "system") + 1, ids
  chat_flat, chat_offsets = ragged(chat_ids)

  save_npz(os.path.join(out_dir, f"{name}_reference.npz"), input_ids=input_ids, logits=logits.astype(np.float32),
           greedy=greedy, greedy_logits=greedy_logits.astype(np.float32), **tok_arrays,
           chat_texts=np.array(chat_texts), chat_ids=chat_flat, chat_offsets=chat_offsets)
  gaps = top2_gap(greedy_logits)
  merged_tokens = sum(1 for ids in tok_ids for i in ids if N_BYTES <= i < ENDOFTEXT)
  print(f"{name}: {os.path.getsize(path) / 1024:.1f} KiB gguf, tensor types {dict(types)}, "
        f"|logits| max {np.abs(logits).max():.2f}, min top1-top2 gap per greedy path "
        f"{[round(float(g), 4) for g in gaps.min(-1)]}, prompt positions {float(top2_gap(logits).min()):.4f}; "
        f"tokenizer: {sum(map(len, tok_ids))} ids over {len(TOK_TEXTS)} strings, {merged_tokens} of them merges; "
        f"NFC changes {differ}")
  assert os.path.getsize(path) < 5 << 20
  assert gaps.min() > 1e-3, gaps.min()


def sha256(path):
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 24), b""):
      h.update(chunk)
  return h.hexdigest()


def make_real(path, fixture, versions):
  digest = sha256(path)
  assert digest == REAL_SHA256, f"{path} has sha256 {digest}, expected {REAL_SHA256}"
  tok = load_tokenizer(path)
  tok_arrays, _, differ = tokenizer_reference(tok)
  chat = tok.apply_chat_template(CHAT_QUESTION, add_generation_prompt=True, tokenize=False)
  prompts = RAW_PROMPTS + [chat]
  prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
  assert list(tok.apply_chat_template(CHAT_QUESTION, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)) == prompt_ids[-1]

  model = load_model(path)
  cfg = check_config(model, model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936,
                     rope_theta=1e6, tie_word_embeddings=False, use_sliding_window=False)
  check_weights(model, path, names={"token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_q.weight",
                                    "blk.0.attn_k.weight", "blk.0.attn_k.bias", "blk.0.attn_v.weight",
                                    "blk.0.ffn_down.weight", "blk.27.attn_output.weight"})

  greedy, greedy_logits, prompt_top = [], [], []
  for ids in prompt_ids:
    new, logits = greedy_decode(model, ids, REAL_NEW_TOKENS)
    greedy.append(new)
    greedy_logits.append(logits)
    prompt_top.append(top_k(full_logits(model, ids)[0]))
  greedy, greedy_logits = np.stack(greedy), np.stack(greedy_logits)
  greedy_top_ids, greedy_top_logits = top_k(greedy_logits)
  gaps = top2_gap(greedy_logits)
  input_ids, input_offsets = ragged(prompt_ids)
  os.makedirs(os.path.dirname(fixture), exist_ok=True)
  save_npz(fixture, gguf_sha256=np.array(digest), prompts=np.array(prompts), input_ids=input_ids,
           input_offsets=input_offsets, greedy=greedy, greedy_gap=gaps, greedy_top_ids=greedy_top_ids,
           greedy_top_logits=greedy_top_logits, prompt_top_ids=np.concatenate([p[0] for p in prompt_top]),
           prompt_top_logits=np.concatenate([p[1] for p in prompt_top]), versions=np.array(json.dumps(versions)),
           **tok_arrays)
  print(f"real: config {cfg}")
  for p, ids, new, g in zip(prompts, prompt_ids, greedy, gaps):
    print(f"  {p!r} ({len(ids)} ids) -> {tok.decode(new)!r}\n    min top1-top2 gap {g.min():.4f} "
          f"at step {int(g.argmin())}; gaps {np.round(g, 3).tolist()}")
  print(f"  tokenizer: NFC changes {differ}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tiny-dir", default=TINY_DIR)
  ap.add_argument("--fixture", default=FIXTURE)
  ap.add_argument("--real-gguf", default=REAL_GGUF)
  ap.add_argument("--skip-real", action="store_true")
  ap.add_argument("--skip-tiny", action="store_true")
  args = ap.parse_args()
  transformers.utils.logging.disable_progress_bar()
  transformers.utils.logging.set_verbosity_error()
  torch.use_deterministic_algorithms(True)
  versions = {"transformers": transformers.__version__, "torch": torch.__version__,
              "gguf": importlib.metadata.version("gguf"), "numpy": np.__version__,
              "tokenizers": tokenizers.__version__, "python": platform.python_version()}
  if not args.skip_tiny:
    os.makedirs(args.tiny_dir, exist_ok=True)
    for name, (tied, seed, embd_type, out_type, layer_types) in TINY_MODELS.items():
      make_tiny(args.tiny_dir, name, tied, seed, embd_type, out_type, layer_types)
    with open(os.path.join(args.tiny_dir, "versions.json"), "w") as f:
      json.dump(versions, f, indent=2)
      f.write("\n")
  if not args.skip_real:
    make_real(args.real_gguf, args.fixture, versions)
  print(json.dumps(versions), file=sys.stderr)


if __name__ == "__main__":
  main()

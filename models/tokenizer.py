"""Tokenizers for Llama checkpoints: built from GGUF metadata (GPT-2 byte-level BPE) or tokenizer.json.

`TextTokenizer` wraps a `tokenizers.Tokenizer` with the model's special ids and chat template.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
from typing import Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the HF pre-tokenizer that matches them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2's split: Llama-3's with every digit alone (\p{N}, not \p{N}{1,3}); Qwen2 also NFC-normalizes first.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# GGUF token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("smollm",):  # every digit alone, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in ("llama-bpe", "llama3", "qwen2"):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), behavior="isolated",
                             invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in (None, "default", "gpt2", "gpt-2"):
    return byte_level
  raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported (smollm, llama-bpe, qwen2, gpt2, default)")


def tokenizer_from_gguf_metadata(tokens: Sequence[str], token_types: Sequence[int],
                                 merges: Sequence[str], pre: str | None) -> tokenizers.Tokenizer:
  """A byte-level BPE `tokenizers.Tokenizer` from GGUF's tokenizer.ggml.* arrays."""
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise ValueError(f"malformed GGUF merge {m!r} (expected two tokens separated by a space)")
    pairs.append((a, b))
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = _pre_tokenizer(pre)
  if pre == "qwen2":  # as Qwen2's tokenizer.json: Unicode NFC before the split
    tok.normalizer = normalizers.NFC()
  tok.decoder = decoders.ByteLevel()
  special = [AddedToken(tokens[i], special=True, normalized=False)
             for i, t in enumerate(token_types) if t == _CONTROL]
  added = [AddedToken(tokens[i], special=False, normalized=False)
           for i, t in enumerate(token_types) if t == _USER_DEFINED]
  tok.add_special_tokens(special)
  if added:
    tok.add_tokens(added)
  return tok


class ChatTemplateError(ValueError):
  """A chat template that cannot be rendered (a syntax error, or its own raise_exception)."""


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None


def render_chat_template(template: str, messages: list[dict], **variables) -> str:
  """A Hugging Face chat template rendered as transformers renders it: jinja2's immutable sandbox (a template
  cannot touch Python objects or change the messages), trim_blocks and lstrip_blocks, loop controls, and the
  `raise_exception`, `tojson` and `strftime_now` helpers templates use."""
  import jinja2
  try:
    return _compiled_template(template).render(messages=messages, **variables)
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"the model's chat template failed: {type(e).__name__}: {e}") from None


@dataclasses.dataclass
class TextTokenizer:
  """Text <-> ids for one model. `eos_id` ends raw generations; `chat_eos_id` ends chat turns."""

  tokenizer: tokenizers.Tokenizer
  bos_id: int | None = None
  eos_id: int | None = None
  add_bos: bool = False
  chat_template: str | None = None
  # the checkpoint's sampling defaults (generation_config.json: temperature, top_p, top_k, eos_ids), used where a
  # caller leaves them unset (the server, the CLI, `generate`); None: the checkpoint has none
  generation: dict | None = None

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def chat_eos_id(self) -> int | None:
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
      i = self.tokenizer.token_to_id(name)
      if i is not None and self.chat_template and name in self.chat_template:
        return i
    return self.eos_id

  def encode(self, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
    """Ids of `text`; with chat=True, of a one-user-turn chat ending in the assistant prompt."""
    if chat:
      text = self.apply_chat([{"role": "user", "content": text}], system=system)
    # encode_batch releases the GIL while it runs (encode holds it: a multi-MB prompt would stall every other
    # thread, a server's event loop included)
    ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

  def apply_chat(self, messages: list[dict], *, system: str | None = None,
                 add_generation_prompt: bool = True) -> str:
    """Renders messages with the model's own chat template (jinja2, in Hugging Face's sandbox settings:
    `render_chat_template`); a model without one gets ChatML (or Llama-3's format when its tokens say so)."""
    tpl = self.chat_template or ""
    if system is not None:
      messages = [{"role": "system", "content": system}] + list(messages)
    if tpl:
      bos = self.tokenizer.id_to_token(self.bos_id) if self.bos_id is not None else ""
      eos = self.tokenizer.id_to_token(self.eos_id) if self.eos_id is not None else ""
      text = render_chat_template(tpl, messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                                  eos_token=eos)
      if self.add_bos and bos and text.startswith(bos):
        text = text[len(bos):]  # encode() adds BOS itself
      return text
    if "<|start_header_id|>" in tpl:
      out = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                    for m in messages)
      return out + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")
    # ChatML (SmolLM2, Qwen, ...), the default.
    out = ""
    default_system = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", tpl, re.S)
    if messages and messages[0]["role"] != "system" and default_system:
      out += f"<|im_start|>system\n{default_system.group(1)}<|im_end|>\n"
    for m in messages:
      out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    if add_generation_prompt:
      out += "<|im_start|>assistant\n"
    return out

  # Persistence next to converted weights.
  def save(self, directory: str) -> None:
    self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
    meta = dict(bos_id=self.bos_id, eos_id=self.eos_id, add_bos=self.add_bos, chat_template=self.chat_template,
                generation=self.generation)
    with open(os.path.join(directory, "tokenizer_meta.json"), "w") as f:
      json.dump(meta, f)

  def save_hf(self, directory: str, *, model_max_length: int | None = None) -> str:
    """A Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json with the chat template), which
    `transformers.AutoTokenizer.from_pretrained(directory)` loads offline, as load generators such as guidellm
    ask for a `processor`. The text round trip is the same; what transformers adds on its own differs: this
    tokenizer adds BOS in `encode`, not in tokenizer.json, so `add_bos_token` says it. Returns directory."""
    os.makedirs(directory, exist_ok=True)
    self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
    name = lambda i: None if i is None else self.tokenizer.id_to_token(i)  # noqa: E731
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_id),
           "eos_token": name(self.eos_id), "add_bos_token": bool(self.add_bos and self.bos_id is not None),
           "add_eos_token": False, "clean_up_tokenization_spaces": False}
    if self.chat_template:
      cfg["chat_template"] = self.chat_template
    if model_max_length:
      cfg["model_max_length"] = int(model_max_length)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=1)
    return directory

  @classmethod
  def load(cls, directory: str) -> "TextTokenizer":
    tok = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_meta.json")) as f:
      meta = json.load(f)
    return cls(tokenizer=tok, **meta)


def tokenizer_from_hf_dir(directory: str, config: dict) -> TextTokenizer:
  """tokenizer.json (+ tokenizer_config.json for the chat template and BOS handling)."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no tokenizer.json in {directory!r} (looked for {path})")
  try:
    tok = tokenizers.Tokenizer.from_file(path)
  except Exception as e:
    raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
  tcfg = {}
  tcfg_path = os.path.join(directory, "tokenizer_config.json")
  if os.path.exists(tcfg_path):
    with open(tcfg_path) as f:
      tcfg = json.load(f)

  def tid(v):
    if isinstance(v, dict):
      v = v.get("content")
    return tok.token_to_id(v) if isinstance(v, str) else None

  bos = config.get("bos_token_id")
  eos = config.get("eos_token_id")
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  bos = tid(tcfg.get("bos_token")) if bos is None else bos
  eos = tid(tcfg.get("eos_token")) if eos is None else eos
  # A post-processor (Llama-3's TemplateProcessing) already adds BOS; add it ourselves only when
  # tokenizer_config asks for it and the tokenizer would not.
  add_bos = bool(tcfg.get("add_bos_token", False))
  if add_bos and bos is not None and tok.encode("a").ids[:1] == [bos]:
    add_bos = False
  if tok.post_processor is not None and bos is not None and tok.encode("a").ids[:1] == [bos]:
    add_bos = True  # we call encode(add_special_tokens=False), so add it ourselves
  return TextTokenizer(tokenizer=tok, bos_id=bos, eos_id=eos, add_bos=add_bos,
                       chat_template=chat_template_of(directory, tcfg), generation=generation_defaults(directory))


def generation_defaults(directory: str) -> dict | None:
  """The sampling defaults of a checkpoint's generation_config.json, as vLLM applies them: temperature, top_p and
  top_k where the file sets them (do_sample: false -> temperature 0, greedy), and its eos_token_id(s) as extra
  stop ids. None without the file; a value of the wrong type is a ValueError naming it."""
  path = os.path.join(directory, "generation_config.json")
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    cfg = json.load(f)
  out = {}
  for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
    v = cfg.get(key)
    if v is None:
      continue
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
      raise ValueError(f"{path}: {key}={v!r} must be a {'number' if kind is float else 'whole number'}")
    out[key] = kind(v)
  if cfg.get("do_sample") is False:
    out["temperature"] = 0.0
  eos = cfg.get("eos_token_id")
  eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
  if isinstance(eos, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos) and eos:
    out["eos_ids"] = sorted(set(eos))
  return out


def read_chat_template(path: str) -> str:
  """A chat template given on its own (`serve --chat-template FILE`), read as transformers reads one: a jinja2
  file's text, or a .json file's "chat_template" (as chat_template.json). It must parse; an unreadable file, a
  .json without the key, or a template with a syntax error is a ValueError naming the path."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    why = (e.strerror or e) if isinstance(e, OSError) else e
    raise ValueError(f"cannot read the chat template {path!r}: {why}") from None
  if path.endswith(".json"):
    try:
      text = json.loads(text)["chat_template"]
    except (ValueError, KeyError, TypeError):
      raise ValueError(f"{path!r}: a .json chat template must be an object with a \"chat_template\" string") from None
    if isinstance(text, list):  # named templates, as tokenizer_config.json holds them
      text = next((t["template"] for t in text if t.get("name") == "default"), text[0]["template"])
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"the chat template {path!r} is empty")
  try:
    _compiled_template(text)
  except ChatTemplateError as e:
    raise ValueError(f"the chat template {path!r} does not parse: {str(e).split(': ', 1)[-1]}") from None
  return text


def chat_template_of(directory: str, tokenizer_config: dict) -> str | None:
  """The chat template where transformers looks for it, first found wins: chat_template.jinja (where current
  checkpoints keep it), chat_template.json ({"chat_template": ...}), then tokenizer_config.json's
  "chat_template" (a string, or a list of named templates: the one named "default")."""
  jinja = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  template = None
  as_json = os.path.join(directory, "chat_template.json")
  if os.path.isfile(as_json):
    with open(as_json, encoding="utf-8") as f:
      template = json.load(f).get("chat_template")
  if template is None:
    template = tokenizer_config.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}]
    template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
  return template

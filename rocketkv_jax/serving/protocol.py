"""The server's wire protocol: pydantic models of the OpenAI request and response bodies (as vLLM's
`protocol.py`), so that a body is checked in one place and `/docs` / `/openapi.json` show real schemas.

Requests (`CompletionRequest`, `ChatCompletionRequest`, `TokenizeRequest`, `DetokenizeRequest`) are validated
strictly (JSON types as sent: `"5"` is not an integer, `true` is not a number) with the engine's own bounds, so a
value the engine would refuse is refused here first, naming its field. Unknown fields are accepted (clients
send vendor extensions); a known field this server does not implement (`REFUSED`) is accepted only at its
neutral value. `parse` turns both kinds of failure into a `RequestError` carrying OpenAI's `param` (the field,
e.g. `temperature` or `messages[0].content`) and `code`, which the server sends as a 400.

Response models document the bodies the server builds (as plain dicts, for speed) in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engine import (MAX_CACHE_SALT, MAX_INT32, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_SEED,
                     MAX_TEMPERATURE)

__all__ = ["REFUSED", "ChatCompletionRequest", "ChatCompletionResponse", "CompletionRequest", "CompletionResponse",
           "DetokenizeRequest", "DetokenizeResponse", "ErrorResponse", "MAX_CACHE_SALT", "MAX_N", "MAX_STOP_STRINGS",
           "RequestError", "TokenizeRequest", "TokenizeResponse", "TokenizerInfo", "param_of", "parse"]

MAX_STOP_STRINGS = 16
MAX_N = 16            # samples per prompt (`n`)

# Fields this server does not implement, accepted only at a neutral value (anything else is a 400 naming the
# field): OpenAI's, then vLLM's sampling extensions.
REFUSED: dict[str, tuple] = {
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "min_p": (None, 0, 0.0),
    "length_penalty": (None, 1, 1.0), "use_beam_search": (None, False), "early_stopping": (None, False),
    "bad_words": (None, []), "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "prompt_logprobs": (None,), "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "typical_p": (None, 1, 1.0),
    "echo_prompt": (None, False), "continue_final_message": (None, False), "add_generation_prompt": (None, True),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,),
}
# Chat's `echo` is vLLM's (echo the last message), not implemented; completions' `echo` is.
CHAT_REFUSED = dict(REFUSED, echo=(None, False))


class RequestError(ValueError):
  """A request body this server refuses: OpenAI's 400 error fields."""

  def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value"):
    super().__init__(message)
    self.message, self.param, self.code = message, param, code


class _Body(BaseModel):
  """A request body: strict JSON types, unknown fields kept."""

  model_config = ConfigDict(extra="allow", strict=True)


def _num(*, ge=None, gt=None, le=None, description: str):
  return Field(None, ge=ge, gt=gt, le=le, allow_inf_nan=False, description=description)


class StreamOptions(_Body):
  include_usage: bool = Field(False, description="send a last chunk with the usage (`choices: []`)")


class _Sampling(_Body):
  """The fields completions and chat share. None (or absent) means the default."""

  model: str = Field(description="the served model's id (`GET /v1/models`)")
  max_tokens: Optional[int] = Field(None, ge=0, le=MAX_INT32,
                                    description="new tokens at most; prompt + max_tokens at most max_model_len "
                                                "(`/v1/models`). Default: all the prompt leaves (completions: 16), "
                                                "at most what the server's slots hold after it. 0: completions "
                                                "with echo only (the prompt and its logprobs, nothing generated)")
  temperature: Optional[float] = _num(ge=0, le=MAX_TEMPERATURE, description="0 is greedy (default: the "
                                      "checkpoint's generation_config.json, else 1)")
  top_p: Optional[float] = _num(gt=0, le=1, description="nucleus sampling (1 is off)")
  top_k: Optional[int] = Field(None, ge=-1, le=MAX_INT32, description="vLLM's: the k most likely only (0 or -1: off)")
  seed: Optional[int] = Field(None, ge=0, le=MAX_SEED,
                              description="the same seed gives the same samples; none: a fresh random seed per "
                                          "request (OpenAI's); sample i of n uses seed + i")
  stop: Union[str, list[str], None] = Field(None, description="strings that end the answer (cut before them)")
  stop_token_ids: Optional[list[int]] = Field(None, description="vLLM's: token ids that end the answer")
  presence_penalty: Optional[float] = _num(ge=-2, le=2, description="subtracted once from the logit of every token "
                                           "already generated")
  frequency_penalty: Optional[float] = _num(ge=-2, le=2, description="subtracted from a token's logit per time it "
                                            "was generated")
  repetition_penalty: Optional[float] = _num(gt=0, le=MAX_REPETITION_PENALTY,
                                             description="vLLM's: the logits of tokens in the prompt or the answer "
                                                         "divided (positive) or multiplied (negative) by it; 1 is off")
  min_tokens: Optional[int] = Field(None, ge=0, le=MAX_INT32, description="vLLM's: no stop before this many tokens")
  ignore_eos: Optional[bool] = Field(None, description="vLLM's: the model's end-of-sequence / end-of-turn tokens do "
                                                       "not end the answer (stop and stop_token_ids still do)")
  logit_bias: Optional[dict[str, float]] = Field(
      None, description=f"token id (as a string) -> bias in [-100, 100] added to its logit; at most "
                        f"{MAX_LOGIT_BIAS} entries")
  n: Optional[int] = Field(None, ge=1, le=MAX_N, description="samples per prompt (greedy gives n equal answers)")
  best_of: Optional[int] = Field(None, description="accepted only when equal to n (no extra samples are drawn)")
  stream: Optional[bool] = Field(None, description="server-sent events")
  stream_options: Optional[StreamOptions] = None
  cache_salt: Optional[str] = Field(None, max_length=MAX_CACHE_SALT,
                                    description="vLLM's: prompt histories (cached_tokens) are shared only between "
                                                "requests with the same salt")
  user: Optional[str] = None

  refused: ClassVar[dict] = REFUSED

  @model_validator(mode="before")
  @classmethod
  def _neutral_only(cls, body):
    """A field this server does not implement is accepted only at its neutral value (`REFUSED`)."""
    if isinstance(body, dict):
      for name, neutral in cls.refused.items():
        v = body.get(name)
        if v is not None and not any(v == x and type(v) is type(x) for x in neutral if x is not None):
          raise RequestError(f"{name}={_short(v)} is not supported by this server", param=name,
                             code="unsupported_parameter")
    return body

  @field_validator("stop")
  @classmethod
  def _stop_strings(cls, v):
    items = [v] if isinstance(v, str) else v
    if items is not None:
      if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(items)} strings; at most {MAX_STOP_STRINGS}")
      if any(not s for s in items):
        raise ValueError("stop strings must not be empty")
    return v

  @field_validator("stop_token_ids")
  @classmethod
  def _token_ids(cls, v):
    if v is not None and any(not 0 <= t <= MAX_INT32 for t in v):
      raise ValueError("token ids must lie in [0, 2**31)")
    return v

  @field_validator("logit_bias")
  @classmethod
  def _bias(cls, v):
    if v is None:
      return v
    if len(v) > MAX_LOGIT_BIAS:
      raise ValueError(f"{len(v)} entries; at most {MAX_LOGIT_BIAS}")
    for key, bias in v.items():
      if not (key.isascii() and key.isdigit()) or int(key) > MAX_INT32:
        raise ValueError(f"key {key!r} is not a token id")
      if not -100 <= bias <= 100:
        raise ValueError(f"bias {bias!r} of token {key} must be in [-100, 100]")
    return v

  @model_validator(mode="after")
  def _across_fields(self):
    n = self.n or 1
    if self.best_of is not None and self.best_of not in (1, n):
      raise RequestError(f"best_of={self.best_of} is not supported: only best_of = n (= {n})", param="best_of",
                         code="unsupported_parameter")
    if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
      raise RequestError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}", param="min_tokens")
    return self

  def stop_strings(self) -> tuple[str, ...]:
    return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

  def bias_pairs(self) -> tuple[tuple[int, float], ...]:
    """logit_bias as SamplingParams takes it: (token id, bias) pairs."""
    return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())


TokenIds = list[int]


class CompletionRequest(_Sampling):
  """POST /v1/completions."""

  prompt: Union[str, TokenIds, list[Union[str, TokenIds]]] = Field(
      description="a string, a list of token ids, or a list of such (one choice each, times n)")
  logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS,
                                  description="return each token's logprob and the k most likely alternatives")
  echo: Optional[bool] = Field(None, description="the answer starts with the prompt (with logprobs: the prompt's "
                                                 "positions first, the first one None)")

  @model_validator(mode="after")
  def _zero_needs_echo(self):
    if self.max_tokens == 0 and not self.echo:
      raise RequestError("max_tokens=0 generates nothing: only with echo (the prompt and, with logprobs, its "
                         "logprobs); ask for at least 1 token", param="max_tokens")
    return self

  @field_validator("prompt")
  @classmethod
  def _non_empty(cls, v):
    if isinstance(v, list) and not v:
      raise ValueError("the prompt list is empty")
    return v

  def prompts(self) -> list:
    """The prompts, each a string or a list of token ids."""
    p = self.prompt
    if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
      return [p]
    return list(p)


class TextPart(_Body):
  type: Literal["text"]
  text: str


class ChatMessage(_Body):
  role: Literal["system", "developer", "user", "assistant"]
  content: Union[str, list[TextPart], None] = Field(None, description="a string or a list of text parts")
  name: Optional[str] = None

  def text(self) -> str:
    c = self.content
    return "" if c is None else c if isinstance(c, str) else "".join(part.text for part in c)


class ChatCompletionRequest(_Sampling):
  """POST /v1/chat/completions."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32, description="OpenAI's name of max_tokens "
                                                                                     "(wins over it)")
  logprobs: Optional[bool] = Field(None, description="return each token's logprob")
  top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS,
                                      description="with logprobs: the k most likely alternatives per token")

  refused: ClassVar[dict] = CHAT_REFUSED

  @model_validator(mode="after")
  def _some_tokens(self):
    if self.max_tokens == 0 and self.max_completion_tokens is None:
      raise RequestError("max_tokens=0 generates nothing (chat has no echo): ask for at least 1 token",
                         param="max_tokens")
    return self

  @model_validator(mode="after")
  def _top_needs_logprobs(self):
    if self.top_logprobs and not self.logprobs:
      raise RequestError(f"top_logprobs={self.top_logprobs} needs logprobs: true", param="top_logprobs")
    return self


class TokenizeRequest(_Body):
  """POST /tokenize: `prompt` (text) or `messages` (rendered by the chat template)."""

  model: Optional[str] = None
  prompt: Optional[str] = None
  messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
  add_special_tokens: bool = Field(True, description="add the BOS token where the model's tokenizer does")
  add_generation_prompt: bool = Field(True, description="with messages: end with the assistant's turn header")

  @model_validator(mode="after")
  def _one_source(self):
    if (self.prompt is None) == (self.messages is None):
      raise RequestError('send {"prompt": str} or {"messages": [...]}', param="prompt", code="invalid_type")
    return self


class DetokenizeRequest(_Body):
  """POST /detokenize."""

  model: Optional[str] = None
  tokens: list[int]


# --- responses (documentation: the server builds these bodies as dicts) -----------------------------------------


class _Out(BaseModel):
  model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Out):
  cached_tokens: int = Field(description="prompt tokens taken from a stored history, not prefilled")


class Usage(_Out):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int
  prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
  """OpenAI's legacy format: one entry per token; with echo, the prompt's first (its first entry None)."""

  tokens: list[str]
  token_logprobs: list[Optional[float]]
  top_logprobs: list[Optional[dict[str, float]]]
  text_offset: list[int]


class CompletionChoice(_Out):
  index: int
  text: str
  logprobs: Optional[CompletionLogprobs] = None
  finish_reason: Optional[Literal["stop", "length", "abort"]] = None


class CompletionResponse(_Out):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage


class TopLogprob(_Out):
  token: str
  logprob: float
  bytes: list[int]


class TokenLogprobOut(TopLogprob):
  top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
  content: list[TokenLogprobOut]


class AssistantMessage(_Out):
  role: Literal["assistant"] = "assistant"
  content: str


class ChatChoice(_Out):
  index: int
  message: AssistantMessage
  logprobs: Optional[ChatLogprobs] = None
  finish_reason: Optional[Literal["stop", "length", "abort"]] = None


class ChatCompletionResponse(_Out):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage


class TokenizeResponse(_Out):
  tokens: list[int]
  count: int
  max_model_len: Optional[int]


class DetokenizeResponse(_Out):
  prompt: str


class TokenizerInfo(_Out):
  """GET /tokenizer_info (vLLM's; lm-eval's `tokenizer_backend=remote` reads it)."""

  eos_token: Optional[str]
  bos_token: Optional[str]
  pad_token: Optional[str]
  chat_template: Optional[str]
  model_max_length: Optional[int]
  vocab_size: int


class ErrorBody(_Out):
  message: str
  type: str
  param: Optional[str]
  code: Optional[str]


class ErrorResponse(_Out):
  error: ErrorBody


# --- parsing ---------------------------------------------------------------------------------------------------


def _short(v: Any, limit: int = 120) -> str:
  text = repr(v)
  return text if len(text) <= limit else text[:limit] + "..."


# the field names of the nested models: a path through them names the param (`messages[0].content`)
_NESTED = set().union(*(m.model_fields for m in (StreamOptions, TextPart, ChatMessage)))
_TYPE_ERRORS = ("_type", "_parsing", "is_instance_of", "literal_error", "union_tag", "model_attributes_type")


def param_of(loc: tuple) -> str | None:
  """`('messages', 0, 'content', 'str')` -> 'messages[0].content': a union's member tags are left out."""
  out = ""
  for part in loc:
    if isinstance(part, int):
      out += f"[{part}]"
    elif not out:
      out = part
    elif part in _NESTED:
      out += "." + part
    else:
      break
  return out or None


def parse(model: type[_Body], body: dict):
  """`model` validated from a JSON object; RequestError naming the field otherwise."""
  try:
    return model.model_validate(body)
  except RequestError:
    raise
  except ValidationError as e:
    errors = e.errors(include_url=False)
    for err in errors:  # a RequestError raised inside a validator: as it is
      cause = (err.get("ctx") or {}).get("error")
      if isinstance(cause, RequestError):
        raise cause from None
    err = errors[0]
    param = param_of(err["loc"])
    kind = err["type"]
    if kind == "missing":
      code = "missing_required_parameter"
      message = f"{param} is required"
    else:
      code = "invalid_type" if any(t in kind for t in _TYPE_ERRORS) else "invalid_value"
      message = f"{param}={_short(err.get('input'))}: {err['msg'].removeprefix('Value error, ')}"
      if len(errors) > 1 and code == "invalid_type" and param in ("prompt", "stop"):  # a union: say what is accepted
        message = {"prompt": "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                   "stop": "stop must be a string or a list of strings"}[param] + f" (got {_short(body.get(param))})"
    raise RequestError(message, param=param, code=code) from None

"""The output processor: a decode call's tokens for one request -> its `TokenEvent` (stop ids, max_tokens, stop
strings, incremental detokenization, logprobs). Host code, run by the engine's thread after each call; it holds
no device state and no lock (the engine calls it under its own).

Stops: the model's EOS and the chat end-of-turn ids, plus each request's `stop_ids`, are checked after each
token, as are `stop_strings` (on the detokenized text; the string and what follows are cut) and `max_tokens`;
tokens a row generated past its stop within the call are discarded. Text that may be the start of a stop string,
or an incomplete UTF-8 character, is held back until it is known.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from .engine import Request

__all__ = ["RequestState", "TokenEvent", "TokenLogprob", "advance", "prompt_logprobs", "token_logprob"]


@dataclasses.dataclass
class TokenEvent:
  """What one step produced for one request.

  token_ids: the new token ids (a stop id is not included; tokens past a stop are dropped). text: the new
  detokenized text (a stop string and what follows it are cut; text that may be the start of a stop string,
  or an incomplete UTF-8 character, is held back until it is known). finish_reason: None while running, else
  "stop" (a stop id or string), "length" (max_tokens) or "abort". prompt_tokens: the prompt's length (with a
  context, context + prompt). completion_tokens: tokens generated so far, a stop id included. cached_tokens:
  prompt tokens not prefilled for this request (taken from the history or a compressed context). queued_s: how
  long it waited for a slot. logprobs: with `SamplingParams.logprobs`, one `TokenLogprob` per entry of token_ids, then
  the stop id's when a stop id ended the request (it is not in token_ids).
  prompt_logprobs: with `SamplingParams.prompt_logprobs`, on the request's first event: one entry per prompt
  token, the first None (nothing precedes it). finish_reason "error": the request failed on its own (`error`
  says why); the other requests go on.
  """

  request_id: str
  token_ids: list[int]
  text: str
  finished: bool
  finish_reason: str | None
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int = 0
  queued_s: float = 0.0  # seconds the request waited in the queue before its prefill began
  logprobs: list[TokenLogprob] | None = None
  prompt_logprobs: list[TokenLogprob | None] | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One position's log-probabilities under the model's raw distribution (log_softmax of its logits, before
  temperature, penalties and bias: vLLM's default `raw_logprobs`). token_id: the token at the position;
  logprob: its log-probability; top: the k most likely (token id, logprob), most likely first (k = the
  request's `logprobs` / `prompt_logprobs`)."""

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class RequestState:
  """Host state of a request in a slot: what the output processor has taken from its tokens so far."""

  request: "Request"
  prompt_tokens: int      # its context's and its prompt's tokens
  stops: frozenset
  cached: int = 0         # prompt tokens not prefilled
  sampled: int = 0        # tokens the loop has sampled for it (its next token index)
  generated: list = dataclasses.field(default_factory=list)  # kept token ids (no stop id)
  completion: int = 0     # tokens generated, a stop id included
  sent: str = ""          # text already emitted
  done: bool = False      # finished or aborted: tokens of calls still in flight are dropped
  queued_s: float = 0.0   # seconds between submit and the start of its prefill
  scores: object = None   # the prompt's PromptScores until its first event carries them
  serial: int = 0         # which insert made it (the processing arrays are rebuilt when the active set changes)



def advance(tokenizer, a: RequestState, row: list[int], scores=None) -> TokenEvent | None:
  """Takes a call's tokens for one request: stop ids, max_tokens, stop strings (checked after each token, so
  the tokens after the one that completes a stop string are dropped), then the text delta. scores: the row's
  (token_logprobs, top_ids, top_logprobs) from a processed call."""
  s = a.request.sampling
  new, reason, text = [], None, None
  lps = [] if s.logprobs is not None else None
  start = max(0, len(a.sent) - max(map(len, s.stop_strings), default=0))
  for j, t in enumerate(row):
    if t < 0:
      break
    a.completion += 1
    if t in a.stops:
      reason = "stop"
      if lps is not None:  # the stop id's own logprob is kept (vLLM does; lm-eval's echo scoring counts on it)
        lps.append(token_logprob(t, scores, j, s.logprobs))
      break
    new.append(t)
    if lps is not None:
      lps.append(token_logprob(t, scores, j, s.logprobs))
    if s.stop_strings:
      text = tokenizer.decode(a.generated + new)
      hits = [k for k in (text.find(stop, start) for stop in s.stop_strings) if k >= 0]
      if hits:
        text, reason = text[:min(hits)], "stop"
        break
    if len(a.generated) + len(new) >= s.max_tokens:
      reason = "length"
      break
  a.generated.extend(new)
  if text is None:
    text = tokenizer.decode(a.generated)
  end = len(text)
  if reason is None:
    while end > 0 and text[end - 1] == "\ufffd":  # an incomplete UTF-8 character: wait for its bytes
      end -= 1
    hold = 0
    for stop in s.stop_strings:  # a tail that may start a stop string: wait until it is known
      hold = max([hold] + [k for k in range(1, min(len(stop), end + 1)) if text[:end].endswith(stop[:k])])
    end -= hold
  delta = text[len(a.sent):end] if end > len(a.sent) and text.startswith(a.sent) else ""
  a.sent += delta
  if not new and not delta and reason is None and a.scores is None:
    return None
  prompt_lps, a.scores = prompt_logprobs(a.request, a.scores), None
  return TokenEvent(a.request.request_id, new, delta, reason is not None, reason, a.prompt_tokens,
                    a.completion, a.cached, a.queued_s, logprobs=lps, prompt_logprobs=prompt_lps)


def token_logprob(token: int, scores, j: int, k: int) -> TokenLogprob:
  """TokenLogprob of column j of a row's (token_logprobs, top_ids, top_logprobs), its k most likely kept."""
  tlp, tid, tv = scores
  return TokenLogprob(int(token), float(tlp[j]), tuple(zip(tid[j, :k].tolist(), tv[j, :k].tolist())))


def prompt_logprobs(request: "Request", scores) -> list[TokenLogprob | None] | None:
  """A request's prompt logprobs from its prefill's PromptScores (batch 1, entry t scores token t + 1)."""
  if scores is None:
    return None
  tlp, tid, tv = (np.asarray(x)[0] for x in scores)
  ids, k = request.prompt_ids, request.sampling.prompt_logprobs
  return [None] + [token_logprob(ids[t + 1], (tlp, tid, tv), t, k) for t in range(len(ids) - 1)]

"""Prompt logprobs at the API: ``echo`` + ``logprobs`` on completions, and vLLM's ``prompt_logprobs``.

- ``echo: true`` with ``logprobs: n`` asks the engine for prompt logprobs with the same n, and the
  choice's ``logprobs`` covers the prompt's tokens before the generated ones, as OpenAI's legacy
  completions did: the first prompt token has ``null`` in ``token_logprobs`` and ``top_logprobs``
  (nothing predicts it); ``text_offset`` counts characters from the start of the echoed text, each
  token's offset the previous one's plus the length of its decoded text (a token that holds part of a
  multi-byte character decodes to U+FFFD, so past such a token offsets follow the tokens, not the text).
- ``prompt_logprobs: k`` (completions and chat, not streamed) returns vLLM's shape: a list with None
  first, then per prompt token ``{token id: {logprob, rank, decoded_token}}`` for the prompt token and
  the top-k (per choice on completions, once per response on chat).
"""

from __future__ import annotations

from typing import Any

from kvfleet_common.openai_protocol import CompletionLogprobs, CompletionRequest
from kvfleet_engine.outputs import Logprob, PromptLogprobs

# JSON has no -inf; OpenAI clients expect a number. -9999 is what the OpenAI API itself reports for an
# impossible token (a masked one under structured outputs, say).
LOGPROB_FLOOR = -9999.0


def finite_logprob(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def engine_kwargs(req: CompletionRequest, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams keyword arguments of a completion: echo + logprobs asks for prompt logprobs too."""
    if req.echo and req.logprobs is not None:
        kwargs["prompt_logprobs"] = max(req.logprobs, kwargs.get("prompt_logprobs") or 0)
    return kwargs


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's ``prompt_logprobs`` as JSON-ready values (token ids become the keys' strings)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if pos is None
        else {
            str(tid): {
                "logprob": finite_logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tid, lp in pos.items()
        }
        for pos in prompt_logprobs
    ]


def _top(pos: dict[int, Logprob], num: int) -> dict[str, float]:
    """The position's top ``num`` tokens by rank, and the scored token itself (OpenAI's legacy shape)."""
    out: dict[str, float] = {}
    ranked = sorted(pos.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
    scored = next(iter(pos.values()))  # the first entry is the token at this position
    for lp in ranked:
        if lp is scored or (lp.rank is not None and lp.rank <= num):
            out.setdefault(lp.decoded_token or "", finite_logprob(lp.logprob))
    return out


def asked_prompt_logprobs(req: CompletionRequest, prompt) -> list | None:
    """A completion choice's ``prompt_logprobs``: only when the request set the field (not for echo)."""
    return prompt_logprobs_json(prompt.prompt_logprobs) if req.prompt_logprobs is not None else None


def echoed(prompt, num: int, output_processor, generated: CompletionLogprobs | None) -> CompletionLogprobs:
    """An echoed choice's ``logprobs``: the prompt's tokens (a ``PreparedPrompt`` with the engine's prompt
    logprobs), then the generated ones (whose offsets already count the echoed text)."""
    part = echoed_prompt_logprobs(
        prompt.token_ids, prompt.prompt_logprobs, num, output_processor.decode_token
    )
    return with_generated(part, generated)


def echoed_prompt_logprobs(
    prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None, num: int, decode
) -> CompletionLogprobs:
    """The prompt's part of an echoed choice's ``logprobs`` (offsets from 0, the echoed text's start)."""
    lp = CompletionLogprobs()
    offset = 0
    for i, tid in enumerate(prompt_token_ids):
        pos = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) else None
        entry = pos.get(tid) if pos else None
        token = entry.decoded_token if entry is not None and entry.decoded_token is not None else decode(tid)
        lp.tokens.append(token)
        lp.token_logprobs.append(None if entry is None else finite_logprob(entry.logprob))
        lp.top_logprobs.append(None if pos is None else _top(pos, num))
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def with_generated(
    prompt_part: CompletionLogprobs, generated: CompletionLogprobs | None
) -> CompletionLogprobs:
    """The prompt's entries followed by the generated tokens' (whose offsets already count the echo)."""
    if generated is not None:
        prompt_part.tokens += generated.tokens
        prompt_part.token_logprobs += generated.token_logprobs
        prompt_part.top_logprobs += generated.top_logprobs
        prompt_part.text_offset += generated.text_offset
    return prompt_part

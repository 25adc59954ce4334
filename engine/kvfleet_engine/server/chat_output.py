"""A chat request's generations as OpenAI choices and stream chunks: content, tool calls, logprobs.

One ``ChatShaper`` per request. Choice ``i`` of the response is the engine's sample ``i``; when the request's
``ChatOutputPlan`` reads tool calls, each choice's text goes through its own parser (``tool_parser.py``),
fed as the text streams, or whole for a non-streamed answer, with the same result.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvfleet_common.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from kvfleet_engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_engine.server.chat_structure import ChatOutputPlan
from kvfleet_engine.server.completion_logprobs import finite_logprob
from kvfleet_engine.server.tool_parser import parse_whole


class ChatShaper:
    def __init__(self, plan: ChatOutputPlan, model_name: str, top_logprobs: int) -> None:
        self.plan = plan
        self.model_name = model_name
        self.top_logprobs = top_logprobs

    def choices(self, outs: list[CompletionOutput]) -> list[ChatChoice]:
        """The choices of a whole (non-streamed) response."""
        choices = []
        for c in outs:
            parser = self.plan.new_parser()
            if parser is None:
                message = ChatResponseMessage(content=c.text)
            else:
                content, calls = parse_whole(parser, c.text)
                message = ChatResponseMessage(content=content, tool_calls=calls or None)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self.logprobs(c),
                    finish_reason=self.plan.finish_reason(parser, c.finish_reason),
                    stop_reason=c.stop_reason,
                )
            )
        return choices

    def chunks(
        self, rec, created: int, prompts, req, n: int, i: int, out: RequestOutput, state: dict
    ) -> Iterator[dict]:
        """The stream chunks of one engine delta (``OpenAIServing._stream``'s chunker). ``state`` maps a
        choice's index to its parser (None: no parsing) once its role chunk was sent."""
        for c in out.outputs:
            choices = []
            if c.index not in state:
                state[c.index] = self.plan.new_parser()
                choices.append(
                    ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))
                )
            parser = state[c.index]
            if parser is None:
                deltas = [DeltaMessage(content=c.text or None)] if c.text else []
            else:
                deltas = parser.feed(c.text) if c.text else []
                if c.finish_reason is not None:
                    deltas += parser.finish()
            if not deltas and (c.finish_reason is not None or c.logprobs):
                deltas = [DeltaMessage()]
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                choices.append(
                    ChatChunkChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=self.logprobs(c) if last else None,
                        finish_reason=self.plan.finish_reason(parser, c.finish_reason) if last else None,
                        stop_reason=c.stop_reason if last else None,
                    )
                )
            for choice in choices:
                yield ChatCompletionChunk(
                    id=rec.request_id, created=created, model=self.model_name, choices=[choice]
                ).model_dump(exclude_none=False)

    def logprobs(self, c: CompletionOutput) -> ChatLogprobs | None:
        if c.logprobs is None:
            return None
        content = []
        for pos, tid in zip(c.logprobs, c.token_ids):
            sampled = pos.get(tid) or next(iter(pos.values()))
            token = sampled.decoded_token or ""
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=finite_logprob(sampled.logprob),
                    bytes=list(token.encode()),
                    top_logprobs=_chat_top(pos, self.top_logprobs),
                )
            )
        return ChatLogprobs(content=content)


def _chat_top(pos: dict[int, Logprob], k: int) -> list[TopLogprob]:
    """The k most likely tokens at a position (by rank), whatever was sampled."""
    ranked = sorted(pos.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
    seen: list[TopLogprob] = []
    for lp in ranked:
        if len(seen) == k:
            break
        tok = lp.decoded_token or ""
        seen.append(TopLogprob(token=tok, logprob=finite_logprob(lp.logprob), bytes=list(tok.encode())))
    return seen

"""EngineCoreOutputs -> RequestOutputs: detokenize incrementally, match stop strings, build logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_engine.core.messages import EngineCoreOutput
from kvfleet_engine.detokenizer import IncrementalDetokenizer
from kvfleet_engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from kvfleet_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SequenceState:
    """One sequence (an n>1 request has several) as the frontend tracks it."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.output_text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: dict[str, SequenceState]  # engine request id -> sequence
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    # Set from the first output that carries them (every sequence of the request computes them).
    prompt_logprobs: PromptLogprobs | None = None

    def output(self) -> RequestOutput:
        outs = sorted((s.completion() for s in self.seqs.values()), key=lambda c: c.index)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.num_unfinished == 0,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        # Engine request id of each live sequence -> its request and sequence (one lookup per output).
        self.live_seqs: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seqs: dict[str, SamplingParams],
    ) -> None:
        states = {
            seq_id: SequenceState(
                index=i,
                params=p,
                detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p),
                logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None,
            )
            for i, (seq_id, p) in enumerate(seqs.items())
        }
        req = self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, states, 0, len(states)
        )
        for seq_id, seq in states.items():
            self.live_seqs[seq_id] = (req, seq)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (finished RequestOutputs, sequence ids the core must stop because a stop string matched)."""
        finished: list[RequestOutput] = []
        to_stop: list[str] = []
        for out in outputs:
            self._apply(out, finished, to_stop)
        return finished, to_stop

    def process_outputs_delta(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Streaming form: one RequestOutput per request that changed, holding only what is new
        (text, token ids and logprobs since the previous delta) for the sequences that changed;
        ``finished`` is set on a request's last delta. Also returns the sequence ids to stop.

        ``prompt_logprobs`` (when asked for) is on every delta from the first on: each sequence's first
        output carries them, so the first delta of a request, and of each of its sequences, has them."""
        deltas: dict[str, dict[int, CompletionOutput]] = {}
        states: dict[str, RequestState] = {}
        to_stop: list[str] = []
        finished: list[RequestOutput] = []
        for out in outputs:
            applied = self._apply(out, finished, to_stop)
            if applied is None:
                continue
            req, seq, first_new_logprob = applied
            states[req.request_id] = req
            done = seq.finish_reason is not None
            text = seq.detok.get_next_output_text(finished=done, delta=True)
            per_req = deltas.setdefault(req.request_id, {})
            prev = per_req.get(seq.index)
            new_lps = seq.logprobs[first_new_logprob:] if seq.logprobs is not None else None
            if prev is None:
                per_req[seq.index] = CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(out.new_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=new_lps,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            else:  # two outputs for one sequence in a batch (not produced today, but harmless)
                prev.text += text
                prev.token_ids.extend(out.new_token_ids)
                if prev.logprobs is not None and new_lps:
                    prev.logprobs.extend(new_lps)
                prev.finish_reason, prev.stop_reason = seq.finish_reason, seq.stop_reason
        result = []
        for rid, per_req in deltas.items():
            req = states[rid]
            result.append(
                RequestOutput(
                    request_id=rid,
                    prompt=req.prompt,
                    prompt_token_ids=req.prompt_token_ids,
                    outputs=(
                        list(per_req.values())
                        if len(per_req) == 1
                        else sorted(per_req.values(), key=lambda c: c.index)
                    ),
                    finished=req.num_unfinished == 0,
                    num_cached_tokens=req.num_cached_tokens,
                    prompt_logprobs=req.prompt_logprobs,
                )
            )
        return result, to_stop

    def _apply(
        self, out: EngineCoreOutput, finished: list[RequestOutput], to_stop: list[str]
    ) -> tuple[RequestState, SequenceState, int] | None:
        """Fold one core output into its sequence; returns (request, sequence, index of its first new
        logprob entry), or None when the output belongs to no live sequence.

        Runs for every running sequence every step: one dict lookup finds the sequence, and the
        usual output (a token, no logprobs, not finishing) takes no other branch."""
        live = self.live_seqs.get(out.request_id)
        if live is None:
            return None
        req, seq = live
        if seq.finish_reason is not None:
            return None
        logprobs = seq.logprobs
        first_new_logprob = len(logprobs) if logprobs is not None else 0
        if seq.index == 0:
            req.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = [None] + [
                self._logprob_dict(ids, lps, rank) for ids, lps, rank in out.prompt_logprobs
            ]
        seq.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and logprobs is not None:
            for ids, lps, rank in out.new_logprobs:
                logprobs.append(self._logprob_dict(ids, lps, rank))
                seq.cumulative_logprob += lps[0]
        finish_reason = out.finish_reason
        stop_str = seq.detok.update(out.new_token_ids, finish_reason == "stop" and not out.grammar_complete)
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
            if finish_reason is None:
                to_stop.append(out.request_id)
        elif finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, out.stop_reason
            seq.detok.flush()
        if seq.finish_reason is not None:
            del self.live_seqs[out.request_id]
            req.num_unfinished -= 1
            if req.num_unfinished == 0:
                finished.append(req.output())
                del self.requests[req.request_id]
        return req, seq, first_new_logprob

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequence ids (for the core to abort)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        for seq_id in req.seqs:
            self.live_seqs.pop(seq_id, None)
        return list(req.seqs)

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        d = self.decode_token
        entry = {ids[0]: Logprob(lps[0], rank, d(ids[0]))}
        for j, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            entry.setdefault(tid, Logprob(lp, j, d(tid)))
        return entry

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

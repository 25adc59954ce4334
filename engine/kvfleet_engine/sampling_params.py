"""Per-request sampling parameters, in vLLM's shape (users know it).

Validation that needs only the parameters themselves happens here and raises ``ValueError`` (the
server maps it to HTTP 400). Checks that need the model (stop token ids inside the vocabulary,
``max_tokens`` against ``max_model_len``), and the stop-token set with the model's EOS, are the
``InputProcessor``'s.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import IntEnum

from kvfleet_engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (the sampled one is always included)
    # top-n logprobs of every prompt token after the first (each token's own logprob always included).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this constraint
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs that reshape the distribution are meaningless.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (self.repetition_penalty > 0.0):
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise bad(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
                if not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                    raise bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs must be a StructuredOutputsParams")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

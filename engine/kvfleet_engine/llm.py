"""The offline API, in vLLM's shape: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.engine_core import EngineCore
from kvfleet_engine.engine_args import EngineArgs
from kvfleet_engine.input_processor import InputProcessor, PromptType, fan_out
from kvfleet_engine.models.architectures import get_model_class
from kvfleet_engine.output_processor import OutputProcessor
from kvfleet_engine.outputs import RequestOutput
from kvfleet_engine.sampling_params import SamplingParams
from kvfleet_engine.tokenizer import load_tokenizer


class LLM:
    def __init__(self, model: str | Path, use_tqdm: bool = True, **engine_args: Any) -> None:
        """``engine_args`` are the fields of :class:`~kvfleet_engine.engine_args.EngineArgs` (vLLM's names:
        dtype, device, max_num_seqs, tensor_parallel_size, ...); an unknown name raises TypeError, a bad
        value ValueError."""
        self.config = EngineConfig.create(EngineArgs(model=model, **engine_args))
        get_model_class(self.config.model)  # unsupported architecture: say so before anything loads
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.engine = EngineCore(self.config, use_tqdm=use_tqdm)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, use_tqdm: bool = True) -> LLM:
        return cls(use_tqdm=use_tqdm, **{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")

        added: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                added.append(self._add_request(prompt, sp, priority[i] if priority else 0))
        except Exception:
            self._abort(added)  # a bad prompt in the batch leaves nothing behind
            raise
        return self._run(added, use_tqdm)

    def _add_request(self, prompt: PromptType, params: SamplingParams, priority: int) -> str:
        request_id = str(next(self._ids))
        text, token_ids = self.input_processor.tokenize(prompt)
        seqs = fan_out(request_id, params)
        requests = [
            self.input_processor.process(seq_id, token_ids, p, priority=priority)
            for seq_id, p in seqs.items()
        ]
        added_seqs: list[str] = []
        try:
            for r in requests:
                self.engine.add_request(r)
                added_seqs.append(r.request_id)
        except Exception:
            self.engine.abort_requests(added_seqs)
            raise
        self.output_processor.add_request(request_id, text, token_ids, seqs)
        return request_id

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_requests(self.output_processor.abort_request(rid))

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_pending_work():
                finished, to_stop = self.output_processor.process_outputs(self.engine.step())
                if to_stop:
                    self.engine.stop_requests(to_stop)
                for out in finished:
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            self._abort([r for r in request_ids if r not in results])
            self.engine.step()  # let the workers drop the aborted requests' state too
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]

    def sleep(self, level: int = 1) -> None:
        """Free device memory until :meth:`wake_up`: level 1 keeps the weights in host memory,
        level 2 discards them (reloaded from the model directory on wake). The prefix cache is emptied."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep`; ``tags`` ("weights", "kv_cache") wakes only part (None: everything)."""
        self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    @property
    def num_free_kv_blocks(self) -> int:
        return self.engine.scheduler.kv.get_num_free_blocks()

    def shutdown(self) -> None:
        self.engine.shutdown()

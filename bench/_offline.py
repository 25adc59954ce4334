"""Offline-generation systems shared by ``bench/engine_throughput.py`` (CPU) and ``bench/gpu_throughput.py``.

* The workload: random token-id prompts with uniformly drawn prompt and output lengths, from one seed, plus
  two short warm-up prompts.
* ``kvfleet``: one ``LLM.generate`` call with per-request ``SamplingParams(max_tokens=k, ignore_eos=True,
  temperature=0)``.
* HF static batching: ``model.generate`` over consecutive left-padded batches, ``max_new_tokens =
  min_new_tokens =`` the batch's largest ask; only the tokens each request asked for are counted.
* HF continuous batching: transformers' manager (``add_request`` with each request's own ``max_new_tokens``)
  or ``model.generate_batch`` (one ``max_new_tokens``, the largest ask, for every request).

Every function takes the device and dtype it runs on (the model's, for the HF ones); only generation is
timed, and every result is on the host when the timer stops.
"""

from __future__ import annotations

import inspect
import random
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from bench import _common as common

WARMUP_TOKENS = 8


# ---- workload ------------------------------------------------------------------------------------


class Workload(NamedTuple):
    prompts: list[list[int]]  # token ids
    outs: list[int]  # output tokens each request asks for
    warm: list[list[int]]  # the untimed warm-up prompts


def make_workload(
    model_dir: Path,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> Workload:
    """Prompts (token ids), output lengths, and 2 short warm-up prompts, all from ``seed``.

    Per request, in order: its prompt length, its prompt's tokens, its output length (lengths uniform in the
    inclusive ranges); tokens are uniform over the vocabulary less the special ids."""
    cfg = common.read_model_config(model_dir)
    specials = common.special_token_ids(model_dir)
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        prompts.append(common.random_token_ids(rng, n, cfg["vocab_size"], specials))
        outs.append(rng.randint(*output_len))
    wrng = random.Random(seed + 1_000_003)
    warm = [
        common.random_token_ids(wrng, min(32, prompt_len[1]), cfg["vocab_size"], specials) for _ in range(2)
    ]
    return Workload(prompts, outs, warm)


def add_workload_args(
    parser: Any, count_flag: str, count: int, prompt_len: tuple[int, int], output_len: tuple[int, int]
) -> None:
    """The workload's flags: ``count_flag`` (the number of requests), ``--min-prompt``/``--max-prompt``,
    ``--min-output``/``--max-output`` and ``--seed``, with these defaults."""
    w = parser.add_argument_group("workload")
    w.add_argument(count_flag, type=int, default=count)
    for flag, default in zip(("prompt", "output"), (prompt_len, output_len)):
        w.add_argument(f"--min-{flag}", type=int, default=default[0])
        w.add_argument(f"--max-{flag}", type=int, default=default[1])
    w.add_argument("--seed", type=int, default=0, help="workload seed (prompt tokens and lengths)")


def check_workload_args(parser: Any, args: Any, count_flag: str) -> None:
    """``parser.error`` unless the flags of :func:`add_workload_args` make sense."""
    if not (1 <= args.min_prompt <= args.max_prompt) or not (1 <= args.min_output <= args.max_output):
        parser.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output")
    if getattr(args, count_flag.lstrip("-").replace("-", "_")) < 1:
        parser.error(f"{count_flag} must be >= 1")


def workload_from_args(args: Any, count: int, model_dir: Path) -> Workload:
    """:func:`make_workload` of ``count`` requests with the lengths and seed of :func:`add_workload_args`."""
    prompt_len, output_len = (args.min_prompt, args.max_prompt), (args.min_output, args.max_output)
    return make_workload(model_dir, count, prompt_len, output_len, args.seed)


def pad_token_id(model_dir: Path) -> int:
    """The model's pad id, else its first EOS id (HF's padding and ``eos_token_id`` for static batching)."""
    pad_id = common.read_model_config(model_dir).get("pad_token_id")
    if not isinstance(pad_id, int):
        pad_id = (common.eos_token_ids(model_dir) or [0])[0]
    return pad_id


# ---- kvfleet -------------------------------------------------------------------------------------


def run_kvfleet(
    model_dir: Path, work: Workload, engine_args: dict[str, Any], warmup: bool = True
) -> dict[str, Any]:
    """``LLM(model_dir, **engine_args).generate`` over the whole workload; the engine is shut down after."""
    from kvfleet_engine import LLM, SamplingParams

    prompts, outs, warm = work

    common.log("kvfleet: building the engine")
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), use_tqdm=False, **engine_args)
    setup_s = time.perf_counter() - t0
    cfg = llm.config
    try:
        if warmup:
            wp = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0)
            llm.generate([{"prompt_token_ids": p} for p in warm], wp, use_tqdm=False)
            llm.reset_prefix_cache()
        params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0) for k in outs]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        common.log("kvfleet: generating")
        t0 = time.perf_counter()
        results = llm.generate(inputs, params, use_tqdm=True)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = [list(r.outputs[0].token_ids) for r in results]
    return {
        "wall_s": wall,
        "setup_s": setup_s,
        "generated_tokens": sum(len(t) for t in tokens),
        "num_cached_tokens": sum(r.num_cached_tokens for r in results),
        "engine_config": {
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_model_len": cfg.max_model_len,
            "block_size": cfg.block_size,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "attention_backend": cfg.attention_backend,
            "num_kv_blocks": llm.engine.num_kv_blocks,
        },
        "_tokens": tokens,
    }


# ---- Hugging Face --------------------------------------------------------------------------------


def load_hf_model(model_dir: Path, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.to(device).eval()


class _StepBar:
    """A ``generate`` streamer that advances a tqdm bar by one per decoding step (the first put is the prompt)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.bar.update(1)

    def end(self) -> None:
        self.seen_prompt = False


def _hf_static_batches(
    model: Any, prompts: list[list[int]], outs: list[int], bs: int, pad_id: int, bar: Any = None
) -> tuple[list[list[int]], int]:
    """Run ``model.generate`` over consecutive batches; return each request's asked-for tokens and the number
    of token positions processed (prompt padding and unasked generated tokens included)."""
    import torch
    from transformers import GenerationConfig

    tokens: list[list[int]] = []
    processed = 0
    for start in range(0, len(prompts), bs):
        bp, bo = prompts[start : start + bs], outs[start : start + bs]
        width, k = max(len(p) for p in bp), max(bo)
        ids = torch.full((len(bp), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(bp), width), dtype=torch.long)
        for i, p in enumerate(bp):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        gen_cfg = GenerationConfig(
            max_new_tokens=k,
            min_new_tokens=k,  # EOS is suppressed until k tokens: no row can stop early
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=pad_id,
            use_cache=True,
        )
        streamer = _StepBar(bar) if bar is not None else None
        with torch.inference_mode():
            seqs = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                generation_config=gen_cfg,
                streamer=streamer,
            )
        if seqs.shape[1] != width + k:
            raise RuntimeError(f"HF generate returned {seqs.shape[1] - width} new tokens, expected {k}")
        seqs = seqs.cpu()
        for i, n in enumerate(bo):
            tokens.append(seqs[i, width : width + n].tolist())
        processed += len(bp) * (width + k)
    return tokens, processed


def run_hf_static(
    model: Any, work: Workload, bs: int, pad_id: int, warmup: bool = True, progress: bool = True
) -> dict[str, Any]:
    """HF static batching of ``bs`` requests a batch. ``progress`` draws a bar per decoding step through a
    streamer (which copies each step's tokens to the host: leave it off on a GPU)."""
    from tqdm.auto import tqdm

    prompts, outs, warm = work

    if warmup:
        _hf_static_batches(model, warm, [WARMUP_TOKENS] * len(warm), bs, pad_id)
    steps = sum(max(outs[i : i + bs]) for i in range(0, len(outs), bs))
    with tqdm(total=steps, desc=f"HF static bs={bs}", unit="step", disable=not progress) as bar:
        t0 = time.perf_counter()
        tokens, processed = _hf_static_batches(model, prompts, outs, bs, pad_id, bar if progress else None)
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "batch_size": bs,
        "generated_tokens": sum(len(t) for t in tokens),
        "padded_token_positions": processed,
        "_tokens": tokens,
    }


def _cb_configs(
    prompts: list[list[int]],
    gen_lens: list[int],
    max_batch_tokens: int,
    max_requests: int,
    seed: int,
    pad_id: int,
):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cb_cfg = ContinuousBatchingConfig()
    # Cache pages for every request at once at the length it will generate to (kvfleet's KV cache also holds
    # the whole workload), the same token budget per step and the same request cap as kvfleet.
    pages = sum(-(-(len(p) + k) // cb_cfg.page_size) for p, k in zip(prompts, gen_lens))
    cb_cfg = ContinuousBatchingConfig(
        num_blocks=pages + 4,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        seed=seed,
    )
    gen_cfg = GenerationConfig(
        max_new_tokens=max(gen_lens), do_sample=False, eos_token_id=-1, pad_token_id=pad_id
    )
    return cb_cfg, gen_cfg


def _cb_context(model: Any, prompts: list[list[int]], gen_cfg: Any, cb_cfg: Any, **kw: Any) -> Any:
    """``model.continuous_batching_context_manager`` sized for ``prompts`` (workload hints: what
    ``generate_batch`` computes from its inputs) where this transformers takes hints."""
    params = inspect.signature(model.continuous_batching_context_manager).parameters
    if "workload_hints" in params:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kw["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(p) for p in prompts),
            max_generated_length=gen_cfg.max_new_tokens,
            num_requests=len(prompts),
        )
    return model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30, **kw
    )


def _cb_collect(manager: Any, ids: list[str], bar: Any, stall_s: float = 600.0) -> dict[str, Any]:
    results: dict[str, Any] = {}
    wanted = set(ids)
    last = time.perf_counter()
    while len(results) < len(wanted):
        r = manager.get_result(timeout=1)
        if r is not None:
            if r.request_id in wanted and r.is_finished():
                results[r.request_id] = r
                bar.update(1)
                last = time.perf_counter()
        elif not manager.is_running():
            raise RuntimeError("HF continuous-batching generation thread stopped unexpectedly")
        elif time.perf_counter() - last > stall_s:
            raise RuntimeError(f"HF continuous batching made no progress for {stall_s:.0f}s")
    return results


def _cb_warmup(manager: Any, warm: list[list[int]]) -> None:
    from tqdm.auto import tqdm

    wids = [
        manager.add_request(p, request_id=f"warm_{i}", max_new_tokens=WARMUP_TOKENS, eos_token_id=-1)
        for i, p in enumerate(warm)
    ]
    with tqdm(total=len(wids), desc="HF continuous warm-up", unit="req", leave=False) as bar:
        _cb_collect(manager, wids, bar)


def _generate_batch(
    model: Any,
    prompts: list[list[int]],
    warm: list[list[int]],
    gen_cfg: Any,
    cb_cfg: Any,
    warmup: bool,
) -> tuple[list[Any], float, bool]:
    """``model.generate_batch`` with the largest ask for every request. With ``warmup``, the warm-up requests
    go first, untimed; where transformers can keep a manager for the next call (``persistent_manager``), they
    go through one built for this workload (cache allocation, CUDA-graph capture), which the timed
    ``generate_batch`` then reuses. Returns the results in request order, the wall time, and whether the
    manager's set-up was inside the timed call."""
    from tqdm.auto import tqdm

    persistent = (
        warmup
        and "persistent_manager" in inspect.signature(model.generate_batch).parameters
        and hasattr(model, "destroy_cached_continuous_batching_manager")
    )
    kw: dict[str, Any] = {"persistent_manager": True} if persistent else {}
    try:
        if persistent:
            with _cb_context(model, prompts, gen_cfg, cb_cfg, persistent_manager=True) as manager:
                _cb_warmup(manager, warm)
        elif warmup:  # no manager to keep: at least the kernels are warm
            model.generate_batch(
                inputs=warm,
                generation_config=gen_cfg,
                continuous_batching_config=cb_cfg,
                max_new_tokens=WARMUP_TOKENS,
                progress_bar=False,
            )
        with tqdm(total=len(prompts), desc="HF continuous (generate_batch)", unit="req") as bar:
            t0 = time.perf_counter()
            out = model.generate_batch(
                inputs=prompts,
                generation_config=gen_cfg,
                continuous_batching_config=cb_cfg,
                progress_bar=False,
                **kw,
            )
            wall = time.perf_counter() - t0
            bar.update(len(out))
    finally:
        if persistent:
            model.destroy_cached_continuous_batching_manager()
    ordered = list(out.values())
    if len(ordered) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(ordered)} results for {len(prompts)} requests")
    return ordered, wall, not persistent


def run_hf_continuous(
    model: Any,
    work: Workload,
    *,
    api: str,
    max_batch_tokens: int,
    max_requests: int,
    seed: int,
    pad_id: int,
    warmup: bool = True,
) -> dict[str, Any]:
    """HF continuous batching through ``api``: ``manager`` (per-request ``max_new_tokens``) or
    ``generate_batch`` (the largest ask for every request; only the asked tokens are counted)."""
    if api not in ("manager", "generate_batch"):
        raise ValueError(f"unknown HF continuous-batching API {api!r}")
    prompts, outs, warm = work
    # generate_batch generates the largest ask for every request: its cache must hold that.
    gen_lens = outs if api == "manager" else [max(outs)] * len(outs)
    cb_cfg, gen_cfg = _cb_configs(prompts, gen_lens, max_batch_tokens, max_requests, seed, pad_id)
    info: dict[str, Any] = {
        "api": api,
        "cb_config": {
            "page_size": cb_cfg.page_size,
            "num_blocks": cb_cfg.num_blocks,
            "max_batch_tokens": cb_cfg.max_batch_tokens,
            "max_requests_per_batch": cb_cfg.max_requests_per_batch,
        },
    }
    if api == "generate_batch":
        ordered, wall, info["setup_timed"] = _generate_batch(model, prompts, warm, gen_cfg, cb_cfg, warmup)
    else:  # per-request max_new_tokens through the manager; its set-up and warm-up are untimed
        from tqdm.auto import tqdm

        with _cb_context(model, prompts, gen_cfg, cb_cfg) as manager:
            if warmup:
                _cb_warmup(manager, warm)
            with tqdm(total=len(prompts), desc="HF continuous", unit="req") as bar:
                t0 = time.perf_counter()
                ids = [
                    manager.add_request(p, request_id=f"req_{i}", max_new_tokens=k, eos_token_id=-1)
                    for i, (p, k) in enumerate(zip(prompts, outs))
                ]
                if any(i is None for i in ids):
                    raise RuntimeError("the HF continuous-batching manager dropped requests")
                res = _cb_collect(manager, ids, bar)
                wall = time.perf_counter() - t0
        ordered = [res[i] for i in ids]
    errors = [r.error for r in ordered if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} HF continuous-batching requests failed: {errors[0]}")
    tokens = [list(r.generated_tokens[:k]) for r, k in zip(ordered, outs)]
    short = sum(1 for r, k in zip(ordered, outs) if len(r.generated_tokens) < k)
    if short:
        raise RuntimeError(f"{short} HF continuous-batching requests returned fewer tokens than asked")
    return {
        "wall_s": wall,
        "generated_tokens": sum(len(t) for t in tokens),
        "generated_tokens_returned": sum(len(r.generated_tokens) for r in ordered),
        **info,
        "_tokens": tokens,
    }


def add_hf_cb_args(group: Any, default_api: str) -> None:
    """``--hf-cb-api``, ``--hf-cb-max-batch-tokens`` and ``--hf-cb-max-requests`` (see :func:`run_hf_baselines`)."""
    group.add_argument(
        "--hf-cb-api",
        choices=("manager", "generate_batch"),
        default=default_api,
        help="manager: per-request max_new_tokens via the CB manager; generate_batch: one max_new_tokens",
    )
    group.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        default=None,
        help="HF CB tokens per step (default: kvfleet's budget)",
    )
    group.add_argument(
        "--hf-cb-max-requests",
        type=int,
        default=None,
        help="HF CB max_requests_per_batch (default: kvfleet's max_num_seqs, at most the number of prompts)",
    )


def run_hf_baselines(
    systems: dict[str, dict[str, Any]],
    model_dir: Path,
    work: Workload,
    args: Any,
    *,
    batch_sizes: list[int],
    static_name: str,
    max_batch_tokens: int,
    cb_warmup: bool,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = True,
) -> None:
    """Load the HF model once, run static batching at each of ``batch_sizes`` (system ``static_name``, a
    format string of ``bs``), then, unless ``args.skip_hf_cb``, continuous batching through
    ``args.hf_cb_api`` (system ``hf-continuous``; ``args.hf_cb_max_requests``, else ``args.max_num_seqs``
    capped at the number of requests). Device memory is released after each system."""
    hf = [load_hf_model(model_dir, dtype, device)]  # emptied at the end: nothing holds the weights after
    pad_id = pad_token_id(model_dir)
    for bs in batch_sizes:
        run_system(
            systems,
            static_name.format(bs=bs),
            lambda bs=bs: run_hf_static(
                hf[0], work, bs, pad_id, warmup=not args.no_warmup, progress=progress
            ),
            batch_size=bs,
        )
        common.release_device_memory()
    if not args.skip_hf_cb:
        max_requests = args.hf_cb_max_requests or min(args.max_num_seqs, len(work.prompts))
        run_system(
            systems,
            "hf-continuous",
            lambda: run_hf_continuous(
                hf[0],
                work,
                api=args.hf_cb_api,
                max_batch_tokens=max_batch_tokens,
                max_requests=max_requests,
                seed=args.seed,
                pad_id=pad_id,
                warmup=cb_warmup,
            ),
            api=args.hf_cb_api,
        )
    hf.clear()
    common.release_device_memory()


# ---- running and comparing -----------------------------------------------------------------------


def compare(a: list[list[int]], b: list[list[int]], n: int) -> dict[str, Any]:
    """Greedy agreement of the first ``n`` requests: exact matches and common-prefix lengths."""
    n = min(n, len(a), len(b))
    prefixes = []
    for x, y in zip(a[:n], b[:n]):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
    exact = sum(1 for x, y in zip(a[:n], b[:n]) if x == y)
    return {
        "compared": n,
        "exact_matches": exact,
        "common_prefix_lens": prefixes,
        "lens": [len(x) for x in a[:n]],
    }


def run_system(systems: dict[str, dict[str, Any]], name: str, fn: Any, **on_error: Any) -> None:
    """Run one system; a failure is recorded (error string) instead of ending the benchmark."""
    before = common.contention()
    cpu0 = time.process_time()
    try:
        res = fn()
    except Exception as e:
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}", **on_error}
    res["process_cpu_s"] = time.process_time() - cpu0  # all of this process's threads, set-up included
    res["contention_before"], res["contention_after"] = before, common.contention()
    systems[name] = res

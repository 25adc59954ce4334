"""Shared helpers for the benchmark scripts in ``bench/``.

Demo-model building and caching, this machine's float32 matmul FLOP/s, parameter counts for compute
efficiency, random token-id prompts, table printing (rich when installed, plain text otherwise), and JSON
result files. The scripts compare systems against a baseline measured in the same run, so what they report
are ratios; absolute seconds depend on the machine.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
MODEL_CACHE_DIR = REPO_ROOT / ".kvfleet" / "models"


# ---- models --------------------------------------------------------------------------------------


def ensure_demo_model(
    arch: str = "llama", preset: str = "small", seed: int = 0, cache_dir: str | Path | None = None
) -> Path:
    """The demo model ``<cache_dir>/<arch>-<preset>-s<seed>``, built with ``build_demo_model`` if absent.

    The model is built into a temporary sibling directory and renamed into place, so a directory that
    exists is complete (an interrupted build leaves only a ``.tmp-*`` directory behind).
    """
    from kvfleet_engine.demo_model import build_demo_model

    root = Path(cache_dir) if cache_dir is not None else MODEL_CACHE_DIR
    final = root / f"{arch}-{preset}-s{seed}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        build_demo_model(tmp, arch=arch, preset=preset, seed=seed)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent build that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(args: Any) -> Path:
    """``--model DIR`` when given, else the cached demo model for ``--arch/--preset/--model-seed``."""
    if getattr(args, "model", None):
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {path}: no config.json there")
        return path
    return ensure_demo_model(args.arch, args.preset, args.model_seed, args.model_cache)


def add_model_args(parser: Any, default_preset: str = "small", default_arch: str = "llama") -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--preset", default=default_preset, help="demo-model preset (tiny, small, bench)")
    g.add_argument("--arch", default=default_arch, help="demo-model architecture (llama, qwen2, mistral)")
    g.add_argument("--model-seed", type=int, default=0, help="demo-model weight seed")
    g.add_argument(
        "--model-cache", default=None, help=f"demo-model cache directory (default {MODEL_CACHE_DIR})"
    )
    g.add_argument("--model", default=None, help="use this HF model directory instead of a demo model")


def read_model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def eos_token_ids(model_dir: Path) -> list[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = model_dir / name
        if not p.is_file():
            continue
        eos = json.loads(p.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return sorted(ids)


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, read from a safetensors file's JSON header (no weights loaded)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def parameter_counts(model_dir: Path) -> dict[str, Any]:
    """Parameter counts for the compute-efficiency formula.

    ``flop_params`` = non-embedding parameters + LM-head parameters, the LM head counted even when it is
    tied to the embedding (its matmul runs either way); the input embedding is a lookup, not a matmul.
    """
    cfg = read_model_config(model_dir)
    shapes: dict[str, list[int]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        shapes.update(_safetensors_shapes(f))
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")

    def numel(shape: list[int]) -> int:
        n = 1
        for s in shape:
            n *= s
        return n

    total = sum(numel(s) for s in shapes.values())
    embed = sum(numel(s) for k, s in shapes.items() if k.endswith("embed_tokens.weight"))
    head_stored = sum(numel(s) for k, s in shapes.items() if k.endswith("lm_head.weight"))
    lm_head = cfg["vocab_size"] * cfg["hidden_size"]
    non_embedding = total - embed - head_stored
    return {
        "total_stored": total,
        "embedding": embed,
        "lm_head": lm_head,
        "lm_head_tied": head_stored == 0,
        "non_embedding": non_embedding,
        "flop_params": non_embedding + lm_head,
    }


# ---- machine -------------------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when torch sees a GPU, else ``cpu``; any other name as given."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def device_name(device: str) -> str:
    """The card's name (``torch.cuda.get_device_name``) for a CUDA device, ``cpu`` otherwise."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def release_device_memory() -> None:
    """Collect garbage and hand cached CUDA blocks back, so the next system (or a server process) gets the
    memory a finished one held."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def measure_matmul_flops(n: int = 2048, reps: int = 8, warmup: int = 2) -> dict[str, Any]:
    """This machine's float32 matmul FLOP/s: best of ``reps`` timed ``n x n @ n x n`` products, on the
    threads torch is set to use. The best (not the mean) is the peak the efficiency is measured against."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=torch.float32)
    b = torch.randn(n, n, generator=g, dtype=torch.float32)
    c = torch.empty(n, n, dtype=torch.float32)
    for _ in range(warmup):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flop = 2 * n**3
    return {
        "n": n,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "best_s": min(times),
        "median_s": statistics.median(times),
        "flops": flop / min(times),
        "median_flops": flop / statistics.median(times),
    }


def small_op_latency_ms(reps: int = 30) -> float:
    """Median milliseconds of a small ``[16, 512] @ [512, 1792]`` matmul on torch's threads: a contention probe.

    On an idle machine it takes well under a millisecond; when other processes occupy the cores, every
    multi-threaded op waits for a descheduled worker thread and this jumps to several milliseconds (which
    slows small-batch decoding far more than it slows the big matmul of the FLOP/s probe)."""
    import torch

    x = torch.randn(16, 512)
    w = torch.randn(1792, 512)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


CONTENDED_MS = 2.0  # small_op_latency_ms above this: the machine is busy with other work


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages: other processes on the machine make timings noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def busy_machine_warning() -> str | None:
    """A warning when other processes already load the CPUs (timings, even same-run ratios, get noisy).
    Call after ``set_threads``."""
    # The probe, not the load average: the 1-minute average still counts processes that just ended.
    la, n = loadavg(), os.cpu_count() or 1
    probe = small_op_latency_ms()
    if probe >= CONTENDED_MS:
        time.sleep(1.0)  # a one-off spike (a process finishing) should not flag the whole run
        probe = min(probe, small_op_latency_ms())
    if probe < CONTENDED_MS:
        return None
    msg = (
        f"WARNING: busy machine before the benchmark started (load average {la[0] if la else '?'} on {n} CPUs, "
        f"small-matmul probe {probe:.2f} ms): other processes compete for the cores, so timings are noisy"
    )
    log(msg)
    return msg


def contention() -> dict[str, Any]:
    """Load average and the small-matmul probe, recorded around each timed measurement."""
    return {"loadavg": loadavg(), "small_op_ms": round(small_op_latency_ms(), 3)}


def env_info() -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": tf_version,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "git_commit": _git_commit(),
        "loadavg": loadavg(),
        "argv": sys.argv,
    }


# ---- workload ------------------------------------------------------------------------------------


def random_token_ids(rng: Any, n: int, vocab_size: int, exclude: Sequence[int] = ()) -> list[int]:
    """``n`` uniformly random token ids in ``[0, vocab_size)`` (``rng``: a ``random.Random``), never one of
    ``exclude`` (EOS / pad / other special ids)."""
    bad = set(exclude)
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab_size)
        if t not in bad:
            out.append(t)
    return out


def special_token_ids(model_dir: Path) -> list[int]:
    """EOS ids plus the tokenizer's added special tokens (kept out of random prompts)."""
    ids = set(eos_token_ids(model_dir))
    p = model_dir / "tokenizer_config.json"
    if p.is_file():
        added = json.loads(p.read_text()).get("added_tokens_decoder") or {}
        ids.update(int(k) for k, v in added.items() if v.get("special"))
    cfg = read_model_config(model_dir)
    if isinstance(cfg.get("pad_token_id"), int):
        ids.add(cfg["pad_token_id"])
    return sorted(ids)


# ---- output --------------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def print_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()
) -> None:
    """Print a table with rich when it is installed, as aligned plain text otherwise."""
    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
        for row in cells:
            table.add_row(*row)
        console = Console(width=max(shutil.get_terminal_size((160, 24)).columns, 120))
        console.print(table)
        for n in notes:
            console.print(n, markup=False, highlight=False)
        return
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(title)
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for n in notes:
        print(n)


def default_out(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def command_line(module: str, argv: list[str] | None) -> str:
    """How ``module`` (``bench.NAME``) was run from the repository root, shell-quoted: ``argv``, else this
    process's arguments."""
    return shlex.join([".venv/bin/python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def log(msg: str) -> None:
    """A progress line on stderr (where tqdm bars also go), flushed at once."""
    print(msg, file=sys.stderr, flush=True)

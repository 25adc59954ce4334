"""How each benchmark client is run, as its documentation tells a user to, and what is read back from its own
output files (``bench/clients.py`` drives them).

A client lives in its own virtual environment (they pin conflicting dependencies, and guidellm needs torch):
``ClientInstall`` is where its executable and interpreter are. ``command(...)`` builds the argv, the
environment and any config file of one run against one target; ``parse(...)`` turns the client's output
files into a ``ClientCounts``: requests, failures and token counts as the client reports them. Nothing here
judges a run: ``bench/clients.py`` compares the counts with the server's.

The tenant key reaches aiperf and guidellm as their documented flags (``--api-key``, ``api_key=``) and
inference-perf in its config file: it is a throwaway key of a local fleet, so the command line is acceptable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPENAI_SCRIPT = Path(__file__).resolve().parent / "_clients_openai.py"
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass(frozen=True, slots=True)
class ClientSpec:
    name: str
    package: str
    version: str  # the version the issue tried; the docs' install command pins it
    executable: str | None  # console script in the venv's bin/ (None: a Python script run by its interpreter)
    install: str  # what to run when it is missing


CLIENTS: dict[str, ClientSpec] = {
    "openai": ClientSpec(
        "openai", "openai", "any", None, "pip install openai  (it is in kvfleet's dev environment already)"
    ),
    "aiperf": ClientSpec(
        "aiperf", "aiperf", "0.13.0", "aiperf",
        "python3 -m venv VENV && VENV/bin/pip install aiperf==0.13.0",
    ),
    "guidellm": ClientSpec(
        "guidellm", "guidellm", "0.8.1", "guidellm",
        "python3 -m venv VENV && VENV/bin/pip install <a CPU build of torch 2.13> && VENV/bin/pip install guidellm==0.8.1",
    ),
    "inference-perf": ClientSpec(
        "inference-perf", "inference-perf", "0.7.0", "inference-perf",
        "python3.12 -m venv VENV && VENV/bin/pip install inference-perf==0.7.0  (it needs Python >= 3.12)",
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ClientInstall:
    spec: ClientSpec
    python: Path  # the interpreter of the client's environment
    executable: Path | None
    version: str
    where: str  # how it was found (flag, env, PATH, current interpreter)


def parse_venv_list(text: str) -> dict[str, Path]:
    """``NAME=PATH[,NAME=PATH...]`` (commas or the OS path separator between items) as a dict."""
    out: dict[str, Path] = {}
    for item in text.replace(os.pathsep, ",").split(","):
        name, sep, path = item.strip().partition("=")
        if not item.strip():
            continue
        if not sep or name not in CLIENTS or not path:
            raise ValueError(f"expected NAME=PATH with NAME in {sorted(CLIENTS)}, not {item!r}")
        out[name] = Path(path).expanduser()
    return out


def _version(python: Path, package: str) -> str | None:
    r = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return r.stdout.strip() if r.returncode == 0 else None


def find_client(name: str, venvs: Mapping[str, Path]) -> ClientInstall | None:
    """The client's install: the venv given for it (``--client-venv`` / ``KVFLEET_CLIENT_VENVS``), else its
    console script on PATH (openai: the current interpreter, if it imports the SDK). None if absent."""
    spec = CLIENTS[name]
    if name in venvs:
        venv = venvs[name]
        python = venv / "bin" / "python"
        exe = venv / "bin" / spec.executable if spec.executable else None
        where = f"venv {venv}"
        if not python.exists() or (exe is not None and not exe.exists()):
            return None
    elif spec.executable is None:
        python, exe, where = Path(sys.executable), None, "current interpreter"
    else:
        found = shutil.which(spec.executable)
        if found is None:
            return None
        exe = Path(found)
        python = exe.parent / "python"
        where = f"PATH {exe}"
        if not python.exists():
            return None
    version = _version(python, spec.package)
    if version is None:
        return None
    return ClientInstall(spec, python, exe, version, where)


# ---- one run ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 24
    concurrency: int = 2
    prompt_tokens: int = 64
    output_tokens: int = 16
    seed: int | None = None  # guidellm's --seed (it defaults to 42); aiperf's --random-seed


@dataclass(slots=True)
class RunPlan:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    endpoint: str  # which API the client sends to


@dataclass(slots=True)
class ClientCounts:
    """What the client's output files say. ``usage_completion_tokens``: the server's usage as the client
    recorded it; ``tokenized_completion_tokens``: the client's own tokenizer over the output text."""

    requests: int
    failed: int
    usage_completion_tokens: int | None = None
    tokenized_completion_tokens: int | None = None
    headline_completion_tokens: int | None = None  # what the client's throughput figures use
    cached_prompt_tokens: int | None = None
    per_request_exact: bool | None = None  # openai: every request's logprob count == its usage
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _base_env(drop_offline: bool) -> dict[str, str]:
    env = dict(os.environ)
    # Not the caller's venv: each client runs in its own.
    for var in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(var, None)
    if drop_offline:
        # aiperf 0.13 treats a local tokenizer directory as a hub repo id when either is set to anything
        # (even "0"); see docs/BENCHMARKS.md.
        for var in OFFLINE_VARS:
            env.pop(var, None)
    return env


def command(
    install: ClientInstall,
    base_url: str,
    api_key: str | None,
    model: str,
    tokenizer_dir: Path,
    work: Workload,
    out_dir: Path,
    extra_args: list[str] | None = None,
    env_overrides: Mapping[str, str] | None = None,
) -> RunPlan:
    """The argv (and env, cwd) of one run of ``install``'s client against ``base_url``."""
    name = install.spec.name
    out_dir.mkdir(parents=True, exist_ok=True)
    env = _base_env(drop_offline=name == "aiperf")
    if name == "openai":
        argv = [
            str(install.python), str(OPENAI_SCRIPT), "--base-url", base_url, "--model", model,
            "--requests", str(work.requests), "--concurrency", str(work.concurrency),
            "--max-tokens", str(work.output_tokens), "--out", str(out_dir / "openai.json"),
        ]  # fmt: skip
        env["OPENAI_API_KEY"] = api_key or "no-key"  # a replica without --api-key takes any
        endpoint = "chat + completions, streamed and not"
    elif name == "aiperf":
        argv = [
            str(install.executable), "profile", "--model", model, "--url", base_url,
            "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer_dir),
            "--synthetic-input-tokens-mean", str(work.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(work.output_tokens), "--request-count", str(work.requests),
            "--concurrency", str(work.concurrency), "--artifact-dir", str(out_dir), "--ui-type", "none",
        ]  # fmt: skip
        if api_key:
            argv += ["--api-key", api_key]
        if work.seed is not None:
            argv += ["--random-seed", str(work.seed)]
        endpoint = "chat, streamed"
    elif name == "guidellm":
        backend = f"kind=openai_http,target={base_url},model={model}" + (
            f",api_key={api_key}" if api_key else ""
        )
        argv = [
            str(install.executable), "run", "--backend", backend,
            "--profile", f"kind=concurrent,streams={work.concurrency}",
            "--constraint", f"kind=max_requests,count={work.requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={work.prompt_tokens},output_tokens={work.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output", f"kind=json,path={out_dir / 'benchmarks.json'}", "--disable-progress",
        ]  # fmt: skip
        if work.seed is not None:
            argv += ["--seed", f"kind=static,value={work.seed}"]
        endpoint = "chat, streamed"
    elif name == "inference-perf":
        config = {
            # Completions: its synthetic ("random") data refuses the chat API.
            "api": {"type": "completion", "streaming": True},
            "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True,
                       **({"api_key": api_key} if api_key else {})},
            "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
            "data": {"type": "random", "input_distribution": _fixed(work.prompt_tokens, work.requests),
                     "output_distribution": _fixed(work.output_tokens, work.requests)},
            "load": {"type": "concurrent", "num_workers": 1,
                     "stages": [{"num_requests": work.requests, "concurrency_level": work.concurrency}]},
            "report": {"request_lifecycle": {"summary": True, "per_request": True}},
            "storage": {"local_storage": {"path": str(out_dir / "reports")}},
        }  # fmt: skip
        path = out_dir / "config.yml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        path.chmod(0o600)  # it holds the key
        argv = [str(install.executable), "--config_file", str(path)]
        endpoint = "completions, streamed"
    else:
        raise ValueError(f"unknown client {name!r}")
    argv += extra_args or []
    env.update(env_overrides or {})
    return RunPlan(argv=argv, env=env, cwd=out_dir, endpoint=endpoint)


def _fixed(n: int, count: int) -> dict[str, int]:
    return {"min": n, "max": n, "mean": n, "std_dev": 0, "total_count": count}


# ---- reading the client's files -------------------------------------------------------------------


def parse(name: str, out_dir: Path) -> ClientCounts:
    """The counts of a finished run out of the client's own output files (raises if they are missing)."""
    return {"openai": _parse_openai, "aiperf": _parse_aiperf, "guidellm": _parse_guidellm,
            "inference-perf": _parse_inference_perf}[name](out_dir)  # fmt: skip


def _parse_openai(out_dir: Path) -> ClientCounts:
    d = json.loads((out_dir / "openai.json").read_text())
    ok = [r for r in d["records"] if r["ok"]]
    return ClientCounts(
        requests=d["requests"],
        failed=d["failed"],
        usage_completion_tokens=sum(r["completion_tokens"] for r in ok),
        headline_completion_tokens=sum(r["completion_tokens"] for r in ok),
        cached_prompt_tokens=sum(r["cached_tokens"] for r in ok),
        per_request_exact=all(r["logprob_tokens"] == r["completion_tokens"] for r in ok),
        errors=[r["error"] for r in d["records"] if not r["ok"]],
        extra={"texts": [r["text"] for r in ok], "usage": [r["completion_tokens"] for r in ok],
               "openai_version": d["openai_version"]},
    )  # fmt: skip


def _avg(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    return None if v is None else v.get("avg")


def _parse_aiperf(out_dir: Path) -> ClientCounts:
    d = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    requests = round(_avg(d, "request_count") or 0)
    completed = round(_avg(d, "completed_request_count") or requests)
    errors = [json.dumps(e)[:300] for e in d.get("error_summary") or []]
    usage = _avg(d, "total_usage_completion_tokens")
    headline = _avg(d, "total_output_tokens")
    use_server = bool((d.get("input_config") or {}).get("endpoint", {}).get("use_server_token_count"))
    return ClientCounts(
        requests=requests,
        failed=max(requests - completed, len(errors)),
        usage_completion_tokens=None if usage is None else round(usage),
        tokenized_completion_tokens=None if headline is None or use_server else round(headline),
        headline_completion_tokens=None if headline is None else round(headline),
        cached_prompt_tokens=_round(_avg(d, "total_usage_prompt_cache_read_tokens")),
        errors=errors,
        extra={"use_server_token_count": use_server},
    )


def _round(x: float | None) -> int | None:
    return None if x is None else round(x)


def _parse_guidellm(out_dir: Path) -> ClientCounts:
    d = json.loads((out_dir / "benchmarks.json").read_text())
    (bench,) = d["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    ok = bench["requests"]["successful"]
    bad = (bench["requests"].get("errored") or []) + (bench["requests"].get("incomplete") or [])
    output = sum(r["output_metrics"]["text_tokens"] or 0 for r in ok)
    return ClientCounts(
        requests=totals["successful"] + totals["errored"] + totals["incomplete"],
        failed=totals["errored"] + totals["incomplete"],
        # guidellm prefers the response's usage (prefer_response_metrics) and falls back to its tokenizer.
        usage_completion_tokens=output,
        headline_completion_tokens=round(bench["metrics"]["output_token_count"]["successful"]["total_sum"]),
        cached_prompt_tokens=sum(r["input_metrics"].get("cached_tokens") or 0 for r in ok),
        errors=[str(r["info"].get("error"))[:300] for r in bad],
        extra={"seed": d["config"]["spec"]["seed"].get("value")},
    )


def _parse_inference_perf(out_dir: Path) -> ClientCounts:
    d = json.loads((out_dir / "reports" / "summary_lifecycle_metrics.json").read_text())
    ok, failures = d["successes"], d["failures"]
    count = ok["count"]
    output_len = ok.get("output_len") or {}
    return ClientCounts(
        requests=count + failures["count"],
        failed=failures["count"],
        usage_completion_tokens=round(ok["output_tokens"]["total"]),
        tokenized_completion_tokens=None if not output_len else round(output_len["mean"] * count),
        headline_completion_tokens=None if not output_len else round(output_len["mean"] * count),
        cached_prompt_tokens=round(ok["prompt_tokens"].get("cached") or 0),
        errors=[json.dumps(failures.get("by_label"))[:300]] if failures["count"] else [],
        extra={"token_count_mismatches": ok.get("token_count_mismatches")},
    )

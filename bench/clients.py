"""The benchmark clients users already run keep working against kvfleet: aiperf, guidellm, inference-perf and
the openai SDK, each run briefly, unmodified, against the gateway and against a replica directly (issue 27).

    .venv/bin/python -m bench.clients \\
        --client-venv aiperf=/tmp/venvs/aiperf --client-venv guidellm=/tmp/venvs/guidellm \\
        --client-venv inference-perf=/tmp/venvs/inference-perf

Starts Redis, one ``kvfleet engine serve`` replica of the tiny demo model (the real engine on CPU; see
``_clients_stack``) and a ``kvfleet gateway`` with a tenant key. Each client runs as its documentation tells
a user to (its CLI and flags; ``_clients_runners``), a few dozen requests at concurrency 2, and is judged
from its own output files against the server's counters scraped around the run:

* ``ok`` needs exit status 0, every request sent answered (0 failed, as the client counts them), no
  non-200 request in the replica's counters, and the completion tokens the client took from the server's
  usage equal to the tokens the replica generated in that run (exact). The openai SDK also checks each
  request's usage against the number of logprob entries it received.
* Tokens a client counts by re-tokenizing the output text are reported beside them (over-count in %),
  not judged: random-weight output does not re-tokenize into the tokens it was made of.

Clients are found through ``--client-venv NAME=PATH``, ``KVFLEET_CLIENT_VENVS`` (``NAME=PATH,...``) or their
console script on PATH; openai in the current interpreter. A missing one is reported "not installed", with
its install command, and is not a failure. ``--pitfalls`` (default on) also reproduces the guide's three
pitfalls (docs/BENCHMARKS.md): aiperf under ``HF_HUB_OFFLINE=1``, the re-tokenization over-count, and
guidellm's fixed seed hitting the prefix cache on a repeated run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import _clients_runners as runners
from bench import _common as common
from bench._clients_stack import SERVED_MODEL, ClientStack

TARGETS = ("gateway", "replica")
DEFAULT_CLIENTS = ("openai", "aiperf", "guidellm", "inference-perf")


def client_venvs(flags: Sequence[str]) -> dict[str, Path]:
    """``KVFLEET_CLIENT_VENVS`` overridden by ``--client-venv`` flags."""
    venvs = runners.parse_venv_list(os.environ.get("KVFLEET_CLIENT_VENVS", ""))
    venvs.update(runners.parse_venv_list(",".join(flags)))
    return venvs


def target_url(stack: ClientStack, target: str) -> tuple[str, str | None]:
    """Base URL and API key a client uses for ``target``."""
    if target == "gateway":
        return stack.gateway_url, stack.api_key
    if target == "replica":
        return stack.replica_url, None
    raise ValueError(f"unknown target {target!r}")


def _gateway_completion_tokens(stack: ClientStack) -> int:
    import httpx

    from bench._fleet import ADMIN_TOKEN

    r = httpx.get(
        f"{stack.gateway_url}/admin/usage", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    )
    r.raise_for_status()
    tenants = r.json()["data"]
    return sum(t["total"]["completion_tokens"] for t in tenants.values())


def run_client(
    install: runners.ClientInstall,
    stack: ClientStack,
    target: str,
    work: runners.Workload,
    out_dir: Path,
    timeout_s: float = 600.0,
    extra_args: list[str] | None = None,
    env_overrides: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One run of a client against ``target``, judged (see the module docstring). Returns the row."""
    url, key = target_url(stack, target)
    plan = runners.command(
        install, url, key, SERVED_MODEL, stack.model_dir, work, out_dir, extra_args, env_overrides
    )
    before = stack.counters()
    gw_before = _gateway_completion_tokens(stack) if target == "gateway" else None
    log_path = out_dir / "client.log"
    t0 = time.perf_counter()
    with log_path.open("wb") as log:
        try:
            proc = subprocess.run(plan.argv, env=plan.env, cwd=plan.cwd, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s)  # fmt: skip
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall_s = time.perf_counter() - t0
    stack.check_alive()
    server = stack.counters().minus(before)
    row: dict[str, Any] = {
        "client": install.spec.name, "target": target, "version": install.version, "endpoint": plan.endpoint,
        "returncode": rc, "wall_s": round(wall_s, 2), "expected_requests": work.requests, "server": server,
        "argv": [a.replace(key, "<tenant key>") if key else a for a in plan.argv], "log": str(log_path),
    }  # fmt: skip
    if gw_before is not None:
        row["gateway_metered_completion_tokens"] = _gateway_completion_tokens(stack) - gw_before
    try:
        counts = runners.parse(install.spec.name, out_dir)
    except (OSError, KeyError, ValueError) as e:
        row.update(status=f"FAIL: no readable results ({type(e).__name__}: {e})", log_tail=_tail(log_path))
        return row
    extra = counts.extra
    row.update(
        requests=counts.requests, failed=counts.failed, errors=counts.errors[:5],
        usage_completion_tokens=counts.usage_completion_tokens,
        tokenized_completion_tokens=counts.tokenized_completion_tokens,
        headline_completion_tokens=counts.headline_completion_tokens,
        cached_prompt_tokens=counts.cached_prompt_tokens, per_request_exact=counts.per_request_exact,
        client_extra={k: v for k, v in extra.items() if k not in ("texts", "usage")},
    )  # fmt: skip
    if "texts" in extra:
        row["retokenized"] = retokenization(stack.model_dir, extra["texts"], extra["usage"])
    if counts.tokenized_completion_tokens and counts.usage_completion_tokens:
        row["tokenized_over_count_pct"] = round(
            100 * (counts.tokenized_completion_tokens / counts.usage_completion_tokens - 1), 2
        )
    row["status"] = judge(row)
    if row["status"] != "ok":
        row["log_tail"] = _tail(log_path)
    return row


def judge(row: Mapping[str, Any]) -> str:
    """``ok`` or ``FAIL: <reasons>`` for a run's row (the rules are in the module docstring)."""
    problems = []
    if row["returncode"] != 0:
        problems.append("timed out" if row["returncode"] is None else f"exit status {row['returncode']}")
    if row["requests"] != row["expected_requests"]:
        problems.append(f"{row['requests']} requests counted, {row['expected_requests']} asked for")
    if row["failed"]:
        problems.append(f"{row['failed']} failed requests")
    if row["server"]["requests_failed"]:
        problems.append(f"{row['server']['requests_failed']} non-200 requests at the replica")
    usage, generated = row["usage_completion_tokens"], row["server"]["completion_tokens"]
    if usage is None:
        problems.append("the client recorded no usage")
    elif usage != generated:
        problems.append(f"usage completion tokens {usage} != {generated} generated by the replica")
    metered = row.get("gateway_metered_completion_tokens")
    if metered is not None and metered != generated:
        problems.append(f"gateway metered {metered} completion tokens, the replica generated {generated}")
    if row.get("per_request_exact") is False:
        problems.append("a request's usage differs from the logprob entries it received")
    return "ok" if not problems else "FAIL: " + "; ".join(problems)


def retokenization(model_dir: Path, texts: Sequence[str], usage: Sequence[int]) -> dict[str, Any]:
    """What a client that re-tokenizes the output text would count: the model's own tokenizer over each
    text, against the server's usage; and how much of the excess comes from texts holding U+FFFD (a lone
    byte token of a multi-byte character, decoded to the replacement character, re-encodes as 3 bytes)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    counts = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    excess = sum(c - u for c, u in zip(counts, usage, strict=True))
    replacement = sum(c - u for c, u, t in zip(counts, usage, texts, strict=True) if "\ufffd" in t)
    total_usage = sum(usage)
    return {
        "requests": len(texts), "usage_tokens": total_usage, "retokenized_tokens": sum(counts),
        "over_count_pct": round(100 * excess / total_usage, 2) if total_usage else None,
        "requests_differing": sum(c != u for c, u in zip(counts, usage, strict=True)),
        "excess_from_replacement_char_texts": replacement, "excess_tokens": excess,
    }  # fmt: skip


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def tokens_cell(row: Mapping[str, Any]) -> str:
    """The table's token column: what was compared, and the re-tokenized over-count if any."""
    if row.get("usage_completion_tokens") is None:
        return "-"
    cell = f"usage {row['usage_completion_tokens']} / replica {row['server']['completion_tokens']}"
    if row.get("per_request_exact") is not None:
        cell += ", per request " + ("exact" if row["per_request_exact"] else "NOT exact")
    if row.get("tokenized_over_count_pct") is not None:
        cell += (
            f"; re-tokenized {row['tokenized_completion_tokens']} ({row['tokenized_over_count_pct']:+.1f} %)"
        )
    elif row.get("retokenized"):
        cell += f"; re-tokenized {row['retokenized']['over_count_pct']:+.1f} %"
    return cell


# ---- the pitfalls ------------------------------------------------------------------------------------


def pitfalls(
    installs: Mapping[str, runners.ClientInstall], stack: ClientStack, log_dir: Path, timeout_s: float
) -> dict[str, Any]:
    """The guide's pitfalls, reproduced where their client is installed (each against the replica)."""
    out: dict[str, Any] = {}
    if "aiperf" in installs:
        small = runners.Workload(requests=4, concurrency=2)
        runs = {}
        for label, extra in (("HF_HUB_OFFLINE=1", []), ("HF_HUB_OFFLINE=1 --use-server-token-count",
                                                          ["--use-server-token-count"])):  # fmt: skip
            d = log_dir / "pitfall-aiperf-offline" / label.replace(" ", "_").replace("=", "")
            row = run_client(installs["aiperf"], stack, "replica", small, d, timeout_s, extra,
                             {"HF_HUB_OFFLINE": "1"})  # fmt: skip
            text = Path(row["log"]).read_text(errors="replace")
            runs[label] = {
                "returncode": row["returncode"], "requests_answered": row["server"]["requests_ok"],
                "tokenizer_error": "Failed to load tokenizer" in text and "HFValidationError" in text,
            }  # fmt: skip
        out["aiperf_hf_hub_offline"] = runs
    if "guidellm" in installs:
        stack.reset_prefix_cache()
        work = runners.Workload(requests=12, concurrency=2)
        runs = {}
        for label, seed in (("first run (default seed 42)", None), ("same command again", None),
                            ("again with --seed kind=static,value=7", 7)):  # fmt: skip
            d = log_dir / "pitfall-guidellm-seed" / str(len(runs))
            w = runners.Workload(
                work.requests, work.concurrency, work.prompt_tokens, work.output_tokens, seed
            )
            row = run_client(installs["guidellm"], stack, "replica", w, d, timeout_s)
            runs[label] = {
                "status": row["status"], "client_cached_prompt_tokens": row.get("cached_prompt_tokens"),
                "replica_cached_prompt_tokens": row["server"]["cached_prompt_tokens"],
                "replica_prompt_tokens": row["server"]["prompt_tokens"],
            }  # fmt: skip
        out["guidellm_fixed_seed_prefix_cache"] = runs
    return out


# ---- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default=",".join(DEFAULT_CLIENTS), help="comma-separated (default: all four)")
    p.add_argument("--targets", default=",".join(TARGETS), help="gateway, replica or both (default)")
    p.add_argument("--client-venv", action="append", default=[], metavar="NAME=PATH",
                   help="a client's virtual environment (repeatable); else KVFLEET_CLIENT_VENVS, else PATH")  # fmt: skip
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--simulate", action="store_true", help="a --simulate replica instead of the real engine")
    p.add_argument("--pitfalls", action=argparse.BooleanOptionalAction, default=True,
                   help="also reproduce the guide's pitfalls (default on)")  # fmt: skip
    p.add_argument("--model", type=Path, help="model directory (default: the tiny demo model, built once)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per client run")
    p.add_argument("--log-dir", type=Path, help="client outputs and server logs (default: a temp dir)")
    p.add_argument("--out", type=Path, default=common.default_out("clients"))
    args = p.parse_args(argv)
    names = [c for c in args.clients.split(",") if c]
    targets = [t for t in args.targets.split(",") if t]
    for n in names:
        if n not in runners.CLIENTS:
            p.error(f"unknown client {n!r}; choose from {', '.join(runners.CLIENTS)}")
    for t in targets:
        if t not in TARGETS:
            p.error(f"unknown target {t!r}")
    try:
        venvs = client_venvs(args.client_venv)
    except ValueError as e:
        p.error(str(e))
    log_dir = args.log_dir or common.RESULTS_DIR / "clients-logs"
    model = args.model or common.ensure_demo_model(preset="tiny")
    work = runners.Workload(args.requests, args.concurrency, args.prompt_tokens, args.output_tokens)

    installs = {n: i for n in names if (i := runners.find_client(n, venvs)) is not None}
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "clients", "command": common.command_line("bench.clients", argv),
        "engine": "simulated" if args.simulate else "real (CPU)", "model": str(model),
        "workload": dataclasses.asdict(work),
        "clients": {n: ({"version": i.version, "where": i.where} if (i := installs.get(n)) else
                        {"installed": False, "install": runners.CLIENTS[n].install}) for n in names},
        "env": common.env_info(), "runs": rows,
    }  # fmt: skip
    with ClientStack(model, log_dir / "servers", simulate=args.simulate) as stack:
        result["stack_startup_s"] = round(stack.startup_s["stack_s"], 2)
        for n in names:
            install = installs.get(n)
            for t in targets:
                if install is None:
                    rows.append({"client": n, "target": t, "status": "not installed",
                                 "install": runners.CLIENTS[n].install})  # fmt: skip
                    continue
                common.log(f"{n} -> {t} ...")
                rows.append(run_client(install, stack, t, work, log_dir / n / t, args.timeout))
                common.log(f"  {rows[-1]['status']}")
        if args.pitfalls:
            common.log("pitfalls ...")
            result["pitfalls"] = pitfalls(installs, stack, log_dir, args.timeout)
    result["all_ok"] = all(r["status"] in ("ok", "not installed") for r in rows)
    _print(result)
    common.write_json(args.out, result)
    return result


def _print(result: Mapping[str, Any]) -> None:
    rows = result["runs"]
    table = [
        [r["client"], r["target"], r.get("version", "-"), r.get("requests", "-"), r.get("failed", "-"),
         tokens_cell(r), r.get("cached_prompt_tokens", "-"), r["status"]]
        for r in rows
    ]  # fmt: skip
    missing = {r["client"]: r["install"] for r in rows if r["status"] == "not installed"}
    common.print_table(
        f"Benchmark clients against kvfleet ({result['engine']} engine, tiny demo model)",
        ["client", "target", "version", "requests", "failed", "completion tokens", "cached", "status"],
        table,
        notes=[f"install {name}: {how}" for name, how in missing.items()],
    )
    for name, runs in (result.get("pitfalls") or {}).items():
        common.print_table(name, ["run", "outcome"], [[k, str(v)] for k, v in runs.items()])


if __name__ == "__main__":
    raise SystemExit(0 if main()["all_ok"] else 1)

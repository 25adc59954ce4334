"""The ``kvfleet`` console script: dispatches to a component, importing only that component.

Starting the gateway or the operator must never import torch, so each sub-command names a module
that is imported on demand.
"""

from __future__ import annotations

import importlib
import sys

# sub-command -> (module, function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo-model": (
        "kvfleet_engine.demo_model",
        "main",
        "write a random-weight HF model directory for tests and demos",
    ),
    "generate": ("kvfleet_engine.generate_cli", "generate_main", "generate text offline from a model directory"),
    "engine": (
        "kvfleet_engine.generate_cli",
        "engine_main",
        "engine commands: serve (one OpenAI-compatible replica), generate",
    ),
    "gateway": ("kvfleet_gateway.gateway_cli", "main", "run the multi-tenant OpenAI gateway (prefix-aware routing)"),
    "operator": ("kvfleet_operator.operator_cli", "main", "run the Kubernetes operator (kopf); also: crds, render"),
    "up": (
        "kvfleet_cli.up",
        "main",
        "run it all on this machine: redis, engine replicas, the gateway, a tenant, one request",
    ),
}


# package of a sub-command's module -> the extra that installs its dependencies
EXTRA_OF_PACKAGE = {
    "kvfleet_engine": "engine", "kvfleet_gateway": "gateway", "kvfleet_operator": "operator",
    "kvfleet_cli": "engine,gateway",  # `kvfleet up` runs the engine and the gateway
}  # fmt: skip


def _usage() -> str:
    lines = ["usage: kvfleet <command> [args...]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from kvfleet_common import __version__

        print(f"kvfleet {__version__}")
        return 0
    entry = COMMANDS.get(argv[0])
    if entry is None:
        print(f"kvfleet: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = entry
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        extra = EXTRA_OF_PACKAGE[module.partition(".")[0]]
        print(f"kvfleet {argv[0]}: missing dependency ({e}); install kvfleet[{extra}]", file=sys.stderr)
        return 2
    return int(getattr(mod, func)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

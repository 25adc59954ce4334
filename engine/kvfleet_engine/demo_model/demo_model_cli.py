"""``kvfleet demo-model``: command-line front end of ``build_demo_model``."""

from __future__ import annotations

import argparse

from kvfleet_engine.demo_model.presets import ARCHS, DTYPES, PRESETS
from kvfleet_engine.demo_model.weights import DEFAULT_LOGIT_STD


def make_parser(prog: str = "kvfleet demo-model") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Write a Hugging Face model directory (config, safetensors weights, tokenizer with a ChatML chat "
            "template) with deterministic random weights, loadable by the kvfleet engine and by transformers."
        ),
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="architecture (default: llama)")
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="size: tiny (0.5-0.7 M params), small (~50 M), bench (Qwen2-0.5B shape, 0.36 B); default tiny",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--shard-size",
        default=None,
        metavar="SIZE",
        help="split the weights into HF shards of at most SIZE (e.g. 50MB, 64MiB, bytes); default: one file",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)")
    parser.add_argument(
        "--logit-std",
        type=float,
        default=DEFAULT_LOGIT_STD,
        help=f"spread of the output logits (default {DEFAULT_LOGIT_STD:g}; smaller = softer sampling)",
    )
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None)
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    from kvfleet_engine.demo_model.builder import build

    if args.seed < 0:
        make_parser().error("--seed must be >= 0")
    try:
        result = build(
            args.out,
            arch=args.arch,
            preset=args.preset,
            seed=args.seed,
            shard_size=args.shard_size,
            dtype=args.dtype,
            logit_std=args.logit_std,
            progress=args.progress,
        )
    except ValueError as exc:
        make_parser().error(str(exc))
    print(result.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

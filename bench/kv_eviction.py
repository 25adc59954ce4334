"""KV-cache eviction: segmented LRU and keep-warm (the engine's policy) vs plain LRU, on the real
``KVCacheManager``.

Deterministic and model-free: requests are admitted and freed through the same ``KVCacheManager`` the
scheduler uses (prefix lookup, allocation, lazy eviction), with no forward pass. Plain LRU is the same
pool with the protected queue's cap at 0 (every protected block is demoted at once, so the free order
is pure recency). Each request is a group's shared system prompt (``--prefix`` tokens) plus private
tokens (``--private``: its question and answer, never shared); ``--concurrency`` requests hold their
blocks at a time. Reported: the fraction of system-prompt tokens found in the cache.

Scenarios:

* ``uniform``: every request picks one of ``G`` groups uniformly (G from ``--groups``). With the
  defaults (768 blocks of 16 tokens, 2,000-token prompts: the simulated replicas of
  ``bench/routing.py``) about 5 prompts fit besides the running requests.
* ``shift``: the first half of the requests uses groups 0..G-1, the second half G..2G-1; reported for
  the second half only. Checks that prompts that were hot once do not keep the cache from new ones.
* ``queued``: as ``uniform``, but each request waits behind ``--queue`` others between arriving and
  being admitted (an engine under load). With keep-warm the scheduler protects, at arrival, the prefix
  the request will hit (``Scheduler.add_request``); without it the prefix can be evicted meanwhile.

Usage::

    .venv/bin/python -m bench.kv_eviction            # ~30 s
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from typing import Any

from bench import _common as common

NAME = "kv_eviction"
# name -> (protected cap, keep-warm at arrival); None: the engine's PROTECTED_FRACTION
POLICIES = {"lru": (0.0, False), "segmented-lru": (None, False), "segmented-lru+keep-warm": (None, True)}
SCENARIOS = ("uniform", "shift", "queued")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=768, help="KV blocks (default 768)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2000, help="system prompt tokens per group")
    p.add_argument("--private", type=int, default=300, help="private tokens per request (question + answer)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=4, help="requests holding blocks at once")
    p.add_argument("--queue", type=int, default=8, help="(queued) requests waiting ahead of each arrival")
    p.add_argument("--groups", default="3,4,5,6,8", help="comma-separated group counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    args.groups = [int(g) for g in args.groups.split(",") if g.strip()]
    if min(args.groups, default=0) < 1 or args.requests < 2 or args.concurrency < 1:
        p.error("--groups must be positive, --requests >= 2, --concurrency >= 1")
    return args


def simulate(args: argparse.Namespace, policy: str, groups: int, scenario: str) -> float:
    """Hit rate on system-prompt tokens (second half only for ``shift``)."""
    import kvfleet_engine.core.block_pool as block_pool
    from kvfleet_engine.core.kv_cache_manager import KVCacheManager
    from kvfleet_engine.core.messages import EngineCoreRequest
    from kvfleet_engine.request import Request
    from kvfleet_engine.sampling_params import SamplingParams

    fraction, warm = POLICIES[policy]
    shift = scenario == "shift"
    queue = args.queue if scenario == "queued" else 0
    saved = block_pool.PROTECTED_FRACTION
    if fraction is not None:
        block_pool.PROTECTED_FRACTION = fraction
    try:
        kv = KVCacheManager(args.blocks, args.block_size)
    finally:
        block_pool.PROTECTED_FRACTION = saved
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 4000) for _ in range(n)]

    prompts = [tokens(args.prefix) for _ in range(2 * groups if shift else groups)]
    params = SamplingParams(max_tokens=1)
    hit = total = 0
    holding: list[Any] = []
    waiting: deque[tuple[Any, bool]] = deque()
    for i in range(args.requests):
        second_half = i >= args.requests // 2
        g = rng.randrange(groups) + (groups if shift and second_half else 0)
        core_request = EngineCoreRequest(
            f"r{i}",
            prompts[g] + tokens(args.private),
            params,
            max_tokens=1,
            stop_token_ids=frozenset(),
            arrival_time=float(i),
        )
        req = Request(core_request, block_size=args.block_size)
        if warm:
            kv.keep_warm(req)
        waiting.append((req, second_half))
        if len(waiting) <= queue:
            continue
        req, second_half = waiting.popleft()
        blocks, num_hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - num_hit, blocks, num_hit) is None:
            raise SystemExit("the cache cannot hold --concurrency requests: raise --blocks")
        req.num_computed_tokens = req.num_tokens
        if not shift or second_half:
            hit += min(num_hit, args.prefix)
            total += args.prefix
        holding.append(req)
        if len(holding) >= args.concurrency:
            kv.free(holding.pop(0))
    return hit / total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from kvfleet_engine.core.block_pool import PROTECTED_FRACTION

    rows = []
    for scenario in SCENARIOS:
        for g in args.groups:
            rates = {name: simulate(args, name, g, scenario) for name in POLICIES}
            rows.append({"scenario": scenario, "groups": g, **rates})
    engine = "segmented-lru+keep-warm"  # what the engine does
    worse = [r for r in rows if min(r["segmented-lru"], r[engine]) < r["lru"] - 1e-9]
    common.print_table(
        f"Prefix hit rate on system prompts ({args.blocks} blocks x {args.block_size}, {args.prefix}-token prompts, "
        f"{args.private} private tokens, {args.concurrency} concurrent, queue {args.queue}, {args.requests} requests)",
        ["scenario", "groups", "LRU", "segmented LRU", "+ keep-warm (engine)", "engine vs LRU"],
        [
            [
                r["scenario"],
                str(r["groups"]),
                f"{r['lru']:.1%}",
                f"{r['segmented-lru']:.1%}",
                f"{r[engine]:.1%}",
                f"{100 * (r[engine] - r['lru']):+.1f} pp",
            ]
            for r in rows
        ],
        [f"protected cap {PROTECTED_FRACTION:.0%}; never worse than LRU: {'yes' if not worse else 'NO'}"],
    )
    result = {
        "benchmark": NAME,
        "config": vars(args),
        "protected_fraction": PROTECTED_FRACTION,
        "rows": rows,
        "never_worse": not worse,
    }
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()

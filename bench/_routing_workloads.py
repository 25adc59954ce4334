"""The routing benchmark's workloads (``bench/routing.py``): the four scenarios' sessions, the prompts' reuse
profile (prompt tokens, and uncached tokens if every block were computed once in the whole fleet) and the
arrival rate calibrated from the simulated replicas' timing model.

Prompt text is vocabulary words of the demo model's tokenizer, one token each; counts are measured with the
tokenizer and the chat template, as the gateway and engine compute them.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import _fleet as fleet_mod
from bench import _serve_common as sc
from kvfleet_common.hashing import hash_blocks

SCENARIOS = ("shared-prefix", "multi-turn", "hot-prefix", "no-sharing", "shared-prefix-no-pressure")
# (a) again, the same requests and arrival times, on replicas whose KV cache holds every group's system
# prompt with room to spare (``kv_blocks``): what is left of the routers' difference without evictions
NO_PRESSURE = "shared-prefix-no-pressure"
BLOCK_SIZE = 16  # the engine's default; the gateway reads it from the heartbeats


@dataclass(slots=True)
class Session:
    """One user's requests, in order: a single question, or a chat's turns (each sent ``think_s[k]`` after
    the previous answer ended, quoting the chat so far). ``start``: seconds from the run's start."""

    sid: int
    start: float
    system: str
    messages: list[str]
    think_s: list[float] = field(default_factory=list)
    group: int | None = None


@dataclass(slots=True)
class Workload:
    scenario: str
    sessions: list[Session]
    output_len: int
    info: dict[str, Any]


def chat_messages(system: str, users: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """The request's ``messages``: the system prompt, the earlier turns with their answers, the new message."""
    out = [{"role": "system", "content": system}]
    for i, u in enumerate(users):
        out.append({"role": "user", "content": u})
        if i < len(answers):
            out.append({"role": "assistant", "content": answers[i]})
    return out


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat request exactly as the gateway and the engine compute them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def reuse_profile(prompts: Sequence[list[int]], block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """Prompt tokens in total, and uncached tokens if every full block were computed once in the whole fleet
    (the prefix-aware ideal), processing the prompts in order. A hit never covers a prompt's last token."""
    seen: set[bytes] = set()
    total = uncached = 0
    for ids in prompts:
        hashes = hash_blocks(ids, block_size)
        matched = 0
        for h in hashes[: (len(ids) - 1) // block_size]:
            if h not in seen:
                break
            matched += 1
        total += len(ids)
        uncached += len(ids) - matched * block_size
        seen.update(hashes)
    n = max(1, len(prompts))
    return {
        "requests": len(prompts),
        "prompt_tokens_mean": total / n,
        "uncached_tokens_mean_ideal": uncached / n,
    }


def build_workload(scenario: str, args: argparse.Namespace, tokenizer: Any, words: list[str]) -> Workload:
    """Sessions (without start times) and the token profile the arrival rate is calibrated from."""
    seed = args.seed * 1000 + SCENARIOS.index("shared-prefix" if scenario == NO_PRESSURE else scenario)
    rng = random.Random(seed)

    def texts(count: int, length: int, salt: int) -> list[str]:
        return sc.make_prompts(tokenizer, count, length, seed=seed * 10 + salt, words=words)

    sessions: list[Session] = []
    if scenario in ("shared-prefix", NO_PRESSURE):
        systems = texts(args.groups, args.system_len, 1)
        users = [(g, u) for g in range(args.groups) for u in range(args.users_per_group)]
        rng.shuffle(users)
        questions = texts(len(users), args.question_len, 2)
        for i, ((g, _), q) in enumerate(zip(users, questions)):
            sessions.append(Session(i, 0.0, systems[g], [q], group=g))
    elif scenario == "hot-prefix":
        (system,) = texts(1, args.system_len, 1)
        for i, q in enumerate(texts(args.hot_requests, args.question_len, 2)):
            sessions.append(Session(i, 0.0, system, [q], group=0))
    elif scenario == "no-sharing":
        systems = texts(args.unique_requests, args.system_len, 1)
        for i, (s, q) in enumerate(zip(systems, texts(args.unique_requests, args.question_len, 2))):
            sessions.append(Session(i, 0.0, s, [q]))
    elif scenario == "multi-turn":
        systems = texts(args.chats, args.chat_system_len, 1)
        msgs = texts(args.chats * args.turns, args.chat_message_len, 2)
        for i, s in enumerate(systems):
            think = [rng.expovariate(1.0 / args.think_s) for _ in range(args.turns - 1)]
            sessions.append(Session(i, 0.0, s, msgs[i * args.turns : (i + 1) * args.turns], think, group=i))
    else:
        raise ValueError(f"unknown scenario {scenario!r}")

    # Token profile: the real prompts; a chat's answers are stand-ins of the output length (the simulated
    # replica's answers are only known after the run).
    placeholder = texts(1, args.output_len, 3)[0]
    prompts = []
    for s in sessions:
        for k in range(len(s.messages)):
            prompts.append(
                prompt_ids(tokenizer, chat_messages(s.system, s.messages[: k + 1], [placeholder] * k))
            )
    profile = reuse_profile(prompts)
    return Workload(scenario, sessions, args.output_len, profile)


def kv_blocks(scenario: str, args: argparse.Namespace) -> int:
    """KV blocks per replica for ``scenario``: ``--num-kv-blocks``, except under ``NO_PRESSURE``: twice what
    every group's whole request (system prompt, question, answer) takes, so that nothing is evicted."""
    if scenario != NO_PRESSURE:
        return args.num_kv_blocks
    per_group = -(-(args.system_len + args.question_len + args.output_len) // BLOCK_SIZE)
    return max(args.num_kv_blocks, 2 * args.groups * per_group)


def calibrate(workload: Workload, args: argparse.Namespace, cost: fleet_mod.SimCost) -> dict[str, Any]:
    """Capacities from the timing model, the chosen request rate, and Poisson start times for the sessions."""
    prof = workload.info
    per_replica_tok_s = cost.prefill_tokens_per_s
    cap_ideal = args.replicas * per_replica_tok_s / prof["uncached_tokens_mean_ideal"]
    cap_none = args.replicas * per_replica_tok_s / prof["prompt_tokens_mean"]
    basis = cap_ideal if args.rate_basis == "prefix-aware" else cap_none
    rate = min(args.utilisation * basis, args.max_rate)
    turns = max(len(s.messages) for s in workload.sessions)
    session_rate = rate / turns  # a chat's turns follow its answers: start chats at rate / turns
    starts = sc.poisson_offsets(len(workload.sessions), session_rate, seed=args.seed + 7919)
    for s, t in zip(workload.sessions, starts):
        s.start = t
    return {
        "capacity_req_s_prefix_aware_ideal": cap_ideal,
        "capacity_req_s_no_reuse": cap_none,
        "rate_basis": args.rate_basis,
        "rate_req_s": rate,
        "rate_capped": rate < args.utilisation * basis,
        "session_rate_per_s": session_rate,
        "load_vs_no_reuse_capacity": rate / cap_none,
        "load_vs_prefix_aware_capacity": rate / cap_ideal,
        "arrivals_span_s": starts[-1] if starts else 0.0,
    }

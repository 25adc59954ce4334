"""The autoscaling policy: from a model's recent load to the replicas it should have. Pure (no I/O).

One tick of the operator's autoscaler builds a `LoadSample` (the gateways' counts from Redis, the engines'
heartbeats, the Deployment's replicas) and calls `decide`, which returns the replicas to ask for, the reason,
and the memory for the next tick. The bench (`bench/autoscale.py`) drives the same function in virtual time.

The rules, in order (each tick):

1. **Cold start.** No replica is asked for and a request is held at a gateway (``held > 0``): ask for one at
   once. Nothing else can serve it, so no stabilization applies (reason ``ColdStart``).
2. **Recommendation.** ``ceil(demand / target)``, kept inside ``[minReplicas, maxReplicas]`` and at least 1
   while anything is in flight or held. Demand by metric:
   - ``inFlight`` (default): requests in flight to the model (the larger of the gateways' count and the
     engines' running + waiting) plus requests held at gateways;
   - ``waiting``: requests queued in the engines plus those held at gateways;
   - ``kvCacheUsage``: the sum of the ready replicas' KV-cache usage (a replica at 80 % counts 0.8).
   Within ``tolerance`` of the current size the recommendation is the current size (no churn for 5 %).
3. **Scale up** to the *lowest* recommendation of the last ``scaleUpStabilizationSeconds``: a burst must
   last the window before a replica (minutes of GPU time) is added (and a new leader waits that long).
4. **Scale down** to the *highest* recommendation of the last ``scaleDownDelaySeconds``, and only once the
   memory covers that whole window (a new operator leader waits one full delay before removing anything).
   Never below 1 here:
5. **Scale to zero** only with ``minReplicas: 0``, when the model has had no demand at all (nothing in
   flight, held, running or waiting, and no request recorded) for ``scaleToZeroAfterSeconds``.

While none of the replicas asked for is ready yet (a cold start), nothing more is added, and the window of
rule 3 starts over once one is: requests held that long are a backlog the first replica drains in seconds,
not a rate (rule 3's exception). A replica that never becomes
ready adds no capacity and no demand: the recommendation depends on demand, not
on how many replicas are ready, so it neither triggers more scale-ups (each would wait for the same missing
node) nor shrinks the ready ones. `decide` reports it (reason ``ReplicasNotReady``) while it lasts.

Invariant: ``min(policy.min_replicas, …) <= Decision.replicas <= policy.max_replicas`` after the first tick,
whatever the samples say; ``Decision.memory`` holds only what the rules above look back at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Metric = Literal["inFlight", "waiting", "kvCacheUsage"]
METRICS: tuple[str, ...] = ("inFlight", "waiting", "kvCacheUsage")
DEFAULT_TARGETS: dict[str, float] = {"inFlight": 8.0, "waiting": 2.0, "kvCacheUsage": 0.7}
"""Per-replica targets when the spec gives none: 8 concurrent streams, 2 queued requests, 70 % of KV."""


@dataclass(frozen=True, slots=True)
class AutoscalingPolicy:
    """``spec.autoscaling`` of an InferenceModel, validated (CRD schema + CEL): min <= max, target > 0."""

    min_replicas: int
    max_replicas: int
    metric: Metric = "inFlight"
    target: float = DEFAULT_TARGETS["inFlight"]
    scale_up_stabilization_s: float = 30.0
    scale_down_delay_s: float = 300.0
    scale_to_zero_after_s: float = 3600.0
    tolerance: float = 0.1


@dataclass(frozen=True, slots=True)
class LoadSample:
    """What one tick sees of a model. Counts are fleet-wide (every live gateway, every live replica)."""

    at: float  # unix seconds
    replicas: int  # replicas the Deployment asks for now
    ready: int  # of those, ready
    in_flight: int = 0  # requests the gateways are proxying to the model's replicas
    held: int = 0  # requests the gateways hold for the model (no replica yet, or all asleep)
    running: int = 0  # engines' running requests (heartbeats)
    waiting: int = 0  # engines' queued requests (heartbeats)
    kv_usage: float = 0.0  # sum over ready replicas of their KV-cache usage (0..1 each)
    last_request_at: float | None = None  # the gateways' last recorded request for the model


@dataclass(frozen=True, slots=True)
class ScalerMemory:
    """What `decide` remembers between ticks: its recommendations and when the model last had demand."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (at, replicas), oldest first
    first_seen_at: float | None = None
    active_at: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str  # CamelCase, for status conditions, Events and the operator's metric
    message: str
    memory: ScalerMemory = field(default_factory=ScalerMemory)
    previous: int = 0  # the replicas asked for before this tick

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous


def demand(policy: AutoscalingPolicy, sample: LoadSample) -> float:
    """The load the policy's metric measures, in units of ``policy.target``."""
    if policy.metric == "waiting":
        return float(sample.waiting + sample.held)
    if policy.metric == "kvCacheUsage":
        return sample.kv_usage
    return float(max(sample.in_flight, sample.running + sample.waiting) + sample.held)


def has_demand(sample: LoadSample) -> bool:
    """Anything at all for the model: a request in flight, held, running or queued."""
    return bool(sample.in_flight or sample.held or sample.running or sample.waiting)


def recommend(policy: AutoscalingPolicy, sample: LoadSample) -> int:
    """Rule 2: the replicas this sample alone asks for, before stabilization and the zero rule (>= 1)."""
    load = demand(policy, sample)
    current = sample.replicas
    if current > 0 and abs(load / (current * policy.target) - 1.0) <= policy.tolerance:
        wanted = current
    else:
        wanted = math.ceil(load / policy.target - 1e-9)
    floor = max(policy.min_replicas, 1)  # zero is rule 5's business, never the recommendation's
    return min(policy.max_replicas, max(floor, wanted))


def decide(policy: AutoscalingPolicy, memory: ScalerMemory, sample: LoadSample) -> Decision:
    """One tick: the replicas to ask for now, why, and the memory for the next tick (module docstring)."""
    now = sample.at
    horizon = max(policy.scale_up_stabilization_s, policy.scale_down_delay_s)
    first_seen = memory.first_seen_at if memory.first_seen_at is not None else now
    active_at = memory.active_at
    if has_demand(sample):
        active_at = now
    if sample.last_request_at is not None and (active_at is None or sample.last_request_at > active_at):
        active_at = min(sample.last_request_at, now)
    wanted = recommend(policy, sample)
    current = sample.replicas
    starting_blind = current > 0 and sample.ready == 0 and wanted > current
    kept = tuple((t, r) for t, r in memory.recommendations if t >= now - horizon)
    # While no replica is ready the demand is not evidence for more (rule 3's exception): remembered as the
    # current size, so the scale-up window starts over once a replica serves.
    history = (*kept, (now, current if starting_blind else wanted))
    remembered = ScalerMemory(recommendations=history, first_seen_at=first_seen, active_at=active_at)

    def verdict(replicas: int, reason: str, message: str) -> Decision:
        return Decision(replicas, reason, message, remembered, current)

    if current == 0 and (sample.held or has_demand(sample)):
        return verdict(max(1, policy.min_replicas), "ColdStart",
                       f"{sample.held} request(s) held and no replica: starting one")  # fmt: skip
    if current == 0 and policy.min_replicas == 0:
        return verdict(0, "ScaledToZero", "no request: no replica")
    if current < policy.min_replicas:
        return verdict(policy.min_replicas, "BelowMinimum", f"minReplicas is {policy.min_replicas}")
    if current > policy.max_replicas:
        return verdict(policy.max_replicas, "AboveMaximum", f"maxReplicas is {policy.max_replicas}")
    load = f"{policy.metric} {demand(policy, sample):g} for a target of {policy.target:g} per replica"

    if starting_blind:
        # Rule 3's exception: while none of the replicas is ready yet (a cold start, or no node for any of
        # them), the held requests are a backlog, not a rate: a trickle piles up for the whole start-up and
        # would ask for replicas that sit idle once the first one drains it in seconds. More replicas would
        # also wait for the same start-up (or the same missing node).
        return verdict(current, "ReplicasNotReady",
                       f"{load}: no replica ready yet; holding {current} until one is")  # fmt: skip
    if wanted > current:
        covered = first_seen <= now - policy.scale_up_stabilization_s
        settled = min(r for t, r in history if t >= now - policy.scale_up_stabilization_s)
        if covered and settled > current:
            return verdict(settled, "ScaleUp", f"{load}: {current} -> {settled} replicas")
        return verdict(current, "StabilizingUp",
                       f"{load}: holding {current} until the demand lasts "
                       f"{policy.scale_up_stabilization_s:g} s")  # fmt: skip

    if wanted < current:
        covered = first_seen <= now - policy.scale_down_delay_s
        settled = max(r for t, r in history if t >= now - policy.scale_down_delay_s)
        if covered and settled < current:
            return verdict(settled, "ScaleDown", f"{load}: {current} -> {settled} replicas")
        return verdict(current, "DelayingScaleDown",
                       f"{load}: keeping {current} for scaleDownDelaySeconds "
                       f"({policy.scale_down_delay_s:g} s)")  # fmt: skip

    if current == 1 and policy.min_replicas == 0 and not has_demand(sample):
        idle_since = active_at if active_at is not None else first_seen
        idle_for = now - idle_since
        if idle_for >= policy.scale_to_zero_after_s:
            return verdict(0, "ScaleToZero", f"no request for {idle_for:.0f} s: removing the last replica")
        return verdict(current, "Idle", f"idle for {idle_for:.0f} s; scale to zero after "
                       f"{policy.scale_to_zero_after_s:g} s")  # fmt: skip
    if sample.ready < current:
        return verdict(current, "ReplicasNotReady", f"{sample.ready}/{current} replicas ready; {load}")
    return verdict(current, "Steady", load)

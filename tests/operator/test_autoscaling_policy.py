"""The autoscaling policy (`kvfleet_operator.autoscaling.decide`) against load traces, in virtual time.

`simulate` plays a small fleet: every tick (1 s) it samples the trace, asks `decide`, and applies the answer
the way a Deployment would: a new replica becomes ready ``startup_s`` after it is asked for (or never, for the
never-ready case), a removed one goes at once. Each test states what a user of the policy relies on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvfleet_operator.autoscaling import (
    DEFAULT_TARGETS,
    AutoscalingPolicy,
    Decision,
    LoadSample,
    ScalerMemory,
    decide,
    recommend,
)

POLICY = AutoscalingPolicy(
    min_replicas=0,
    max_replicas=3,
    target=8,
    scale_up_stabilization_s=30,
    scale_down_delay_s=120,
    scale_to_zero_after_s=600,
)


@dataclass
class Run:
    """What a simulation saw: one entry per tick."""

    times: list[float] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)  # asked for after the tick's decision
    ready: list[int] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def changes(self) -> list[tuple[float, int, int]]:
        """(time, before, after) of each change of the replicas asked for."""
        return [(d_t, d.previous, d.replicas) for d_t, d in zip(self.times, self.decisions) if d.changed]

    def at(self, t: float) -> int:
        return self.replicas[self.times.index(t)]

    def reasons(self) -> set[str]:
        return {d.reason for d in self.decisions}


def simulate(
    policy: AutoscalingPolicy,
    in_flight: Callable[[float], float],
    seconds: int,
    startup_s: float = 20.0,
    start_replicas: int = 1,
    never_ready_from: int | None = None,
    held_when_empty: bool = True,
) -> Run:
    """Tick once a second for ``seconds``; ``in_flight(t)`` is the demand. With no ready replica the
    demand is held at the gateways (``held``); replicas from index ``never_ready_from`` on (0-based, in
    the order asked for) never start."""
    run, memory = Run(), ScalerMemory()
    asked_at: list[float] = [-1e9] * start_replicas  # when each replica was asked for (oldest first)
    for t in range(seconds):
        now = float(t)
        ready = sum(1 for i, a in enumerate(asked_at)
                    if now - a >= startup_s and (never_ready_from is None or i < never_ready_from))  # fmt: skip
        load = round(in_flight(now))
        held = load if ready == 0 and held_when_empty else 0
        sample = LoadSample(at=now, replicas=len(asked_at), ready=ready, in_flight=load - held, held=held,
                            running=load - held, last_request_at=now if load else None)  # fmt: skip
        decision = decide(policy, memory, sample)
        memory = decision.memory
        while len(asked_at) < decision.replicas:
            asked_at.append(now)
        del asked_at[decision.replicas :]
        run.times.append(now)
        run.replicas.append(decision.replicas)
        run.ready.append(ready)
        run.decisions.append(decision)
    return run


def step(at: float, until: float, high: float, low: float = 0.0) -> Callable[[float], float]:
    return lambda t: high if at <= t < until else low


def test_step_burst_scales_up_after_the_window_then_down_after_the_delay_then_to_zero() -> None:
    run = simulate(POLICY, step(100, 400, high=40), seconds=1300)
    changes = run.changes()
    # one replica idles until the burst; the burst (5 replicas' worth) is capped at maxReplicas
    assert run.at(99) == 1
    up = [c for c in changes if c[2] > c[1]]
    assert up == [(130.0, 1, 3)], changes  # the burst lasted the 30 s window: straight to the cap
    assert set(run.replicas[130:400]) == {3}
    # the burst ends at 400: kept for the 120 s delay, then one replica, then zero 600 s after the last request
    down = [c for c in changes if c[2] < c[1]]
    assert down == [(520.0, 3, 1), (999.0, 1, 0)], changes
    assert {"ScaleUp", "StabilizingUp", "DelayingScaleDown", "ScaleDown", "Idle", "ScaleToZero"} <= run.reasons()


def test_ramp_adds_replicas_in_order_and_never_removes_one_while_it_grows() -> None:
    run = simulate(POLICY, lambda t: min(40.0, t / 10), seconds=600)  # 0 -> 40 in flight over 400 s
    assert run.replicas[-1] == 3
    ups = [c for c in run.changes() if c[2] > c[1]]
    assert [c[2] for c in ups] == [2, 3]
    assert all(b <= a for b, a in zip(run.replicas, run.replicas[1:])), "a growing load never loses a replica"
    for t, _, after in ups:
        # each step was justified for the whole window before it: demand above (after-1) replicas' target
        window = [min(40.0, s / 10) for s in range(int(t) - 30, int(t) + 1)]
        assert min(window) > (after - 1) * POLICY.target * (1 + POLICY.tolerance) - 1


def test_diurnal_sine_tracks_the_load_with_few_changes() -> None:
    period = 3600.0
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=6, target=8, scale_up_stabilization_s=30,
                               scale_down_delay_s=300, scale_to_zero_after_s=3600)  # fmt: skip

    def load(t: float) -> float:
        return 24 + 20 * math.sin(2 * math.pi * t / period)  # 4 .. 44 in flight

    run = simulate(policy, load, seconds=int(2 * period))
    changes = run.changes()
    # each direction moves through at most the 6 levels per half period: no oscillation between neighbours
    assert len(changes) <= 2 * 2 * 6, changes
    flips = sum(1 for a, b in itertools.pairwise(changes) if (a[2] > a[1]) != (b[2] > b[1]))
    assert flips <= 4, f"direction changed {flips} times in two periods: {changes}"
    # capacity follows demand: at the peaks every replica is asked for; in the troughs the fleet shrank
    peaks = [run.at(float(t)) for t in (1000, 1000 + int(period))]
    troughs = [run.at(float(t)) for t in (3000, 3000 + int(period))]
    assert peaks == [6, 6] and max(troughs) <= 2, (peaks, troughs)
    # and short of the cap the fleet keeps up: ready capacity covers the load except while scaling up
    short = [t for t in range(len(run.times)) if run.ready[t] * policy.target * 1.5 < load(t)]
    assert len(short) < 0.1 * len(run.times)


@pytest.mark.parametrize(("on_s", "off_s"), [(10, 10), (20, 20)])
def test_flapping_shorter_than_the_window_never_scales(on_s: int, off_s: int) -> None:
    def flapping(t: float) -> float:
        return 40.0 if (t % (on_s + off_s)) < on_s else 4.0

    run = simulate(POLICY, flapping, seconds=900)
    assert run.changes() == []
    assert set(run.replicas) == {1}


def test_slow_flapping_scales_up_once_and_the_delay_keeps_it_there() -> None:
    def flapping(t: float) -> float:  # 60 s on, 60 s off: each burst outlasts the window
        return 40.0 if (t % 120) < 60 else 4.0

    run = simulate(POLICY, flapping, seconds=900)
    assert [c for c in run.changes()] == [(30.0, 1, 3)], "one scale-up, no scale-down inside the delay"


def test_load_at_the_threshold_does_not_flap_within_the_tolerance() -> None:
    run = simulate(POLICY, lambda t: 16.0 + (t % 2), seconds=600, start_replicas=2)  # 16, 17, 16, ...
    assert run.changes() == [] and set(run.replicas) == {2}


def test_a_replica_that_never_becomes_ready_triggers_no_more_scale_ups_and_scale_down_still_works() -> None:
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=5, target=8, scale_up_stabilization_s=30,
                               scale_down_delay_s=120, scale_to_zero_after_s=600)  # fmt: skip
    # 24 in flight = 3 replicas' worth; the third replica asked for never starts (no node for it)
    run = simulate(policy, step(50, 500, high=24, low=4), seconds=900, never_ready_from=2)
    assert max(run.replicas) == 3, "no replica beyond what the demand asks, though one never became ready"
    assert run.changes()[0] == (80.0, 1, 3)
    assert set(run.ready[200:500]) == {2}
    assert "ReplicasNotReady" in {d.reason for d in run.decisions[200:500]}
    assert run.replicas[-1] == 1  # the load went: back to the minimum


def test_a_cold_start_asks_for_no_more_replicas_until_one_is_ready() -> None:
    def backlog(t: float) -> float:  # a trickle of 0.6 req/s held from t=50: the held count keeps growing
        return min(40.0, max(0.0, (t - 50) * 0.6))

    # a 120 s start-up: the first replica (asked for at t=51) comes up at t=171; only then may the fleet grow
    run = simulate(POLICY, backlog, seconds=400, start_replicas=0, startup_s=120)
    assert run.at(55) == 1 and max(run.replicas[:171]) == 1
    assert "ReplicasNotReady" in {d.reason for d in run.decisions[80:171]}
    # no node for the pod at all: one pending replica, never a fleet of them
    run = simulate(POLICY, backlog, seconds=400, start_replicas=0, startup_s=120, never_ready_from=0)
    assert max(run.replicas) == 1


def test_cold_start_asks_for_one_replica_at_once_for_a_held_request() -> None:
    run = simulate(POLICY, step(50, 60, high=1), seconds=120, start_replicas=0)
    assert run.at(49) == 0
    assert run.changes()[0] == (50.0, 0, 1)
    assert run.decisions[50].reason == "ColdStart"


def test_scale_to_zero_counts_from_the_last_request_the_gateways_recorded() -> None:
    memory = ScalerMemory()
    base = dict(replicas=1, ready=1)
    d = decide(POLICY, memory, LoadSample(at=0.0, **base))
    # nothing in flight now, but a request was recorded at t=500 (between two ticks)
    d = decide(POLICY, d.memory, LoadSample(at=700.0, last_request_at=500.0, **base))
    assert d.replicas == 1 and d.reason == "Idle"
    d = decide(POLICY, d.memory, LoadSample(at=1100.0, last_request_at=500.0, **base))
    assert (d.replicas, d.reason) == (0, "ScaleToZero")


def test_a_new_leader_waits_a_full_delay_before_removing_a_replica() -> None:
    d = decide(POLICY, ScalerMemory(), LoadSample(at=1000.0, replicas=3, ready=3, in_flight=1, running=1))
    assert (d.replicas, d.reason) == (3, "DelayingScaleDown")
    d = decide(POLICY, d.memory, LoadSample(at=1120.0, replicas=3, ready=3, in_flight=1, running=1))
    assert (d.replicas, d.reason) == (1, "ScaleDown")


def test_minimum_and_maximum_are_enforced_whatever_the_load() -> None:
    policy = AutoscalingPolicy(min_replicas=2, max_replicas=4, scale_up_stabilization_s=0, scale_down_delay_s=0)
    assert decide(policy, ScalerMemory(), LoadSample(at=0, replicas=0, ready=0)).replicas == 2
    assert decide(policy, ScalerMemory(), LoadSample(at=0, replicas=7, ready=7)).replicas == 4
    assert decide(policy, ScalerMemory(), LoadSample(at=0, replicas=2, ready=2, in_flight=1000)).replicas == 4
    assert decide(policy, ScalerMemory(), LoadSample(at=0, replicas=4, ready=4)).replicas == 2


@pytest.mark.parametrize(
    ("metric", "sample", "expected"),
    [
        ("inFlight", LoadSample(at=0, replicas=1, ready=1, in_flight=17), 3),
        ("inFlight", LoadSample(at=0, replicas=1, ready=1, in_flight=3, running=10, waiting=7), 3),
        ("waiting", LoadSample(at=0, replicas=1, ready=1, in_flight=30, waiting=5), 3),
        ("kvCacheUsage", LoadSample(at=0, replicas=2, ready=2, kv_usage=1.9), 3),
    ],
)
def test_each_metric_measures_its_own_load(metric: str, sample: LoadSample, expected: int) -> None:
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=10, metric=metric, target=DEFAULT_TARGETS[metric])  # type: ignore[arg-type]
    assert recommend(policy, sample) == expected

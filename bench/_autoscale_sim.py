"""The discrete-event simulation behind ``bench/autoscale.py``: a bursty trace, simulated replicas, gateways
that route and hold, and the operator's real autoscaling policy ticking in virtual time.

Everything here is deterministic: the trace comes from a seeded generator and the simulation has no other
randomness, so one seed gives the same numbers on any machine. Time is virtual (seconds of the trace, never
the wall clock): two hours of a fleet play out in about a second.

The replica model (the constants are `ReplicaModel`'s fields; bench/autoscale.py exposes them as options):

- continuous batching with at most ``max_num_seqs`` requests running; a request that finds every slot taken
  waits in the replica's FIFO queue;
- an admitted request is prefilled ``prompt_tokens * prefill_s_per_token`` seconds, one prefill at a time
  per replica (the replica's GPU runs one prefill after the other, so a burst of arrivals queues for it);
  its first token is out when its prefill ends;
- it then decodes its remaining ``output_tokens - 1`` tokens at ``decode_s_per_token +
  decode_s_per_token_per_seq * (batch - 1)`` seconds each, ``batch`` being the replica's running requests
  when it was admitted (decoding slows mildly as the batch grows; fixed at admission to keep one event per
  request). Prefill does not slow the running decodes down (a simplification: on a real engine it does a
  little, the same in every scenario).

TTFT = time held at the gateway (no replica ready) + time queued at the replica + time waiting for the
replica's earlier prefills + its own prefill.

The fleet: gateways send each request to the least-loaded ready replica (running + queued; lowest index on
a tie); with no ready replica they hold it (scale from zero) and dispatch held requests, oldest first, as
soon as one becomes ready. A replica asked for becomes ready ``cold_start_s`` later. Scaling down removes
replicas still starting first, then the most recently ready ones (a ReplicaSet's order); a removed ready
replica drains: it takes no new request and finishes its running and queued ones, counting replica-seconds
until the last one ends. Replica-seconds integrate every replica that exists (starting, serving, draining)
from t = 0 until the scenario's last request finishes (or the trace ends, whichever is later).

The autoscaler ticks every ``tick_s`` and samples the way the operator does: ``in_flight`` = requests the
gateways have sent to replicas and not yet seen finish (running + queued, draining replicas included),
``held`` = requests held at the gateways, ``running`` / ``waiting`` from the replicas, ``replicas`` = asked
for, ``ready`` = of those, serving. The real gateways and heartbeats report within ~50 ms / ~1 s; the sample
here is exact, a difference far below the policy's windows.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field

from kvfleet_operator.autoscaling import AutoscalingPolicy, LoadSample, ScalerMemory, decide

# Events at the same instant: a finish frees a slot before a new arrival looks for one, and the tick sees
# the state after everything else that happened at that instant.
FINISH, READY, ARRIVAL, TICK = 0, 1, 2, 3

PROMPT_CLIP = (16, 4096)
OUTPUT_CLIP = (8, 1024)


@dataclass(frozen=True, slots=True)
class ReplicaModel:
    """One replica's speed and capacity (defaults: a small model, e.g. ~1-3 B parameters, on one GPU)."""

    max_num_seqs: int = 32  # the concurrency its KV cache allows
    prefill_s_per_token: float = 0.0001  # 10k prompt tokens/s
    decode_s_per_token: float = 0.015  # one sequence alone: ~67 tokens/s
    decode_s_per_token_per_seq: float = 0.00015  # + 0.15 ms per other running sequence (32 running: +31 %)
    cold_start_s: float = 60.0  # asked for -> ready (pod scheduled, image, weights, warm-up)


@dataclass(frozen=True, slots=True)
class Burst:
    start_s: float
    duration_s: float
    multiplier: float


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Poisson arrivals at ``base_rps``, times ``multiplier`` inside a burst, none inside the idle stretch."""

    duration_s: float
    base_rps: float
    bursts: tuple[Burst, ...]
    idle: tuple[float, float] | None  # (start_s, duration_s)
    prompt_median: float = 400.0
    prompt_sigma: float = 0.8
    output_median: float = 120.0
    output_sigma: float = 0.7
    seed: int = 0

    def rate_at(self, t: float) -> float:
        if self.idle is not None and self.idle[0] <= t < self.idle[0] + self.idle[1]:
            return 0.0
        for b in self.bursts:
            if b.start_s <= t < b.start_s + b.duration_s:
                return self.base_rps * b.multiplier
        return self.base_rps

    def segments(self) -> list[tuple[float, float, float]]:
        """(start_s, end_s, rps) pieces of constant rate covering ``[0, duration_s)``, in order."""
        cuts = {0.0, self.duration_s}
        for b in self.bursts:
            cuts.update((b.start_s, b.start_s + b.duration_s))
        if self.idle is not None:
            cuts.update((self.idle[0], self.idle[0] + self.idle[1]))
        points = sorted(c for c in cuts if 0.0 <= c <= self.duration_s)
        return [(a, b, self.rate_at(a)) for a, b in itertools.pairwise(points) if b > a]


@dataclass(slots=True)
class Request:
    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token_at: float | None = None
    finished_at: float | None = None
    held: bool = False  # held at a gateway (no replica ready)
    queued: bool = False  # waited for a free slot at its replica

    @property
    def ttft(self) -> float:
        assert self.first_token_at is not None
        return self.first_token_at - self.arrival


def make_trace(spec: TraceSpec) -> list[Request]:
    """The arrivals, sorted by time. Piecewise-constant Poisson (exponential gaps restarted at each piece's
    start, exact because the process is memoryless); lognormal prompt and output lengths, clipped."""
    rng = random.Random(spec.seed)
    out: list[Request] = []
    for start, end, rps in spec.segments():
        if rps <= 0:
            continue
        t = start + rng.expovariate(rps)
        while t < end:
            prompt = round(rng.lognormvariate(math.log(spec.prompt_median), spec.prompt_sigma))
            output = round(rng.lognormvariate(math.log(spec.output_median), spec.output_sigma))
            prompt = min(PROMPT_CLIP[1], max(PROMPT_CLIP[0], prompt))
            output = min(OUTPUT_CLIP[1], max(OUTPUT_CLIP[0], output))
            out.append(Request(len(out), t, prompt, output))
            t += rng.expovariate(rps)
    return out


@dataclass(slots=True)
class Replica:
    index: int
    created_at: float
    state: str = "starting"  # starting -> ready -> draining -> gone (or starting -> gone)
    ready_at: float | None = None
    running: int = 0
    queue: deque[Request] = field(default_factory=deque)
    prefill_free_at: float = 0.0

    @property
    def load(self) -> int:
        return self.running + len(self.queue)


@dataclass
class ScenarioResult:
    name: str
    requests: list[Request]
    replica_seconds: float
    end_s: float
    peak_replicas: int
    scale_events: list[tuple[float, int, int, str]]  # (t, from, to, reason)
    replicas_per_minute: list[int]  # replicas existing at each whole minute
    cold_start_s: float | None
    policy: AutoscalingPolicy | None


class Simulation:
    """One scenario over a trace: ``fixed`` replicas for the whole run, or ``policy`` deciding each tick."""

    def __init__(
        self,
        trace: list[Request],
        model: ReplicaModel,
        *,
        fixed: int | None = None,
        policy: AutoscalingPolicy | None = None,
        initial_replicas: int = 1,
        tick_s: float = 1.0,
        trace_end_s: float = 0.0,
    ) -> None:
        if (fixed is None) == (policy is None):
            raise ValueError("give either fixed replicas or an autoscaling policy")
        # Fresh copies: every scenario plays the same arrivals.
        self.requests = [Request(r.index, r.arrival, r.prompt_tokens, r.output_tokens) for r in trace]
        self.model, self.policy, self.tick_s, self.trace_end_s = model, policy, tick_s, trace_end_s
        self.events: list[tuple[float, int, int, object]] = []
        self.order = 0
        self.replicas: list[Replica] = []
        self.held: deque[Request] = deque()
        self.existing = 0
        self.replica_seconds = 0.0
        self.peak = 0
        self.clock = 0.0
        self.last_arrival: float | None = None
        self.unfinished = len(self.requests)
        self.scale_events: list[tuple[float, int, int, str]] = []
        self.per_minute: list[int] = []
        self.memory = ScalerMemory()
        for _ in range(fixed if fixed is not None else initial_replicas):
            self._add_replica(ready_now=True)
        for r in self.requests:
            self._push(r.arrival, ARRIVAL, r)
        if policy is not None:
            self._push(0.0, TICK, None)

    # ---- bookkeeping ------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, data: object) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, kind, self.order, data))

    def _advance(self, t: float) -> None:
        while len(self.per_minute) * 60.0 <= t:
            self.per_minute.append(self.existing)
        self.replica_seconds += self.existing * (t - self.clock)
        self.clock = t

    def _asked(self) -> list[Replica]:
        return [r for r in self.replicas if r.state in ("starting", "ready")]

    def _add_replica(self, ready_now: bool = False) -> None:
        replica = Replica(len(self.replicas), self.clock)
        self.replicas.append(replica)
        self.existing += 1
        self.peak = max(self.peak, self.existing)
        if ready_now:
            replica.state, replica.ready_at = "ready", self.clock
        else:
            self._push(self.clock + self.model.cold_start_s, READY, replica)

    def _gone(self, replica: Replica) -> None:
        replica.state = "gone"
        self.existing -= 1

    # ---- requests ---------------------------------------------------------------------------------

    def _dispatch(self, request: Request) -> None:
        ready = [r for r in self.replicas if r.state == "ready"]
        if not ready:
            request.held = True
            self.held.append(request)
            return
        replica = min(ready, key=lambda r: (r.load, r.index))
        if replica.running < self.model.max_num_seqs:
            self._admit(replica, request)
        else:
            request.queued = True
            replica.queue.append(request)

    def _admit(self, replica: Replica, request: Request) -> None:
        m = self.model
        replica.running += 1
        start = max(self.clock, replica.prefill_free_at)
        request.first_token_at = start + request.prompt_tokens * m.prefill_s_per_token
        replica.prefill_free_at = request.first_token_at
        per_token = m.decode_s_per_token + m.decode_s_per_token_per_seq * (replica.running - 1)
        request.finished_at = request.first_token_at + (request.output_tokens - 1) * per_token
        self._push(request.finished_at, FINISH, (replica, request))

    def _finish(self, replica: Replica) -> None:
        replica.running -= 1
        self.unfinished -= 1
        if replica.queue:
            self._admit(replica, replica.queue.popleft())
        elif replica.state == "draining" and replica.running == 0:
            self._gone(replica)

    # ---- the autoscaler ---------------------------------------------------------------------------

    def sample(self) -> LoadSample:
        asked = self._asked()
        live = [r for r in self.replicas if r.state in ("ready", "draining")]
        running = sum(r.running for r in live)
        waiting = sum(len(r.queue) for r in live)
        ready = [r for r in asked if r.state == "ready"]
        return LoadSample(
            at=self.clock,
            replicas=len(asked),
            ready=len(ready),
            in_flight=running + waiting,
            held=len(self.held),
            running=running,
            waiting=waiting,
            kv_usage=sum(r.running / self.model.max_num_seqs for r in ready),
            last_request_at=self.last_arrival,
        )

    def _tick(self) -> None:
        assert self.policy is not None
        decision = decide(self.policy, self.memory, self.sample())
        self.memory = decision.memory
        if decision.changed:
            self.scale_events.append((self.clock, decision.previous, decision.replicas, decision.reason))
            self._scale_to(decision.replicas)

    def _scale_to(self, wanted: int) -> None:
        asked = self._asked()
        for _ in range(wanted - len(asked)):
            self._add_replica()
        excess = max(0, len(asked) - wanted)
        # A ReplicaSet removes pods still starting first, then the most recently ready.
        victims = sorted(asked, key=lambda r: (r.state == "ready", -(r.ready_at or 0.0), -r.index))[:excess]
        for replica in victims:
            if replica.state == "starting" or replica.load == 0:
                self._gone(replica)
            else:
                replica.state = "draining"

    # ---- the run ----------------------------------------------------------------------------------

    def run(self) -> None:
        while self.events:
            t, kind, _, data = heapq.heappop(self.events)
            if kind == TICK and self.unfinished == 0 and t >= self.trace_end_s:
                break  # nothing left to serve: the autoscaler's later ticks change nothing measured
            self._advance(t)
            if kind == FINISH:
                replica, _request = data  # type: ignore[misc]
                self._finish(replica)
            elif kind == READY:
                replica = data  # type: ignore[assignment]
                if replica.state == "starting":
                    replica.state, replica.ready_at = "ready", t
                    while self.held:
                        self._dispatch(self.held.popleft())
            elif kind == ARRIVAL:
                self.last_arrival = t
                self._dispatch(data)  # type: ignore[arg-type]
            else:
                self._tick()
                self._push(t + self.tick_s, TICK, None)
        self._advance(max(self.clock, self.trace_end_s))

    def result(self, name: str) -> ScenarioResult:
        return ScenarioResult(
            name=name,
            requests=self.requests,
            replica_seconds=self.replica_seconds,
            end_s=self.clock,
            peak_replicas=self.peak,
            scale_events=self.scale_events,
            replicas_per_minute=self.per_minute,
            cold_start_s=self.model.cold_start_s if self.policy is not None else None,
            policy=self.policy,
        )


def run_scenario(
    name: str,
    trace: list[Request],
    model: ReplicaModel,
    *,
    fixed: int | None = None,
    policy: AutoscalingPolicy | None = None,
    tick_s: float = 1.0,
    trace_end_s: float = 0.0,
) -> ScenarioResult:
    """One scenario; an autoscaled one starts with ``max(1, minReplicas)`` replicas ready (a model already
    serving)."""
    initial = max(1, policy.min_replicas) if policy is not None else 0
    sim = Simulation(
        trace,
        model,
        fixed=fixed,
        policy=policy,
        initial_replicas=initial,
        tick_s=tick_s,
        trace_end_s=trace_end_s,
    )
    sim.run()
    return sim.result(name)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation between the closest ranks."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)

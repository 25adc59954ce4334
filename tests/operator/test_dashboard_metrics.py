"""The Grafana dashboard shipped in the chart queries only what the code exports.

The exported series are collected from the real metric classes (``EngineMetrics``, ``GatewayMetrics``): every
metric gets one child so that ``registry.collect()`` yields its samples with their suffixes (``_total``,
``_bucket``, ...) and label names. Every PromQL expression of the dashboard (panel targets and template
variables) is then scanned for the series it selects, the label matchers it uses, the labels it groups by and
the labels its legends print; each must exist. A small PromQL scanner suffices because the dashboard's queries
are ours: selectors, functions, aggregations with ``by``, binary operators, ranges.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvfleet_engine.server.metrics import EngineMetrics
from kvfleet_gateway.metrics import Children, GatewayMetrics

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfleet"
DASHBOARD = CHART / "dashboards" / "kvfleet.json"

# Labels Prometheus attaches to every scraped series (Prometheus Operator's ServiceMonitor targets).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "container", "endpoint"})
AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group"}
)  # fmt: skip
FUNCTIONS = frozenset(
    {"rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "abs", "clamp_min", "clamp_max",
     "clamp", "ceil", "floor", "round", "sort", "sort_desc", "time", "vector", "scalar", "label_replace", "absent",
     "changes", "resets", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time",
     "last_over_time", "predict_linear", "timestamp"}
)  # fmt: skip
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
OPERATOR_WORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})

Exported = dict[str, frozenset[str]]  # series name -> its label names


def exported_series(*registries: CollectorRegistry, wrappers: list[MetricWrapperBase]) -> Exported:
    """Series names and label names that ``registries`` expose once each metric in ``wrappers`` has a child."""
    for metric in wrappers:
        labelnames = metric._labelnames  # a labelled metric exposes no sample until it has a child
        if labelnames:
            metric.labels(*["x"] * len(labelnames))
    out: dict[str, set[str]] = {}
    for registry in registries:
        for family in registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in out.items()}


def wrappers_of(*objects: object) -> list[MetricWrapperBase]:
    """The metrics an object holds, directly or behind a ``Children`` cache of their labelled children."""
    found = [v.metric if isinstance(v, Children) else v for obj in objects for v in vars(obj).values()]
    return [v for v in found if isinstance(v, MetricWrapperBase)]


def kvfleet_series() -> Exported:
    engine, gateway = EngineMetrics("m"), GatewayMetrics()
    return exported_series(engine.registry, gateway.registry, wrappers=wrappers_of(engine, gateway))


# ---- a PromQL scanner, enough for our dashboards ------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<space>\s+)
      | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      | (?P<var>\$\{\w+\}|\$\w+)
      | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)
      | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){}\[\],])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    text: str


def tokens(expr: str) -> list[Token]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot scan {expr[pos : pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "space":
            out.append(Token(str(m.lastgroup), m.group()))
    return out


@dataclass(slots=True)
class Query:
    """What one expression references: selectors (series -> matcher labels), grouping labels, functions."""

    selectors: list[tuple[str, list[str]]]
    grouping: list[str]
    unknown_functions: list[str]


def scan(expr: str) -> Query:
    toks = tokens(expr)
    q = Query([], [], [])
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.kind == "op" and t.text == "[":  # range or subquery: durations and variables only
            i = next(j for j in range(i, len(toks)) if toks[j].text == "]") + 1
            continue
        if t.kind != "ident":
            i += 1
            continue
        word = t.text.lower()
        if word in GROUPING:  # by (a, b); group_left may come without a label list
            if nxt is None or nxt.text != "(":
                i += 1
                continue
            close = next(j for j in range(i, len(toks)) if toks[j].text == ")")
            q.grouping += [tok.text for tok in toks[i + 2 : close] if tok.kind == "ident"]
            i = close + 1
        elif word in AGGREGATIONS and nxt is not None and (nxt.text == "(" or nxt.text.lower() in GROUPING):
            i += 1
        elif nxt is not None and nxt.text == "(":
            if t.text not in FUNCTIONS:
                q.unknown_functions.append(t.text)
            i += 1
        elif word in OPERATOR_WORDS:
            i += 2 if word == "offset" else 1
        else:  # a series selector, maybe with label matchers
            labels: list[str] = []
            i += 1
            if nxt is not None and nxt.text == "{":
                close = next(j for j in range(i, len(toks)) if toks[j].text == "}")
                body = toks[i + 1 : close]
                labels = [body[k].text for k in range(0, len(body), 4) if body[k].kind == "ident"]
                i = close + 1
            q.selectors.append((t.text, labels))
    return q


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def problems(expr: str, series: Exported, legend: str = "") -> list[str]:
    """Why ``expr`` (a PromQL expression or a Grafana ``label_values(...)`` query) is not answerable from the
    ``series`` the code exports; empty when it is."""
    m = _LABEL_VALUES.match(expr)
    if m:
        selector = m["selector"] or ""
        found = problems(selector, series) if selector else []
        names = [name for name, _ in scan(selector).selectors] if selector else list(series)
        if not any(m["label"] in series.get(n, ()) or m["label"] in TARGET_LABELS for n in names):
            found.append(f"label_values: no series of {names} has label {m['label']!r}")
        return found
    query = scan(expr)
    found = [f"unknown function {f!r}" for f in query.unknown_functions]
    available = set(TARGET_LABELS)
    if not query.selectors:
        found.append("selects no series")
    for name, matchers in query.selectors:
        if name not in series:
            close = sorted(s for s in series if s.startswith(name) or name.startswith(s))
            found.append(f"{name} is not exported" + (f" (did you mean {close[:3]}?)" if close else ""))
            continue
        available |= series[name]
        for label in matchers:
            if label not in series[name] and label not in TARGET_LABELS:
                found.append(f"{name} has no label {label!r} (has {sorted(series[name])})")
    for label in query.grouping + _LEGEND_LABEL.findall(legend):
        if label not in available:
            found.append(f"label {label!r} is on none of the series {[n for n, _ in query.selectors]}")
    return found


def dashboard_queries(dashboard: dict) -> Iterator[tuple[str, str, str]]:
    """(where, expr, legend) for every panel target (rows' nested panels too) and every query variable."""

    def walk(panels: list[dict]) -> Iterator[tuple[str, str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                yield (
                    f"panel {panel['title']!r} {target['refId']}",
                    target["expr"],
                    target.get("legendFormat", ""),
                )
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            yield f"variable ${var['name']}", query, ""


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# ---- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def series() -> Exported:
    return kvfleet_series()


def test_collected_series_carry_their_suffixes_and_labels(series: Exported):
    assert series["kvfleet_engine_requests_total"] >= {"model_name", "endpoint", "status"}
    assert "le" in series["kvfleet_engine_time_to_first_token_seconds_bucket"]
    assert "kvfleet_engine_time_to_first_token_seconds_sum" in series
    assert series["kvfleet_gateway_tenant_tokens_total"] == {"tenant", "model", "kind"}
    assert "kvfleet_engine_kv_cache_usage_ratio" in series and "kvfleet_engine_requests" not in series
    assert "kvfleet_gateway_routing_decisions_total" in series


def test_every_dashboard_query_uses_only_exported_series_and_labels(series: Exported):
    queries = list(dashboard_queries(load_dashboard()))
    assert len(queries) >= 40
    found = {where: p for where, expr, legend in queries if (p := problems(expr, series, legend))}
    assert found == {}


def test_dashboard_covers_what_an_operator_watches(series: Exported):
    """Requests, TTFT / ITL (engine and gateway), routing decisions, cache-prediction accuracy, KV usage, sleep
    state and per-tenant usage and rejections each have a panel."""
    used = {name for _, expr, _ in dashboard_queries(load_dashboard()) for name, _ in scan_any(expr)}
    needed = {
        "kvfleet_gateway_requests_total", "kvfleet_engine_requests_total",
        "kvfleet_engine_time_to_first_token_seconds_bucket", "kvfleet_gateway_time_to_first_token_seconds_bucket",
        "kvfleet_engine_inter_token_latency_seconds_bucket", "kvfleet_gateway_routing_decisions_total",
        "kvfleet_gateway_predicted_cached_tokens_total", "kvfleet_gateway_actual_cached_tokens_total",
        "kvfleet_gateway_cached_tokens_prediction_error_bucket", "kvfleet_engine_kv_cache_usage_ratio",
        "kvfleet_engine_sleep_level", "kvfleet_gateway_tenant_tokens_total", "kvfleet_gateway_rejected_requests_total",
    }  # fmt: skip
    assert needed <= used, needed - used
    assert used <= set(series)


def scan_any(expr: str) -> list[tuple[str, list[str]]]:
    m = _LABEL_VALUES.match(expr)
    return scan(m["selector"]).selectors if m and m["selector"] else scan(expr).selectors


def test_dashboard_is_a_well_formed_grafana_dashboard():
    d = load_dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    panels = [p for p in d["panels"]] + [c for p in d["panels"] for c in p.get("panels", [])]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "model", "tenant"} <= variables
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        # A panel's variables are ones the dashboard defines ($__rate_interval is Grafana's own).
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, (p["title"], used)
    # No two panels overlap on the grid.
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not (cells & mine), p["title"]
        cells |= mine


def test_the_chart_ships_this_dashboard_for_the_grafana_sidecar():
    template = (CHART / "templates" / "dashboards.yaml").read_text()
    assert '.Files.Get "dashboards/kvfleet.json"' in template
    assert "kvfleet.json: |-" in template
    values = (CHART / "values.yaml").read_text()
    assert 'grafana_dashboard: "1"' in values


# ---- the checker itself catches mistakes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, legend, expected",
    [
        ("rate(kvfleet_engine_request_total[5m])", "", "kvfleet_engine_request_total is not exported"),
        ("sum(rate(kvfleet_gateway_requests[5m]))", "", "kvfleet_gateway_requests is not exported"),
        ('kvfleet_engine_kv_cache_usage_ratio{model="m"}', "", "has no label 'model'"),
        ('kvfleet_gateway_inflight_requests{model_name=~"$model"}', "", "has no label 'model_name'"),
        ("sum by (tenant) (rate(kvfleet_engine_requests_total[5m]))", "", "label 'tenant' is on none"),
        (
            "histogram_quantile(0.9, sum by (le) (rate(kvfleet_gateway_requests_bucket[5m])))",
            "",
            "not exported",
        ),
        (
            "histogram_quantil(0.9, sum by (le) (rate(kvfleet_engine_e2e_request_latency_seconds_bucket[5m])))",
            "",
            "unknown function 'histogram_quantil'",
        ),
        ("sum(rate(kvfleet_gateway_rejected_requests_total[5m]))", "{{tenant}}", "label 'tenant' is on none"),
        ("label_values(kvfleet_engine_healthy, tenant)", "", "has label 'tenant'"),
        ("label_values(kvfleet_engine_unknown, model_name)", "", "kvfleet_engine_unknown is not exported"),
        ("1 + 1", "", "selects no series"),
    ],
)
def test_checker_rejects_bad_queries(series: Exported, expr: str, legend: str, expected: str):
    found = problems(expr, series, legend)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(
    "expr, legend",
    [
        ('sum by (model, status) (rate(kvfleet_gateway_requests_total{model=~"$model", status=~"5.."}[$__rate_interval]))',
         "{{model}} {{status}}"),
        ("histogram_quantile(0.99, sum by (le, pod) (rate(kvfleet_engine_inter_token_latency_seconds_bucket[1m])))",
         "{{pod}}"),
        ("sum(rate(kvfleet_gateway_actual_cached_tokens_total[5m])) / sum(rate(kvfleet_gateway_predicted_cached_tokens_total[5m]))",
         ""),
        ("max by (pod) (kvfleet_engine_sleep_level offset 5m) > bool 0", "{{pod}}"),
        ("sum by (model_name) (kvfleet_engine_healthy) * on (model_name) group_left "
         "sum by (model_name) (kvfleet_engine_num_requests_running)", "{{model_name}}"),
        ("label_values(kvfleet_engine_healthy, model_name)", ""),
    ],
)  # fmt: skip
def test_checker_accepts_good_queries(series: Exported, expr: str, legend: str):
    assert problems(expr, series, legend) == []

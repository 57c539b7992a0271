"""The Grafana dashboards under deploy/grafana, read as Grafana reads them: their panels' queries,
and the template variables and `$__interval` / `$__rate_interval` filled in as Grafana fills them
before the query reaches Prometheus (for the static checks and for the live ones)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO_ROOT / "deploy" / "grafana"
DASHBOARD_MODELS = {
    "llm.json": ("llm",),
    "encoders.json": ("embedding", "rerank"),
    "versions.json": ("llm",),
}
"""The models each dashboard's panels must have data for (its `model` variable's values)."""

SPECULATIVE_ONLY = "vllm:spec_decode_"
"""The prefix of the series a model exports only when it speculates (`speculative_config`); the
default repository's llm does not, so on the live server their panels must evaluate, not have
data (tests/llm/spec_decode/test_spec_decode_metrics.py checks the series themselves)."""


ALL = ".*"
"""The dashboards' `allValue`: passing it as `version` or `namespace` selects "All"."""

SAFE_RESOLUTION = 11000
"""Grafana's Prometheus backend never steps finer than range / 11000."""

# Grafana's interval rounding table (ms): an interval up to the limit rounds to the value.
_ROUNDING = (
    (10, 1),
    (15, 10),
    (35, 20),
    (75, 50),
    (150, 100),
    (350, 200),
    (750, 500),
    (1500, 1000),
    (3500, 2000),
    (7500, 5000),
    (12500, 10000),
    (17500, 15000),
    (25000, 20000),
    (45000, 30000),
    (90000, 60000),
    (210000, 120000),
    (450000, 300000),
    (750000, 600000),
    (1050000, 900000),
    (1500000, 1200000),
    (2700000, 1800000),
    (5400000, 3600000),
    (9000000, 7200000),
    (16200000, 10800000),
    (32400000, 21600000),
    (86400000, 43200000),
    (172800000, 86400000),
    (604800000, 86400000),
    (1814400000, 604800000),
    (3628800000, 2592000000),
)
_YEAR_MS = 31536000000

# Grafana's variable syntaxes: $name, ${name}, [[name]].
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}|\[\[(\w+)\]\]")
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


@dataclass(frozen=True)
class PanelQuery:
    """One query of one panel, its expression as saved (variables not filled in)."""

    title: str
    ref_id: str
    expr: str


def needs_speculation(panel: PanelQuery) -> bool:
    return SPECULATIVE_ONLY in panel.expr


def load(name: str) -> dict:
    """A dashboard by file name (`llm.json`, `encoders.json`, `versions.json`)."""
    return json.loads((DASHBOARD_DIR / name).read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel but the rows, those inside collapsed rows included."""
    found = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            found += panels(panel)  # a collapsed row keeps its panels under its own `panels`
        else:
            found.append(panel)
    return found


def panel_queries(dashboard: dict) -> list[PanelQuery]:
    """The queries Grafana runs for the dashboard (hidden targets are not run)."""
    return [
        PanelQuery(panel["title"], target["refId"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if not target.get("hide")
    ]


def _round_interval(ms: float, *, inclusive: bool) -> int:
    # The backend's table compares with <=, the frontend's with <; they differ only at the limits.
    for limit, value in _ROUNDING:
        if ms < limit or (inclusive and ms == limit):
            return value
    return _YEAR_MS


def _format_interval(ms: int) -> str:
    """Grafana's gtime.FormatInterval: the largest whole unit, truncated (`$__interval`)."""
    for unit, size in (("y", _YEAR_MS), ("d", 86400000), ("h", 3600000), ("m", 60000)):
        if ms >= size:
            return f"{ms // size}{unit}"
    return f"{ms // 1000}s" if ms >= 1000 else f"{max(ms, 1)}ms"


def _go_duration(ms: int) -> str:
    """Go's time.Duration.String() (`$__rate_interval`): `1m0s`, `1m15s`, `2h0m0s`, `500ms`."""
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest = divmod(ms, 3600000)
    minutes, rest = divmod(rest, 60000)
    seconds = f"{rest / 1000:f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    return f"{minutes}m{seconds}" if minutes else seconds


def grafana_intervals(
    range_seconds: float, max_data_points: int, scrape_interval_seconds: float
) -> tuple[str, str]:
    """`$__interval` and `$__rate_interval` as Grafana 10/11 fill them for a Prometheus panel of
    `max_data_points` over `range_seconds`, the data source's scrape interval (its min interval)
    being `scrape_interval_seconds` and the panel setting no min interval of its own.

    The frontend computes the interval (range / max data points, rounded, at least the scrape
    interval) and the backend the step that `$__interval` becomes (at least the scrape interval,
    else rounded, and not finer than range / 11000); `$__rate_interval` is
    max(interval + scrape, 4 * scrape), written as Go writes a duration (`1m0s`, which Prometheus
    reads as 1m)."""
    range_ms = range_seconds * 1000
    scrape_ms = round(scrape_interval_seconds * 1000)
    raw_ms = range_ms / max_data_points
    step = scrape_ms if raw_ms < scrape_ms else _round_interval(raw_ms, inclusive=True)
    step = max(step, _round_interval(range_ms / SAFE_RESOLUTION, inclusive=True))
    interval = max(_round_interval(raw_ms, inclusive=False), scrape_ms)
    rate = max(interval + scrape_ms, 4 * scrape_ms)
    return _format_interval(step), _go_duration(rate)


def _regular_escape(value: str) -> str:
    """Grafana's escaping of a single-value variable without an All option."""
    return value.replace("\\", "\\\\").replace("'", "\\\\'")


def _regex_escape(value: str) -> str:
    """Grafana's escaping of a value of a variable with an All option (it may go in `=~`)."""
    return _REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value.replace("\\", "\\\\\\\\"))


def substitute(
    expr: str,
    *,
    model: str,
    version: str = ALL,
    namespace: str = ALL,
    interval: str,
    rate_interval: str,
) -> str:
    """`expr` with the dashboards' variables filled in as Grafana fills them: `model` a single
    value, `version` and `namespace` a value or ALL (the allValue, put in as is). Variables the
    dashboards do not define are left in place."""
    values = {
        "model": _regular_escape(model),
        "version": version if version == ALL else _regex_escape(version),
        "namespace": namespace if namespace == ALL else _regex_escape(namespace),
        "__interval": interval,
        "__rate_interval": rate_interval,
    }

    def fill(match: re.Match) -> str:
        name = next(group for group in match.groups() if group)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(fill, expr)

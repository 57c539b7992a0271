"""The chart's PrometheusRule as a plain Prometheus rule file, the format `promtool` and a
`prometheus` with `rule_files:` read (in a cluster the Prometheus Operator does this conversion)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.deploy.chart import EVERYTHING_ON, by_kind, merge, render

RULE_FILE_NAME = "rules.yaml"
# The chart defaults (values.yaml thresholds) with every optional object on; overrides go on top.
VALUES_NAME = None


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as `|` blocks, so the written file reads like the template."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def rule_file(objects: list[dict]) -> dict:
    """`{"groups": [...]}` from the one PrometheusRule among the rendered `objects`."""
    (prometheus_rule,) = by_kind(objects, "PrometheusRule").values()
    return {"groups": prometheus_rule["spec"]["groups"]}


def dump_rule_file(rules: dict, path: Path) -> Path:
    path.write_text(yaml.dump(rules, Dumper=_Dumper, sort_keys=False, width=1000))
    return path


def render_rule_file(directory: Path, overrides: dict | None = None) -> Path:
    """Render the chart (defaults + EVERYTHING_ON + `overrides`) and write its rules to
    `directory/rules.yaml`; returns that path."""
    objects = render(VALUES_NAME, merge(EVERYTHING_ON, overrides or {}))
    return dump_rule_file(rule_file(objects), Path(directory) / RULE_FILE_NAME)

"""The PromQL the chart ships, pulled out of its rendered objects: prometheus-adapter rules (their
templates filled in as the adapter fills them for a per-pod request), the PrometheusRule's
expressions, and the KEDA triggers' queries."""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from tests.deploy.chart import KEDA, by_kind, render


@dataclass(frozen=True)
class AdapterRule:
    """One prometheus-adapter rule: the custom metric `name` an HPA reads, from `series`."""

    name: str
    series_query: str
    series: str
    metrics_query: str
    """With the adapter's `<<.Series>>`, `<<.LabelMatchers>>` and `<<.GroupBy>>` placeholders."""

    def filled(self, label_matchers: str, group_by: str = "pod") -> str:
        """The query the adapter sends for a request on the pods `label_matchers` select."""
        query = (
            self.metrics_query.replace("<<.Series>>", self.series)
            .replace("<<.LabelMatchers>>", label_matchers)
            .replace("<<.GroupBy>>", group_by)
        )
        assert "<<" not in query, query
        return query


def adapter_rules(objects: list[dict]) -> list[AdapterRule]:
    (configmap,) = by_kind(objects, "ConfigMap").values()
    rules = []
    for rule in yaml.safe_load(configmap["data"]["config.yaml"])["rules"]:
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)
        assert re.fullmatch(rule["name"]["matches"], series)
        rules.append(
            AdapterRule(rule["name"]["as"], rule["seriesQuery"], series, rule["metricsQuery"])
        )
    return rules


def rule_queries(objects: list[dict]) -> tuple[list[str], set[str]]:
    """The PrometheusRule's expressions and the names its recording rules define."""
    (rule,) = by_kind(objects, "PrometheusRule").values()
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    return [r["expr"] for r in rules], {r["record"] for r in rules if "record" in r}


def keda_queries(values_name: str = "values-gpu.yaml") -> dict[str, list[str]]:
    """The KEDA triggers' queries, by ScaledObject (= Deployment) name."""
    objects = render(values_name, KEDA)
    return {
        name: [trigger["metadata"]["query"] for trigger in scaled["spec"]["triggers"]]
        for name, scaled in by_kind(objects, "ScaledObject").items()
    }

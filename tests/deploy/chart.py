"""Render deploy/helm/triton-llm with Helm's own engine (the `helm-python-sdk` wheel binds Helm's Go
SDK: no `helm` binary, no cluster) and load the manifests, for the tests in this folder."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "triton-llm"
CRD_DIR = REPO_ROOT / "deploy" / "crds"
VALUES_FILES = ("values-cpu.yaml", "values-gpu.yaml")
RELEASE, NAMESPACE = "rel", "serving"

# The A/B objects at the gateway, with what they require: the Gateway, the other release's Service
# and the endpoint picker.
GATEWAY = {
    "gateway": {
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "inference-gateway", "namespace": "gateway-system"}],
            "other": {"service": "other-triton-llm-llm"},
        },
        "inferenceExtension": {"enabled": True, "pool": {"extensionRef": {"name": "llm-epp"}}},
    }
}
# Every optional object on: monitoring, the OpenAI sidecar, the version-regression alert and the
# gateway objects (HPA autoscaling is on by default).
EVERYTHING_ON = {
    "openai": {"enabled": True},
    "monitoring": {
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True, "versionRegression": {"enabled": True}},
    },
    **GATEWAY,
}
KEDA = {"autoscaling": {"engine": "keda"}}
# llm-d's endpoint picker rendered by the chart (its precise prefix-cache scorer fed by the llm
# pods' KV events), in place of a picker named by extensionRef.
ENDPOINT_PICKER = {
    "gateway": {
        "inferenceExtension": {
            "endpointPicker": {"enabled": True},
            "pool": {"extensionRef": {"name": ""}},
        }
    }
}


def merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values_file(name: str) -> dict:
    return yaml.safe_load((CHART_DIR / name).read_text()) or {}


@functools.cache
def _render(values_name: str | None, overrides_json: str) -> tuple[dict, ...]:
    values = values_file(values_name) if values_name else {}
    values = merge(values, json.loads(overrides_json))
    chart = helm_python.Chart.load(CHART_DIR)
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return tuple(
        doc
        for text in manifests.values()
        for doc in yaml.safe_load_all(text)
        if doc  # templates that render nothing
    )


def render(values_name: str | None = None, overrides: dict | None = None) -> list[dict]:
    """The chart's objects for the chart defaults + `values_name` + `overrides` (deep copies)."""
    return copy.deepcopy(list(_render(values_name, json.dumps(overrides or {}, sort_keys=True))))


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def crd_schema(filename: str) -> dict:
    return copy.deepcopy(_crd_schema(filename))


@functools.cache
def _crd_schema(filename: str) -> dict:
    # Parsed once: the LeaderWorkerSet CRD (two pod templates) is 400 kB of YAML.
    crd = yaml.load(
        (CRD_DIR / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


KUBERNETES_VERSION = "1.33"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    (
        "inference.networking.x-k8s.io/v1alpha2",
        "InferencePool",
    ): "inference.networking.x-k8s.io_inferencepools.yaml",
    (
        "inference.networking.x-k8s.io/v1alpha2",
        "InferenceModel",
    ): "inference.networking.x-k8s.io_inferencemodels.yaml",
    (
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
    ): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
}


def closed(schema: dict) -> dict:
    """The structural schema as the API server applies it: objects with listed properties reject
    others unless marked x-kubernetes-preserve-unknown-fields."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        # No metaschema check: the CRDs' patterns are Go regular expressions (one has `^(?i)`),
        # which Python's `re` only rejects when a value is matched against them.
        jsonschema.Draft7Validator(closed(crd_schema(CRD_SCHEMAS[key]))).validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)

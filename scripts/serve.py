#!/usr/bin/env python3
"""`make serve`: print how to call each model of the repository, then run tritonserver on it.

Runs `tritonserver --model-repository=<repo>` (the venv launcher: a system tritonserver when present, the
nvidia-pytriton binary otherwise) with HTTP on :8000, gRPC on :8001 and metrics on :8002 by default.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

from tooling.tritonserver import tritonserver_command

EXAMPLES = {
    "embedding": """\
  {name}  (embedding: text_input [N,1] STRING -> embedding [N,dim] FP32)
    curl -s localhost:{http}/v2/models/{name}/infer -d '{{"inputs":[{{"name":"text_input","shape":[2,1],"datatype":"BYTES","data":["hello world","bonjour"]}}]}}'
""",
    "rerank": """\
  {name}  (rerank: query, document [N,1] STRING -> score [N,1] FP32)
    curl -s localhost:{http}/v2/models/{name}/infer -d '{{"inputs":[{{"name":"query","shape":[1,1],"datatype":"BYTES","data":["what is a cat?"]}},{{"name":"document","shape":[1,1],"datatype":"BYTES","data":["Cats are small felines."]}}]}}'
""",
    "llm": """\
  {name}  (llm: text_input STRING (+ sampling_parameters JSON, stream BOOL) -> text_output STRING)
    curl -s localhost:{http}/v2/models/{name}/generate -d '{{"text_input":"ROMEO:","max_tokens":40}}'
    curl -sN localhost:{http}/v2/models/{name}/generate_stream -d '{{"text_input":"ROMEO:","max_tokens":40}}'
""",
}


def model_kind(config_text: str) -> str | None:
    """Tell a model's kind from the tensors its config.pbtxt declares."""
    names = set(re.findall(r'name:\s*"([^"]+)"', config_text))
    if re.search(r"decoupled:\s*true", config_text) or "text_output" in names:
        return "llm"
    if {"query", "document"} <= names:
        return "rerank"
    if "embedding" in names:
        return "embedding"
    return None


def usage(repository: Path, http_port: int, grpc_port: int, metrics_port: int) -> str:
    lines = [
        f"Serving {repository} (HTTP :{http_port}, gRPC :{grpc_port}, metrics :{metrics_port})",
        "Models and example calls:",
    ]
    for config in sorted(repository.glob("*/config.pbtxt")):
        kind = model_kind(config.read_text())
        if kind:
            lines.append(EXAMPLES[kind].format(name=config.parent.name, http=http_port).rstrip())
    lines.append(f"  metrics: curl -s localhost:{metrics_port}/metrics")
    lines.append(
        "  Python clients: see README.md (tritonclient.http / tritonclient.grpc); "
        "scripts/client.py streams from the llm model over gRPC."
    )
    return "\n".join(lines)


ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"
ADMIN_HEADER = "triton-admin-key"


def restricted_api_args(key: str) -> list[str]:
    """Restrict the repository-control API (index, load, unload) to clients that send `key` in
    the `triton-admin-key` header."""
    return [
        f"--http-restricted-api=model-repository:{ADMIN_HEADER}={key}",
        f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={key}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args, extra = parser.parse_known_args()

    print(
        usage(args.model_repository, args.http_port, args.grpc_port, args.metrics_port), flush=True
    )
    # Without $TRITON_ADMIN_KEY a random key that nobody knows locks repository control.
    admin_key = os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(16)
    command = [
        tritonserver_command(),
        f"--model-repository={args.model_repository}",
        f"--http-port={args.http_port}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-port={args.metrics_port}",
        # One model failing to load (a bad config.pbtxt value) must not take the others down.
        "--exit-on-error=false",
        *restricted_api_args(admin_key),
        *extra,
    ]
    print("$ " + " ".join(command).replace(admin_key, "<key>"), flush=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.execv(command[0], command)


if __name__ == "__main__":
    main()

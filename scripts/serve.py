#!/usr/bin/env python3
"""`make serve`: print how to call each model of the repository, then run tritonserver on it and the
OpenAI-compatible frontend in front of it.

Runs `tritonserver --model-repository=<repo>` (the venv launcher: a system tritonserver when present, the
nvidia-pytriton binary otherwise) with HTTP on :8000, gRPC on :8001 and metrics on :8002 by default, and
`python -m openai_frontend` on :9000. Ctrl-C (or SIGTERM) stops both.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend_lib.contract import model_kind
from tooling.repository import read_config
from tooling.tritonserver import SERVER_ARGS, tritonserver_command

EXAMPLES = {
    "embedding": """\
  {name}  (embedding: text_input [N,1] STRING -> embedding [N,dim] FP32, num_input_tokens [N,1])
    curl -s localhost:{http}/v2/models/{name}/infer -d '{{"inputs":[{{"name":"text_input","shape":[2,1],"datatype":"BYTES","data":["hello world","bonjour"]}}]}}'
""",
    "rerank": """\
  {name}  (rerank: query, document [N,1] STRING -> score [N,1] FP32, num_input_tokens [N,1])
    curl -s localhost:{http}/v2/models/{name}/infer -d '{{"inputs":[{{"name":"query","shape":[1,1],"datatype":"BYTES","data":["what is a cat?"]}},{{"name":"document","shape":[1,1],"datatype":"BYTES","data":["Cats are small felines."]}}]}}'
""",
    "llm": """\
  {name}  (llm: text_input STRING (+ sampling_parameters JSON, stream BOOL) -> text_output STRING)
    curl -s localhost:{http}/v2/models/{name}/generate -d '{{"text_input":"ROMEO:","max_tokens":40}}'
    curl -sN localhost:{http}/v2/models/{name}/generate_stream -d '{{"text_input":"ROMEO:","max_tokens":40}}'
""",
}


OPENAI_EXAMPLES = """\
OpenAI-compatible API on :{port} (python -m openai_frontend; see README "OpenAI-compatible API"):
    curl -s localhost:{port}/v1/models
    curl -s localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' -d '{{"model":"llm","messages":[{{"role":"user","content":"Who goes there?"}}],"max_tokens":40}}'
    curl -s localhost:{port}/v1/completions -H 'Content-Type: application/json' -d '{{"model":"llm","prompt":"ROMEO:","max_tokens":40}}'
    curl -s localhost:{port}/v1/embeddings -H 'Content-Type: application/json' -d '{{"model":"embedding","input":["hello world"]}}'
    curl -s localhost:{port}/v1/rerank -H 'Content-Type: application/json' -d '{{"model":"rerank","query":"what is a cat?","documents":["Cats are small felines.","Paris is in France."]}}'
    curl -s localhost:{port}/v1/score -H 'Content-Type: application/json' -d '{{"model":"rerank","text_1":"what is a cat?","text_2":["Cats are small felines."]}}'
    curl -s localhost:{port}/tokenize -H 'Content-Type: application/json' -d '{{"model":"llm","prompt":"ROMEO:"}}'"""


def usage(repository: Path, http_port: int, grpc_port: int, metrics_port: int) -> str:
    lines = [
        f"Serving {repository} (HTTP :{http_port}, gRPC :{grpc_port}, metrics :{metrics_port})",
        "Models and example calls:",
    ]
    for config in sorted(repository.glob("*/config.pbtxt")):
        kind = model_kind(read_config(config.read_text()))  # the frontend's own test
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
    parser.add_argument("--openai-port", type=int, default=9000, help="0: no OpenAI frontend")
    args, extra = parser.parse_known_args()

    print(
        usage(args.model_repository, args.http_port, args.grpc_port, args.metrics_port), flush=True
    )
    if args.openai_port:
        print(OPENAI_EXAMPLES.format(port=args.openai_port), flush=True)
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
        *SERVER_ARGS,
        *restricted_api_args(admin_key),
        *extra,
    ]
    print("$ " + " ".join(command).replace(admin_key, "<key>"), flush=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if not args.openai_port:
        os.execv(command[0], command)
    run_both(command, frontend_command(args, admin_key))


def frontend_command(args: argparse.Namespace, admin_key: str) -> list[str]:
    # The admin key reaches the frontend through its environment (it reads the repository
    # index), never its command line.
    os.environ[ADMIN_KEY_ENV] = admin_key
    return [
        sys.executable,
        "-m",
        "openai_frontend",
        f"--triton-url=127.0.0.1:{args.grpc_port}",
        f"--model-repository={args.model_repository}",
        f"--port={args.openai_port}",
    ]


def run_both(triton_command: list[str], openai_command: list[str]) -> None:
    """Run tritonserver and the frontend until either exits or a signal comes; stop both."""
    processes = [subprocess.Popen(triton_command), subprocess.Popen(openai_command)]

    def stop(*_: object) -> None:
        for process in processes:
            if process.poll() is None:
                process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
    finally:
        stop()
        for process in processes:
            process.wait()
    sys.exit(processes[0].returncode or 0)


if __name__ == "__main__":
    main()

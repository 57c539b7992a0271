"""`python -m openai_frontend --triton-url 127.0.0.1:8001 --model-repository model_repository`."""

from __future__ import annotations

import argparse
from pathlib import Path

import uvicorn

from openai_frontend.app import create_app
from openai_frontend.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    FrontendConfig,
)


def parse_args(argv: list[str] | None = None) -> FrontendConfig:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--triton-url", default="127.0.0.1:8001", help="tritonserver gRPC host:port"
    )
    parser.add_argument("--model-repository", type=Path, help="to read tokenizers and templates")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--api-key", help="require this bearer token (default $OPENAI_API_KEY)")
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        help='named keys, JSON {"<name>": "<key>", ...}: each name is its requests\' tenant',
    )
    parser.add_argument("--triton-admin-key", help="default $TRITON_ADMIN_KEY")
    parser.add_argument("--chat-template", type=Path, help="a jinja2 chat template for every llm")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--index-ttl", type=float, default=2.0, help="seconds")
    parser.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_RESPONSES_STORE_SIZE,
        help="responses kept in memory for previous_response_id (LRU; 0: none)",
    )
    parser.add_argument(
        "--traffic-split",
        action="append",
        default=[],
        metavar="MODEL=VERSION:PERCENT,...",
        help="split a model's traffic between its versions, e.g. llm=1:90,2:10 (repeatable)",
    )
    parser.add_argument(
        "--traffic-split-file",
        type=Path,
        help='JSON {"splits": {"llm": {"1": 90, "2": 10}}}, re-read when it changes',
    )
    parser.add_argument(
        "--allowed-local-media-path",
        type=Path,
        help="file:// image URLs are read below this directory only (default: none are)",
    )
    parser.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="read http(s) image URLs (default: refused; send data: URLs)",
    )
    args = parser.parse_args(argv)
    return FrontendConfig.with_env_defaults(
        triton_url=args.triton_url,
        model_repository=args.model_repository,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        api_keys_file=args.api_keys_file,
        triton_admin_key=args.triton_admin_key,
        chat_template=args.chat_template,
        max_body_bytes=args.max_body_bytes,
        index_ttl_s=args.index_ttl,
        responses_store_size=args.responses_store_size,
        traffic_splits=tuple(args.traffic_split),
        traffic_split_file=args.traffic_split_file,
        allowed_local_media_path=args.allowed_local_media_path,
        allow_remote_media=args.allow_remote_media,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()

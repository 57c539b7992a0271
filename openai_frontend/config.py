"""The frontend's settings: one dataclass, validated once, errors naming the field."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from backend_lib.multimodal.image_sources import ImageFetchPolicy
from openai_frontend.tenant import NamedKeyError, read_named_keys
from openai_frontend.traffic import SplitError, VersionSplit, parse_split_flag, read_split_file

API_KEY_ENV = "OPENAI_API_KEY"
ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_RESPONSES_STORE_SIZE = 1000


class FrontendConfigError(ValueError):
    """A setting is invalid; the message names it."""

    def __init__(self, field: str, value: object, reason: str):
        self.field = field
        super().__init__(f"invalid setting {field}={value!r}: {reason}")


@dataclass(frozen=True)
class FrontendConfig:
    """Where tritonserver is, where its repository is, and how the HTTP side behaves."""

    triton_url: str = "127.0.0.1:8001"
    model_repository: Path | None = None
    host: str = "0.0.0.0"
    port: int = 9000
    api_key: str | None = None
    # Named keys, a JSON object name -> key (tenant.py): any of them is accepted too, and its name
    # is the tenant of the requests made with it.
    api_keys_file: Path | None = None
    # Sent as `triton-admin-key` on repository-index calls when tritonserver restricts that API.
    triton_admin_key: str | None = None
    chat_template: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    index_ttl_s: float = 2.0
    request_timeout_s: float = 600.0
    # Responses kept in memory for previous_response_id and GET /v1/responses/{id} (LRU; 0: none).
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    # Version splits `<model>=<version>:<percent>,...` (openai_frontend/traffic.py).
    traffic_splits: tuple[str, ...] = ()
    # A JSON split file, re-read when it changes; it replaces the flags' splits when read.
    traffic_split_file: Path | None = None
    # Image URLs (backend_lib/multimodal/image_sources.py): file:// ones are read below this
    # directory only (vLLM's --allowed-local-media-path; None: refused), http(s) ones only when
    # remote media are allowed (a deployment with network).
    allowed_local_media_path: Path | None = None
    allow_remote_media: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.triton_url or "://" in self.triton_url:
            raise FrontendConfigError("triton_url", self.triton_url, "expected host:port")
        if not 0 <= self.port < 65536:
            raise FrontendConfigError("port", self.port, "expected 0-65535")
        if self.model_repository is not None and not Path(self.model_repository).is_dir():
            raise FrontendConfigError("model_repository", self.model_repository, "not a directory")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise FrontendConfigError("chat_template", self.chat_template, "not a file")
        if self.max_body_bytes < 1024:
            raise FrontendConfigError("max_body_bytes", self.max_body_bytes, "must be >= 1024")
        if self.index_ttl_s < 0:
            raise FrontendConfigError("index_ttl_s", self.index_ttl_s, "must be >= 0")
        if self.request_timeout_s <= 0:
            raise FrontendConfigError("request_timeout_s", self.request_timeout_s, "must be > 0")
        if self.responses_store_size < 0:
            raise FrontendConfigError(
                "responses_store_size", self.responses_store_size, "must be >= 0"
            )
        if (
            self.allowed_local_media_path is not None
            and not Path(self.allowed_local_media_path).is_dir()
        ):
            raise FrontendConfigError(
                "allowed_local_media_path", self.allowed_local_media_path, "not a directory"
            )
        if self.api_keys_file is not None:
            self.named_keys()
        self.split_flags()  # raises naming traffic_splits
        if self.traffic_split_file is not None:
            try:
                read_split_file(Path(self.traffic_split_file))
            except (OSError, SplitError) as exc:
                raise FrontendConfigError(
                    "traffic_split_file", str(self.traffic_split_file), str(exc)
                ) from None

    def image_fetch_policy(self) -> ImageFetchPolicy:
        """Which image URLs requests may name."""
        return ImageFetchPolicy(self.allowed_local_media_path, self.allow_remote_media)

    def named_keys(self) -> dict[str, str]:
        """The named API keys (name -> key; empty without `api_keys_file`)."""
        if self.api_keys_file is None:
            return {}
        try:
            return read_named_keys(Path(self.api_keys_file))
        except NamedKeyError as exc:
            raise FrontendConfigError("api_keys_file", str(self.api_keys_file), str(exc)) from None

    def split_flags(self) -> dict[str, VersionSplit]:
        """The splits of `traffic_splits`, by model."""
        splits = {}
        for value in self.traffic_splits:
            try:
                model, split = parse_split_flag(value)
            except SplitError as exc:
                raise FrontendConfigError("traffic_splits", value, str(exc)) from None
            splits[model] = split
        return splits

    @classmethod
    def with_env_defaults(cls, **values) -> FrontendConfig:
        """`values`, with the API key and Triton admin key taken from the environment if unset."""
        values.setdefault("api_key", None)
        values.setdefault("triton_admin_key", None)
        values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
        values["triton_admin_key"] = (
            values["triton_admin_key"] or os.environ.get(ADMIN_KEY_ENV) or None
        )
        return cls(**values)

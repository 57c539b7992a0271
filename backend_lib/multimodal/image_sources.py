"""Where an image URL's bytes come from, under a policy: `data:` URLs (base64) always, `file://`
URLs under one allowed directory, remote http(s) URLs only where the deployment allows them
(vLLM's `--allowed-local-media-path`, and our `--allow-remote-media`)."""

from __future__ import annotations

import base64
import binascii
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backend_lib.errors import InputError


@dataclass(frozen=True)
class ImageFetchPolicy:
    """Which image URLs may be read.

    - `local_dir`: `file://` URLs are read only below this directory (symlinks and `..`
      resolved first); None refuses every `file://` URL.
    - `allow_remote`: read http(s) URLs (a deployment with network); refused when False.
    - `timeout_s`: connect and read timeout of one remote fetch, seconds.
    """

    local_dir: Path | None = None
    allow_remote: bool = False
    timeout_s: float = 10.0


def read_image_url(url: str, policy: ImageFetchPolicy, max_bytes: int) -> bytes:
    """The encoded image an `image_url` names, at most `max_bytes` long. `InputError` says why a
    URL is refused: an unknown scheme, a data URL that is not base64, a path outside the allowed
    directory, a remote URL where none are allowed, or too many bytes."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, max_bytes)
    if scheme == "file":
        return _read_file_url(url, policy, max_bytes)
    if scheme in ("http", "https"):
        return _read_remote(url, policy, max_bytes)
    raise InputError(
        f"image URL scheme '{scheme or url[:16]}' is not supported: send a data: URL "
        "(base64), a file:// URL under the allowed directory, or an http(s) URL where allowed"
    )


_BASE64_TEXT = re.compile(rb"[A-Za-z0-9+/=\s]+")


def image_input_bytes(value: object, max_bytes: int) -> bytes:
    """One element of a Triton `image` input as encoded image bytes: base64 text (what Triton's
    vLLM backend clients send) or the file's raw bytes (no image format starts with base64
    text only: PNG, JPEG and WebP headers hold bytes outside its alphabet)."""
    data = value if isinstance(value, bytes) else str(value).encode("latin-1")
    if not _BASE64_TEXT.fullmatch(data):
        return _within(data, max_bytes)
    if len(data) > 4 * (max_bytes // 3 + 2) + data.count(b"\n") + data.count(b" "):
        raise InputError(f"the image holds more than {max_bytes} bytes (max_image_bytes)")
    try:
        return _within(base64.b64decode(b"".join(data.split()), validate=True), max_bytes)
    except (binascii.Error, ValueError):
        raise InputError("the image input is neither base64 text nor an image file") from None


def _read_data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise InputError("an image data URL must be base64: data:image/png;base64,<data>")
    if len(payload) > 4 * (max_bytes // 3 + 2):  # checked before decoding
        raise InputError(f"the image data URL holds more than {max_bytes} bytes (max_image_bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("the image data URL's payload is not valid base64") from None


def _read_file_url(url: str, policy: ImageFetchPolicy, max_bytes: int) -> bytes:
    if policy.local_dir is None:
        raise InputError("file:// image URLs are not allowed here (no allowed local media path)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InputError(f"a file:// image URL must name a local path, not host '{parsed.netloc}'")
    root = Path(os.path.realpath(policy.local_dir))
    path = Path(os.path.realpath(urllib.parse.unquote(parsed.path)))
    if not path.is_relative_to(root):
        raise InputError(f"file:// image paths must lie under the allowed directory {root}")
    try:
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as exc:
        raise InputError(f"the image file cannot be read: {exc.strerror or exc}") from None
    return _within(data, max_bytes)


def _read_remote(url: str, policy: ImageFetchPolicy, max_bytes: int) -> bytes:
    if not policy.allow_remote:
        raise InputError("remote image URLs are not allowed here: send the image as a data: URL")
    try:
        with urllib.request.urlopen(url, timeout=policy.timeout_s) as response:  # noqa: S310 (scheme checked)
            data = response.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InputError(f"the image URL cannot be fetched: {exc}") from None
    return _within(data, max_bytes)


def _within(data: bytes, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise InputError(f"the image is over {max_bytes} bytes (max_image_bytes)")
    return data

"""Image URLs under the fetch policy: base64 data URLs, file:// only under the allowed directory
(`..` and symlinks resolved first), remote URLs only where allowed."""

from __future__ import annotations

import base64
import os

import pytest

from backend_lib.errors import InputError
from backend_lib.multimodal.image_sources import (
    ImageFetchPolicy,
    image_input_bytes,
    read_image_url,
)

PAYLOAD = b"\x89PNG fake bytes"


def data_url(data: bytes = PAYLOAD) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_data_url_gives_its_bytes():
    assert read_image_url(data_url(), ImageFetchPolicy(), 1024) == PAYLOAD


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,***not base64***", "not valid base64"),
        ("data:image/png;base64", "must be base64"),
        ("ftp://host/image.png", "scheme 'ftp' is not supported"),
        ("image.png", "not supported"),
        ("http://example.com/cat.png", "remote image URLs are not allowed"),
        ("https://example.com/cat.png", "remote image URLs are not allowed"),
        ("file:///etc/passwd", "file:// image URLs are not allowed"),
    ],
)
def test_refused_urls(url, message):
    with pytest.raises(InputError, match=message):
        read_image_url(url, ImageFetchPolicy(), 1024)


def test_data_url_over_the_byte_limit_is_refused_before_decoding():
    with pytest.raises(InputError, match="max_image_bytes"):
        read_image_url(data_url(b"x" * 4096), ImageFetchPolicy(), 1024)


@pytest.fixture
def media(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(PAYLOAD)
    (tmp_path / "secret.png").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.png", root / "link.png")
    return root


def test_file_url_under_the_allowed_directory(media):
    policy = ImageFetchPolicy(local_dir=media)
    assert read_image_url(f"file://{media}/sub/cat.png", policy, 1024) == PAYLOAD
    assert read_image_url(f"file://localhost{media}/sub/cat.png", policy, 1024) == PAYLOAD
    with pytest.raises(InputError, match="max_image_bytes"):
        read_image_url(f"file://{media}/sub/cat.png", policy, 4)


@pytest.mark.parametrize(
    "path, message",
    [
        ("{media}/../secret.png", "must lie under the allowed directory"),
        ("{media}/sub/../../secret.png", "must lie under the allowed directory"),
        ("{media}/link.png", "must lie under the allowed directory"),
        ("/etc/passwd", "must lie under the allowed directory"),
        ("{media}/missing.png", "cannot be read"),
        ("{media}/sub", "cannot be read"),
    ],
    ids=["dotdot", "nested-dotdot", "symlink-out", "absolute", "missing", "directory"],
)
def test_file_urls_outside_or_unreadable(media, path, message):
    with pytest.raises(InputError, match=message):
        read_image_url("file://" + path.format(media=media), ImageFetchPolicy(local_dir=media), 64)


def test_file_url_naming_another_host_is_refused(media):
    with pytest.raises(InputError, match="not host 'evil'"):
        read_image_url(f"file://evil{media}/sub/cat.png", ImageFetchPolicy(local_dir=media), 64)


def test_remote_url_where_allowed(media):
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/sub/cat.png"
        assert read_image_url(url, ImageFetchPolicy(allow_remote=True), 1024) == PAYLOAD
        with pytest.raises(InputError, match="max_image_bytes"):
            read_image_url(url, ImageFetchPolicy(allow_remote=True), 4)
        with pytest.raises(InputError, match="cannot be fetched"):
            read_image_url(url + ".missing", ImageFetchPolicy(allow_remote=True), 1024)
    finally:
        server.shutdown()
        server.server_close()


def test_triton_image_input_takes_base64_text_or_raw_bytes():
    from tests.multimodal.image_helpers import encoded

    png = encoded(8, 8)
    text = base64.b64encode(png)
    assert image_input_bytes(png, 4096) == png
    assert image_input_bytes(text, 4096) == png
    assert image_input_bytes(text.decode(), 4096) == png
    wrapped = b"\n".join(text[i : i + 60] for i in range(0, len(text), 60))
    assert image_input_bytes(wrapped, 4096) == png
    with pytest.raises(InputError, match="neither base64 text nor an image file"):
        image_input_bytes(b"abc", 4096)
    with pytest.raises(InputError, match="max_image_bytes"):
        image_input_bytes(text, 16)
    with pytest.raises(InputError, match="max_image_bytes"):
        image_input_bytes(png, 16)

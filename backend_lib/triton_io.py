"""Reading request tensors (as numpy arrays) into Python values, with errors that name the input.

These functions take the `{name: numpy array}` view of one Triton request, so they are tested without
the server; the model.py files only build that view with `pb_utils`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from backend_lib.errors import InputError

Inputs = Mapping[str, np.ndarray]


def _rows(inputs: Inputs, name: str) -> np.ndarray:
    """The values of input `name` as a flat array of rows ([N, 1] and [N] both give N values)."""
    array = np.asarray(inputs[name])
    if array.ndim == 0:
        return array.reshape(1)
    if array.ndim == 2 and array.shape[1] == 1:
        return array[:, 0]
    if array.ndim == 1:
        return array
    raise InputError(f"input '{name}' must have shape [N, 1] or [N], got {list(array.shape)}")


def read_blobs(inputs: Inputs, name: str, *, max_bytes: int | None = None) -> list[bytes]:
    """A TYPE_STRING (BYTES) input's rows as raw bytes, one per row (e.g. encoded images).
    Requires the input."""
    if name not in inputs:
        raise InputError(f"missing required input '{name}'")
    rows = _rows(inputs, name)
    if rows.size == 0:
        raise InputError(f"input '{name}' is empty: send at least one row")
    blobs = []
    for index, value in enumerate(rows):
        if isinstance(value, str):
            raw = value.encode("utf-8", "surrogatepass")
        elif isinstance(value, (bytes, np.bytes_)):
            raw = bytes(value)
        else:
            raise InputError(
                f"input '{name}' must be TYPE_STRING (bytes), got {type(value).__name__}"
            )
        if max_bytes is not None and len(raw) > max_bytes:
            raise InputError(
                f"input '{name}'[{index}] is {len(raw)} bytes, over the limit of {max_bytes} bytes"
            )
        blobs.append(raw)
    return blobs


def read_strings(inputs: Inputs, name: str, *, max_bytes: int | None = None) -> list[str]:
    """Decode a TYPE_STRING input as UTF-8 strings, one per row. Requires the input."""
    texts = []
    for index, raw in enumerate(read_blobs(inputs, name, max_bytes=max_bytes)):
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InputError(
                f"input '{name}'[{index}] is not valid UTF-8 (byte {exc.start}: {exc.reason})"
            ) from None
    return texts


def read_token_rows(inputs: Inputs, name: str) -> list[list[int]]:
    """An integer input of shape [N, L] as N lists of L token ids (N, L >= 1). Requires the input."""
    if name not in inputs:
        raise InputError(f"missing required input '{name}'")
    array = np.asarray(inputs[name])
    if array.ndim == 1:
        array = array.reshape(1, -1)
    if array.ndim != 2 or array.size == 0:
        raise InputError(
            f"input '{name}' must have shape [N, L] with N, L >= 1, got {list(array.shape)}"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"input '{name}' must be an integer type, got {array.dtype}")
    return array.astype(np.int64).tolist()


def read_bools(inputs: Inputs, name: str, count: int, default: bool | None) -> list[bool | None]:
    """An optional TYPE_BOOL input with one value per row (or one value for all rows)."""
    if name not in inputs:
        return [default] * count
    rows = _rows(inputs, name)
    if rows.dtype != np.bool_:
        raise InputError(f"input '{name}' must be TYPE_BOOL, got {rows.dtype}")
    if rows.size == 1:
        return [bool(rows[0])] * count
    if rows.size != count:
        raise InputError(f"input '{name}' has {rows.size} rows, expected 1 or {count}")
    return [bool(v) for v in rows]


def read_shared(inputs: Inputs, name: str, count: int) -> np.ndarray | None:
    """The one value of optional batched input `name` that all `count` rows of a request share
    (Triton gives an [N, 1] input one row per item), as a 1-element array; None when absent."""
    if name not in inputs:
        return None
    rows = _rows(inputs, name)
    if rows.size not in (1, count) or any(v != rows[0] for v in rows[1:]):
        raise InputError(
            f"input '{name}' must hold one value shared by all {count} rows of a request"
        )
    return rows[:1]


def read_scalar(inputs: Inputs, name: str, kind: type) -> int | float | bool | str | None:
    """An optional single-value input (e.g. `max_tokens` INT32 [1]); None when absent."""
    if name not in inputs:
        return None
    rows = np.asarray(inputs[name]).reshape(-1)
    if rows.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value, got {rows.size}")
    value = rows[0]
    if kind is bool:
        if rows.dtype != np.bool_:
            raise InputError(f"input '{name}' must be TYPE_BOOL, got {rows.dtype}")
        return bool(value)
    if kind is str:
        return read_strings({name: rows}, name)[0]
    if kind is int:
        if not np.issubdtype(rows.dtype, np.integer):
            raise InputError(f"input '{name}' must be an integer type, got {rows.dtype}")
        return int(value)
    if kind is float:
        if not np.issubdtype(rows.dtype, np.number):
            raise InputError(f"input '{name}' must be a number, got {rows.dtype}")
        number = float(value)
        if not math.isfinite(number):
            raise InputError(f"input '{name}' must be a finite number, got {number}")
        return number
    raise TypeError(f"unsupported scalar kind {kind!r}")

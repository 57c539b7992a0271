import numpy as np
import pytest

from backend_lib.errors import InputError
from backend_lib.triton_io import read_blobs, read_bools, read_scalar, read_strings


def strings(*values: bytes) -> np.ndarray:
    return np.array(values, dtype=object).reshape(-1, 1)


def test_read_strings_decodes_rows_of_any_batch_shape():
    assert read_strings({"t": strings(b"a", "é".encode())}, "t") == ["a", "é"]
    assert read_strings({"t": np.array([b"x"], dtype=object)}, "t") == ["x"]


@pytest.mark.parametrize(
    "inputs,fragment",
    [
        ({}, "missing required input 't'"),
        ({"t": np.zeros((0, 1), dtype=object)}, "is empty"),
        ({"t": strings(b"ok", b"\xff\xfe")}, "'t'[1] is not valid UTF-8"),
        ({"t": np.zeros((2, 1), dtype=np.int32)}, "must be TYPE_STRING"),
        ({"t": np.array([[b"a", b"b"]], dtype=object)}, "shape [N, 1] or [N]"),
        ({"t": strings(b"x" * 11)}, "over the limit of 10 bytes"),
    ],
)
def test_read_strings_errors_say_what_is_wrong(inputs, fragment):
    with pytest.raises(InputError) as info:
        read_strings(inputs, "t", max_bytes=10)
    assert fragment in str(info.value)


def test_read_blobs_keeps_each_rows_bytes_as_sent():
    """Encoded images are not UTF-8: the bytes come back untouched, row by row."""
    png_head = b"\x89PNG\r\n\x1a\n\x00\xff"
    assert read_blobs({"i": strings(png_head, b"")}, "i") == [png_head, b""]
    with pytest.raises(InputError, match="'i'\\[0\\] is 10 bytes, over the limit of 4"):
        read_blobs({"i": strings(png_head)}, "i", max_bytes=4)


def test_read_bools_broadcasts_and_checks_type():
    assert read_bools({}, "b", 3, None) == [None, None, None]
    assert read_bools({"b": np.array([[True]])}, "b", 2, None) == [True, True]
    assert read_bools({"b": np.array([[True], [False]])}, "b", 2, None) == [True, False]
    with pytest.raises(InputError, match="TYPE_BOOL"):
        read_bools({"b": np.array([[1]])}, "b", 1, None)
    with pytest.raises(InputError, match="3 rows, expected 1 or 2"):
        read_bools({"b": np.array([[True]] * 3)}, "b", 2, None)


def test_read_scalar_types_and_finiteness():
    assert read_scalar({"n": np.array([5], dtype=np.int32)}, "n", int) == 5
    assert read_scalar({}, "n", int) is None
    assert read_scalar({"f": np.array([0.5], dtype=np.float32)}, "f", float) == 0.5
    with pytest.raises(InputError, match="finite"):
        read_scalar({"f": np.array([np.inf], dtype=np.float32)}, "f", float)
    with pytest.raises(InputError, match="integer"):
        read_scalar({"n": np.array([0.5])}, "n", int)
    with pytest.raises(InputError, match="exactly one value"):
        read_scalar({"n": np.array([1, 2])}, "n", int)

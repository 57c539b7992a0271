"""Kernel tests: Triton kernels vs their PyTorch references, on CUDA when present, otherwise on CPU
through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before triton loads)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Too late if a kernel module is already imported (the choice is made when @triton.jit runs);
    # tests/conftest.py sets it first, this covers running these tests with another root.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import (  # noqa: E402  (after the switch)
    activation,
    fused_moe,
    kv_cache,
    lora,
    paged_attention,
    rmsnorm,
    rotary,
    token_bitmask,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative error bound: max |got - want| / max |want|.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
KERNEL_MODULES = (
    activation,
    fused_moe,
    kv_cache,
    lora,
    paged_attention,
    rmsnorm,
    rotary,
    token_bitmask,
)


def _check_kernels_runnable() -> None:
    import kernels

    if getattr(kernels, "__file__", None) is None:
        raise pytest.UsageError(
            "`kernels` resolved to a namespace package (tests/kernels shadows it): run "
            "`python -m pytest` from the repository root, or put the root on sys.path first"
        )
    if DEVICE.type == "cuda":
        return
    from triton.runtime.jit import JITFunction

    compiled = [
        f"{module.__name__}.{name}"
        for module in KERNEL_MODULES
        for name, value in vars(module).items()
        if isinstance(value, JITFunction)
    ]
    if compiled:
        raise pytest.UsageError(
            "Triton kernels were compiled for a GPU but none is present: "
            f"{', '.join(compiled)}. Set TRITON_INTERPRET=1 before `kernels` is first imported "
            '(tests/conftest.py: os.environ.setdefault("TRITON_INTERPRET", "1")).'
        )


_check_kernels_runnable()


@pytest.fixture(scope="package", autouse=True)
def _few_torch_threads() -> Iterator[None]:
    """At most two intra-op threads while the kernel tests run: the PyTorch references and Triton's
    interpreter work on small tensors, where more OpenMP threads only contend for a shared machine's
    cores. (A fixture, not a `pytest_sessionstart` hook: pytest runs that hook only in the conftests
    of the paths it starts from, so `make test` never ran it.)"""
    previous = torch.get_num_threads()
    torch.set_num_threads(min(2, previous))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking `dtype` runs in float32, float16 and bfloat16; bfloat16 only on CUDA."""
    if "dtype" in metafunc.fixturenames:
        params = []
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            marks = ()
            if dtype == torch.bfloat16 and DEVICE.type != "cuda":
                marks = pytest.mark.skip(
                    reason="Triton's CPU interpreter mishandles bfloat16 (float32->bfloat16 casts "
                    "truncate instead of rounding; tl.dot on bfloat16 returns garbage)"
                )
            params.append(pytest.param(dtype, marks=marks, id=str(dtype).removeprefix("torch.")))
        metafunc.parametrize("dtype", params)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64; NaN anywhere in `got` counts as infinite."""
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = (got.double() - want.double()).abs()
    if diff.isnan().any():
        return float("inf")
    return (diff.max() / want.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    """assert_close(got, want, dtype): same dtype and relative error within TOLERANCE[dtype]."""

    def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        err = _relative_error(got, want)
        assert err <= TOLERANCE[dtype], f"relative error {err:.3g} > {TOLERANCE[dtype]:g} ({dtype})"

    return check


@contextlib.contextmanager
def nan_allocations() -> Iterator[None]:
    """Inside: torch.empty / torch.empty_like return NaN-filled float tensors, so any output element a
    kernel forgets to write shows up as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(*args, **kwargs):
        return poisoned(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poisoned(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


@pytest.fixture
def run_poisoned() -> Callable:
    """Call a function with NaN-poisoned allocations (see `nan_allocations`)."""

    def run(fn: Callable, *args, **kwargs):
        with nan_allocations():
            return fn(*args, **kwargs)

    return run


@pytest.fixture(scope="package")
def cpu_kernels():
    """torch.ops.llm_cpu, the C++ CPU kernels. Where a C++ compiler exists `make setup` must have
    built them, so failing to load them fails (never skips) a test; without a compiler it skips."""
    from kernels import cpu_extension

    if not cpu_extension.load():
        reason = cpu_extension.check_build() or "it failed to load (see the log)"
        if cpu_extension._compiler() is None:
            pytest.skip(f"no C++ compiler on this machine: {reason}")
        pytest.fail(f"C++ CPU kernels not usable although a compiler exists: {reason}")
    return torch.ops.llm_cpu

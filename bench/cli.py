"""The command line every benchmark shares: the common flags, and what they mean for a run.

The common flags are defined once here (`add_cli_args`); each benchmark states its own defaults
for --dtype, --threads and --repeats and adds its own flags in its `Benchmark` (bench.skeleton,
the vLLM `benchmarks/` pattern). A default may depend on the run (`ByMode`): tiny under --quick,
else per device.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ByMode:
    """A default that depends on the run: under --quick, else on CUDA, else on CPU."""

    quick: Any
    cpu: Any
    cuda: Any = None
    """Defaults to `cpu`."""

    def pick(self, mode: str) -> Any:
        if mode == "cuda" and self.cuda is not None:
            return self.cuda
        return self.quick if mode == "quick" else self.cpu

    def __str__(self) -> str:
        cuda = "" if self.cuda is None else f", CUDA {self.cuda}"
        return f"{self.cpu} (quick {self.quick}{cuda})"


@dataclass(frozen=True)
class Defaults:
    """A benchmark's defaults for the common flags that every benchmark states itself."""

    dtype: str | ByMode
    threads: int | ByMode
    """torch CPU threads; 0: torch's default."""
    repeats: int | ByMode


DEFAULT_DTYPE = ByMode(quick="float32", cpu="float32", cuda="bfloat16")
"""The --dtype default of the benchmarks that compare with a float32 reference (transformers,
sentence-transformers) and check outputs equal first: float32 on every CPU, also where `auto`
would pick bfloat16 (AVX512-BF16/AMX), so a figure means the same on every machine; bfloat16 on
CUDA. `--dtype auto` or `bfloat16` asks for the other."""


def add_cli_args(parser: argparse.ArgumentParser, name: str) -> None:
    """The flags every benchmark takes. dtype, threads and repeats have no default here."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    parser.add_argument(
        "--out", type=Path, default=Path(f"bench/results/{name}.json"), help="the JSON result"
    )
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA if available)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="auto: bfloat16 on CUDA and on CPUs with native bfloat16, float32 otherwise "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (0: torch default; the served benchmarks set the server's too; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, help="timed runs of each system (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)


def resolve_by_mode(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each `ByMode` value replaced by the one this run picks."""
    by_mode = {key: value for key, value in vars(args).items() if isinstance(value, ByMode)}
    if by_mode:
        mode_ = mode(args.quick, args.device)
        for key, value in by_mode.items():
            setattr(args, key, value.pick(mode_))
    return args


def default_device(device: str | None):
    """The torch device of --device: CUDA when available unless given."""
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def mode(quick: bool, device) -> str:
    """Which preset a run uses: "quick" (tiny sizes), else by device "cuda" or "cpu"."""
    if quick:
        return "quick"
    return "cuda" if default_device(device).type == "cuda" else "cpu"


class TorchSetup(NamedTuple):
    device: Any
    dtype: Any
    """torch.dtype."""
    dtype_name: str
    """"float32", "bfloat16" or "float16"."""


def setup_torch(args: argparse.Namespace) -> TorchSetup:
    """Apply --threads (when not 0); resolve --device and --dtype."""
    import torch

    from backend_lib.device import resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    return TorchSetup(device, dtype, str(dtype).removeprefix("torch."))

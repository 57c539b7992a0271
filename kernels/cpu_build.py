"""`python -m kernels.cpu_build` (run by `make setup`): build the C++ CPU kernels and print one line.

Exits 0 when nothing could be built too (no compiler, a failed compile: the line says why), so setup
works on a machine without a compiler; the PyTorch paths then serve (kernels/cpu_extension.py).
"""

from __future__ import annotations

import sys

from kernels import cpu_extension


def main() -> int:
    built, message = cpu_extension.build()
    print(f"C++ CPU kernels: {'built' if built else 'not built, PyTorch fallback'}: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

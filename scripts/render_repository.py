#!/usr/bin/env python3
"""Render the default model repository from config_templates/ (tooling.repository.DEFAULT_MODELS).

python scripts/render_repository.py                 # rewrite model_repository/
python scripts/render_repository.py --out /tmp/repo # render elsewhere
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tooling.repository import DEFAULT_MODELS, REPO_ROOT, write_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "model_repository")
    args = parser.parse_args()
    for spec in DEFAULT_MODELS:
        for path in write_model(spec, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

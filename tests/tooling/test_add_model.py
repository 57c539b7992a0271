"""scripts/add_model.py refuses an LLM checkpoint whose architecture the engine does not serve,
before writing anything, naming the supported ones (the loader's table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from backend_lib.llm.execution.models import supported_architectures
from tooling.repository import REPO_ROOT


def _add_model(checkpoint: Path, repository: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "add_model.py"), str(checkpoint)]
        + ["--name", "m", "--repository", str(repository)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )


def test_unsupported_llm_architecture_is_refused_up_front(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["GPT2ForCausalLM"]}))
    repository = tmp_path / "repo"
    result = _add_model(checkpoint, repository)
    assert result.returncode != 0
    assert "unsupported architecture 'GPT2ForCausalLM'" in result.stderr
    for arch in supported_architectures():
        assert arch in result.stderr
    assert not repository.exists()

    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"]}))
    result = _add_model(checkpoint, repository)
    assert result.returncode == 0, result.stderr
    assert (repository / "m" / "config.pbtxt").is_file()

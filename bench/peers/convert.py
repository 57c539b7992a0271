"""Converting a benchmark's checkpoint for one peer; runs in `.venv-peers` (see `cache`):

    python -m bench.peers.convert TARGET SOURCE DEST

- openvino-llm: `optimum-cli export openvino --task text-generation-with-past --weight-format fp32`
  (full-precision weights: no int8 compression, which optimum applies by default only to models
  over 1B parameters, and no fp16 weights);
- openvino-llm-int4: the same with NNCF's weight compression `--weight-format int4 --group-size 128
  --sym --ratio 1.0 --backup-precision none`: every projection int4 symmetric in groups of 128;
  the embeddings and lm_head (NNCF's default: int8) stay in their original precision;
- openvino-llm-int8: the same with NNCF's `--weight-format int8` (every weight 8-bit, asymmetric
  per output channel: its default int8 compression);
- ctranslate2-llm: `ctranslate2.converters.TransformersConverter`, float32 weights;
- openvino-encoder: `optimum-cli export openvino --task feature-extraction --weight-format fp32`;
- onnx-encoder: `torch.onnx.export` (torch.export-based: transformers 5's mask code does not trace
  with the TorchScript exporter) of the transformers model's last_hidden_state, dynamic axes.

Writes `conversion.json` (versions, the weights' element types) into DEST.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

COMPRESSED = {"f16", "bf16", "i8", "u8", "i4", "u4", "nf4"}
FP32 = ("--weight-format", "fp32")
INT8 = ("--weight-format", "int8")
INT4 = (
    *("--weight-format", "int4", "--group-size", "128", "--sym", "--ratio", "1.0"),
    *("--backup-precision", "none"),
)


def optimum_export(source: Path, dest: Path, task: str, weights: tuple[str, ...] = FP32) -> dict:
    cli = Path(sys.executable).with_name("optimum-cli")
    command = [str(cli), "export", "openvino", "--model", str(source), "--task", task, *weights]
    subprocess.run([*command, str(dest)], check=True)
    info = ir_weights(dest, compressed={INT4: ("i4", "u4"), INT8: ("i8", "u8")}.get(weights))
    return {"command": " ".join(command[1:]), **info}


def ir_weights(dest: Path, compressed: tuple[str, ...] | None = None) -> dict:
    """Element types of the IR's large constants; fails on compressed weights, or (`compressed`:
    the element types wanted) on none of those, then naming the weights left in float."""
    import openvino as ov

    model = ov.Core().read_model(dest / "openvino_model.xml")
    large = [
        op
        for op in model.get_ops()
        if op.get_type_name() == "Constant" and op.get_output_size() and _size(op) >= 4096
    ]
    types = Counter(str(op.get_element_type().get_type_name()) for op in large)
    info = {"weight_element_types": dict(types), "openvino": ov.__version__}
    if compressed:
        if not set(compressed) & set(types):
            raise SystemExit(f"the export holds no {'/'.join(compressed)} weights: {dict(types)}")
        info["float_weights"] = sorted(
            op.get_friendly_name()
            for op in large
            if op.get_element_type().is_real() and "/" not in op.get_friendly_name()
        )
    elif COMPRESSED & set(types):
        raise SystemExit(f"the export compressed the weights: {dict(types)}")
    return info


def _size(op) -> int:
    size = 1
    for dim in op.get_output_shape(0):
        size *= int(dim)
    return size


def ctranslate2_llm(source: Path, dest: Path) -> dict:
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(source)).convert(str(dest), quantization="float32", force=True)
    return {"quantization": "float32", "ctranslate2": ctranslate2.__version__}


def onnx_encoder(source: Path, dest: Path) -> dict:
    import torch
    import transformers

    class LastHiddenState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.AutoModel.from_pretrained(
                source, dtype=torch.float32, attn_implementation="eager"
            )

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    example = torch.ones((2, 8), dtype=torch.long)
    mask = example.clone()
    mask[1, 5:] = 0  # padding: an all-ones mask would be traced as "no mask"
    dest.mkdir(parents=True, exist_ok=True)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with torch.no_grad():
        torch.onnx.export(
            LastHiddenState().eval(),
            (example, mask, torch.zeros_like(example)),
            str(dest / "model.onnx"),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]},
            opset_version=17,
            dynamo=True,
        )
    return {"exporter": "torch.onnx.export (dynamo)", "opset": 17, "torch": torch.__version__}


def main(target: str, source: Path, dest: Path) -> None:
    if target == "openvino-llm":
        info = optimum_export(source, dest, "text-generation-with-past")
    elif target == "openvino-llm-int8":
        info = optimum_export(source, dest, "text-generation-with-past", INT8)
    elif target == "openvino-llm-int4":
        info = optimum_export(source, dest, "text-generation-with-past", INT4)
    elif target == "ctranslate2-llm":
        info = ctranslate2_llm(source, dest)
    elif target == "openvino-encoder":
        info = optimum_export(source, dest, "feature-extraction")
    elif target == "onnx-encoder":
        info = onnx_encoder(source, dest)
    else:
        raise SystemExit(f"unknown target {target}")
    if (source / "tokenizer.json").exists():
        shutil.copy(source / "tokenizer.json", dest / "tokenizer.json")
    (dest / "conversion.json").write_text(json.dumps({"target": target, **info}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))

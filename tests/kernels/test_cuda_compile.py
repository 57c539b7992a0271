"""Every Triton kernel compiles for real GPUs (sm_80, sm_90), down to a cubin with the bundled
ptxas, without register spills on sm_90. The interpreter runs kernels as Python and would never see a
compile error (types of loop-carried values, unsupported ops, resource limits); this needs no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Each config: kernel, pointer element types (other scalars int32), float scalars, constexprs,
# num_warps. Attention shapes go through the wrapper's own tile choice: prefill and decode tiles,
# split-KV, sliding window, GQA 1/4/8, padded head_dims (80, 96), in bf16 (the GPU default), fp16, fp32.
COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import activation, kv_cache, lora, paged_attention, rmsnorm, rotary

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

def signature(fn, pointers, floats, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, pointers["*"])
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig

def attention(dtype, num_tokens, num_seqs, groups, head_dim, num_splits, window, specialized=None,
              softcap=False, kv_cache=None, limits=False):
    # The launch shape the wrapper would choose for this batch.
    tiles = paged_attention.tile_config(num_tokens, num_seqs, groups, dtype, head_dim,
                                        kv_cache is not None)
    type_name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    pointers = {"*": type_name, "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32",
                "block_tables_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
                "k_scale_ptr": "fp32", "v_scale_ptr": "fp32", "visible_until_ptr": "i32"}
    if kv_cache is not None:  # an 8-bit cache (kv_cache_dtype int8 / fp8): "i8" or "fp8e4nv"
        pointers.update(k_cache_ptr=kv_cache, v_cache_ptr=kv_cache)
    constexprs = dict(NUM_GROUPS=groups, BLOCK_SIZE=16, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_q,
                      BLOCK_N=tiles.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
                      NUM_SPLITS=num_splits, USE_WINDOW=window, USE_SOFTCAP=softcap,
                      DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                      QUANTIZED=kv_cache is not None, FP8=kv_cache == "fp8e4nv", HAS_LIMITS=limits,
                      **(specialized or {}))
    floats = {"qk_scale", "softcap"}
    return paged_attention._paged_attention_kernel, pointers, floats, constexprs, tiles.num_warps

configs = {
    "attention-bf16-prefill": attention(torch.bfloat16, 512, 2, 4, 128, 1, False),
    "attention-bf16-decode-split": attention(torch.bfloat16, 8, 8, 4, 128, 8, False),
    # The launcher turns integer arguments equal to 1 into constants.
    "attention-bf16-one-seq": attention(torch.bfloat16, 1, 1, 4, 128, 1, False, {"num_seqs": 1}),
    "attention-fp16-mqa-window": attention(torch.float16, 300, 3, 8, 64, 1, True),
    "attention-fp16-d96-decode": attention(torch.float16, 4, 4, 1, 96, 1, False),
    "attention-fp32-d80-prefill": attention(torch.float32, 64, 2, 1, 80, 1, False),
    # Gemma 2: soft-capped scores on sliding layers, head_dim 256 (bigger tiles' registers).
    "attention-bf16-softcap-window-d256": attention(torch.bfloat16, 512, 2, 2, 256, 1, True,
                                                    softcap=True),
    "attention-bf16-softcap-decode-split": attention(torch.bfloat16, 8, 8, 2, 256, 8, False,
                                                     softcap=True),
    # Gemma 3 vision: image tokens attend both ways on its global layers (head_dim 256, GQA 2).
    "attention-bf16-image-limits-d256": attention(torch.bfloat16, 512, 2, 2, 256, 1, False,
                                                  limits=True),
    "attention-fp32-decode-split-window": attention(torch.float32, 4, 4, 4, 128, 4, True),
    "attention-bf16-int8kv-decode-split": attention(torch.bfloat16, 8, 8, 4, 128, 8, False,
                                                    kv_cache="i8"),
    "attention-bf16-int8kv-prefill": attention(torch.bfloat16, 512, 2, 4, 128, 1, False,
                                               kv_cache="i8"),
    "attention-bf16-fp8kv-decode": attention(torch.bfloat16, 8, 8, 4, 128, 1, False,
                                             kv_cache="fp8e4nv"),
    "merge-splits-bf16": (paged_attention._merge_splits_kernel, {"*": "fp32", "out_ptr": "bf16"},
                          set(), dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128), 4),
    "rms-norm-bf16-residual": (rmsnorm._rms_norm_kernel, {"*": "bf16"}, {"eps"},
                               dict(HAS_RESIDUAL=True, BLOCK=4096), 16),
    "rms-norm-fp16": (rmsnorm._rms_norm_kernel, {"*": "fp16"}, {"eps"},
                      dict(HAS_RESIDUAL=False, BLOCK=128), 1),
    "rotary-bf16": (rotary._rotary_kernel, {"*": "bf16", "positions_ptr": "i64", "cache_ptr": "fp32"},
                    set(), dict(ROT_HALF=64, BLOCK_H=32, BLOCK_HALF=64), 4),
    "kv-cache-bf16": (kv_cache._write_kv_cache_kernel,
                      {"*": "bf16", "slot_ptr": "i64", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"},
                      set(), dict(NUM_KV_HEADS=8, BLOCK_H=8, BLOCK_D=128, QMAX=0.0, FP8=False), 4),
    "kv-cache-bf16-to-int8": (kv_cache._write_kv_cache_kernel,
                              {"*": "bf16", "slot_ptr": "i64", "k_cache_ptr": "i8",
                               "v_cache_ptr": "i8", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"},
                              set(), dict(NUM_KV_HEADS=8, BLOCK_H=8, BLOCK_D=128, QMAX=127.0,
                                          FP8=False), 4),
    "silu-and-mul-bf16": (activation._act_and_mul_kernel, {"*": "bf16"}, set(),
                          dict(ACTIVATION="silu", BLOCK=1024), 4),
    "gelu-tanh-and-mul-bf16": (activation._act_and_mul_kernel, {"*": "bf16"}, set(),
                               dict(ACTIVATION="gelu_tanh", BLOCK=1024), 4),
    "lora-shrink-bf16": (lora._lora_shrink_kernel, {"*": "bf16", "y_ptr": "fp32", "starts_ptr": "i32",
                         "ends_ptr": "i32", "slots_ptr": "i32"}, set(),
                         dict(BLOCK_M=16, BLOCK_R=64, BLOCK_K=32, DOT_PRECISION="tf32"), 4),
    "lora-expand-fp16": (lora._lora_expand_kernel, {"*": "fp16", "y_ptr": "fp32", "starts_ptr": "i32",
                         "ends_ptr": "i32", "slots_ptr": "i32"}, set(),
                         dict(BLOCK_M=16, BLOCK_N=64, BLOCK_R=16, DOT_PRECISION="ieee"), 4),
}
failures = {}
for arch in (80, 90):
    for name, (fn, pointers, floats, constexprs, num_warps) in configs.items():
        key = f"sm_{arch}:{name}"
        if "fp8" in name and arch < 89:
            continue  # float8_e4m3fn caches need compute capability 8.9 (kv_cache_dtype's check)
        try:
            src = ASTSource(fn, signature(fn, pointers, floats, constexprs), constexprs)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
        except Exception as exc:  # report every failure, not just the first
            failures[key] = f"{type(exc).__name__}: {exc}"[-2000:]
            continue
        if arch != 90:
            continue  # spills are checked for the deployment GPU (H100/H200) only
        path = f"{sys.argv[1]}/{arch}-{name}.cubin"
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        stack = re.search(r"STACK:(\d+)", usage)
        if stack is None or int(stack.group(1)) > 0:
            failures[key] = f"register spills / stack use: {usage.strip()[-500:]}"
print(json.dumps(failures))
"""


def test_kernels_compile_for_cuda(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a cache hit would skip compiling
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's default-change warning
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failures, json.dumps(failures, indent=2)

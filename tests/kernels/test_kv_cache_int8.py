"""8-bit KV cache (kv_cache_dtype int8 / fp8): quantize-on-write and the attention paths reading
the 8-bit rows and their scales, each against the PyTorch twin (kernels/kv_cache.py's contract):
the twin against a per-token loop, the C++ ops and the Triton kernels against the twin, and
attention over an int8 cache close to attention over the full-precision cache it was written from.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import (
    QUANTIZED_KV_DTYPES,
    dequantize_kv,
    quantize_kv,
    write_kv_cache_cpu,
    write_kv_cache_torch,
    write_kv_cache_triton,
)
from kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_torch,
    paged_attention_triton,
    plan_paged_attention_cpu,
)
from tests.kernels.attention_helpers import CASES, Inputs, make_inputs, naive_attention
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt

NUM_BLOCKS, BLOCK_SIZE = 6, 8
KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
KV_IDS = ["int8", "fp8"]


def _quantized_caches(num_kv_heads, head_dim, kv_dtype, device="cpu"):
    """(k_cache, v_cache, k_scale, v_scale) with random old contents (a missed write shows)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k, ks = quantize_kv(torch.randn(shape, device=device), kv_dtype)
    v, vs = quantize_kv(torch.randn(shape, device=device), kv_dtype)
    return k, v, ks, vs


def _slots(num_tokens: int, device="cpu") -> torch.Tensor:
    """Distinct random slots, every third token skipped (-1)."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[::3] = -1
    return slots.to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(_bytes(g), _bytes(w))


# --- the quantizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_quantize_is_symmetric_per_row_with_max_over_head_dim(kv_dtype):
    x = torch.randn(5, 3, 64) * torch.rand(5, 3, 1) * 10
    x[2, 1] = 0.0  # an all-zero row: scale 0, zeros back
    q, scale = quantize_kv(x, kv_dtype)
    qmax = QUANTIZED_KV_DTYPES[kv_dtype]
    assert q.dtype == kv_dtype and scale.dtype == torch.float32 and scale.shape == (5, 3)
    torch.testing.assert_close(scale, x.abs().amax(-1) / qmax, rtol=0, atol=0)
    assert float(q.float().abs().max()) == qmax  # each row's largest element maps to +-QMAX
    back = dequantize_kv(q, scale, torch.float32)
    assert torch.equal(back[2, 1], torch.zeros(64))
    # int8: within half a step; fp8 (3 mantissa bits): within 1/16 of the magnitude, plus a step
    # of its subnormals.
    err = (back - x).abs()
    if kv_dtype == torch.int8:
        assert bool((err <= scale[..., None] * 0.5001).all())
    else:
        assert bool((err <= x.abs() / 16 + scale[..., None] / 512 + 1e-7).all())


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_torch_write_quantizes_each_token_into_its_slot(kv_dtype):
    num_tokens, num_kv_heads, head_dim = 10, 2, 64
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim)
    caches = _quantized_caches(num_kv_heads, head_dim, kv_dtype)
    want = [c.clone() for c in caches]
    slots = _slots(num_tokens)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, BLOCK_SIZE)
        for x, cache, scales in ((key, want[0], want[2]), (value, want[1], want[3])):
            q, s = quantize_kv(x[t], kv_dtype)
            _bytes(cache)[b, o] = _bytes(q)
            scales[b, o] = s
    write_kv_cache_torch(key, value, *caches[:2], slots, *caches[2:])
    assert_same(caches, tuple(want))


def test_torch_write_wants_scales_exactly_for_8_bit_caches():
    key = value = torch.randn(2, 2, 64)
    k, v, ks, vs = _quantized_caches(2, 64, torch.int8)
    with pytest.raises(ValueError, match="takes k_scale"):
        write_kv_cache_torch(key, value, k, v, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="takes no scales"):
        write_kv_cache_torch(
            key, value, key.new_zeros(k.shape), key.new_zeros(k.shape), torch.tensor([0, 1]), ks, vs
        )


# --- attention over an 8-bit cache ------------------------------------------------------------


def quantized_inputs(
    inputs: Inputs, kv_dtype: torch.dtype
) -> tuple[Inputs, torch.Tensor, torch.Tensor, Inputs]:
    """(inputs with an 8-bit cache, k_scale, v_scale, the same inputs over its dequantized cache)."""
    k, ks = quantize_kv(inputs.k_cache, kv_dtype)
    v, vs = quantize_kv(inputs.v_cache, kv_dtype)
    dtype = inputs.q.dtype
    quantized = Inputs(inputs.q, k, v, *inputs.args()[3:])
    dequantized = Inputs(
        inputs.q, dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype), *inputs.args()[3:]
    )
    return quantized, ks, vs, dequantized


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_torch_attention_reads_the_dequantized_cache(case, kv_dtype):
    inputs = make_inputs(CASES[case], torch.float32, torch.device("cpu"))
    quantized, ks, vs, dequantized = quantized_inputs(inputs, kv_dtype)
    got = paged_attention_torch(*quantized.args(), k_scale=ks, v_scale=vs)
    assert _relative(got, naive_attention(dequantized)) <= 1e-5
    # Close to the full-precision cache the 8-bit one was written from.
    bound = 2e-2 if kv_dtype == torch.int8 else 8e-2
    assert _relative(got, naive_attention(inputs)) <= bound


# --- the C++ ops (kernels/csrc/kv_cache_cpu.cpp, paged_attention_cpu.cpp) ----------------------


@pytest.fixture
def cpu_writes(cpu_kernels, monkeypatch) -> list[int]:
    """Token counts of the llm_cpu.write_kv_cache calls of the test (a silent fallback fails)."""
    calls: list[int] = []
    real = cpu_kernels.write_kv_cache

    def spy(key, *args):
        calls.append(key.shape[0])
        return real(key, *args)

    monkeypatch.setattr(cpu_kernels, "write_kv_cache", spy)
    return calls


CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CPU_IDS = ["float32", "bfloat16", "float16"]
# Twice conftest.TOLERANCE: the SDPA rows also round the dequantized context to q's dtype.
ROUTED_TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


@pytest.mark.parametrize("cpu_dtype", CPU_DTYPES, ids=CPU_IDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_cpu_write_equals_the_twin_bytes_and_scales(cpu_writes, kv_dtype, cpu_dtype):
    # key/value as views into one fused qkv output; every third slot -1; an all-zero row.
    num_tokens, num_kv_heads, head_dim = 12, 2, 64
    qkv = (torch.randn(num_tokens, 8 * head_dim) * 3).to(cpu_dtype)
    qkv[4, 4 * head_dim : 5 * head_dim] = 0
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = _slots(num_tokens)
    slots[4] = 9
    caches = _quantized_caches(num_kv_heads, head_dim, kv_dtype)
    want = tuple(c.clone() for c in caches)
    write_kv_cache_torch(key, value, *want[:2], slots, *want[2:])
    write_kv_cache_cpu(key, value, *caches[:2], slots, *caches[2:])
    assert_same(caches, want)
    assert cpu_writes == [num_tokens]


def _cpu_attention_calls(cpu_kernels, monkeypatch) -> list[torch.dtype]:
    calls: list[torch.dtype] = []
    real = cpu_kernels.paged_attention

    def spy(q, k_cache, *args, **kwargs):
        calls.append(k_cache.dtype)
        return real(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "paged_attention", spy)
    return calls


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("cpu_dtype", CPU_DTYPES, ids=CPU_IDS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_cpu_attention_reads_the_8_bit_cache_in_place(
    cpu_kernels, monkeypatch, assert_close, case, kv_dtype, cpu_dtype
):
    """The op over the 8-bit cache and its scales against the float64 reference over the
    dequantized cache (conftest's tolerances)."""
    inputs = make_inputs(CASES[case], cpu_dtype, torch.device("cpu"))
    quantized, ks, vs, _ = quantized_inputs(inputs, kv_dtype)
    calls = _cpu_attention_calls(cpu_kernels, monkeypatch)
    plan = plan_paged_attention_cpu(*quantized.args()[3:6], quantized.k_cache)
    seqs = list(range(len(CASES[case].query_lens)))
    plan.native_seqs = torch.tensor(seqs, dtype=torch.int32)  # every sequence to the op
    plan.decode_groups, plan.prefills = [], []
    got = paged_attention_cpu(*quantized.args(), plan=plan, k_scale=ks, v_scale=vs)
    assert calls == [kv_dtype]
    # The reference: float32 dequantized rows (the op's values), float64 attention.
    exact = Inputs(
        inputs.q,
        dequantize_kv(quantized.k_cache, ks, torch.float32),
        dequantize_kv(quantized.v_cache, vs, torch.float32),
        *inputs.args()[3:],
    )
    want = naive_attention(exact).to(cpu_dtype)
    assert_close(got, want, cpu_dtype)
    # And the routed entry (the op for what the plan gives it, SDPA over the context dequantized
    # to q's dtype for the rest) agrees too.
    routed = paged_attention_cpu(*quantized.args(), k_scale=ks, v_scale=vs)
    assert _relative(routed, want) <= ROUTED_TOLERANCE[cpu_dtype]


def test_cpu_attention_refuses_a_quantized_cache_without_scales(cpu_kernels):
    inputs = make_inputs(CASES["gqa4-d128"], torch.float32, torch.device("cpu"))
    quantized, ks, _, _ = quantized_inputs(inputs, torch.int8)
    out = torch.empty_like(inputs.q)
    seqs = torch.arange(3, dtype=torch.int32)
    args = (*quantized.args()[:7], 0, seqs, out)
    with pytest.raises(RuntimeError, match="k_scale and v_scale go with"):
        cpu_kernels.paged_attention(*args)
    with pytest.raises(RuntimeError, match="k_scale and v_scale go with"):
        cpu_kernels.paged_attention(*args, 0.0, ks)


# --- the Triton kernels (CUDA, or Triton's interpreter on CPU: float32 / float16 there) ---------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 1, 64), (9, 2, 128), (12, 3, 80)])
def test_triton_write_equals_the_twin_bytes_and_scales(
    device, dtype, kv_dtype, num_tokens, num_kv_heads, head_dim
):
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, device=device) * 3).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    key[0, 0] = 0  # an all-zero row
    slots = _slots(num_tokens, device) if num_tokens > 1 else torch.tensor([17], device=device)
    caches = _quantized_caches(num_kv_heads, head_dim, kv_dtype, device)
    want = tuple(c.clone() for c in caches)
    write_kv_cache_torch(key, value, *want[:2], slots, *want[2:])
    write_kv_cache_triton(key, value, *caches[:2], slots, *caches[2:])
    assert_same(caches, want)


def test_triton_fp8_encoding_is_torchs_cast(device):
    """Rows whose largest magnitude is 448 have scale 1, so the kernel's float8_e4m3fn encoding of
    every other element shows directly: all binades, subnormals, the ties between neighbours."""
    codes = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = codes.float()
    ties = (grid[:-1] + grid[1:]) / 2  # exact halfway points: round to the even code
    values = torch.cat([grid, ties, grid * 1.01, grid * 0.99, torch.rand(247) * 448]).clamp(max=448)
    values = torch.cat([values, -values])
    head_dim = 128
    rows = values[: values.numel() // (head_dim - 1) * (head_dim - 1)].view(-1, head_dim - 1)
    key = torch.cat([rows, torch.full((rows.shape[0], 1), 448.0)], dim=1)[:, None].to(device)
    slots = torch.arange(key.shape[0], device=device)
    caches = _quantized_caches(1, head_dim, torch.float8_e4m3fn, device)
    want = tuple(c.clone() for c in caches)
    write_kv_cache_torch(key, key, *want[:2], slots, *want[2:])
    write_kv_cache_triton(key, key, *caches[:2], slots, *caches[2:])
    assert bool((want[2].view(-1)[: key.shape[0]] == 1).all())
    assert_same(caches, want)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_triton_attention_reads_the_8_bit_cache_in_place(
    device, assert_close, dtype, case, kv_dtype
):
    inputs = make_inputs(CASES[case], dtype, device)
    quantized, ks, vs, _ = quantized_inputs(inputs, kv_dtype)
    exact = Inputs(
        inputs.q,
        dequantize_kv(quantized.k_cache, ks, torch.float32),
        dequantize_kv(quantized.v_cache, vs, torch.float32),
        *inputs.args()[3:],
    )
    want = naive_attention(exact).to(dtype)
    splits = [None, 3] if case == "long-decode" else [None]
    for num_kv_splits in splits:
        got = paged_attention_triton(
            *quantized.args(), k_scale=ks, v_scale=vs, num_kv_splits=num_kv_splits
        )
        assert_close(got, want, dtype)


def test_softcapped_scores_scale_the_keys_first(cpu_kernels, device):
    """With Gemma's soft-capping the key scale applies before the cap, in the twin, the C++ op and
    the Triton kernel alike."""
    inputs = make_inputs(CASES["mixed-prefill-decode-d96"], torch.float32, torch.device("cpu"))
    inputs.q.mul_(8)  # scores large enough for the cap to matter
    quantized, ks, vs, _ = quantized_inputs(inputs, torch.int8)
    exact = Inputs(
        inputs.q,
        dequantize_kv(quantized.k_cache, ks, torch.float32),
        dequantize_kv(quantized.v_cache, vs, torch.float32),
        *inputs.args()[3:],
    )
    want = naive_attention(exact, softcap=5.0).float()
    twin = paged_attention_torch(*quantized.args(), softcap=5.0, k_scale=ks, v_scale=vs)
    cpu = paged_attention_cpu(*quantized.args(), softcap=5.0, k_scale=ks, v_scale=vs)
    moved = [t.to(device) for t in (*quantized.args()[:6], ks, vs)]
    triton_out = paged_attention_triton(
        *moved[:6], inputs.scale, None, softcap=5.0, k_scale=moved[6], v_scale=moved[7]
    )
    for got in (twin, cpu, triton_out.cpu()):
        assert _relative(got, want) <= 1e-5


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_engine_over_an_8_bit_cache_gives_the_same_greedy_tokens_with_triton_and_torch(
    kv_cache_dtype,
):
    """kernel_backend=triton (the interpreter on CPU) and torch (the C++ ops) over the same 8-bit
    cache: prefills, a prefix-cache hit, chunked prefill and decodes in mixed batches."""
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    shared = random_prompt(12, seed=1)
    prompts = [
        shared + random_prompt(5, seed=2),
        shared + random_prompt(9, seed=3),
        random_prompt(3, seed=4),
    ]
    outputs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(
            model_dir,
            kernel_backend=backend,
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=16,
        )
        assert engine.runner.kv_pool.device_cache.dtype == KV_DTYPES[KV_IDS.index(kv_cache_dtype)]
        first = engine.generate(prompts[:1], greedy(6))
        rest = engine.generate(prompts[1:], greedy(6))
        outputs[backend] = [o.outputs[0].token_ids for o in first + rest]
        assert engine.stats().counters.prefix_cache_hits > 0
    assert outputs["triton"] == outputs["torch"]

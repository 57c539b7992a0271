// A decode step's decoder layers in one call: the Llama forward's layer loop
// (backend_lib/llm/execution/models/llama.py with CppKernels) over this library's own ops, called
// directly (llm_cpu_ops.h), for a small step whose every projection is one of this library's: a
// blocked GEMV (float weights) or a WNA16 layer (4- or 8-bit weights). Built with the other
// kernels/csrc sources into one library (kernels/cpu_extension.py); registers
// torch.ops.llm_cpu.decode_layers; the Python side is models/decode_layers.py.
//
// Why: the same ops from Python cost a few microseconds each in dispatch, argument parsing and
// tensor wrappers (~25 per layer), 0.5-1 ms a step on an 8-layer model whose weights stream in
// 4-7 ms, and ~6 ms of a 4-bit 1B model's 37 ms step. Here they are plain C++ calls. The calls,
// their order and their arguments are the Python loop's, so the result is the same bits
// (tests/llm/execution/test_decode_layers.py).
//
// Per layer l (weights: input norm, post-attention norm, then the qkv, o, gate_up and down
// projections' tensors, one blocked weight or WNA16's packed, scales and zeros each; biases[4 l ...]
// and projections[5 (4 l + i) ...] of the four projections; kv_caches[2 l ...]):
//   normed, residual = rms_norm(hidden (+ residual))
//   q, k, v = split(qkv(normed)); q, k = rotary(q, k); write k, v; attended = attention(q)
//   hidden = o(attended)            (the last layer then keeps output_rows only, residual too)
//   normed, residual = rms_norm(hidden + residual); hidden = down(silu_and_mul(gate_up(normed)))
// then the final norm.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "llm_cpu_ops.h"

namespace {

// (normed x, the new residual): RMSNorm of x + residual (x alone for the first layer, whose
// residual is then x itself), as CppKernels.rms_norm.
std::pair<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                       const std::optional<at::Tensor>& residual) {
  at::Tensor out = at::empty_like(x);
  if (!residual.has_value()) {
    llm_cpu::rms_norm(x, weight, eps, std::nullopt, out, out);
    return {out, x};
  }
  at::Tensor summed = at::empty_like(x);
  llm_cpu::rms_norm(x, weight, eps, residual, out, summed);
  return {out, summed};
}

// One projection's bound operands: `bits` 0 is a blocked GEMV of tensors[0] (llm_cpu::blocked_gemv),
// 4 or 8 a WNA16 layer of tensors[0..2] (packed, scales, zeros: llm_cpu::wna16_linear).
struct Projection {
  const at::Tensor* tensors;
  std::optional<at::Tensor> bias;
  int64_t n, bits, group_size, gemm_min_rows;
  bool dynamic_int8;

  at::Tensor operator()(const at::Tensor& x) const {
    if (bits == 0) return llm_cpu::blocked_gemv(x, tensors[0], n, bias);
    return llm_cpu::wna16_linear(x, tensors[0], tensors[1], tensors[2], bits, group_size, n, bias, gemm_min_rows,
                                 dynamic_int8);
  }
};

// A layer's norms and projections (qkv, o, gate_up, down).
struct Layer {
  const at::Tensor* input_norm;
  const at::Tensor* post_norm;
  Projection qkv, o, gate_up, down;
};

constexpr int64_t kProjectionArgs = 5;  // n, bits, group_size, gemm_min_rows, dynamic_int8

// The layers of the op's flat arguments, checked against one another.
std::vector<Layer> bind_layers(const std::vector<at::Tensor>& weights,
                               const c10::List<std::optional<at::Tensor>>& biases,
                               const std::vector<int64_t>& projections, int64_t layers) {
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(projections.size()) == 4 * kProjectionArgs * layers,
              "llm_cpu::decode_layers: per layer 4 biases and ", 4 * kProjectionArgs, " projection arguments; got ",
              biases.size(), " and ", projections.size(), " for ", layers, " layers");
  std::vector<Layer> bound;
  size_t next = 0;
  auto take = [&](size_t count) {
    TORCH_CHECK(next + count <= weights.size(), "llm_cpu::decode_layers: too few weights (", weights.size(), ")");
    const at::Tensor* first = &weights[next];
    next += count;
    return first;
  };
  for (int64_t l = 0; l < layers; ++l) {
    Layer layer{take(1), take(1), {}, {}, {}, {}};
    Projection* slots[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t* a = &projections[kProjectionArgs * (4 * l + i)];
      TORCH_CHECK(a[1] == 0 || a[1] == 4 || a[1] == 8, "llm_cpu::decode_layers: projection bits must be 0 (a ",
                  "blocked GEMV), 4 or 8; got ", a[1]);
      *slots[i] = Projection{take(a[1] == 0 ? 1 : 3), biases.get(4 * l + i), a[0], a[1], a[2], a[3], a[4] != 0};
    }
    bound.push_back(layer);
  }
  TORCH_CHECK(next == weights.size(), "llm_cpu::decode_layers: ", weights.size() - next, " weights left over");
  return bound;
}

struct Step {
  const at::Tensor& positions;
  const at::Tensor& slot_mapping;
  const at::Tensor& query_start_loc;
  const at::Tensor& seq_lens;
  const at::Tensor& block_tables;
  const at::Tensor& seqs;
  const at::Tensor& rope;
  int64_t num_heads, num_kv_heads, head_dim;
};

// Attention of layer l on normed hidden [T, hidden] -> o's input [T, num_heads * head_dim].
at::Tensor attention(const Step& s, const at::Tensor& normed, const Projection& qkv_proj, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, double scale, int64_t sliding_window) {
  const int64_t tokens = normed.size(0), q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  const at::Tensor qkv = qkv_proj(normed);
  const auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
  const at::Tensor q = parts[0].reshape({tokens, s.num_heads, s.head_dim});
  const at::Tensor k = parts[1].reshape({tokens, s.num_kv_heads, s.head_dim});
  const at::Tensor v = parts[2].reshape({tokens, s.num_kv_heads, s.head_dim});
  at::Tensor q_rot = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor k_rot = at::empty_like(k, at::MemoryFormat::Contiguous);
  llm_cpu::rotary(s.positions, q, k, s.rope, q_rot, k_rot);
  llm_cpu::write_kv_cache(k_rot, v, k_cache, v_cache, s.slot_mapping, std::nullopt, std::nullopt);
  at::Tensor out = at::empty_like(q_rot);
  llm_cpu::paged_attention(q_rot, k_cache, v_cache, s.query_start_loc, s.seq_lens, s.block_tables, scale,
                           sliding_window, s.seqs, out, 0.0, std::nullopt, std::nullopt);
  return out.reshape({tokens, q_size});
}

at::Tensor decode_layers(const at::Tensor& hidden, const std::vector<at::Tensor>& weights,
                         const c10::List<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& projections,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions,
                         const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, const at::Tensor& seqs, const at::Tensor& rope, double eps,
                         const std::vector<double>& scales, const std::vector<int64_t>& sliding_windows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& final_norm,
                         const std::optional<at::Tensor>& output_rows) {
  const auto layers = static_cast<int64_t>(scales.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(kv_caches.size()) == 2 * layers &&
                  static_cast<int64_t>(sliding_windows.size()) == layers,
              "llm_cpu::decode_layers: per layer 2 caches, a scale and a sliding window; got ", kv_caches.size(),
              ", ", scales.size(), ", ", sliding_windows.size());
  const std::vector<Layer> bound = bind_layers(weights, biases, projections, layers);
  const Step step{positions, slot_mapping, query_start_loc, seq_lens, block_tables, seqs, rope,
                  num_heads, num_kv_heads, head_dim};
  at::Tensor x = hidden;
  std::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const Layer& layer = bound[l];
    auto [normed, summed] = norm(x, *layer.input_norm, eps, residual);
    residual = summed;
    const at::Tensor attended = attention(step, normed, layer.qkv, kv_caches[2 * l], kv_caches[2 * l + 1], scales[l],
                                          sliding_windows[l]);
    x = layer.o(attended);
    if (l == layers - 1 && output_rows.has_value()) {
      x = x.index_select(0, *output_rows);
      residual = residual->index_select(0, *output_rows);
    }
    std::tie(normed, summed) = norm(x, *layer.post_norm, eps, residual);
    residual = summed;
    const at::Tensor gate_up = layer.gate_up(normed);
    at::Tensor activated = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    llm_cpu::silu_and_mul(gate_up, activated);
    x = layer.down(activated);
  }
  return norm(x, final_norm, eps, residual).first;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] projections, Tensor[] kv_caches, "
      "Tensor positions, Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "Tensor seqs, Tensor rope, float eps, float[] scales, int[] sliding_windows, int num_heads, int num_kv_heads, "
      "int head_dim, Tensor final_norm, Tensor? output_rows) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}

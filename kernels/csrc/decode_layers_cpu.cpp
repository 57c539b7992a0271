// A decode step's decoder layers in one call: the Llama forward's layer loop
// (backend_lib/llm/execution/models/llama.py with CppKernels) over this library's own ops, called
// directly (llm_cpu_ops.h), for a step whose every projection is a blocked GEMV (a few rows of x).
// Built with the other kernels/csrc sources into one library (kernels/cpu_extension.py); registers
// torch.ops.llm_cpu.decode_layers; the Python side is models/decode_layers.py.
//
// Why: the same ops from Python cost a few microseconds each in dispatch, argument parsing and
// tensor wrappers (~25 per layer), 0.5-1 ms a step on an 8-layer model whose weights stream in
// 4-7 ms. Here they are plain C++ calls. The calls, their order and their arguments are the Python
// loop's, so the result is the same bits (tests/llm/execution/test_decode_layers.py).
//
// Per layer l (weights[6 l ...]: input norm, post-attention norm, qkv, o, gate_up, down blocked
// weights; biases[4 l ...] and out_features[4 l ...] of the four projections; kv_caches[2 l ...]):
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
at::Tensor attention(const Step& s, const at::Tensor& normed, const at::Tensor& qkv_w,
                     const std::optional<at::Tensor>& qkv_b, int64_t qkv_n, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, double scale, int64_t sliding_window) {
  const int64_t tokens = normed.size(0), q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  const at::Tensor qkv = llm_cpu::blocked_gemv(normed, qkv_w, qkv_n, qkv_b);
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
                         const c10::List<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& out_features,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& positions,
                         const at::Tensor& slot_mapping, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, const at::Tensor& seqs, const at::Tensor& rope, double eps,
                         const std::vector<double>& scales, const std::vector<int64_t>& sliding_windows,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& final_norm,
                         const std::optional<at::Tensor>& output_rows) {
  const auto layers = static_cast<int64_t>(scales.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == 6 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers &&
                  static_cast<int64_t>(kv_caches.size()) == 2 * layers &&
                  static_cast<int64_t>(sliding_windows.size()) == layers,
              "llm_cpu::decode_layers: per layer 6 weights, 4 biases, 4 out_features, 2 caches, a scale and a "
              "sliding window; got ",
              weights.size(), ", ", biases.size(), ", ", out_features.size(), ", ", kv_caches.size(), ", ",
              scales.size(), ", ", sliding_windows.size());
  const Step step{positions, slot_mapping, query_start_loc, seq_lens, block_tables, seqs, rope,
                  num_heads, num_kv_heads, head_dim};
  at::Tensor x = hidden;
  std::optional<at::Tensor> residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[6 * l];
    const int64_t* n = &out_features[4 * l];
    auto [normed, summed] = norm(x, w[0], eps, residual);
    residual = summed;
    const at::Tensor attended = attention(step, normed, w[2], biases.get(4 * l), n[0], kv_caches[2 * l],
                                          kv_caches[2 * l + 1], scales[l], sliding_windows[l]);
    x = llm_cpu::blocked_gemv(attended, w[3], n[1], biases.get(4 * l + 1));
    if (l == layers - 1 && output_rows.has_value()) {
      x = x.index_select(0, *output_rows);
      residual = residual->index_select(0, *output_rows);
    }
    std::tie(normed, summed) = norm(x, w[1], eps, residual);
    residual = summed;
    const at::Tensor gate_up = llm_cpu::blocked_gemv(normed, w[4], n[2], biases.get(4 * l + 2));
    at::Tensor activated = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    llm_cpu::silu_and_mul(gate_up, activated);
    x = llm_cpu::blocked_gemv(activated, w[5], n[3], biases.get(4 * l + 3));
  }
  return norm(x, final_norm, eps, residual).first;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] out_features, Tensor[] kv_caches, "
      "Tensor positions, Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "Tensor seqs, Tensor rope, float eps, float[] scales, int[] sliding_windows, int num_heads, int num_kv_heads, "
      "int head_dim, Tensor final_norm, Tensor? output_rows) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}

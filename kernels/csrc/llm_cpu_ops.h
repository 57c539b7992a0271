// The C++ entry points of the ops the sources of kernels/csrc/ register (torch.ops.llm_cpu.*), for
// another source of the same library to call directly, without the dispatcher: the same arguments,
// checks and results as the ops (decode_layers_cpu.cpp runs a decode step's layers through them).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace llm_cpu {

// elementwise_cpu.cpp
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual,
              at::Tensor out, at::Tensor summed);
void rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cache,
            at::Tensor q_out, at::Tensor k_out);
void silu_and_mul(const at::Tensor& x, at::Tensor out);

// kv_cache_cpu.cpp
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale);

// paged_attention_cpu.cpp
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, int64_t sliding_window, const at::Tensor& seqs, at::Tensor out, double softcap,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);

// gemv_cpu.cpp
at::Tensor blocked_gemv(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias);

// wna16_linear_cpu.cpp
at::Tensor wna16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t bits, int64_t group_size, int64_t n,
                        const std::optional<at::Tensor>& bias, int64_t gemm_min_rows, bool dynamic_int8);

}  // namespace llm_cpu

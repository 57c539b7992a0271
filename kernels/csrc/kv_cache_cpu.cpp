// Writing new tokens' keys and values into the paged KV cache on CPU: the C++ twin of
// kernels/kv_cache.py's write_kv_cache_torch (the contract is that module's docstring). One call
// copies each token's rows to its slot and skips slot -1, where the twin needs a check (a host
// sync) and, when a slot is -1, a boolean mask before its two index_copy_ calls. Built with the
// other kernels/csrc sources into one library (kernels/cpu_extension.py); registers
// torch.ops.llm_cpu.write_kv_cache. An int8 / float8_e4m3fn cache takes k_scale, v_scale
// [blocks, block_size, Hkv] float32 and each (token, kv head) row is quantized as the twin does
// (quantize_kv: scale = max|x| / QMAX, x / max(scale, FLT_MIN) clamped to +-QMAX, then rounded half
// to even or cast to fp8): the same bytes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include "llm_cpu_ops.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// One row x [D] (in_t) into q [D] (out_t: int8_t or Float8_e4m3fn) and its scale.
template <typename in_t, typename out_t>
inline void quantize_row(const in_t* x, int64_t D, out_t* q, float* scale, float* buf) {
  constexpr float qmax = std::is_same_v<out_t, int8_t> ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    buf[d] = static_cast<float>(x[d]);
    amax = std::max(amax, std::fabs(buf[d]));
  }
  const float s = amax / qmax, divisor = std::max(s, FLT_MIN);
  for (int64_t d = 0; d < D; ++d) {
    const float y = std::clamp(buf[d] / divisor, -qmax, qmax);
    if constexpr (std::is_same_v<out_t, int8_t>) q[d] = static_cast<int8_t>(std::nearbyint(y));
    else q[d] = c10::Float8_e4m3fn(y);
  }
  *scale = s;
}

template <typename in_t, typename out_t>
void write_quantized(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                     const int64_t* slot, at::Tensor& k_scale, at::Tensor& v_scale) {
  const int64_t tokens = key.size(0), heads = k_cache.size(2), D = k_cache.size(3);
  const auto* kp = static_cast<const in_t*>(key.data_ptr());
  const auto* vp = static_cast<const in_t*>(value.data_ptr());
  auto* kc = static_cast<out_t*>(k_cache.data_ptr());
  auto* vc = static_cast<out_t*>(v_cache.data_ptr());
  float* ks = k_scale.data_ptr<float>();
  float* vs = v_scale.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * D, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> buf(D);
                     for (int64_t t = begin; t < end; ++t) {
                       if (slot[t] < 0) continue;
                       for (int64_t h = 0; h < heads; ++h) {
                         const int64_t row = slot[t] * heads + h;
                         quantize_row(kp + t * key.stride(0) + h * key.stride(1), D, kc + row * D, ks + row, buf.data());
                         quantize_row(vp + t * value.stride(0) + h * value.stride(1), D, vc + row * D, vs + row,
                                      buf.data());
                       }
                     }
                   });
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping, std::optional<at::Tensor> k_scale,
                    std::optional<at::Tensor> v_scale) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && slot_mapping.device().is_cpu(),
              "llm_cpu::write_kv_cache: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "llm_cpu::write_kv_cache: caches must be contiguous [blocks, block_size, Hkv, D] alike");
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == heads && key.size(2) == head_dim &&
                  key.stride(2) == 1 && value.stride(2) == 1,
              "llm_cpu::write_kv_cache: key and value must be [T, Hkv, D] with unit stride along D");
  const auto cache_type = k_cache.scalar_type();
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == cache_type &&
                  (quantized || key.scalar_type() == cache_type),
              "llm_cpu::write_kv_cache: key, value and caches must share a dtype (or the caches be int8 / "
              "float8_e4m3fn ones alike)");
  TORCH_CHECK(quantized == k_scale.has_value() && quantized == v_scale.has_value(),
              "llm_cpu::write_kv_cache: k_scale and v_scale go with an int8 / float8_e4m3fn cache, and only there");
  if (quantized) {
    for (const at::Tensor* scales : {&*k_scale, &*v_scale})
      TORCH_CHECK(scales->device().is_cpu() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                      scales->dim() == 3 && scales->size(0) == k_cache.size(0) &&
                      scales->size(1) == k_cache.size(1) && scales->size(2) == heads,
                  "llm_cpu::write_kv_cache: k_scale, v_scale must be contiguous float32 [blocks, block_size, Hkv]");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "llm_cpu::write_kv_cache: slot_mapping must be contiguous int64 [T]");
  const int64_t tokens = key.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "llm_cpu::write_kv_cache: slot_mapping[", t, "] = ", slot[t],
                " outside the cache's ", slots, " slots");
  if (quantized) {
    const auto run = [&](auto in_tag) {
      using in_t = decltype(in_tag);
      if (cache_type == at::kChar)
        return write_quantized<in_t, int8_t>(key, value, k_cache, v_cache, slot, *k_scale, *v_scale);
      return write_quantized<in_t, c10::Float8_e4m3fn>(key, value, k_cache, v_cache, slot, *k_scale, *v_scale);
    };
    switch (key.scalar_type()) {
      case at::kFloat:
        return run(float{});
      case at::kBFloat16:
        return run(c10::BFloat16{});
      case at::kHalf:
        return run(c10::Half{});
      default:
        TORCH_CHECK(false, "llm_cpu::write_kv_cache: unsupported key dtype ", key.scalar_type());
    }
  }
  const int64_t row_bytes = head_dim * static_cast<int64_t>(key.element_size());
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t esize = key.element_size();
  const int64_t sk_t = key.stride(0) * esize, sk_h = key.stride(1) * esize;
  const int64_t sv_t = value.stride(0) * esize, sv_h = value.stride(1) * esize;
  const int64_t slot_bytes = heads * row_bytes;
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(2 * slot_bytes, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       if (slot[t] < 0) continue;
                       for (int64_t h = 0; h < heads; ++h) {
                         std::memcpy(kc + slot[t] * slot_bytes + h * row_bytes, kp + t * sk_t + h * sk_h, row_bytes);
                         std::memcpy(vc + slot[t] * slot_bytes + h * row_bytes, vp + t * sv_t + h * sv_h, row_bytes);
                       }
                     }
                   });
}

}  // namespace

namespace llm_cpu {
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping, std::optional<at::Tensor> k_scale, std::optional<at::Tensor> v_scale) {
  ::write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}
}  // namespace llm_cpu

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(write_kv_cache));
}

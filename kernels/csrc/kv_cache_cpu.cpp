// Writing new tokens' keys and values into the paged KV cache on CPU: the C++ twin of
// kernels/kv_cache.py's write_kv_cache_torch (the contract is that module's docstring). One call
// copies each token's rows to its slot and skips slot -1, where the twin needs a check (a host
// sync) and, when a slot is -1, a boolean mask before its two index_copy_ calls. Built with the
// other kernels/csrc sources into one library (kernels/cpu_extension.py); registers
// torch.ops.llm_cpu.write_kv_cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

namespace {

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping) {
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
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "llm_cpu::write_kv_cache: key, value and caches must share a dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "llm_cpu::write_kv_cache: slot_mapping must be contiguous int64 [T]");
  const int64_t tokens = key.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "llm_cpu::write_kv_cache: slot_mapping[", t, "] = ", slot[t],
                " outside the cache's ", slots, " slots");
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

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(write_kv_cache));
}

// Fused per-row kernels on CPU: the C++ twins of kernels/rmsnorm.py (RMSNorm with the residual add),
// kernels/rotary.py (rotary embedding of q and k) and kernels/activation.py (the gated activations,
// SiLU-and-mul and GELU(tanh)-and-mul: one body over the activation); the contracts are those
// modules' docstrings. Built with the other kernels/csrc sources into one library
// (kernels/cpu_extension.py); registers torch.ops.llm_cpu.{rms_norm, rotary, silu_and_mul,
// gelu_tanh_and_mul}.
//
// Why: each of these is one pass over its rows here, where the PyTorch twins make 3-20 passes, each
// a dispatched op with its own temporary. Math is float32 in the twins' order (no fused multiply-add
// contraction, see the pragma), so rotary and SiLU-and-mul give the twins' bits; RMSNorm differs
// only in the summation order of its mean of squares. Rows run under at::parallel_for.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

// The twins round every product before adding it; a contracted a * b - c * d would not.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include "llm_cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Elements per parallel task: below this a row batch is not worth waking another thread for.
constexpr int64_t kGrainElements = 1 << 13;

// n (<= kLanes) elements as float lanes, the rest zero.
template <typename T>
inline Vec load(const T* p, int64_t n = kLanes) {
  if constexpr (std::is_same_v<T, float>) {
    return n == kLanes ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    if (n == kLanes) {
      Vec out;
      at::vec::load_to_float(p, out);
      return out;
    }
    float buf[kLanes] = {};
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return Vec::loadu(buf);
  }
}

// The first n (<= kLanes) lanes of v, rounded to T (round to nearest even, as Tensor.to does) with
// ATen's vector conversion: an element-by-element cast made the bfloat16 SiLU-and-mul ~2x slower.
template <typename T>
inline void store(T* p, const Vec& v, int64_t n = kLanes) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

inline int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1)); }

template <typename F>
void dispatch_dtype(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "llm_cpu::", op, ": unsupported dtype ", dtype);
  }
}

// --- RMSNorm -----------------------------------------------------------------------------------

// One row: with a residual, s = round_T(x + residual) is stored to `summed` and normalised;
// out = round_T((s * rsqrt(mean(s^2) + eps)) * weight), all in float32.
template <typename T>
void rms_norm_row(const T* x, const T* residual, const float* weight, int64_t n, float eps, T* out, T* summed) {
  Vec squares(0.f);
  const T* s = x;
  if (residual != nullptr) {
    for (int64_t j = 0; j < n; j += kLanes) {
      const int64_t m = std::min(kLanes, n - j);
      store(summed + j, load(x + j, m) + load(residual + j, m), m);
    }
    s = summed;
  }
  for (int64_t j = 0; j < n; j += kLanes) {
    const Vec v = load(s + j, std::min(kLanes, n - j));
    squares = squares + v * v;
  }
  const float sum = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, squares);
  const Vec inv_rms(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t m = std::min(kLanes, n - j);
    store(out + j, (load(s + j, m) * inv_rms) * Vec::loadu(weight + j, m), m);
  }
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual,
              at::Tensor out, at::Tensor summed) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu() && summed.device().is_cpu(),
              "llm_cpu::rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "llm_cpu::rms_norm: x must be [rows, hidden] with unit stride");
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1 && out.scalar_type() == x.scalar_type(),
              "llm_cpu::rms_norm: out must be like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "llm_cpu::rms_norm: weight must be [hidden]");
  const bool has_residual = residual.has_value();
  if (has_residual) {
    TORCH_CHECK(residual->device().is_cpu() && residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "llm_cpu::rms_norm: residual must be like x");
    TORCH_CHECK(summed.sizes() == x.sizes() && summed.stride(1) == 1 && summed.scalar_type() == x.scalar_type(),
                "llm_cpu::rms_norm: summed must be like x");
  }
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* rp = has_residual ? residual->data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    T* sp = has_residual ? summed.data_ptr<T>() : nullptr;
    const int64_t sx = x.stride(0), so = out.stride(0);
    const int64_t sr = has_residual ? residual->stride(0) : 0, ss = has_residual ? summed.stride(0) : 0;
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(xp + r * sx, rp ? rp + r * sr : nullptr, wp, n, static_cast<float>(eps), op + r * so,
                     sp ? sp + r * ss : nullptr);
    });
  });
}

// --- Rotary embedding ----------------------------------------------------------------------------

// All heads of one token of x [T, H, D] -> out (contiguous [T, H, D]): the first `half` dims of each
// head x1, the next `half` x2: x1 * cos - x2 * sin, x2 * cos + x1 * sin; dims past 2 * half copied.
template <typename T>
void rotate_token(const T* x, int64_t stride_h, int64_t heads, int64_t head_dim, const float* cos, const float* sin,
                  int64_t half, T* out) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * stride_h;
    T* oh = out + h * head_dim;
    for (int64_t j = 0; j < half; j += kLanes) {
      const int64_t m = std::min(kLanes, half - j);
      const Vec x1 = load(xh + j, m), x2 = load(xh + half + j, m);
      const Vec c = Vec::loadu(cos + j, m), s = Vec::loadu(sin + j, m);
      store(oh + j, x1 * c - x2 * s, m);
      store(oh + half + j, x2 * c + x1 * s, m);
    }
    std::copy(xh + 2 * half, xh + head_dim, oh + 2 * half);
  }
}

void rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cache,
            at::Tensor q_out, at::Tensor k_out) {
  TORCH_CHECK(positions.device().is_cpu() && q.device().is_cpu() && k.device().is_cpu() && cache.device().is_cpu() &&
                  q_out.device().is_cpu() && k_out.device().is_cpu(),
              "llm_cpu::rotary: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.stride(2) == 1 &&
                  k.stride(2) == 1 && k.scalar_type() == q.scalar_type(),
              "llm_cpu::rotary: q and k must be [T, H, D] of one dtype with unit stride along D");
  TORCH_CHECK(q_out.sizes() == q.sizes() && q_out.is_contiguous() && q_out.scalar_type() == q.scalar_type() &&
                  k_out.sizes() == k.sizes() && k_out.is_contiguous() && k_out.scalar_type() == k.scalar_type(),
              "llm_cpu::rotary: outputs must be contiguous and like q and k");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "llm_cpu::rotary: positions must be contiguous int64 [T]");
  TORCH_CHECK(cache.dim() == 2 && cache.scalar_type() == at::kFloat && cache.is_contiguous() &&
                  cache.size(1) % 2 == 0 && cache.size(1) <= q.size(2),
              "llm_cpu::rotary: cache must be contiguous float32 [max_position, rotary_dim <= head_dim]");
  const int64_t tokens = q.size(0), head_dim = q.size(2), half = cache.size(1) / 2, max_position = cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "llm_cpu::rotary: positions[", t, "] = ", pos[t],
                " outside the cache's ", max_position, " positions");
  const float* table = cache.data_ptr<float>();
  dispatch_dtype(q.scalar_type(), "rotary", [&](auto tag) {
    using T = decltype(tag);
    const T* qp = q.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    T* qo = q_out.data_ptr<T>();
    T* ko = k_out.data_ptr<T>();
    const int64_t hq = q.size(1), hk = k.size(1);
    at::parallel_for(0, tokens, grain((hq + hk) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = table + pos[t] * 2 * half;
        rotate_token(qp + t * q.stride(0), q.stride(1), hq, head_dim, cos, cos + half, half, qo + t * hq * head_dim);
        rotate_token(kp + t * k.stride(0), k.stride(1), hk, head_dim, cos, cos + half, half, ko + t * hk * head_dim);
      }
    });
  });
}

// --- Gated activations: act(gate) * up -------------------------------------------------------------
// One body (act_and_mul) for every activation; each activation is a functor over a float32 vector
// whose constants are built once per row, not per vector.

// exp(x) with the bits of Vectorized<float>::exp, i.e. SLEEF's expf_u10 that ATen's vector kernels
// call: x = q ln2 + s (q = rint(x / ln2), ln2 in two parts), a degree-5 polynomial in s, scaled by
// 2^q in two halves; 0 below -104, inf above 100. Inline because the call into libtorch_cpu's copy
// did not scale across threads (64 rows of 1536: 45.6 us on 1 thread and on 2; this version 46 and
// 25). Vectorized<float>::exp itself on the baseline ISA (it is std::exp there).
inline Vec exp_like_aten(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using Int = at::vec::Vectorized<int32_t>;
  // Rounded to nearest, then converted: SLEEF's one rounding conversion.
  const Int q = at::vec::convert_to_int_of_same_size((x * Vec(0x1.715476p+0f)).round());
  const Vec qf = at::vec::convert_to_fp_of_same_size<float>(q);
  Vec s = at::vec::fmadd(qf, Vec(-0x1.62e4p-1f), x);
  s = at::vec::fmadd(qf, Vec(-0x1.7f7d1cp-20f), s);
  Vec u(0x1.a057b4p-13f);
  for (const float c : {0x1.6d2d92p-10f, 0x1.11114cp-7f, 0x1.5554f4p-5f, 0x1.555556p-3f, 0.5f})
    u = at::vec::fmadd(u, s, Vec(c));
  u = Vec(1.f) + at::vec::fmadd(s * s, u, s);
  const Int half = q >> Int(1), bias(127);
  u = u * at::vec::cast<float>((half + bias) << Int(23));
  u = u * at::vec::cast<float>((q - half + bias) << Int(23));
  u = Vec::blendv(u, Vec(0.f), x < Vec(-104.f));
  return Vec::blendv(u, Vec(std::numeric_limits<float>::infinity()), Vec(100.f) < x);
#else
  return x.exp();
#endif
}

// silu(g) = g / (1 + exp(-g)), written as ATen's vectorized silu writes it (the same exp), so the
// result equals F.silu(g) * u bit for bit.
struct Silu {
  static constexpr const char* kOp = "silu_and_mul";
  const Vec one{1.f};
  Vec operator()(const Vec& g) const { return g / (one + exp_like_aten(g.neg())); }
};

// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), written as ATen's vectorized
// GELU (approximate="tanh") writes it: F.gelu(g, approximate="tanh").
struct GeluTanh {
  static constexpr const char* kOp = "gelu_tanh_and_mul";
  const Vec beta{static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)}, kappa{0.044715f}, one{1.f}, half{0.5f};
  Vec operator()(const Vec& g) const {
    const Vec inner = beta * (g + kappa * (g * g * g));
    return half * g * (one + inner.tanh());
  }
};

// One row of x [2 n] (gate, then up) -> out [n]: act(g) * u, float until the store, as the twins.
template <typename Act, typename T>
void act_and_mul_row(const T* x, int64_t n, T* out) {
  // Built per row, as the constants of the per-activation rows were: they fold into read-only data
  // (one functor per task kept them on the stack, and GELU(tanh) measured 10% slower).
  const Act act;
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t m = std::min(kLanes, n - j);
    const Vec g = load(x + j, m), u = load(x + n + j, m);
    store(out + j, act(g) * u, m);
  }
}

// The op Act::kOp: x [rows, 2 I] (unit stride along the row) -> out [rows, I].
template <typename Act>
void act_and_mul(const at::Tensor& x, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "llm_cpu::", Act::kOp, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "llm_cpu::", Act::kOp,
              ": x must be [rows, 2 * I] with unit stride");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2 && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "llm_cpu::", Act::kOp, ": out must be [rows, I] of x's dtype");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  dispatch_dtype(x.scalar_type(), Act::kOp, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t sx = x.stride(0), so = out.stride(0);
    at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) act_and_mul_row<Act>(xp + r * sx, n, op + r * so);
    });
  });
}

}  // namespace

namespace llm_cpu {
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const std::optional<at::Tensor>& residual,
              at::Tensor out, at::Tensor summed) {
  ::rms_norm(x, weight, eps, residual, out, summed);
}
void rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cache,
            at::Tensor q_out, at::Tensor k_out) {
  ::rotary(positions, q, k, cache, q_out, k_out);
}
void silu_and_mul(const at::Tensor& x, at::Tensor out) { ::act_and_mul<Silu>(x, out); }
}  // namespace llm_cpu

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  // Without a residual, `summed` is not touched (pass `out`).
  m.def(
      "rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual, Tensor(a!) out, Tensor(b!) summed) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cache, Tensor(a!) q_out, Tensor(b!) k_out) -> ()");
  m.impl("rotary", c10::DispatchKey::CPU, TORCH_FN(rotary));
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(act_and_mul<Silu>));
  m.def("gelu_tanh_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, TORCH_FN(act_and_mul<GeluTanh>));
}

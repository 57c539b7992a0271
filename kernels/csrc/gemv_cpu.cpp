// Small-M linear on CPU over a weight blocked along its output rows (the "blocked GEMV"): the C++ op
// of kernels/gemv.py (the contract is that module's docstring), a plain streaming read (the bandwidth
// reference of bench/gemv_bandwidth.py) and a view of a oneDNN-packed weight's bytes. Built with the
// other kernels/csrc sources into one library (kernels/cpu_extension.py); registers
// torch.ops.llm_cpu.{blocked_gemv, stream_read, mkldnn_bytes}.
//
// Layout: w [NB, KP, BN, P] in x's dtype, element (b, i, j, q) = W[b BN + j, i P + q], zero past N and
// K: blocks of BN output rows, k-major within a block, P consecutive k innermost. It is the layout
// oneDNN packs inner-product weights in on AVX-512 CPUs (float32: BN 64, P 1; bfloat16: BN 32, P 2),
// so a decode step's GEMV reads the very bytes the prefill GEMM reads (backend_lib/linear.py checks
// them before it uses them); one copy of each weight stays in memory.
//
// Why not oneDNN at small M: its M = 1 calls streamed Llama-3.2-1B's projections at 0.88-0.89
// (float32) and 0.84-0.86 (bfloat16) of a plain read on Intel Sapphire Rapids (1 and 2 threads), with
// ~14 us fixed per call against ~2-4 us here. Here a decode step is one pass over the weight with as
// little around it as possible:
// - Per block, register tiles of MR rows of x by NV vectors of output rows: for each k (pair), one
//   load per vector, x[m, k] broadcast, one FMA (float32), or one vdpbf16ps per vector on
//   AVX512-BF16 (x's bfloat16 pair broadcast as one 32-bit word), or, for bfloat16 without it, the
//   pair widened to two float32 vectors (a shift, an AND) and two FMAs. Lanes are output rows, so
//   there are no horizontal sums.
// - K is cut into chunks only when a block takes several passes (more rows of x than a register tile,
//   or a block wider than its vectors): each pass after the first then finds the chunk in L1.
// - Threads: three quarters of the blocks in one contiguous run per thread, so each thread streams one
//   address range, the rest handed out one at a time (work_split.h); each weight line is also
//   prefetched 4 KiB ahead (kPrefetchBytes), which bfloat16 needed.
//
// One ISA per build (kernels/cpu_extension.py): AVX-512, AVX2 or the baseline; the kernels are
// templates over a vector traits type (Vec512, Vec256) and the build picks one. AVX512-BF16 is
// checked at run time (has_bf16_dot): an AVX-512 build does not imply it.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include "llm_cpu_ops.h"
#include "work_split.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace {

// k steps (pairs for bfloat16) per chunk when a block takes several passes: 128 steps of a 64-row
// float32 block (or a 32-row bfloat16 one) are 32 KiB (16 KiB), within L1 for the passes after the first.
constexpr int64_t kChunkSteps = 128;

// Vectors of output rows per register tile (MR x NV accumulators, at most 16); single output rows on
// the baseline ISA. A one-row tile takes up to the ISA's kOneRowVectors: a whole 64-row block in one
// pass on AVX2 too (8 accumulators), where two passes of 4 vectors each fetched half of every k
// step's 256 bytes, chunk by chunk (Zen 3, one thread, float32 from DRAM: 0.72 of a plain read).
constexpr int kMaxVectors = 4;

// One call's arguments, shared by every block.
struct Gemv {
  const void* w;       // [NB, KP, BN, P]
  int64_t NB, KP, BN, P;
  int64_t M, N;
  const float* xf;     // [M, ldx] float32 x, zero-padded to KP * P (float kernels)
  const uint32_t* xp;  // [M, ldx] bfloat16 pairs of x, zero-padded to KP pairs (vdpbf16ps kernel)
  int64_t ldx;         // row stride of xf (elements) or xp (pairs)
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Bytes ahead of each weight vector that its cache line is prefetched. Measured on Intel Sapphire Rapids,
// one thread, weights from DRAM: bfloat16 0.68 of a plain read without it, 0.90-0.95 at 4-8 KiB
// (1 KiB: 0.77); float32 read at 0.95-1.0 with or without (its four lines per k step keep the
// hardware prefetcher ahead, where bfloat16's two did not).
constexpr int64_t kPrefetchBytes = 4096;

// Whether to prefetch at all: on Intel CPUs only. On AMD Zen 3 (AVX2, float32, one row of x, weights
// from DRAM) the prefetches cost: 0.84 of a plain read with them at 4 KiB (0.74 at 1 KiB, 0.86 at
// 8 KiB), 0.98 without; its hardware prefetchers keep ahead alone.
const bool kSoftwarePrefetch = [] {
  __builtin_cpu_init();  // this runs while the library loads, before the CPU model is otherwise known
  return __builtin_cpu_is("intel") != 0;
}();

// Whether vector v of a register tile starts a cache line (so prefetching from it covers the line's
// other vectors too: two AVX2 vectors share one line).
template <class V>
constexpr bool starts_line(int v) {
  return (v * V::kLanes * 4) % 64 == 0;
}

// The cache line `kPrefetchBytes` past p, into L1. Past the end of a block it is the next block, which
// the same thread reads next; past the last one, a line nobody needs (a prefetch never faults).
__attribute__((always_inline)) inline void prefetch_ahead(const void* p) {
  if (kSoftwarePrefetch) _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

// --- Vector-width traits: what the kernels take from an ISA ----------------------------------------

struct Vec256 {  // AVX2 + FMA
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 2;  // rows of x per register tile (16 registers)
  static constexpr int kOneRowVectors = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static I load_words(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  // The low and high bfloat16 of each 32-bit lane as float32 (exact).
  static F low_bf16(I w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
  static F high_bf16(I w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536))); }
};

#if defined(CPU_CAPABILITY_AVX512)
struct Vec512 {  // AVX-512 F, BW, DQ, VL
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 4;  // 32 registers: up to 4 x 4 accumulators
  static constexpr int kOneRowVectors = 4;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static I load_words(const void* p) { return _mm512_loadu_si512(p); }
  static F low_bf16(I w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
  static F high_bf16(I w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))); }
};
using Simd = Vec512;
#else
using Simd = Vec256;
#endif

// tile[r * ldt + v * kLanes ...] += acc[r][v].
template <class V, int MR, int NV>
__attribute__((always_inline)) inline void add_to_tile(const typename V::F (&acc)[MR][NV], float* tile, int64_t ldt) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      float* t = tile + r * ldt + v * V::kLanes;
      V::store(t, V::add(V::load(t), acc[r][v]));
    }
}

// float32 weights (P = 1): acc[r][v] += w[i, v] * x[r, i] for k steps i0..i1 of one block; `w` points at
// the block's first vector of this register tile, rows of BN floats per k.
template <class V, int MR, int NV>
void tile_f32(const float* w, int64_t BN, int64_t i0, int64_t i1, const float* x, int64_t ldx, float* tile,
              int64_t ldt) {
  using F = typename V::F;
  F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V::zero();
  for (int64_t i = i0; i < i1; ++i) {
    F wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = V::load(w + i * BN + v * V::kLanes);
    for (int v = 0; v < NV; ++v)
      if (starts_line<V>(v)) prefetch_ahead(w + i * BN + v * V::kLanes);
    for (int r = 0; r < MR; ++r) {
      const F xb = V::set1(x[r * ldx + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = V::fmadd(wv[v], xb, acc[r][v]);
    }
  }
  add_to_tile<V, MR, NV>(acc, tile, ldt);
}

// bfloat16 weights (P = 2) widened to float32: each 32-bit lane holds the pair (k = 2 i, 2 i + 1) of
// one output row, made into two float32 vectors (exact) for two FMAs with x's float32 values.
template <class V, int MR, int NV>
void tile_bf16_widen(const c10::BFloat16* w, int64_t BN, int64_t i0, int64_t i1, const float* x, int64_t ldx,
                     float* tile, int64_t ldt) {
  using F = typename V::F;
  F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V::zero();
  for (int64_t i = i0; i < i1; ++i) {
    F lo[NV], hi[NV];
    for (int v = 0; v < NV; ++v) {
      const auto words = V::load_words(w + (i * BN + v * V::kLanes) * 2);
      if (starts_line<V>(v)) prefetch_ahead(w + (i * BN + v * V::kLanes) * 2);
      lo[v] = V::low_bf16(words);
      hi[v] = V::high_bf16(words);
    }
    for (int r = 0; r < MR; ++r) {
      const F x0 = V::set1(x[r * ldx + 2 * i]), x1 = V::set1(x[r * ldx + 2 * i + 1]);
      for (int v = 0; v < NV; ++v) acc[r][v] = V::fmadd(hi[v], x1, V::fmadd(lo[v], x0, acc[r][v]));
    }
  }
  add_to_tile<V, MR, NV>(acc, tile, ldt);
}

#endif

#if defined(CPU_CAPABILITY_AVX512)
bool has_bf16_dot() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
}

// bfloat16 weights on AVX512-BF16: vdpbf16ps adds, per float32 lane (an output row), the two products
// of the lane's weight pair and x's pair (one 32-bit broadcast), exact in float32: one instruction per
// 32 weights and row of x. a[r][v] += that for k step i.
template <int MR, int NV>
__attribute__((target("avx512bf16"), always_inline)) inline void step_bf16_dot(const c10::BFloat16* w, int64_t BN,
                                                                              int64_t i, const uint32_t* x,
                                                                              int64_t ldx, __m512 (&a)[MR][NV]) {
  __m512bh wv[NV];
  for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + (i * BN + v * 16) * 2);
  for (int v = 0; v < NV; ++v) prefetch_ahead(w + (i * BN + v * 16) * 2);
  for (int r = 0; r < MR; ++r) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * ldx + i]));
    for (int v = 0; v < NV; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], wv[v], xb);
  }
}

template <int MR, int NV>
__attribute__((target("avx512bf16"))) void tile_bf16_dot(const c10::BFloat16* w, int64_t BN, int64_t i0, int64_t i1,
                                                         const uint32_t* x, int64_t ldx, float* tile, int64_t ldt) {
  // Two sets of accumulators (even and odd k steps) where the tile has few: vdpbf16ps's latency would
  // otherwise bound a one-row tile's two chains (one row, a 1 MiB weight read from L2: 50 -> 73 GB/s).
  constexpr int S = MR * NV <= 8 ? 2 : 1;
  __m512 acc[S][MR][NV];
  for (int u = 0; u < S; ++u)
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[u][r][v] = _mm512_setzero_ps();
  int64_t i = i0;
  for (; i + S <= i1; i += S) {
    step_bf16_dot<MR, NV>(w, BN, i, x, ldx, acc[0]);
    if constexpr (S == 2) step_bf16_dot<MR, NV>(w, BN, i + 1, x, ldx, acc[S - 1]);
  }
  for (; i < i1; ++i) step_bf16_dot<MR, NV>(w, BN, i, x, ldx, acc[0]);
  if constexpr (S == 2)
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[0][r][v] = _mm512_add_ps(acc[0][r][v], acc[S - 1][r][v]);
  add_to_tile<Vec512, MR, NV>(acc[0], tile, ldt);
}
#endif

enum class Kind { kF32, kBf16Widen, kBf16Dot };

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The register tile of MR rows of x from m0 by NV vectors from v0, over k steps i0..i1 of block b,
// added into tile [M, BN].
template <Kind kind, int MR, int NV>
void tile_at(const Gemv& g, int64_t b, int64_t m0, int64_t v0, int64_t i0, int64_t i1, float* tile) {
  using V = Simd;
  const int64_t col = v0 * V::kLanes, block = b * g.KP * g.BN * g.P;
  float* t = tile + m0 * g.BN + col;
  if constexpr (kind == Kind::kF32) {
    const float* w = static_cast<const float*>(g.w) + block + col;
    tile_f32<V, MR, NV>(w, g.BN, i0, i1, g.xf + m0 * g.ldx, g.ldx, t, g.BN);
  } else if constexpr (kind == Kind::kBf16Widen) {
    const auto* w = static_cast<const c10::BFloat16*>(g.w) + block + col * 2;
    tile_bf16_widen<V, MR, NV>(w, g.BN, i0, i1, g.xf + m0 * g.ldx, g.ldx, t, g.BN);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const auto* w = static_cast<const c10::BFloat16*>(g.w) + block + col * 2;
    tile_bf16_dot<MR, NV>(w, g.BN, i0, i1, g.xp + m0 * g.ldx, g.ldx, t, g.BN);
#endif
  }
}

template <Kind kind, int MR>
void tile_nv(int nv, const Gemv& g, int64_t b, int64_t m0, int64_t v0, int64_t i0, int64_t i1, float* tile) {
  static_assert(kMaxVectors == 4 && Simd::kOneRowVectors <= 8);
  if constexpr (MR == 1 && Simd::kOneRowVectors > kMaxVectors) {
    switch (nv) {
      case 5: return tile_at<kind, MR, 5>(g, b, m0, v0, i0, i1, tile);
      case 6: return tile_at<kind, MR, 6>(g, b, m0, v0, i0, i1, tile);
      case 7: return tile_at<kind, MR, 7>(g, b, m0, v0, i0, i1, tile);
      case 8: return tile_at<kind, MR, 8>(g, b, m0, v0, i0, i1, tile);
      default: break;
    }
  }
  switch (nv) {
    case 1: return tile_at<kind, MR, 1>(g, b, m0, v0, i0, i1, tile);
    case 2: return tile_at<kind, MR, 2>(g, b, m0, v0, i0, i1, tile);
    case 3: return tile_at<kind, MR, 3>(g, b, m0, v0, i0, i1, tile);
    default: return tile_at<kind, MR, 4>(g, b, m0, v0, i0, i1, tile);
  }
}
#endif

// The register tile (mr rows of x from m0, nv vectors from v0) over k steps i0..i1 of block b, into
// tile [M, BN]: the kernel of `kind` instantiated for the one (MR, NV) equal to (mr, nv).
template <Kind kind>
void run_tile(const Gemv& g, int64_t b, int64_t m0, int mr, int64_t v0, int nv, int64_t i0, int64_t i1,
              float* tile) {
#if defined(CPU_CAPABILITY_AVX512)
  switch (mr) {
    case 1: return tile_nv<kind, 1>(nv, g, b, m0, v0, i0, i1, tile);
    case 2: return tile_nv<kind, 2>(nv, g, b, m0, v0, i0, i1, tile);
    case 3: return tile_nv<kind, 3>(nv, g, b, m0, v0, i0, i1, tile);
    default: return tile_nv<kind, 4>(nv, g, b, m0, v0, i0, i1, tile);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (mr == 1) return tile_nv<kind, 1>(nv, g, b, m0, v0, i0, i1, tile);
  return tile_nv<kind, 2>(nv, g, b, m0, v0, i0, i1, tile);
#else
  // Baseline ISA: the same sums one element at a time (x as float32, weights widened).
  for (int64_t m = m0; m < m0 + mr; ++m)
    for (int64_t j = v0; j < v0 + nv; ++j)  // nv counts single output rows here
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t q = 0; q < g.P; ++q) {
          const int64_t at = ((b * g.KP + i) * g.BN + j) * g.P + q;
          const float wv = g.P == 1 ? static_cast<const float*>(g.w)[at]
                                    : static_cast<float>(static_cast<const c10::BFloat16*>(g.w)[at]);
          tile[m * g.BN + j] += wv * g.xf[m * g.ldx + i * g.P + q];
        }
#endif
}

// Sums of block b for every row of x into tile [M, BN] (float32, zeroed here).
template <Kind kind>
void run_block(const Gemv& g, int64_t b, float* tile) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const int64_t vectors = g.BN / Simd::kLanes, max_rows = Simd::kMaxRows;
  const int64_t max_vectors = g.M == 1 ? Simd::kOneRowVectors : kMaxVectors;
#else
  const int64_t vectors = g.BN, max_rows = 1, max_vectors = kMaxVectors;
#endif
  std::fill(tile, tile + g.M * g.BN, 0.f);
  const bool one_pass = g.M <= max_rows && vectors <= max_vectors;
  const int64_t chunk = one_pass ? g.KP : kChunkSteps;
  for (int64_t i0 = 0; i0 < g.KP; i0 += chunk) {
    const int64_t i1 = std::min(g.KP, i0 + chunk);
    for (int64_t m0 = 0; m0 < g.M; m0 += max_rows) {
      const int mr = static_cast<int>(std::min(max_rows, g.M - m0));
      for (int64_t v0 = 0; v0 < vectors; v0 += max_vectors) {
        const int nv = static_cast<int>(std::min<int64_t>(max_vectors, vectors - v0));
        run_tile<kind>(g, b, m0, mr, v0, nv, i0, i1, tile);
      }
    }
  }
}

// out[m, b BN + j] = tile[m, j] (+ bias), rounded to T, for the block's rows below N.
template <typename T>
void store_block(const Gemv& g, int64_t b, const float* tile, const float* bias, T* out) {
  const int64_t n0 = b * g.BN, cols = std::min(g.BN, g.N - n0);
  for (int64_t m = 0; m < g.M; ++m) {
    const float* src = tile + m * g.BN;
    T* dst = out + m * g.N + n0;
    for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<T>(bias ? src[c] + bias[n0 + c] : src[c]);
  }
}

// x as the kernels read it: float32 [M, KP * P] zero-padded (float kernels), or bfloat16 pairs
// [M, KP] (vdpbf16ps). Copied only where x's own rows do not already serve.
at::Tensor prepare_x(const at::Tensor& x, int64_t KP, int64_t P, Kind kind) {
  const int64_t K = x.size(1), padded = KP * P;
  const auto dtype = kind == Kind::kBf16Dot ? at::kBFloat16 : at::kFloat;
  const bool pairs_aligned = x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0;
  if (x.scalar_type() == dtype && K == padded && (kind != Kind::kBf16Dot || pairs_aligned)) return x;
  at::Tensor xs = at::zeros({x.size(0), padded}, x.options().dtype(dtype));
  xs.narrow(1, 0, K).copy_(x);
  return xs;
}

at::Tensor blocked_gemv(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "llm_cpu::blocked_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "llm_cpu::blocked_gemv: x must be float32 or bfloat16 [M, K] with unit stride along K");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "llm_cpu::blocked_gemv: w must be contiguous [NB, KP, BN, P] in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), KP = w.size(1), BN = w.size(2), P = w.size(3);
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(P == (f32 ? 1 : 2), "llm_cpu::blocked_gemv: P must be 1 for float32, 2 for bfloat16, got ", P);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  TORCH_CHECK(BN % Simd::kLanes == 0, "llm_cpu::blocked_gemv: BN must be a multiple of ", Simd::kLanes, ", got ", BN);
#endif
  TORCH_CHECK(KP * P >= K && (KP - 1) * P < K + P * 64, "llm_cpu::blocked_gemv: KP = ", KP, " does not cover K = ", K);
  TORCH_CHECK(n > (NB - 1) * BN && n <= NB * BN, "llm_cpu::blocked_gemv: n = ", n, " does not match ", NB,
              " blocks of ", BN, " rows");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == n, "llm_cpu::blocked_gemv: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;

  Kind kind = f32 ? Kind::kF32 : Kind::kBf16Widen;
#if defined(CPU_CAPABILITY_AVX512)
  if (!f32 && has_bf16_dot()) kind = Kind::kBf16Dot;
#endif
  const at::Tensor xs = prepare_x(x, KP, P, kind);
  Gemv g{w.data_ptr(), NB, KP, BN, P, M, n, nullptr, nullptr, 0};
  if (kind == Kind::kBf16Dot) {
    g.xp = reinterpret_cast<const uint32_t*>(xs.data_ptr<c10::BFloat16>());
    g.ldx = xs.stride(0) / 2;
  } else {
    g.xf = xs.data_ptr<float>();
    g.ldx = xs.stride(0);
  }
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  llm_cpu::for_each_item(
      NB, [&] { return std::vector<float>(M * BN); },
      [&](int64_t b, std::vector<float>& tile) {
        if (kind == Kind::kF32) run_block<Kind::kF32>(g, b, tile.data());
        else if (kind == Kind::kBf16Widen) run_block<Kind::kBf16Widen>(g, b, tile.data());
        else run_block<Kind::kBf16Dot>(g, b, tile.data());
        if (f32) store_block(g, b, tile.data(), bp, out.data_ptr<float>());
        else store_block(g, b, tile.data(), bp, out.data_ptr<c10::BFloat16>());
      });
  return out;
}

// --- The plain read -----------------------------------------------------------------------------------

// The wrapping sum of the 32-bit words in [p, p + bytes), read with the build's widest loads into four
// independent accumulators (so the adds never limit the read); bytes past the last whole word ignored.
uint32_t sum_words(const char* p, int64_t bytes) {
  uint32_t total = 0;
  int64_t at = 0;
#if defined(CPU_CAPABILITY_AVX512)
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (; at + 256 <= bytes; at += 256) {
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_add_epi32(acc[j], _mm512_loadu_si512(p + at + 64 * j));
  }
  total = static_cast<uint32_t>(
      _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3]))));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (; at + 128 <= bytes; at += 128)
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm256_add_epi32(acc[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + at + 32 * j)));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3])));
  for (uint32_t lane : lanes) total += lane;
#endif
  for (; at + 4 <= bytes; at += 4) {
    uint32_t word;
    std::memcpy(&word, p + at, 4);
    total += word;
  }
  return total;
}

// Reads every byte of each tensor once, split evenly over the threads as the GEMV splits its blocks
// (one contiguous run per thread); returns the wrapping sum of their 32-bit words, so nothing is
// skipped. The bandwidth reference: GB/s of a kernel over the same bytes against this.
int64_t stream_read(const std::vector<at::Tensor>& tensors) {
  std::atomic<uint32_t> total{0};
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "llm_cpu::stream_read: contiguous CPU tensors only");
    const char* p = static_cast<const char*>(t.data_ptr());
    const int64_t lines = (t.nbytes() + 63) / 64, bytes = static_cast<int64_t>(t.nbytes());
    at::parallel_for(0, lines, 1, [&](int64_t begin, int64_t end) {
      const int64_t from = begin * 64, to = std::min(end * 64, bytes);
      total.fetch_add(sum_words(p + from, to - from), std::memory_order_relaxed);
    });
  }
  return static_cast<int64_t>(total.load());
}

// A uint8 CPU tensor over the bytes of a oneDNN-packed (mkldnn layout) tensor, holding a reference to
// it; the layout is oneDNN's (kernels/gemv.py checks it before using it).
at::Tensor mkldnn_bytes(const at::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn(), "llm_cpu::mkldnn_bytes: expected an mkldnn tensor");
  static const auto data_ptr =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::data_ptr", "").typed<int64_t(const at::Tensor&)>();
  static const auto nbytes =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_nbytes", "").typed<int64_t(const at::Tensor&)>();
  void* ptr = reinterpret_cast<void*>(data_ptr.call(packed));
  return at::from_blob(
      ptr, {nbytes.call(packed)}, [keep = packed](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

}  // namespace

namespace llm_cpu {
at::Tensor blocked_gemv(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  return ::blocked_gemv(x, w, n, bias);
}
}  // namespace llm_cpu

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  // x [M, K] float32/bfloat16, w [NB, KP, BN, P] in x's dtype -> [M, n] in x's dtype.
  m.def("blocked_gemv(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.impl("blocked_gemv", c10::DispatchKey::CPU, TORCH_FN(blocked_gemv));
  m.def("stream_read(Tensor[] tensors) -> int");
  m.impl("stream_read", c10::DispatchKey::CPU, TORCH_FN(stream_read));
  // A catch-all kernel: the argument is an mkldnn tensor (dispatch key MkldnnCPU).
  m.def("mkldnn_bytes(Tensor packed) -> Tensor", TORCH_FN(mkldnn_bytes));
}

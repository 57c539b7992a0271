// Paged attention on CPU that reads the KV cache in place: the C++ twin of
// kernels/paged_attention.py (the contract is its module docstring). Built by kernels/cpu_extension.py
// (`make setup`), loaded with torch.ops.load_library; registers torch.ops.llm_cpu.paged_attention.
//
// One work item = one query tile (up to block_q consecutive new tokens) of one sequence x a group of
// kv heads (all of them unless the accumulators would outgrow L1, kItemAccFloats). Per kv head, its
// rows are the tile's tokens x the G query heads sharing that kv head (token-major), so each key and
// value row is loaded once per GQA group. The item walks the keys visible to the tile kChunk at a
// time, finding each row through the block table, straight from the cache (any block_size), and
// takes its kv heads in turn on each chunk, so the memory of a chunk's tokens is read in order:
// scores for every row (register tiles of rows x keys; bfloat16 pairs through AVX512-BF16's dot
// product where the CPU has it, qk_bf16), an online softmax in float32 (a row's accumulator
// rescaled on the chunks where its running max moves), then p @ V into a float32 accumulator (with
// AVX512-BF16, p rounded to bfloat16 pairs, pv_bf16); the result is written in q's dtype. Items run
// under at::parallel_for (so torch.set_num_threads holds; built with -fopenmp), longest first, handed
// out dynamically (their costs differ with the context).
//
// 8-bit caches (int8, float8_e4m3fn, with float32 k_scale / v_scale [blocks, block_size, Hkv]; see
// kernels/kv_cache.py): the rows are read in place and converted to float32 in registers
// (load_float); a key's scale multiplies its scores, a value's scale its probabilities before
// p @ V (after the row sums, which stay those of the true probabilities).

// at::vec picks its implementation from these macros (libtorch defines them per build of each
// kernel); derive them from the ISA this file is compiled for (-march, chosen by cpu_extension.py).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include "llm_cpu_ops.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Rows of a tile: enough to amortise each key/value load, few enough that the float32 working set
// (rows x head_dim accumulator + queries) stays in L1.
constexpr int64_t kTileRows = 16;
// Keys per softmax step: the accumulator is rescaled at most once per chunk. Chunks ignore block
// boundaries (each key row is found through its own pointer), so small blocks cost nothing extra.
constexpr int64_t kChunk = 32;
#if defined(CPU_CAPABILITY_AVX512)
// Keys per QK tile and value vectors per PV tile for a group of 4 rows (attend_chunk): with 32
// vector registers the 4 x 4 accumulators fit (QK then reduces them with one shuffle tree, reduce16).
constexpr int kQkKeys = 4;
constexpr int kPvCols = 4;
#else
constexpr int kQkKeys = 2;
constexpr int kPvCols = 2;  // 16 vector registers
#endif

inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}
inline Vec load_float(const c10::Half* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

// 8-bit cache rows to float32 (their scales are applied by the caller): int8 by sign extension,
// float8_e4m3fn through a 256-entry table (gathers with AVX2 / AVX-512).
inline Vec load_float(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float buf[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) buf[i] = static_cast<float>(p[i]);
  return Vec::loadu(buf);
#endif
}

const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> table{};
  for (int i = 0; i < 256; ++i)
    table[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  return table;
}();

inline Vec load_float(const c10::Float8_e4m3fn* p) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(p);
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  return Vec(_mm512_i32gather_ps(index, kFp8Values.data(), 4));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return Vec(_mm256_i32gather_ps(kFp8Values.data(), index, 4));
#else
  float buf[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) buf[i] = kFp8Values[bytes[i]];
  return Vec::loadu(buf);
#endif
}

template <typename cache_t>
constexpr bool kQuantizedCache = std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, c10::Float8_e4m3fn>;

inline float hsum(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, x);
#endif
}

inline float hmax(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(x);
#else
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, x);
#endif
}

// Into L2 only (locality 1): the next chunk's rows (32 keys x kv heads x K and V, ~32 KB in float32)
// would evict the current chunk's from L1 (measured ~1.1x faster at decode than prefetching into L1).
inline void prefetch(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// out[i] = sum of the 8 lanes of a[i]: a transposing add tree, ~1.5 instructions per sum instead of
// ~5 for one reduction at a time.
inline void reduce8_256(const __m256* a, float* out) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                      _mm256_permute2f128_ps(h0123, h4567, 0x31)));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// 16 sums at once: acc[4 * j + r] (key j, row r) -> out[r * stride + j], a shuffle-add tree (each
// step halves the lanes that hold one accumulator) instead of 16 reductions.
template <typename V>  // Vec or __m512
inline void reduce16(const V* acc, float* out, int64_t stride, float scale = 1.f) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = acc[2 * i], y = acc[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)  // 128-bit lane k of b[i]: accumulator 4 * i + k
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_ps(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4 * k + m: accumulator 4 * m + k, i.e. row k, key m.
  const __m512 f = _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_ps(c01, c23, _MM_SHUFFLE(2, 0, 2, 0)),
                                               _mm512_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 1, 3, 1))),
                                 _mm512_set1_ps(scale));
  _mm_storeu_ps(out, _mm512_extractf32x4_ps(f, 0));
  _mm_storeu_ps(out + stride, _mm512_extractf32x4_ps(f, 1));
  _mm_storeu_ps(out + 2 * stride, _mm512_extractf32x4_ps(f, 2));
  _mm_storeu_ps(out + 3 * stride, _mm512_extractf32x4_ps(f, 3));
}

// Query-key scores of bfloat16 rows with AVX512-BF16 (vdpbf16ps: per float32 lane, the two
// products of a pair of bfloat16 elements, exact in float32, added to the accumulator): one
// instruction per 32 dims of a (row, key) pair, against two loads-with-conversion and two FMAs per
// 32 dims otherwise. The queries stay bfloat16 (they are the model's own bfloat16 values), so
// `scale` multiplies the sums instead. Chosen at run time (has_bf16_dot): the library is built
// for AVX-512, which does not imply the BF16 extension.
bool has_bf16_dot() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
}

// scores[r * kChunk + j] = scale * q_r . key_j for NR rows of q (bfloat16, row stride D), NK keys.
// Accumulators key-major (acc[j * NR + r]), the order reduce16 takes. Always inlined: a call per
// tile kept the accumulators in a stack array zeroed on entry (measured 0.86x the float32-FMA path).
template <int NR, int NK>
__attribute__((target("avx512bf16"), always_inline)) inline void qk_tile_bf16(
    const c10::BFloat16* q, int64_t D, const c10::BFloat16* const* keys, float scale, float* scores) {
  __m512 acc[NR * NK];
  for (int i = 0; i < NR * NK; ++i) acc[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m512bh kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(keys[j] + d);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + r * D + d);
      for (int j = 0; j < NK; ++j) acc[j * NR + r] = _mm512_dpbf16_ps(acc[j * NR + r], qv, kv[j]);
    }
  }
  if (d < D) {  // a head_dim tail: masked loads zero the pairs past it
    const __mmask32 mask = (__mmask32(1) << (D - d)) - 1;
    __m512bh kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, keys[j] + d);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + r * D + d);
      for (int j = 0; j < NK; ++j) acc[j * NR + r] = _mm512_dpbf16_ps(acc[j * NR + r], qv, kv[j]);
    }
  }
  if constexpr (NR == 4 && NK == 4) {
    reduce16(acc, scores, kChunk, scale);
  } else {
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NK; ++j) scores[r * kChunk + j] = _mm512_reduce_add_ps(acc[j * NR + r]) * scale;
  }
}

// Every row of a kv head (rows x D bfloat16 queries) against n keys: tiles of 4 rows x 4 keys, then
// smaller ones; the first row group's tiles issue the prefetches of the next chunk's rows.
__attribute__((target("avx512bf16"))) void qk_bf16(const c10::BFloat16* q, int64_t rows, int64_t D,
                                                   const c10::BFloat16* const* keys, int64_t n, float scale,
                                                   float* scores, const c10::BFloat16* const* const* prefetch_rows,
                                                   int64_t next_n) {
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(c10::BFloat16));
  int64_t r = 0;
  for (; r < rows; next_n = 0) {
    const int64_t group = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
    const c10::BFloat16* qr = q + r * D;
    float* sr = scores + r * kChunk;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      for (int64_t i = j; i < std::min(j + 4, next_n); ++i) {
        prefetch(prefetch_rows[0][i], row_bytes);
        prefetch(prefetch_rows[1][i], row_bytes);
      }
      if (group == 4) qk_tile_bf16<4, 4>(qr, D, keys + j, scale, sr + j);
      else if (group == 2) qk_tile_bf16<2, 4>(qr, D, keys + j, scale, sr + j);
      else qk_tile_bf16<1, 4>(qr, D, keys + j, scale, sr + j);
    }
    for (; j < n; ++j) {
      if (group == 4) qk_tile_bf16<4, 1>(qr, D, keys + j, scale, sr + j);
      else if (group == 2) qk_tile_bf16<2, 1>(qr, D, keys + j, scale, sr + j);
      else qk_tile_bf16<1, 1>(qr, D, keys + j, scale, sr + j);
    }
    r += group;
  }
}

// acc += p @ V with AVX512-BF16 for NR rows and NB blocks of 32 dims from d0, p as bfloat16 pairs
// (pairs[r * kChunk + i]: the probabilities of keys 2i and 2i + 1, a 32-bit word). vdpbf16ps wants
// both products of a lane from one pair, so the two keys' value rows are interleaved
// (unpacklo/hi_epi16: lane m of `lo` holds dim 8 (m / 4) + m % 4 of both, of `hi` the 4 dims after);
// the accumulators are permuted into that order on load and back on store (PairLayout).
struct PairLayout {
  int32_t lo[16], hi[16], first[16], second[16];
};
constexpr PairLayout make_pair_layout() {
  PairLayout l{};
  for (int m = 0; m < 16; ++m) {
    l.lo[m] = 8 * (m / 4) + m % 4;  // index into dims [0, 32) = A || B
    l.hi[m] = l.lo[m] + 4;
  }
  for (int t = 0; t < 32; ++t) {  // dim t from lo || hi
    const int w = t % 8, index = w < 4 ? 4 * (t / 8) + w : 16 + 4 * (t / 8) + w - 4;
    (t < 16 ? l.first[t] : l.second[t - 16]) = index;
  }
  return l;
}
alignas(64) constexpr PairLayout kPairLayout = make_pair_layout();

template <int NR, int NB>
__attribute__((target("avx512bf16"), always_inline)) inline void pv_tile_bf16(
    const uint32_t* pairs, const c10::BFloat16* const* values, int64_t n, float* acc, int64_t D, int64_t d0) {
  const __m512i lo_idx = _mm512_load_si512(kPairLayout.lo), hi_idx = _mm512_load_si512(kPairLayout.hi);
  __m512 lo[NR * NB], hi[NR * NB];
  for (int r = 0; r < NR; ++r) {
    for (int b = 0; b < NB; ++b) {
      const float* a = acc + r * D + d0 + 32 * b;
      const __m512 first = _mm512_loadu_ps(a), second = _mm512_loadu_ps(a + 16);
      lo[r * NB + b] = _mm512_permutex2var_ps(first, lo_idx, second);
      hi[r * NB + b] = _mm512_permutex2var_ps(first, hi_idx, second);
    }
  }
  for (int64_t j = 0; j < n; j += 2) {
    const c10::BFloat16* v0 = values[j];
    const c10::BFloat16* v1 = j + 1 < n ? values[j + 1] : v0;  // its p is 0
    __m512i vlo[NB], vhi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i x0 = _mm512_loadu_si512(v0 + d0 + 32 * b), x1 = _mm512_loadu_si512(v1 + d0 + 32 * b);
      vlo[b] = _mm512_unpacklo_epi16(x0, x1);
      vhi[b] = _mm512_unpackhi_epi16(x0, x1);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * kChunk + j / 2]));
      for (int b = 0; b < NB; ++b) {
        lo[r * NB + b] = _mm512_dpbf16_ps(lo[r * NB + b], pr, (__m512bh)vlo[b]);
        hi[r * NB + b] = _mm512_dpbf16_ps(hi[r * NB + b], pr, (__m512bh)vhi[b]);
      }
    }
  }
  const __m512i first_idx = _mm512_load_si512(kPairLayout.first);
  const __m512i second_idx = _mm512_load_si512(kPairLayout.second);
  for (int r = 0; r < NR; ++r) {
    for (int b = 0; b < NB; ++b) {
      float* a = acc + r * D + d0 + 32 * b;
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo[r * NB + b], first_idx, hi[r * NB + b]));
      _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo[r * NB + b], second_idx, hi[r * NB + b]));
    }
  }
}

template <int NR>
__attribute__((target("avx512bf16"), always_inline)) inline void pv_rows_bf16(
    const uint32_t* pairs, const c10::BFloat16* const* values, int64_t n, float* acc, int64_t D, int64_t dims) {
  int64_t d = 0;
  for (; d + 64 <= dims; d += 64) pv_tile_bf16<NR, 2>(pairs, values, n, acc, D, d);
  if (d < dims) pv_tile_bf16<NR, 1>(pairs, values, n, acc, D, d);
}

// acc += p @ V over dims [0, dims) (a multiple of 32) of every row: p (rows x kChunk float32, the
// chunk's probabilities, n keys) rounded to bfloat16 pairs in place first, as the GPU kernels round
// P before their P @ V (the normaliser keeps the float32 sums). An odd n pads with a key of p = 0.
static_assert(kChunk == 32, "pv_bf16 converts a row of kChunk probabilities in one step");
__attribute__((target("avx512bf16"))) void pv_bf16(float* p, const c10::BFloat16* const* values, int64_t n,
                                                   float* acc, int64_t rows, int64_t D, int64_t dims) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = p + r * kChunk;
    if (n & 1) row[n] = 0.f;
    const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
    _mm512_storeu_si512(row, (__m512i)packed);
  }
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(p);
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows_bf16<4>(pairs + r * kChunk, values, n, acc + r * D, D, dims);
  for (; r + 2 <= rows; r += 2) pv_rows_bf16<2>(pairs + r * kChunk, values, n, acc + r * D, D, dims);
  for (; r < rows; ++r) pv_rows_bf16<1>(pairs + r * kChunk, values, n, acc + r * D, D, dims);
}
#endif

// out[i] = sum of the lanes of acc[i], i < 8.
inline void reduce8(const Vec* acc, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256 halves[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = acc[i];
    halves[i] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  }
  reduce8_256(halves, out);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = acc[i];
  reduce8_256(lanes, out);
#else
  for (int i = 0; i < 8; ++i) out[i] = hsum(acc[i]);
#endif
}

struct Item {
  int32_t seq;
  int32_t tile;
  int32_t kv_head;  // the first of the item's kv heads
  int32_t kv_heads;
  int64_t cost;
};

// Float32 accumulator elements per item (rows x head_dim x kv heads): the kv heads of one token lie
// side by side in the cache, so an item walking all of them streams each block's memory in order
// (one kv head alone reads every other 256-byte stretch of it, ~1.5x slower at decode); capped so
// that the accumulators stay within L1.
constexpr int64_t kItemAccFloats = 4096;

// scalar_t: q's and out's dtype; cache_t: the cache's (scalar_t, or an 8-bit one with scales).
template <typename scalar_t, typename cache_t = scalar_t>
struct PagedAttention {
  static constexpr bool kQuantized = kQuantizedCache<cache_t>;
  const scalar_t* q;
  int64_t q_stride_t, q_stride_h;
  const cache_t* k;
  int64_t k_stride_block, k_stride_token, k_stride_head;
  const cache_t* v;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  scalar_t* out;
  int64_t out_stride_t, out_stride_h;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t table_stride;
  int64_t groups, head_dim, block_size, block_q, window, heads_per_item;
  float scale;
  // Gemma's attention logit soft-capping, scores -> tanh(scores / softcap) * softcap; <= 0: none.
  float softcap;
  // Scores through qk_bf16 (bfloat16 on a CPU with AVX512-BF16): queries kept as bfloat16 in q_raw.
  bool bf16_dot;
  // An 8-bit cache's float32 scales (null otherwise): [block][token][kv head] by these strides.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_stride_block = 0, scale_stride_token = 0, scale_stride_head = 0;

  // Scratch of one thread, sized for the largest item. Per-head arrays are head-major.
  struct Scratch {
    std::vector<float> q, acc, scores, max, sum, new_max;
    std::vector<scalar_t> q_raw;
    // This chunk's and the next one's key / value rows: [kv head][kChunk] each.
    std::vector<const cache_t*> keys[2], values[2];
    // An 8-bit cache's scales of those rows, same layout.
    std::vector<float> key_scales[2], value_scales[2];
    explicit Scratch(const PagedAttention& a) {
      const int64_t rows = a.block_q * a.groups * a.heads_per_item;
      if (a.bf16_dot) q_raw.resize(rows * a.head_dim);
      else q.resize(rows * a.head_dim);
      acc.resize(rows * a.head_dim);
      scores.resize(a.block_q * a.groups * kChunk);
      new_max.resize(a.block_q * a.groups);
      max.resize(rows);
      sum.resize(rows);
      for (int c = 0; c < 2; ++c) {
        keys[c].resize(a.heads_per_item * kChunk);
        values[c].resize(a.heads_per_item * kChunk);
        if (kQuantized) {
          key_scales[c].resize(a.heads_per_item * kChunk);
          value_scales[c].resize(a.heads_per_item * kChunk);
        }
      }
    }
  };

  // scores[r * kChunk + j] = q_r . key_j for NR rows of qf (float, row stride head_dim) and NK keys:
  // NR x NK vector accumulators, so each key load serves NR rows and each query load NK keys.
  template <int NR, int NK>
  inline void qk_tile(const float* qf, const cache_t* const* keys, float* scores) const {
    Vec acc[NR * NK];
    for (int i = 0; i < NR * NK; ++i) acc[i] = Vec(0.f);
    int64_t d = 0;
    for (; d + kLanes <= head_dim; d += kLanes) {
      Vec kv[NK];
      for (int j = 0; j < NK; ++j) kv[j] = load_float(keys[j] + d);
      for (int r = 0; r < NR; ++r) {
        const Vec qv = Vec::loadu(qf + r * head_dim + d);
        for (int j = 0; j < NK; ++j) acc[r * NK + j] = at::vec::fmadd(qv, kv[j], acc[r * NK + j]);
      }
    }
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (NR == 4 && NK == 4) {
      if (d == head_dim) {
        Vec by_key[16];  // reduce16 takes key-major accumulators
        for (int r = 0; r < 4; ++r)
          for (int j = 0; j < 4; ++j) by_key[4 * j + r] = acc[r * 4 + j];
        reduce16(by_key, scores, kChunk);
        return;
      }
    }
#endif
    float sums[NR * NK];
    if constexpr (NR * NK == 8) {
      reduce8(acc, sums);
    } else {
      for (int i = 0; i < NR * NK; ++i) sums[i] = hsum(acc[i]);
    }
    if (d == head_dim) {  // every head_dim of the models here: no scalar tail
      for (int r = 0; r < NR; ++r)
        for (int j = 0; j < NK; ++j) scores[r * kChunk + j] = sums[r * NK + j];
      return;
    }
    for (int r = 0; r < NR; ++r) {
      for (int j = 0; j < NK; ++j) {
        float s = sums[r * NK + j];
        for (int64_t e = d; e < head_dim; ++e) s += qf[r * head_dim + e] * static_cast<float>(keys[j][e]);
        scores[r * kChunk + j] = s;
      }
    }
  }

  // Rows [r, r + NR) against n keys: NK at a time, then one by one. Meanwhile the rows in
  // `prefetch_rows` (next_n pairs of key and value rows, the next chunk's) are fetched.
  template <int NR, int NK>
  inline void qk_rows(const float* qf, const cache_t* const* keys, int64_t n, float* scores,
                      const cache_t* const* const* prefetch_rows, int64_t next_n) const {
    const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
    int64_t j = 0;
    for (; j + NK <= n; j += NK) {
      // Spread over the tiles: a burst of prefetches would stall on the memory system at once.
      for (int64_t i = j; i < std::min(j + NK, next_n); ++i) {
        prefetch(prefetch_rows[0][i], row_bytes);
        prefetch(prefetch_rows[1][i], row_bytes);
      }
      qk_tile<NR, NK>(qf, keys + j, scores + j);
    }
    for (; j < n; ++j) qk_tile<NR, 1>(qf, keys + j, scores + j);
  }

  // acc[r] += sum_j p[r][j] * value_j over n values, for NR rows and NC vectors of dims from d0.
  template <int NR, int NC>
  inline void pv_tile(const float* p, const cache_t* const* values, int64_t n, float* acc, int64_t d0) const {
    Vec sums[NR * NC];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) sums[r * NC + c] = Vec::loadu(acc + r * head_dim + d0 + c * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      Vec vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load_float(values[j] + d0 + c * kLanes);
      for (int r = 0; r < NR; ++r) {
        const Vec pr(p[r * kChunk + j]);
        for (int c = 0; c < NC; ++c) sums[r * NC + c] = at::vec::fmadd(pr, vv[c], sums[r * NC + c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) sums[r * NC + c].store(acc + r * head_dim + d0 + c * kLanes);
  }

  // Rows [r, r + NR) over dims [d, head_dim): NC vectors at a time, then one, then scalar.
  template <int NR, int NC>
  inline void pv_rows(const float* p, const cache_t* const* values, int64_t n, float* acc, int64_t d) const {
    for (; d + NC * kLanes <= head_dim; d += NC * kLanes) pv_tile<NR, NC>(p, values, n, acc, d);
    for (; d + kLanes <= head_dim; d += kLanes) pv_tile<NR, 1>(p, values, n, acc, d);
    for (; d < head_dim; ++d) {
      for (int r = 0; r < NR; ++r) {
        float a = acc[r * head_dim + d];
        for (int64_t j = 0; j < n; ++j) a += p[r * kChunk + j] * static_cast<float>(values[j][d]);
        acc[r * head_dim + d] = a;
      }
    }
  }

  // Key / value rows of keys [c0, c0 + n) of kv heads [kv_head, kv_head + heads) of the sequence
  // whose block table row is `table`: keys[h * kChunk + j] for head kv_head + h (and for an
  // 8-bit cache their scales, key_scales / value_scales alike).
  inline void locate(const int32_t* table, int64_t kv_head, int64_t heads, int64_t c0, int64_t n,
                     const cache_t** keys, const cache_t** values, float* key_scales = nullptr,
                     float* value_scales = nullptr) const {
    // Walks the blocks: one division per chunk, not one per key.
    int64_t index = c0 / block_size, offset = c0 - index * block_size;
    const cache_t* key = k + table[index] * k_stride_block + offset * k_stride_token + kv_head * k_stride_head;
    const cache_t* value = v + table[index] * v_stride_block + offset * v_stride_token + kv_head * v_stride_head;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < heads; ++h) {
        keys[h * kChunk + j] = key + h * k_stride_head;
        values[h * kChunk + j] = value + h * v_stride_head;
      }
      if constexpr (kQuantized) {
        const int64_t at = table[index] * scale_stride_block + offset * scale_stride_token + kv_head * scale_stride_head;
        for (int64_t h = 0; h < heads; ++h) {
          key_scales[h * kChunk + j] = k_scale[at + h * scale_stride_head];
          value_scales[h * kChunk + j] = v_scale[at + h * scale_stride_head];
        }
      }
      if (++offset == block_size && j + 1 < n) {
        offset = 0;
        ++index;
        key = k + table[index] * k_stride_block + kv_head * k_stride_head;
        value = v + table[index] * v_stride_block + kv_head * v_stride_head;
      } else {
        key += k_stride_token;
        value += v_stride_token;
      }
    }
  }

  void run(const Item& item, Scratch& s) const {
    const int64_t seq = item.seq, kv_head0 = item.kv_head, heads = item.kv_heads;
    const int64_t q_start = query_start_loc[seq];
    const int64_t q_len = query_start_loc[seq + 1] - q_start;
    const int64_t first_pos = seq_lens[seq] - q_len;  // position of the first new token
    const int64_t t0 = item.tile * block_q;
    const int64_t tokens = std::min(block_q, q_len - t0);
    const int64_t rows = tokens * groups;  // per kv head
    const int64_t D = head_dim;

    // Keys visible to any row of the tile.
    const int64_t kv_end = first_pos + t0 + tokens;
    const int64_t kv_begin = window > 0 ? std::max<int64_t>(first_pos + t0 - window + 1, 0) : 0;
    const int32_t* table = tables + seq * table_stride;
    locate(table, kv_head0, heads, kv_begin, std::min(kChunk, kv_end - kv_begin), s.keys[0].data(),
           s.values[0].data(), s.key_scales[0].data(), s.value_scales[0].data());

    // Queries as float32, pre-scaled; row h * rows + r = token r / G, head (kv_head0 + h) * G + r % G.
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* src = q + (q_start + t0 + r / groups) * q_stride_t +
                              ((kv_head0 + h) * groups + r % groups) * q_stride_h;
        if (bf16_dot) {
          std::copy_n(src, D, &s.q_raw[(h * rows + r) * D]);
          continue;
        }
        float* dst = &s.q[(h * rows + r) * D];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * scale;
      }
    }
    std::fill_n(s.acc.begin(), heads * rows * D, 0.f);
    std::fill_n(s.max.begin(), heads * rows, -std::numeric_limits<float>::infinity());
    std::fill_n(s.sum.begin(), heads * rows, 0.f);

    for (int64_t c0 = kv_begin, chunk = 0; c0 < kv_end; c0 += kChunk, chunk ^= 1) {
      const int64_t n = std::min(kChunk, kv_end - c0);
      // A context's blocks lie anywhere in the pool, so the hardware prefetcher restarts at each
      // one and loads stall on memory: fetch the next chunk's rows while this one computes.
      // (The first row group's QK loop of each head issues that head's prefetches.)
      const int64_t next_n = std::max<int64_t>(0, std::min(kChunk, kv_end - c0 - n));
      if (next_n > 0)
        locate(table, kv_head0, heads, c0 + n, next_n, s.keys[chunk ^ 1].data(), s.values[chunk ^ 1].data(),
               s.key_scales[chunk ^ 1].data(), s.value_scales[chunk ^ 1].data());
      for (int64_t h = 0; h < heads; ++h) {
        const cache_t* const* next_rows[2] = {&s.keys[chunk ^ 1][h * kChunk], &s.values[chunk ^ 1][h * kChunk]};
        const float* scales[2] = {nullptr, nullptr};
        if (kQuantized) scales[0] = &s.key_scales[chunk][h * kChunk], scales[1] = &s.value_scales[chunk][h * kChunk];
        attend_chunk(&s.keys[chunk][h * kChunk], &s.values[chunk][h * kChunk], n, c0, next_rows, next_n,
                     first_pos + t0, rows, h, s, scales);
      }
    }

    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* dst = out + (q_start + t0 + r / groups) * out_stride_t +
                        ((kv_head0 + h) * groups + r % groups) * out_stride_h;
        // Every row sees at least its own key, so sum > 0; the guard only keeps a bad input finite.
        const float sum = s.sum[h * rows + r], inv = sum > 0.f ? 1.f / sum : 0.f;
        const float* acc = &s.acc[(h * rows + r) * D];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
      }
    }
  }

  // scores -> tanh(scores / softcap) * softcap over the n keys of every row (before any masking).
  void cap_scores(float* scores, int64_t rows, int64_t n) const {
    const Vec cap(softcap), inv_cap(1.f / softcap);
    for (int64_t r = 0; r < rows; ++r) {
      float* p = scores + r * kChunk;
      for (int64_t j = 0; j < n; j += kLanes) {
        const int64_t m = std::min(kLanes, n - j);
        ((Vec::loadu(p + j, m) * inv_cap).tanh() * cap).store(p + j, m);
      }
    }
  }

  // The keys [c0 + lo, c0 + hi) of a chunk [c0, c0 + n) that the token at `pos` sees (causal, window);
  // lo >= hi: none.
  std::pair<int64_t, int64_t> visible(int64_t pos, int64_t c0, int64_t n) const {
    const int64_t lo = (window > 0 ? std::max(c0, pos - window + 1) : c0) - c0;
    return {lo, std::min(c0 + n, pos + 1) - c0};
  }

  // The rows of kv head h of the item (row r: the token at position row_pos0 + r / G) against keys
  // [c0, c0 + n): scores, the online-softmax update of max / sum / acc, then acc += p @ V.
  // `scales`: an 8-bit cache's key and value scales of the chunk's keys (nulls otherwise).
  void attend_chunk(const cache_t* const* keys, const cache_t* const* values, int64_t n, int64_t c0,
                    const cache_t* const* const* next_rows, int64_t next_n, int64_t row_pos0, int64_t rows,
                    int64_t h, Scratch& s, const float* const* scales) const {
    const int64_t D = head_dim;
    const float* qf = bf16_dot ? nullptr : &s.q[h * rows * D];
    float* acc = &s.acc[h * rows * D];
    float* row_max = &s.max[h * rows];
    float* row_sum = &s.sum[h * rows];
    float* new_max = s.new_max.data();
    float* scores = s.scores.data();
    // scores[r * kChunk + j]: row r against key c0 + j; 8 (16 with AVX-512) accumulators per tile.
    int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
      if (bf16_dot) {
        qk_bf16(&s.q_raw[h * rows * D], rows, D, keys, n, scale, scores, next_rows, next_n);
        r = rows;
      }
    }
#endif
    for (; r + 4 <= rows; r += 4, next_n = 0) qk_rows<4, kQkKeys>(qf + r * D, keys, n, scores + r * kChunk, next_rows, next_n);
    for (; r + 2 <= rows; r += 2, next_n = 0) qk_rows<2, 4>(qf + r * D, keys, n, scores + r * kChunk, next_rows, next_n);
    for (; r < rows; ++r, next_n = 0) qk_rows<1, 8>(qf + r * D, keys, n, scores + r * kChunk, next_rows, next_n);
    if constexpr (kQuantized) {  // each key's scale (q was pre-scaled by the softmax scale)
      for (r = 0; r < rows; ++r) {
        float* p = scores + r * kChunk;
        for (int64_t j = 0; j < n; ++j) p[j] *= scales[0][j];
      }
    }
    if (softcap > 0.f) cap_scores(scores, rows, n);

    // Online softmax, per row over the keys it sees in this chunk: a contiguous range [lo, hi)
    // (causal and window bounds), so masked keys never enter exp and get p = 0. Two passes over the
    // rows (the new maxima, then exponentials and sums): one row's max -> exp -> sum chain is long,
    // and rows overlap better apart (~5% of a prefill chunk). Ragged ends (the causal diagonal, a
    // context's last chunk) take one masked step.
    const Vec lowest(-std::numeric_limits<float>::infinity());
    for (r = 0; r < rows; ++r) {
      const float* p = scores + r * kChunk;
      const auto [lo, hi] = visible(row_pos0 + r / groups, c0, n);
      Vec chunk_max = lowest;  // a vector max: a scalar chain costs its latency per key
      int64_t j = lo;
      for (; j + kLanes <= hi; j += kLanes) chunk_max = at::vec::maximum(chunk_max, Vec::loadu(p + j));
      if (j < hi) chunk_max = at::vec::maximum(chunk_max, Vec::set(lowest, Vec::loadu(p + j, hi - j), hi - j));
      new_max[r] = std::max(row_max[r], hmax(chunk_max));
    }
    for (r = 0; r < rows; ++r) {
      float* p = scores + r * kChunk;
      const auto [lo, hi] = visible(row_pos0 + r / groups, c0, n);
      if (lo >= hi) {
        std::fill_n(p, n, 0.f);
        continue;
      }
      const Vec m(new_max[r]);
      Vec total(0.f);
      int64_t j = lo;
      for (; j + kLanes <= hi; j += kLanes) {
        const Vec e = (Vec::loadu(p + j) - m).exp_u20();
        e.store(p + j);
        total = total + e;
      }
      if (j < hi) {
        const Vec e = Vec::set(Vec(0.f), (Vec::loadu(p + j, hi - j) - m).exp_u20(), hi - j);
        e.store(p + j, hi - j);
        total = total + e;
      }
      std::fill(p, p + lo, 0.f);
      std::fill(p + hi, p + n, 0.f);
      // The running max moved: rescale what was summed under the old one (0 on the row's first keys,
      // max = -inf). Unchanged, as on most chunks past the first, there is nothing to do.
      if (new_max[r] > row_max[r]) {
        const float alpha = std::exp(row_max[r] - new_max[r]);
        row_sum[r] *= alpha;
        float* a = acc + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        row_max[r] = new_max[r];
      }
      row_sum[r] += hsum(total);
    }

    if constexpr (kQuantized) {  // each value's scale, into the probabilities (the sums are taken)
      for (r = 0; r < rows; ++r) {
        float* p = scores + r * kChunk;
        for (int64_t j = 0; j < n; ++j) p[j] *= scales[1][j];
      }
    }
    // acc += p @ V; 8 accumulators per tile. With bf16_dot, the dims past the last block of 32 here
    // (p still float32), then the blocks through pv_bf16.
    int64_t dot_dims = 0;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
      if (bf16_dot) dot_dims = D - D % 32;
    }
#endif
    for (r = 0; r + 4 <= rows; r += 4) pv_rows<4, kPvCols>(scores + r * kChunk, values, n, acc + r * D, dot_dims);
    for (; r + 2 <= rows; r += 2) pv_rows<2, 4>(scores + r * kChunk, values, n, acc + r * D, dot_dims);
    for (; r < rows; ++r) pv_rows<1, 8>(scores + r * kChunk, values, n, acc + r * D, dot_dims);
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
      if (dot_dims > 0) pv_bf16(scores, values, n, acc, rows, D, dot_dims);
    }
#endif
  }
};

template <typename scalar_t, typename cache_t>
bool bf16_dot_usable() {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>)
    return has_bf16_dot();
#endif
  return false;
}

// Checks the inputs against the contract, builds the work items (tiles of the sequences `seqs`)
// and runs them.
template <typename scalar_t, typename cache_t = scalar_t>
void run_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, double scale, int64_t sliding_window,
                         const at::Tensor& seqs, at::Tensor& out, double softcap,
                         const std::optional<at::Tensor>& k_scale = std::nullopt,
                         const std::optional<at::Tensor>& v_scale = std::nullopt) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t groups = num_heads / num_kv_heads;
  const int64_t block_q = std::max<int64_t>(1, kTileRows / groups);
  const int64_t heads_per_item =
      std::clamp<int64_t>(kItemAccFloats / (block_q * groups * head_dim), 1, num_kv_heads);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_width = block_tables.size(1);

  std::vector<Item> items;
  const int32_t* selected = seqs.data_ptr<int32_t>();
  for (int64_t i = 0; i < seqs.size(0); ++i) {
    const int64_t b = selected[i];
    TORCH_CHECK(b >= 0 && b < num_seqs, "seqs[", i, "] = ", b, " out of range");
    const int64_t q_len = starts[b + 1] - starts[b];
    const int64_t context = lens[b];
    TORCH_CHECK(q_len >= 0 && starts[b] >= 0 && starts[b + 1] <= q.size(0),
                "query_start_loc is not a valid row split of q");
    if (q_len == 0) continue;
    TORCH_CHECK(context >= q_len, "seq_lens[", b, "] = ", context, " < its ", q_len, " new tokens");
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(context - q_len - sliding_window + 1, 0) : 0;
    const int64_t last = (context + block_size - 1) / block_size;  // blocks [first / bs, last) are read
    TORCH_CHECK(last <= table_width, "block_tables too narrow for seq_lens[", b, "] = ", context);
    for (int64_t j = first / block_size; j < last; ++j) {
      const int32_t id = tables[b * table_width + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id, " out of range");
    }
    for (int64_t tile = 0; tile * block_q < q_len; ++tile) {
      const int64_t tokens = std::min(block_q, q_len - tile * block_q);
      const int64_t keys = context - q_len + tile * block_q + tokens;  // before the window
      const int64_t visible = sliding_window > 0 ? std::min(keys, sliding_window + tokens) : keys;
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item) {
        const int64_t heads = std::min(heads_per_item, num_kv_heads - h);
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(tile), static_cast<int32_t>(h),
                         static_cast<int32_t>(heads), tokens * visible * heads});
      }
    }
  }
  // Longest first, then handed out one by one: a thread that drew short items takes more.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  PagedAttention<scalar_t, cache_t> attention{
      q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
      static_cast<const cache_t*>(k_cache.data_ptr()), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
      static_cast<const cache_t*>(v_cache.data_ptr()), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
      out.data_ptr<scalar_t>(), out.stride(0), out.stride(1),
      starts, lens, tables, table_width,
      groups, head_dim, block_size, block_q, sliding_window, heads_per_item, static_cast<float>(scale),
      static_cast<float>(softcap), bf16_dot_usable<scalar_t, cache_t>()};
  if constexpr (kQuantizedCache<cache_t>) {
    attention.k_scale = k_scale->data_ptr<float>();
    attention.v_scale = v_scale->data_ptr<float>();
    attention.scale_stride_block = k_scale->stride(0);
    attention.scale_stride_token = k_scale->stride(1);
    attention.scale_stride_head = k_scale->stride(2);
  }

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    typename PagedAttention<scalar_t, cache_t>::Scratch scratch(attention);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) attention.run(items[i], scratch);
    }
  });
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, int64_t sliding_window,
                     const at::Tensor& seqs, at::Tensor out, double softcap,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  out.device().is_cpu() && query_start_loc.device().is_cpu() &&
                  seq_lens.device().is_cpu() && block_tables.device().is_cpu() && seqs.device().is_cpu(),
              "llm_cpu::paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, Hq, D] alike");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k/v cache must be [blocks, block_size, Hkv, D] alike");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head_dim or GQA group mismatch");
  const auto cache_type = k_cache.scalar_type();
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == cache_type && out.scalar_type() == q.scalar_type() &&
                  (quantized || cache_type == q.scalar_type()),
              "q and out must share a dtype, and the caches it (or be int8 / float8_e4m3fn ones alike)");
  TORCH_CHECK(quantized == k_scale.has_value() && quantized == v_scale.has_value(),
              "llm_cpu::paged_attention: k_scale and v_scale go with an int8 / float8_e4m3fn cache, and only there");
  if (quantized) {
    const auto blocks = k_cache.size(0), block_size = k_cache.size(1), heads = k_cache.size(2);
    for (const at::Tensor* scales : {&*k_scale, &*v_scale})
      TORCH_CHECK(scales->device().is_cpu() && scales->scalar_type() == at::kFloat && scales->dim() == 3 &&
                      scales->size(0) == blocks && scales->size(1) == block_size && scales->size(2) == heads,
                  "llm_cpu::paged_attention: k_scale, v_scale must be float32 [blocks, block_size, Hkv]");
    TORCH_CHECK(k_scale->strides() == v_scale->strides(), "k_scale and v_scale must share strides");
  }
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must have unit stride");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && seqs.scalar_type() == at::kInt,
              "metadata must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.is_contiguous() &&
                  seqs.is_contiguous() && seqs.dim() == 1 && block_tables.dim() == 2 &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "metadata must be contiguous [B+1], [B], [B, max_blocks]");
  if (quantized) {
    // q's dtype x the cache's: the float32 work is the same, only the row loads differ.
    const auto run = [&](auto q_tag) {
      using scalar_t = decltype(q_tag);
      if (cache_type == at::kChar)
        return run_paged_attention<scalar_t, int8_t>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                     scale, sliding_window, seqs, out, softcap, k_scale, v_scale);
      return run_paged_attention<scalar_t, c10::Float8_e4m3fn>(q, k_cache, v_cache, query_start_loc, seq_lens,
                                                               block_tables, scale, sliding_window, seqs, out,
                                                               softcap, k_scale, v_scale);
    };
    switch (q.scalar_type()) {
      case at::kFloat:
        return run(float{});
      case at::kBFloat16:
        return run(c10::BFloat16{});
      case at::kHalf:
        return run(c10::Half{});
      default:
        TORCH_CHECK(false, "llm_cpu::paged_attention: unsupported dtype ", q.scalar_type());
    }
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      return run_paged_attention<float>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                        sliding_window, seqs, out, softcap);
    case at::kBFloat16:
      return run_paged_attention<c10::BFloat16>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                scale, sliding_window, seqs, out, softcap);
    case at::kHalf:
      return run_paged_attention<c10::Half>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                            sliding_window, seqs, out, softcap);
    default:
      TORCH_CHECK(false, "llm_cpu::paged_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

namespace llm_cpu {
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, int64_t sliding_window, const at::Tensor& seqs, at::Tensor out, double softcap,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  ::paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, seqs, out,
                    softcap, k_scale, v_scale);
}
}  // namespace llm_cpu

TORCH_LIBRARY(llm_cpu, m) {
  // sliding_window <= 0: none; softcap <= 0: none; k_scale, v_scale: an int8 / float8_e4m3fn cache's scales. Only the sequences listed in `seqs` (int32 indices) are attended;
  // the other rows of `out` are left untouched (the caller runs them through SDPA).
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, float scale, int sliding_window, Tensor seqs, Tensor(a!) out, float softcap=0.0, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}

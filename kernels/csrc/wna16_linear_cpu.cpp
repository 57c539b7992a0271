// Weight-only 4/8-bit integer linear ("WNA16") on CPU: the C++ fast path of kernels/wna16_linear.py
// (the contract is that module's docstring), on the layout prepare_wna16_cpu repacks once at load.
// Built with the other kernels/csrc sources into one library (kernels/cpu_extension.py); registers
// torch.ops.llm_cpu.wna16_linear.
//
// Packed layout (prepare_wna16_cpu): the output rows in tiles of 16; packed[t, i, l] (int32
// [T, K / E, 16], E = 32 / bits values per word) is word i of row 16 t + l of the checkpoint's
// qweight (4-bit: its nibbles reordered, slot_k), so one 512-bit load holds E consecutive k of 16
// output rows, and each value goes to its own lane with one shift. scales: float32 [T, G, 16] (G
// groups along K), or float16 where every scale is one exactly (GGUF's Q4_0 and Q8_0 store theirs in
// float16): 2 bytes a group and row instead of 4. zeros: float32 [T, G, 16], or one float32 (0-dim)
// when every group has the same zero point (symmetric weights): none stored. At 4 bits in groups of
// 32 the compact form reads 18 bytes per 32 weights instead of 24, as GGUF's Q4_0 does. Rows past N
// (the last tile's padding) have zero words, scale and zero point.
//
// Decode (M < gemm_min_rows): for each k, the vector of values u of 16 output rows is made into the
// floats f = 1 + u / 2^bits (the value shifted into the top of the mantissa and 1.0's exponent OR-ed
// in: a shift and a vpternlogd, where converting an integer would take a third op) and multiplied by
// x[m, k] (broadcast) into a float32 accumulator. Since x . f = xsum + (x . u) / 2^bits, with xsum the
// sum of x over the same k, each group (or chunk of a long group) adds s * (2^bits (acc - xsum) -
// z xsum) = s * (x . (u - z)) to the output: the scale and zero point cost a few ops per group, not
// per weight. With bfloat16 x, 4-bit weights and AVX512-BF16, pairs of f are made as bfloat16 and
// multiplied by pairs of x with vdpbf16ps, 32 products per instruction (micro_tile_bf16). With
// dynamic_int8 (4-bit weights, AVX512-VNNI or AVX2), x is quantized to int8 per row and chunk at the
// call and vpdpbusd (AVX2: vpmaddubsw and vpmaddwd) multiplies the weights' unsigned nibbles by it,
// exact in int32 (micro_tile_int8: 1.3-1.6x the bfloat16 path at 1-16 rows on AMD EPYC with
// AVX-512). Register tiles of up to 4 rows of x by up to 64 output rows (AVX-512; AVX2 half as
// many), so each unpacked weight vector feeds up to 4 FMAs; work items of 64 output rows shared among the threads as work_split.h says. Every tile's
// words, and its scales and zero points, are prefetched ahead of use (Prefetcher): the unpacking
// keeps a core busy (bfloat16 path, M = 1: ~20 GB/s of weights from cache on Intel Sapphire Rapids,
// where vdpbf16ps issues once every two cycles), so without it the reads from memory stalled the
// arithmetic instead of overlapping it (M = 1, Llama-3.2-1B's projections, of a plain read on the same
// threads: bfloat16 path 0.63-0.68 before, 0.84-0.90 after; int8 path 0.74-0.76 before, 0.90-0.94).
//
// Prefill (M >= gemm_min_rows): blocks of output rows are dequantized exactly as the contract reads,
// (u - z) * s in float32 (the twin's bits), into a [K, block] tile of x's dtype (in parallel), and
// each block is one at::addmm (oneDNN/MKL, all threads) into its columns of the output. Where that
// pays depends on the ISA (kAutoGemmMinRows): with AVX-512 never, as measured on AMD EPYC; where
// oneDNN's bfloat16 GEMM runs on AMX tiles the callers pass their own crossover
// (kernels/wna16_linear.py: gemm_min_rows).
//
// One ISA per build (kernels/cpu_extension.py): AVX-512, AVX2 or the baseline. The decode and
// dequantize kernels are written once, as templates over a vector-width traits type (Vec512, Vec256:
// the register types, lanes, register file, rows of x per register tile and the primitive operations,
// one intrinsic each or nearly), and the build's ISA picks one (Simd). The bfloat16 and int8 dot paths
// are AVX-512 only (they need its extensions); the baseline runs scalar loops of the same sums.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "work_split.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kTile = 16;       // output rows per packed tile
constexpr int64_t kItemTiles = 4;   // tiles per parallel work item (64 output rows)
// Bytes of one dequantized GEMM block (prefill): few blocks, since each costs two thread joins (a
// loaded machine makes them expensive), and at the M where that path pays the GEMM reads its B in its
// own cache blocks anyway (128 to 1024 output rows per block measured the same on AMD EPYC).
constexpr int64_t kGemmBlockBytes = 8 << 20;
// Rows of x from which the op takes the dequantize-and-GEMM path when the caller passes
// gemm_min_rows < 0, per ISA, as measured on AMD EPYC (4096 x 4096 and 11008 x 4096, 4-bit, 1 and 2
// threads). AVX-512: the decode kernel was as fast or faster at every M tried (bfloat16, 4096 x 4096,
// one thread: 357 vs 367 ms at 1024 rows, 753 vs 923 at 2048; float32 819 vs 1066 at 1024), so never.
// AVX2 (8 lanes, no BF16 dot, half the register tile): the GEMM from about 64 rows (bfloat16 48 vs
// 98 ms at 64, 136 vs 392 at 256; 21 vs 24 at 16). Baseline: the scalar decode kernel loses even at
// one row (66 vs 21 ms), so always.
// On the int8 path (dynamic_int8), never with AVX2 either: vpmaddubsw's 64 products a cycle against
// 16 for float32 FMAs (4-bit, float32 x, one thread, under load: int8 / GEMM 6.7 / 19.8 ms at 64 rows
// of 2048 x 3072, 27 / 57 at 256; gate_up and down alike).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kAutoGemmMinRows = std::numeric_limits<int64_t>::max();
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kAutoGemmMinRows = 64;
#else
constexpr int64_t kAutoGemmMinRows = 1;
#endif
constexpr int64_t kAutoGemmMinRowsInt8 = std::numeric_limits<int64_t>::max();
// Longest run of k summed in one float32 chain by the decode kernels (Problem::chunk).
constexpr int64_t kMaxChunk = 256;

// Value slot j (bits [bits j, bits (j + 1))) of a packed word holds k offset slot_k(j) of its word.
// 4-bit: even k in the low half-word, odd k in the high one (prepare_wna16_cpu reorders them), so one
// shift moves the pair (2 J, 2 J + 1) into the two bfloat16 halves of a 32-bit lane (micro_tile_bf16).
constexpr int slot_k(int bits, int j) { return bits == 4 ? (j < 4 ? 2 * j : 2 * (j - 4) + 1) : j; }
inline int k_slot(int bits, int offset) { return bits == 4 ? (offset % 2 ? 4 + offset / 2 : offset / 2) : offset; }

// Arguments shared by every work item of one call.
struct Problem {
  const float* x;      // [M, K] float32, row stride ldx (null on the bfloat16-dot path)
  int64_t ldx;
  const c10::BFloat16* xb;  // [M, K] bfloat16, row stride ldxb (the bfloat16-dot path only)
  int64_t ldxb;
  const float* xsum;   // [M, H]: each chunk's sum of x (the int8-dot path: of x's int8 values)
  const int8_t* xq;    // [M, K] int8 x, each word's 8 k in nibble order (the int8-dot path only)
  const float* xscale; // [M, H]: each chunk's scale of xq (the int8-dot path only)
  const int32_t* w;    // packed [T, K / E, 16]
  const float* s;      // [T, G, 16] float32 scales, or null when sh holds them
  const uint16_t* sh;  // [T, G, 16] float16 scales (their bits), or null
  const float* z;      // [T, G, 16], or null when every zero point is z0
  float z0;
  int64_t M, N, K, G, group_size, tiles;
  // The decode kernels' unit along K: a group, or (long groups) a divisor of it of at most
  // kMaxChunk; H = K / chunk of them. Each chunk's sum restarts, so a per-channel row's x . f is not
  // one float32 chain over all of K (which measured 1e-5 relative error at K = 11008 for 8 bits).
  int64_t chunk, H;
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

// --- Vector-width traits -------------------------------------------------------------------------
// What the kernels below take from an ISA, and nothing more: the float32 and int32 register types, a
// vector's lanes, the register file (which sizes the register tiles), the rows of x per register tile,
// and the primitive operations, each one intrinsic where the ISA has it. Everything built from them
// (the shift by a signed count, the bfloat16 rounding, the micro tiles) is written once, below.
// Simd is the build's; Vec256 compiles in AVX-512 builds too (AVX2 is a subset) but serves only AVX2's.

struct Vec256 {  // AVX2 + FMA
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;
  static constexpr int kMaxRows = 2;  // x rows per register tile
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a b + c, one rounding
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }  // a b - c, one rounding
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b, one rounding
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static I as_words(F v) { return _mm256_castps_si256(v); }
  static I set1_words(int32_t v) { return _mm256_set1_epi32(v); }
  static I load_words(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I and_words(I a, I b) { return _mm256_and_si256(a, b); }
  static I add_words(I a, I b) { return _mm256_add_epi32(a, b); }
  template <int S> static I shl(I w) { return _mm256_slli_epi32(w, S); }
  template <int S> static I shr(I w) { return _mm256_srli_epi32(w, S); }  // logical
  // (v & mask) | one, as floats.
  static F mantissa(I v, I mask, I one) { return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(v, mask), one)); }
  // The low 16 bits of each lane (each < 2^16: packus saturates) to p.
  static void store_low_halves(void* p, I v) {
    const I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0xD8);  // lanes 0-3 and 4-7 together
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

#if defined(CPU_CAPABILITY_AVX512)
struct Vec512 {  // AVX-512 F, BW, DQ, VL
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  static constexpr int kMaxRows = 4;
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static I as_words(F v) { return _mm512_castps_si512(v); }
  static I set1_words(int32_t v) { return _mm512_set1_epi32(v); }
  static I load_words(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I and_words(I a, I b) { return _mm512_and_si512(a, b); }
  static I add_words(I a, I b) { return _mm512_add_epi32(a, b); }
  template <int S> static I shl(I w) { return _mm512_slli_epi32(w, S); }
  template <int S> static I shr(I w) { return _mm512_srli_epi32(w, S); }
  // One vpternlogd (truth table of a & b | c).
  static F mantissa(I v, I mask, I one) { return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(v, mask, one, 0xEA)); }
  static void store_low_halves(void* p, I v) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
  }
};
using Simd = Vec512;
#else
using Simd = Vec256;
#endif

// kLanes scales and zero points from element `at` of the [T, G, 16] layout, whichever form it holds.
template <class V>
__attribute__((always_inline)) inline typename V::F load_scales(const Problem& p, int64_t at) {
  return p.sh ? V::load_half(p.sh + at) : V::load(p.s + at);
}
template <class V>
__attribute__((always_inline)) inline typename V::F load_zeros(const Problem& p, int64_t at) {
  return p.z ? V::load(p.z + at) : V::set1(p.z0);
}

// Bytes ahead of a tile's words that the decode kernels prefetch, one cache line per tile and word step.
// Measured on Intel Sapphire Rapids, one thread, weights from DRAM, 4-bit group 128, bfloat16 x (M = 1):
// 0.65 of a plain read without; the words' lines alone 0.73-0.75 at 2-4 KiB (0.64 at 8 KiB); with the
// next register tile's and the scales' and zero points' lines too (Prefetcher) 0.83-0.89, alike at 1,
// 2 and 4 KiB.
constexpr int64_t kPrefetchBytes = 2048;

// The prefetches of a register tile reading `tiles` tiles side by side (each tile its own stream): at word
// step i, the line kPrefetchBytes ahead in each stream, and past a tile's end the same stream of the next
// register tile (`tiles` tiles on), which this thread reads next, so each register tile starts warm.
struct Prefetcher {
  static constexpr int64_t kSteps = kPrefetchBytes / (kTile * 4);
  static constexpr int64_t kGroupsAhead = 4;
  const Problem& p;
  int64_t tiles, words_per_row, wrap;
  Prefetcher(const Problem& problem, int values_per_word, int register_tiles)
      : p(problem),
        tiles(register_tiles),
        words_per_row(problem.K / values_per_word),
        wrap((register_tiles - 1) * words_per_row * kTile) {}
  // The scale and zero point lines of tile t kGroupsAhead groups after chunk h's (past the last group, the
  // next register tile's): their streams are 1/16 of the words' rate, too slow for the hardware to follow.
  __attribute__((always_inline)) void fetch_group(int64_t t, int64_t h) const {
    int64_t g = h * p.chunk / p.group_size + kGroupsAhead;
    t += g / p.G * tiles;
    g %= p.G;
    const int64_t at = (t * p.G + g) * kTile;
    _mm_prefetch(p.sh ? reinterpret_cast<const char*>(p.sh + at) : reinterpret_cast<const char*>(p.s + at),
                 _MM_HINT_T0);
    if (p.z) _mm_prefetch(reinterpret_cast<const char*>(p.z + at), _MM_HINT_T0);
  }
  // The line for the stream at `at` (its word step i).
  __attribute__((always_inline)) void fetch(const int32_t* at, int64_t i) const {
    const int64_t ahead = kSteps * kTile + (i + kSteps >= words_per_row ? wrap : 0);
    _mm_prefetch(reinterpret_cast<const char*>(at + ahead), _MM_HINT_T0);
  }
};

// w shifted left by S bits per 32-bit lane, or right (logically) by -S when S < 0.
template <class V, int S>
__attribute__((always_inline)) inline typename V::I shift(typename V::I w) {
  if constexpr (S > 0) return V::template shl<S>(w);
  else if constexpr (S < 0) return V::template shr<-S>(w);
  else return w;
}

// v rounded to bfloat16, to nearest even (finite values) as c10::BFloat16(float) rounds: kLanes to p.
template <class V>
__attribute__((always_inline)) inline void store_bf16(c10::BFloat16* p, typename V::F v) {
  using I = typename V::I;
  const I b = V::as_words(v);
  const I odd = V::and_words(shift<V, -16>(b), V::set1_words(1));
  V::store_low_halves(p, shift<V, -16>(V::add_words(b, V::add_words(odd, V::set1_words(0x7FFF)))));
}

// Every element of a register tile (MR rows of x by NV vectors) set to `value`.
template <typename R, int MR, int NV>
__attribute__((always_inline)) inline void fill(R (&tile)[MR][NV], R value) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) tile[r][v] = value;
}

// A register tile of float32 sums to out (row r at out + r * ldo).
template <class V, int MR, int NV>
__attribute__((always_inline)) inline void store_tile(const typename V::F (&tile)[MR][NV], float* out, int64_t ldo) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) V::store(out + r * ldo + v * V::kLanes, tile[r][v]);
}

// --- The decode kernel, over V ---------------------------------------------------------------------

// tot += s * (2^BITS (acc - xsum) - z xsum) for chunk h (in group g), i.e. s * (x . (u - z)) over
// the chunk, where acc = x . (1 + u / 2^BITS) over it.
template <class V, int BITS, int MR, int NV>
__attribute__((always_inline)) inline void fold_chunk(const Problem& p, int64_t m0, int64_t t0, int64_t h,
                                                      const typename V::F (&acc)[MR][NV],
                                                      typename V::F (&tot)[MR][NV]) {
  using F = typename V::F;
  const int64_t g = h * p.chunk / p.group_size;
  constexpr int kPerTile = kTile / V::kLanes;
  const F two_bits = V::set1(static_cast<float>(1 << BITS));
  F sv[NV], zv[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t at = ((t0 + v / kPerTile) * p.G + g) * kTile + (v % kPerTile) * V::kLanes;
    sv[v] = load_scales<V>(p, at);
    zv[v] = load_zeros<V>(p, at);
  }
  for (int r = 0; r < MR; ++r) {
    const F xs = V::set1(p.xsum[(m0 + r) * p.H + h]);
    for (int v = 0; v < NV; ++v) {
      const F d = V::fmsub(V::sub(acc[r][v], xs), two_bits, V::mul(zv[v], xs));
      tot[r][v] = V::fmadd(sv[v], d, tot[r][v]);
    }
  }
}

// out[r * ldo + c] = sum_k x[r, k] * w[n0 + c, k] for MR rows of x and NV vectors of output rows
// (NV * kLanes / 16 whole tiles from tile t0), in float32.
template <class V, int BITS, int MR, int NV>
inline void micro_tile(const Problem& p, int64_t m0, int64_t t0, float* out, int64_t ldo) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int E = 32 / BITS;
  constexpr int kPerTile = kTile / V::kLanes;  // vectors per tile
  static_assert(NV % kPerTile == 0);
  const int64_t words_per_chunk = p.chunk / E, tile_words = (p.K / E) * kTile;
  const I mask = V::set1_words(((1 << BITS) - 1) << (23 - BITS));
  const I one = V::set1_words(0x3F800000);
  // Vector v covers lanes [v % kPerTile * kLanes, ...) of tile t0 + v / kPerTile.
  const int32_t* wv_base[NV];
  for (int v = 0; v < NV; ++v) wv_base[v] = p.w + (t0 + v / kPerTile) * tile_words + (v % kPerTile) * V::kLanes;
  const Prefetcher prefetch(p, E, NV / kPerTile);
  const float* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = p.x + (m0 + r) * p.ldx;
  F tot[MR][NV];
  fill(tot, V::set1(0.f));
  for (int64_t h = 0; h < p.H; ++h) {
    F acc[MR][NV];
    fill(acc, V::set1(0.f));
    const int64_t i0 = h * words_per_chunk;
    for (int64_t t = t0; t < t0 + prefetch.tiles; ++t) prefetch.fetch_group(t, h);
    for (int64_t i = i0; i < i0 + words_per_chunk; ++i) {
      I words[NV];
      for (int v = 0; v < NV; ++v) words[v] = V::load_words(wv_base[v] + i * kTile);
      for (int v = 0; v < NV; v += kPerTile) prefetch.fetch(wv_base[v] + i * kTile, i);
      const int64_t k = i * E;
      // Value j of each word, shifted to mantissa bits [23 - BITS, 23): f = 1 + u / 2^BITS.
      [&]<int... J>(std::integer_sequence<int, J...>) {
        (
            [&] {
              F f[NV];
              for (int v = 0; v < NV; ++v) f[v] = V::mantissa(shift<V, (23 - BITS) - BITS * J>(words[v]), mask, one);
              for (int r = 0; r < MR; ++r) {
                const F xb = V::set1(xr[r][k + slot_k(BITS, J)]);
                for (int v = 0; v < NV; ++v) acc[r][v] = V::fmadd(f[v], xb, acc[r][v]);
              }
            }(),
            ...);
      }(std::make_integer_sequence<int, E>{});
    }
    fold_chunk<V, BITS, MR, NV>(p, m0, t0, h, acc, tot);
  }
  store_tile<V>(tot, out, ldo);
}

// Tiles per register tile for MR rows of x: its MR x NV accumulators and as many running totals take
// at most half of V's register file, leaving the rest to the words, the unpacked values and x's
// broadcasts; at most a work item's tiles. AVX-512: 4 tiles for 1-2 rows, 2 for 3-4; AVX2: 2 tiles
// (4 vectors) for one row, 1 for two.
template <class V>
constexpr int wide_tiles(int rows) {
  return std::clamp<int>(V::kRegisters / 4 / rows / (kTile / V::kLanes), 1, kItemTiles);
}

// MR rows x `tiles` tiles from t0: the widest register tile that fits, then single tiles.
template <class V, int BITS, int MR>
void rows_tiles(const Problem& p, int64_t m0, int64_t t0, int64_t tiles, float* out, int64_t ldo) {
  constexpr int kPerTile = kTile / V::kLanes, kWide = wide_tiles<V>(MR);
  int64_t t = 0;
  if constexpr (kWide > 1) {
    for (; t + kWide <= tiles; t += kWide)
      micro_tile<V, BITS, MR, kWide * kPerTile>(p, m0, t0 + t, out + t * kTile, ldo);
  }
  for (; t < tiles; ++t) micro_tile<V, BITS, MR, kPerTile>(p, m0, t0 + t, out + t * kTile, ldo);
}

// The rows of x in register tiles of up to V::kMaxRows: rows_tiles.template operator()<MR>(m0, out, ldo).
template <class V, typename RowsTiles>
void for_row_tiles(const Problem& p, float* buf, RowsTiles&& rows_tiles) {
  constexpr int64_t ldo = kItemTiles * kTile;
  for (int64_t m0 = 0; m0 < p.M;) {
    const int mr = static_cast<int>(std::min<int64_t>(V::kMaxRows, p.M - m0));
    float* out = buf + m0 * ldo;
    [&]<int... R>(std::integer_sequence<int, R...>) {  // the one MR = R + 1 equal to mr
      ((mr == R + 1 ? rows_tiles.template operator()<R + 1>(m0, out, ldo) : void()), ...);
    }(std::make_integer_sequence<int, V::kMaxRows>{});
    m0 += mr;
  }
}

// One work item: its tiles for every row of x, into buf ([M, kItemTiles * kTile]).
template <class V, int BITS>
void item_simd(const Problem& p, int64_t t0, int64_t tiles, float* buf) {
  for_row_tiles<V>(p, buf, [&]<int MR>(int64_t m0, float* out, int64_t ldo) {
    rows_tiles<V, BITS, MR>(p, m0, t0, tiles, out, ldo);
  });
}

// --- Prefill's dequantizer, over V -------------------------------------------------------------------

// Rows 16 t0 .. 16 (t0 + tiles) of the weight as a [K, 16 * tiles] tile (row stride ld) of T:
// (u - z) * s in float32 (the twin's bits), then rounded to T. k-major, so each (k, tile) is
// kTile / kLanes vectors of output rows.
template <class V, int BITS, typename T>
void dequantize_simd(const Problem& p, int64_t t0, int64_t tiles, T* out, int64_t ld) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int E = 32 / BITS, kPerTile = kTile / V::kLanes;
  const int64_t words_per_row = p.K / E, words_per_group = p.group_size / E;
  const I mask = V::set1_words((1 << BITS) - 1);
  for (int64_t tt = 0; tt < tiles; ++tt) {
    const int64_t t = t0 + tt;
    for (int64_t g = 0; g < p.G; ++g)
      for (int c = 0; c < kPerTile; ++c) {
        const int64_t at = (t * p.G + g) * kTile + c * V::kLanes;
        const F sv = load_scales<V>(p, at), zv = load_zeros<V>(p, at);
        for (int64_t i = g * words_per_group; i < (g + 1) * words_per_group; ++i) {
          const I words = V::load_words(p.w + (t * words_per_row + i) * kTile + c * V::kLanes);
          T* dst = out + i * E * ld + tt * kTile + c * V::kLanes;
          [&]<int... J>(std::integer_sequence<int, J...>) {
            (
                [&] {
                  const F u = V::to_float(V::and_words(shift<V, -BITS * J>(words), mask));
                  const F w = V::mul(V::sub(u, zv), sv);
                  if constexpr (std::is_same_v<T, float>) V::store(dst + slot_k(BITS, J) * ld, w);
                  else store_bf16<V>(dst + slot_k(BITS, J) * ld, w);
                }(),
                ...);
          }(std::make_integer_sequence<int, E>{});
        }
      }
  }
}

#endif

#if defined(CPU_CAPABILITY_AVX512)
// AVX512-BF16 (vdpbf16ps: per float32 lane, the two products of a pair of bfloat16 elements, exact in
// float32, added to the accumulator) for 4-bit weights and bfloat16 x: one instruction per 32 weights
// and row of x, against two FMAs. Pair J of a word (slots J and 4 + J, k = 2 J and 2 J + 1) is
// shifted into bits [3, 7) and [19, 23) of each lane, and OR-ed with two bfloat16 1.0s: the pair of
// bfloat16 f = 1 + u / 16 (exact: 4 of their 7 mantissa bits); x's pairs (x[k], x[k + 1]) are one
// 32-bit broadcast each. Chosen at run time (has_bf16_dot): the library is built for AVX-512, which
// does not imply the BF16 extension.
bool has_bf16_dot() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
}

// acc += x[:, k + 2 J .. k + 2 J + 1] . f (pair J of each word) for MR rows and NV tiles.
template <int J, int MR, int NV>
__attribute__((target("avx512bf16"), always_inline)) inline void pair_step_bf16(
    const __m512i (&words)[NV], const c10::BFloat16* const (&xr)[MR], int64_t k, __m512i mask, __m512i ones,
    __m512 (&acc)[MR][NV]) {
  __m512bh f[NV];
  for (int v = 0; v < NV; ++v)
    f[v] = (__m512bh)_mm512_ternarylogic_epi32(shift<Vec512, 3 - 4 * J>(words[v]), mask, ones, 0xEA);
  for (int r = 0; r < MR; ++r) {
    uint32_t pair;
    std::memcpy(&pair, xr[r] + k + 2 * J, sizeof(pair));
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], f[v], xb);
  }
}

template <int MR, int NV>
__attribute__((target("avx512bf16"), always_inline)) inline void micro_tile_bf16(const Problem& p, int64_t m0,
                                                                                int64_t t0, float* out, int64_t ldo) {
  using V = Vec512;
  constexpr int E = 8;
  const int64_t words_per_chunk = p.chunk / E, tile_words = (p.K / E) * kTile;
  const __m512i mask = _mm512_set1_epi32(0x00780078), ones = _mm512_set1_epi32(0x3F803F80);
  const int32_t* wv_base[NV];
  for (int v = 0; v < NV; ++v) wv_base[v] = p.w + (t0 + v) * tile_words;
  const Prefetcher prefetch(p, E, NV);
  const c10::BFloat16* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = p.xb + (m0 + r) * p.ldxb;
  V::F tot[MR][NV];
  fill(tot, V::set1(0.f));
  for (int64_t h = 0; h < p.H; ++h) {
    V::F acc[MR][NV];
    fill(acc, V::set1(0.f));
    const int64_t i0 = h * words_per_chunk;
    for (int64_t t = t0; t < t0 + prefetch.tiles; ++t) prefetch.fetch_group(t, h);
    for (int64_t i = i0; i < i0 + words_per_chunk; ++i) {
      __m512i words[NV];
      for (int v = 0; v < NV; ++v) words[v] = _mm512_loadu_si512(wv_base[v] + i * kTile);
      for (int v = 0; v < NV; ++v) prefetch.fetch(wv_base[v] + i * kTile, i);
      const int64_t k = i * E;
      // Spelled out: a lambda would not inherit the target attribute.
      pair_step_bf16<0, MR, NV>(words, xr, k, mask, ones, acc);
      pair_step_bf16<1, MR, NV>(words, xr, k, mask, ones, acc);
      pair_step_bf16<2, MR, NV>(words, xr, k, mask, ones, acc);
      pair_step_bf16<3, MR, NV>(words, xr, k, mask, ones, acc);
    }
    fold_chunk<V, 4, MR, NV>(p, m0, t0, h, acc, tot);
  }
  store_tile<V>(tot, out, ldo);
}

template <int MR>
__attribute__((target("avx512bf16"))) void rows_tiles_bf16(const Problem& p, int64_t m0, int64_t t0, int64_t tiles,
                                                           float* out, int64_t ldo) {
  constexpr int kWide = wide_tiles<Vec512>(MR);  // as rows_tiles
  int64_t t = 0;
  for (; t + kWide <= tiles; t += kWide) micro_tile_bf16<MR, kWide>(p, m0, t0 + t, out + t * kTile, ldo);
  for (; t < tiles; ++t) micro_tile_bf16<MR, 1>(p, m0, t0 + t, out + t * kTile, ldo);
}

void item_bf16(const Problem& p, int64_t t0, int64_t tiles, float* buf) {
  for_row_tiles<Vec512>(p, buf, [&]<int MR>(int64_t m0, float* out, int64_t ldo) {
    rows_tiles_bf16<MR>(p, m0, t0, tiles, out, ldo);
  });
}

#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// --- The int8 dot path (dynamic_int8) ------------------------------------------------------------
// 4-bit weights and x quantized at the call: per row and chunk, xq = rint(x * 127 / max|x|) in int8
// and its scale max|x| / 127. Per int32 lane, the products of four unsigned bytes (weight values u,
// 0..15) and four signed ones (xq) are added exactly in int32: AVX512-VNNI's vpdpbusd, 64 products
// per instruction (against vdpbf16ps's 32); AVX2's vpmaddubsw (pairs into int16: |u xq| <= 15 * 127,
// so no pair, nor a word's two, saturates) then vpmaddwd by ones (into int32), three instructions
// per 32 products against eight FMAs. A word's low nibbles are the bytes (k0, k4, k1, k5) of its 8 k
// (slot_k), its high nibbles (k2, k6, k3, k7): one AND, and a shift and an AND, make the two byte
// vectors, and xq is stored in that order (k0, k4, k1, k5, k2, k6, k3, k7 in each word's 8 bytes)
// so each 4-byte group is one 32-bit broadcast.
// Each chunk then adds s * sx * (acc - z * qsum) = s * (x . (u - z)) up to x's rounding, with qsum
// the chunk's sum of xq. Chosen at run time (has_int8_dot).

// 8 elements of x from p as float32: a load, or bfloat16 widened (its bits in the top half-word).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// The int32 lanes of a then b as 16 int8 (saturating), each 8 bytes in xq's word order.
inline __m128i narrow_reordered(__m256i a, __m256i b) {
  const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __m256i halves = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // a's 8, then b's
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  return _mm_shuffle_epi8(bytes, order);
}

// x's int8 values (in xq's word order), each chunk's scale and sum of them, 8 k at a time (a chunk
// holds whole words): widened to float32, scaled, rounded to nearest even (the default MXCSR mode) and
// narrowed with saturation (|q| <= 127 already). AVX2 in AVX-512 builds too: it reads x once, a small
// share of a call.
template <typename T>
void quantize_x(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t chunk, int8_t* xq, float* xscale,
                float* qsum) {
  const int64_t H = K / chunk;
  const __m256 sign = _mm256_set1_ps(-0.f);
  // Rows in parallel from 64 (a prefill's x; a decode step's few rows are not worth a join).
  at::parallel_for(0, M, 64, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m)
      for (int64_t h = 0; h < H; ++h) {
        const T* src = x + m * ldx + h * chunk;
        int8_t* dst = xq + m * K + h * chunk;
        __m256 vmax = _mm256_setzero_ps();
        int nan = 0;  // max drops NaN: a chunk holding one gets a NaN scale, as the twin
        for (int64_t k = 0; k < chunk; k += 8) {
          const __m256 v = load8(src + k);
          nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
          vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
        }
        const float amax = nan ? std::numeric_limits<float>::quiet_NaN() : reduce_max(vmax);
        // amax > 0 is false for NaN (xq 0, scale NaN); the bound keeps a subnormal chunk finite.
        const float inv = amax > 0.f ? std::min(127.f / amax, std::numeric_limits<float>::max()) : 0.f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i vsum = _mm256_setzero_si256();
        auto quantize8 = [&](int64_t k) {
          const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + k), vinv));
          vsum = _mm256_add_epi32(vsum, q);
          return q;
        };
        int64_t k = 0;
        for (; k + 16 <= chunk; k += 16) {
          const __m256i lo = quantize8(k), hi = quantize8(k + 8);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), narrow_reordered(lo, hi));
        }
        if (k < chunk) {  // the last 8
          const __m256i q = quantize8(k);
          _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + k), narrow_reordered(q, q));
        }
        xscale[m * H + h] = amax / 127.f;
        qsum[m * H + h] = static_cast<float>(reduce_add(vsum));
      }
  });
}

// out += s * sx * (acc - z * qsum) for chunk h (in group g): s * (x . (u - z)) over the chunk, up to
// x's rounding, for a register tile of MR rows and NV vectors of int32 sums.
template <class V, int MR, int NV>
__attribute__((always_inline)) inline void fold_chunk_int8(const Problem& p, int64_t m0, int64_t t0, int64_t h,
                                                           const typename V::I (&acc)[MR][NV], float* out,
                                                           int64_t ldo) {
  using F = typename V::F;
  constexpr int kPerTile = kTile / V::kLanes;
  const int64_t g = h * p.chunk / p.group_size;
  for (int v = 0; v < NV; ++v) {
    const int64_t at = ((t0 + v / kPerTile) * p.G + g) * kTile + (v % kPerTile) * V::kLanes;
    const F sv = load_scales<V>(p, at), zv = load_zeros<V>(p, at);
    for (int r = 0; r < MR; ++r) {
      const F qs = V::set1(p.xsum[(m0 + r) * p.H + h]);
      const F sx = V::set1(p.xscale[(m0 + r) * p.H + h]);
      const F d = V::fnmadd(zv, qs, V::to_float(acc[r][v]));
      float* o = out + r * ldo + v * V::kLanes;
      V::store(o, V::fmadd(V::mul(sv, sx), d, V::load(o)));
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
bool has_int8_dot() {
  static const bool supported = __builtin_cpu_supports("avx512vnni");
  return supported;
}

// The register tile is MR rows by NV tiles of int32 sums (up to 4 x 4: 16 accumulators, 2 NV
// unpacked vectors and two broadcasts); each chunk's fold goes straight to `out`, zeroed first.
template <int MR, int NV>
__attribute__((target("avx512vnni"), always_inline)) inline void micro_tile_int8(const Problem& p, int64_t m0,
                                                                                int64_t t0, float* out, int64_t ldo) {
  const int64_t words_per_chunk = p.chunk / 8, tile_words = (p.K / 8) * kTile;
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  const int32_t* wv_base[NV];
  for (int v = 0; v < NV; ++v) wv_base[v] = p.w + (t0 + v) * tile_words;
  const Prefetcher prefetch(p, 8, NV);
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = p.xq + (m0 + r) * p.K;
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * ldo + v * kTile, _mm512_setzero_ps());
  for (int64_t h = 0; h < p.H; ++h) {
    __m512i acc[MR][NV];
    fill(acc, _mm512_setzero_si512());
    const int64_t i0 = h * words_per_chunk;
    for (int64_t t = t0; t < t0 + prefetch.tiles; ++t) prefetch.fetch_group(t, h);
    for (int64_t i = i0; i < i0 + words_per_chunk; ++i) {
      __m512i lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        const __m512i words = _mm512_loadu_si512(wv_base[v] + i * kTile);
        prefetch.fetch(wv_base[v] + i * kTile, i);
        lo[v] = _mm512_and_si512(words, nibbles);
        hi[v] = _mm512_and_si512(_mm512_srli_epi32(words, 4), nibbles);
      }
      for (int r = 0; r < MR; ++r) {
        int32_t quad[2];
        std::memcpy(quad, xr[r] + i * 8, sizeof(quad));
        const __m512i xl = _mm512_set1_epi32(quad[0]), xh = _mm512_set1_epi32(quad[1]);
        for (int v = 0; v < NV; ++v) {
          acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], lo[v], xl);
          acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], hi[v], xh);
        }
      }
    }
    fold_chunk_int8<Vec512>(p, m0, t0, h, acc, out, ldo);
  }
}

template <int MR>
__attribute__((target("avx512vnni"))) void rows_tiles_int8(const Problem& p, int64_t m0, int64_t t0, int64_t tiles,
                                                           float* out, int64_t ldo) {
  int64_t t = 0;
  for (; t + 4 <= tiles; t += 4) micro_tile_int8<MR, 4>(p, m0, t0 + t, out + t * kTile, ldo);
  for (; t < tiles; ++t) micro_tile_int8<MR, 1>(p, m0, t0 + t, out + t * kTile, ldo);
}

void item_int8(const Problem& p, int64_t t0, int64_t tiles, float* buf) {
  for_row_tiles<Vec512>(p, buf, [&]<int MR>(int64_t m0, float* out, int64_t ldo) {
    rows_tiles_int8<MR>(p, m0, t0, tiles, out, ldo);
  });
}

#elif defined(CPU_CAPABILITY_AVX2)
bool has_int8_dot() { return true; }  // the build's ISA

// The register tile is MR rows by NV vectors (8 output rows each) of int32 sums: wide_tiles, as the
// float path's; each chunk's fold goes straight to `out`, zeroed first.
template <int MR, int NV>
__attribute__((always_inline)) inline void micro_tile_int8(const Problem& p, int64_t m0, int64_t t0, float* out,
                                                           int64_t ldo) {
  using V = Vec256;
  constexpr int kPerTile = kTile / V::kLanes;
  const int64_t words_per_chunk = p.chunk / 8, tile_words = (p.K / 8) * kTile;
  const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
  const int32_t* wv_base[NV];
  for (int v = 0; v < NV; ++v) wv_base[v] = p.w + (t0 + v / kPerTile) * tile_words + (v % kPerTile) * V::kLanes;
  const Prefetcher prefetch(p, 8, NV / kPerTile);
  const int8_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = p.xq + (m0 + r) * p.K;
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) V::store(out + r * ldo + v * V::kLanes, V::set1(0.f));
  for (int64_t h = 0; h < p.H; ++h) {
    __m256i acc[MR][NV];
    fill(acc, _mm256_setzero_si256());
    const int64_t i0 = h * words_per_chunk;
    for (int64_t t = t0; t < t0 + prefetch.tiles; ++t) prefetch.fetch_group(t, h);
    for (int64_t i = i0; i < i0 + words_per_chunk; ++i) {
      __m256i lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) {
        const __m256i words = V::load_words(wv_base[v] + i * kTile);
        lo[v] = _mm256_and_si256(words, nibbles);
        hi[v] = _mm256_and_si256(_mm256_srli_epi32(words, 4), nibbles);
      }
      for (int v = 0; v < NV; v += kPerTile) prefetch.fetch(wv_base[v] + i * kTile, i);
      for (int r = 0; r < MR; ++r) {
        int32_t quad[2];
        std::memcpy(quad, xr[r] + i * 8, sizeof(quad));
        const __m256i xl = _mm256_set1_epi32(quad[0]), xh = _mm256_set1_epi32(quad[1]);
        for (int v = 0; v < NV; ++v) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], xl), _mm256_maddubs_epi16(hi[v], xh));
          acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    fold_chunk_int8<V>(p, m0, t0, h, acc, out, ldo);
  }
}

template <int MR>
void rows_tiles_int8(const Problem& p, int64_t m0, int64_t t0, int64_t tiles, float* out, int64_t ldo) {
  constexpr int kPerTile = kTile / Vec256::kLanes, kWide = wide_tiles<Vec256>(MR);  // as rows_tiles
  int64_t t = 0;
  for (; t + kWide <= tiles; t += kWide) micro_tile_int8<MR, kWide * kPerTile>(p, m0, t0 + t, out + t * kTile, ldo);
  for (; t < tiles; ++t) micro_tile_int8<MR, kPerTile>(p, m0, t0 + t, out + t * kTile, ldo);
}

void item_int8(const Problem& p, int64_t t0, int64_t tiles, float* buf) {
  for_row_tiles<Vec256>(p, buf, [&]<int MR>(int64_t m0, float* out, int64_t ldo) {
    rows_tiles_int8<MR>(p, m0, t0, tiles, out, ldo);
  });
}
#endif

// One scale and zero point of the [T, G, 16] layout (the baseline ISA's loops).
[[maybe_unused]] inline float scale_at(const Problem& p, int64_t at) {
  return p.sh ? static_cast<float>(c10::Half(p.sh[at], c10::Half::from_bits())) : p.s[at];
}
[[maybe_unused]] inline float zero_at(const Problem& p, int64_t at) { return p.z ? p.z[at] : p.z0; }

// The baseline ISA's version of item_simd: the same sums, one lane at a time.
[[maybe_unused]] void item_scalar(const Problem& p, int bits, int64_t t0, int64_t tiles, float* buf) {
  const int E = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const int64_t words_per_row = p.K / E;
  for (int64_t m = 0; m < p.M; ++m) {
    const float* xr = p.x + m * p.ldx;
    for (int64_t tt = 0; tt < tiles; ++tt) {
      const int64_t t = t0 + tt;
      for (int64_t l = 0; l < kTile; ++l) {
        float total = 0.f;
        for (int64_t h = 0; h < p.H; ++h) {
          float dot = 0.f;
          for (int64_t k = h * p.chunk; k < (h + 1) * p.chunk; ++k) {
            const auto word = static_cast<uint32_t>(p.w[(t * words_per_row + k / E) * kTile + l]);
            dot += xr[k] * static_cast<float>((word >> (k_slot(bits, static_cast<int>(k % E)) * bits)) & mask);
          }
          const int64_t at = (t * p.G + h * p.chunk / p.group_size) * kTile + l;
          total += scale_at(p, at) * (dot - zero_at(p, at) * p.xsum[m * p.H + h]);
        }
        buf[m * kItemTiles * kTile + tt * kTile + l] = total;
      }
    }
  }
}

template <typename T>
void store_row(const float* src, const float* bias, int64_t n, T* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(bias ? src[c] + bias[c] : src[c]);
}

// The build's prefill dequantizer (dequantize_simd's contract): over Simd, or on the baseline ISA
// one element at a time.
template <int BITS, typename T>
void dequantize_tiles(const Problem& p, int64_t t0, int64_t tiles, T* out, int64_t ld) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  dequantize_simd<Simd, BITS>(p, t0, tiles, out, ld);
#else
  constexpr int E = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t words_per_row = p.K / E;
  for (int64_t tt = 0; tt < tiles; ++tt) {
    const int64_t t = t0 + tt;
    for (int64_t k = 0; k < p.K; ++k) {
      const int32_t* words = p.w + (t * words_per_row + k / E) * kTile;
      const int64_t at = (t * p.G + k / p.group_size) * kTile;
      const int shift = k_slot(BITS, static_cast<int>(k % E)) * BITS;
      T* dst = out + k * ld + tt * kTile;
      for (int64_t l = 0; l < kTile; ++l) {
        const float u = static_cast<float>((static_cast<uint32_t>(words[l]) >> shift) & mask);
        dst[l] = static_cast<T>((u - zero_at(p, at + l)) * scale_at(p, at + l));
      }
    }
  }
#endif
}

// The build's decode work item: a dot path where the call chose one (int8: AVX-512 or AVX2; bfloat16:
// AVX-512), else item_simd over Simd, or item_scalar on the baseline ISA.
void decode_item(const Problem& p, int bits, [[maybe_unused]] bool int8_dot, [[maybe_unused]] bool bf16_dot,
                 int64_t t0, int64_t tiles, float* buf) {
#if defined(CPU_CAPABILITY_AVX512)
  if (bf16_dot) return item_bf16(p, t0, tiles, buf);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (int8_dot) return item_int8(p, t0, tiles, buf);
  bits == 4 ? item_simd<Simd, 4>(p, t0, tiles, buf) : item_simd<Simd, 8>(p, t0, tiles, buf);
#else
  item_scalar(p, bits, t0, tiles, buf);
#endif
}

at::Tensor wna16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t bits, int64_t group_size, int64_t n,
                        const std::optional<at::Tensor>& bias, int64_t gemm_min_rows, bool dynamic_int8) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu() && zeros.device().is_cpu(),
              "llm_cpu::wna16_linear: CPU tensors only");
  TORCH_CHECK(bits == 4 || bits == 8, "llm_cpu::wna16_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "llm_cpu::wna16_linear: x must be float32 or bfloat16 [M, K] with unit stride along K");
  const int64_t M = x.size(0), K = x.size(1), E = 32 / bits;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.size(1) * E == K && packed.size(2) == kTile,
              "llm_cpu::wna16_linear: packed must be contiguous int32 [tiles, K / (32 / bits), 16]");
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(n > 0 && n <= tiles * kTile && n > (tiles - 1) * kTile, "llm_cpu::wna16_linear: n = ", n,
              " does not match ", tiles, " tiles of 16 rows");
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && group_size % E == 0,
              "llm_cpu::wna16_linear: group_size must divide K and be a multiple of 32 / bits");
  const int64_t G = K / group_size;
  const bool half_scales = scales.scalar_type() == at::kHalf, one_zero = zeros.dim() == 0;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({tiles, G, kTile}) && scales.is_contiguous() &&
                  (half_scales || scales.scalar_type() == at::kFloat),
              "llm_cpu::wna16_linear: scales must be contiguous float32 or float16 [tiles, K / group_size, 16]");
  TORCH_CHECK(zeros.scalar_type() == at::kFloat && (one_zero || (zeros.sizes() == scales.sizes() && zeros.is_contiguous())),
              "llm_cpu::wna16_linear: zeros must be float32, contiguous [tiles, K / group_size, 16] or one value (0-dim)");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == n,
                "llm_cpu::wna16_linear: bias must be [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;

  int64_t chunk = group_size;
  if (chunk > kMaxChunk) {  // the largest divisor of the group within kMaxChunk (E divides the group)
    chunk = kMaxChunk - kMaxChunk % E;
    while (group_size % chunk) chunk -= E;
  }
  Problem p{nullptr, 0, nullptr, 0, nullptr, nullptr, nullptr, packed.data_ptr<int32_t>(),
            half_scales ? nullptr : scales.data_ptr<float>(),
            half_scales ? reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) : nullptr,
            one_zero ? nullptr : zeros.data_ptr<float>(), one_zero ? *zeros.data_ptr<float>() : 0.f,
            M, n, K, G, group_size, tiles, chunk, K / chunk};

  // Where dynamic_int8 takes effect (4-bit weights; AVX2, or AVX-512 with VNNI).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const bool int8_dot = dynamic_int8 && bits == 4 && has_int8_dot();
#else
  const bool int8_dot = false;
#endif
  if (gemm_min_rows < 0) gemm_min_rows = int8_dot ? kAutoGemmMinRowsInt8 : kAutoGemmMinRows;
  if (M >= gemm_min_rows) {
    // Prefill: dequantize kGemmBlockBytes of output rows at a time, then one GEMM per block (all threads).
    const auto dtype = x.scalar_type();
    const int64_t block_tiles = std::max<int64_t>(8, kGemmBlockBytes / (K * x.element_size() * kTile));
    at::Tensor tile = at::empty({K, std::min(tiles, block_tiles) * kTile}, x.options());
    std::optional<at::Tensor> bias_x;
    if (bias.has_value()) bias_x = bias->to(dtype);
    for (int64_t t0 = 0; t0 < tiles; t0 += block_tiles) {
      const int64_t bt = std::min(block_tiles, tiles - t0), cols = std::min(bt * kTile, n - t0 * kTile);
      const int64_t ld = tile.size(1);
      at::parallel_for(0, bt, 1, [&](int64_t begin, int64_t end) {
        const int64_t from = t0 + begin, count = end - begin, col = begin * kTile;
        if (dtype == at::kFloat) {
          float* dst = tile.data_ptr<float>() + col;
          bits == 4 ? dequantize_tiles<4>(p, from, count, dst, ld) : dequantize_tiles<8>(p, from, count, dst, ld);
        } else {
          c10::BFloat16* dst = tile.data_ptr<c10::BFloat16>() + col;
          bits == 4 ? dequantize_tiles<4>(p, from, count, dst, ld) : dequantize_tiles<8>(p, from, count, dst, ld);
        }
      });
      at::Tensor dst = out.narrow(1, t0 * kTile, cols);
      const at::Tensor w = tile.narrow(1, 0, cols);
      if (bias_x.has_value()) at::addmm_out(dst, bias_x->narrow(0, t0 * kTile, cols), x, w);
      else at::mm_out(dst, x, w);
    }
    return out;
  }

  // Decode. dynamic_int8 with 4-bit weights where the int8 dot runs: x quantized (item_int8). bfloat16 x
  // with 4-bit weights on a CPU with AVX512-BF16: x as it is (item_bf16). Otherwise float32 x
  // (converted once when bfloat16). Either way each chunk's sum of x (of xq), in float32.
#if defined(CPU_CAPABILITY_AVX512)
  const bool bf16_dot = !int8_dot && bits == 4 && x.scalar_type() == at::kBFloat16 && has_bf16_dot();
#else
  const bool bf16_dot = false;
#endif
  const int64_t H = p.H;
  at::Tensor xf, xq, xscale;
  at::Tensor xsum = at::empty({M, H}, x.options().dtype(at::kFloat));
  if (int8_dot) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    xq = at::empty({M, K}, x.options().dtype(at::kChar));
    xscale = at::empty({M, H}, x.options().dtype(at::kFloat));
    if (x.scalar_type() == at::kFloat)
      quantize_x(x.data_ptr<float>(), x.stride(0), M, K, chunk, xq.data_ptr<int8_t>(), xscale.data_ptr<float>(),
                 xsum.data_ptr<float>());
    else
      quantize_x(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, chunk, xq.data_ptr<int8_t>(),
                 xscale.data_ptr<float>(), xsum.data_ptr<float>());
    p.xq = xq.data_ptr<int8_t>();
    p.xscale = xscale.data_ptr<float>();
#endif
  } else if (bf16_dot) {
    p.xb = x.data_ptr<c10::BFloat16>();
    p.ldxb = x.stride(0);
  } else {
    xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    p.x = xf.data_ptr<float>();
    p.ldx = xf.stride(0);
  }
  auto group_sums = [&](auto* xp, int64_t ldx) {
    float* sp = xsum.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t h = 0; h < H; ++h) {
        // 8 partial sums: independent chains (the compiler keeps them in one vector).
        float part[8] = {};
        const auto* src = xp + m * ldx + h * chunk;
        int64_t k = 0;
        for (; k + 8 <= chunk; k += 8)
          for (int j = 0; j < 8; ++j) part[j] += static_cast<float>(src[k + j]);
        for (; k < chunk; ++k) part[0] += static_cast<float>(src[k]);
        sp[m * H + h] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      }
  };
  if (bf16_dot) group_sums(p.xb, p.ldxb);
  else if (!int8_dot) group_sums(p.x, p.ldx);
  p.xsum = xsum.data_ptr<float>();
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t items = (tiles + kItemTiles - 1) / kItemTiles;
  llm_cpu::for_each_item(
      items, [&] { return std::vector<float>(M * kItemTiles * kTile); },
      [&](int64_t item, std::vector<float>& buf) {
        const int64_t t0 = item * kItemTiles, nt = std::min(kItemTiles, tiles - t0);
        decode_item(p, static_cast<int>(bits), int8_dot, bf16_dot, t0, nt, buf.data());
        const int64_t c0 = t0 * kTile, cols = std::min(nt * kTile, n - c0);
        for (int64_t m = 0; m < M; ++m) {
          const float* src = buf.data() + m * kItemTiles * kTile;
          const float* b = bp ? bp + c0 : nullptr;
          if (out.scalar_type() == at::kFloat) store_row(src, b, cols, out.data_ptr<float>() + m * n + c0);
          else store_row(src, b, cols, out.data_ptr<c10::BFloat16>() + m * n + c0);
        }
      });
  return out;
}

}  // namespace

namespace llm_cpu {
at::Tensor wna16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t bits, int64_t group_size, int64_t n,
                        const std::optional<at::Tensor>& bias, int64_t gemm_min_rows, bool dynamic_int8) {
  return ::wna16_linear(x, packed, scales, zeros, bits, group_size, n, bias, gemm_min_rows, dynamic_int8);
}
}  // namespace llm_cpu

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  // x [M, K] float32/bfloat16 -> [M, n] in x's dtype; packed/scales/zeros from prepare_wna16_cpu;
  // gemm_min_rows < 0: this build's kAutoGemmMinRows (kAutoGemmMinRowsInt8 where dynamic_int8 applies).
  m.def(
      "wna16_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int bits, int group_size, int n, "
      "Tensor? bias, int gemm_min_rows, bool dynamic_int8=False) -> Tensor");
  m.impl("wna16_linear", c10::DispatchKey::CPU, TORCH_FN(wna16_linear));
  // Whether dynamic_int8 takes effect in this build on this CPU (AVX-512 with VNNI, or AVX2).
  m.def("wna16_int8_dot() -> bool", [] {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    return has_int8_dot();
#else
    return false;
#endif
  });
}

// How the decode GEMVs (gemv_cpu.cpp, wna16_linear_cpu.cpp) share a call's work items among the
// threads: each thread first takes one contiguous run of kStaticShare of the items (one address
// range, so each item's prefetches run into its next), then the rest one at a time from a shared
// counter, so a thread the machine slows does not hold the others at the join (llama.cpp hands out
// its GEMV chunks from a counter too).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace llm_cpu {

// Measured on AMD EPYC (Zen 3), 2 threads, a 1B Llama's decode step, time per output token,
// interleaved 3-5 times (median / best, ms), at 3/4 against all static and all from the counter:
// Q4_0 GGUF 40.7 / 36.6, 42.3 / 39.9, 42.3 / 39.4; 4-bit g128 29.5 / 26.8, 30.2 / 27.9, 32.7 / 27.8;
// float32 201.7 / 192.9, 217.5 / 213.1, 200.6 / 188.9. All from the counter loses the 4-bit items'
// prefetches into their next.
constexpr double kStaticShare = 0.75;

// body(item, scratch) for every item in [0, items), on at::parallel_for's threads; each thread
// makes its own scratch with make_scratch().
template <typename MakeScratch, typename Body>
void for_each_item(int64_t items, MakeScratch&& make_scratch, Body&& body) {
  if (items <= 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  const int64_t run = static_cast<int64_t>(static_cast<double>(items) * kStaticShare) / workers;
  std::atomic<int64_t> next{run * workers};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t item = worker * run; item < (worker + 1) * run; ++item) body(item, scratch);
      for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) body(item, scratch);
    }
  });
}

}  // namespace llm_cpu

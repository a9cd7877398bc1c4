// Shared helpers for sparsejax's XLA FFI handlers: argument validation with
// messages that name the argument, a deterministic parallel-for on XLA's
// intra-op thread pool, and counter-based hashing used as a seeded RNG.
#ifndef SPARSEJAX_FFI_COMMON_H_
#define SPARSEJAX_FFI_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace sparsejax {

namespace ffi = xla::ffi;

#define SJ_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::xla::ffi::Error sj_err_ = (expr);       \
    if (sj_err_.failure()) return sj_err_;    \
  } while (0)

// Id used for padding in every id array: skipped by all kernels.
inline constexpr int32_t kPadId = -1;

const char* DtypeName(ffi::DataType t);
std::string ShapeString(const ffi::AnyBuffer& b);

// Validates the arguments of one op; every message starts with the op's name
// and names the offending argument.
class ArgChecker {
 public:
  explicit ArgChecker(const char* op) : op_(op) {}

  ffi::Error Dtype(const ffi::AnyBuffer& b, ffi::DataType t,
                   const char* name) const;
  // Checks rank and, for each dim with expected >= 0, its size. `shape` is
  // the human-readable expected shape, e.g. "[B, d]".
  ffi::Error Shape(const ffi::AnyBuffer& b, std::vector<int64_t> expected,
                   const char* name, const char* shape) const;
  ffi::Error Fail(const std::string& msg) const {
    return ffi::Error::InvalidArgument(std::string(op_) + ": " + msg);
  }
  const char* op() const { return op_; }

 private:
  const char* op_;
};

// Checks that every id in ids[0..n) is in [0, limit) or, if allow_pad, equal
// to kPadId. Reports the first (lowest-index) offender, so the message does
// not depend on the thread count.
ffi::Error CheckIds(const ArgChecker& c, const int32_t* ids, int64_t n,
                    int64_t limit, const char* name, const char* limit_name,
                    bool allow_pad, int64_t row_len = 0);

// --- Deterministic parallel for ---------------------------------------------
//
// Splits [0, n) into fixed chunks of `grain` (independent of the thread
// count) and runs body(begin, end) for each chunk on XLA's intra-op thread
// pool, the calling thread included. Each output element must be written by
// exactly one chunk, so results never depend on how many threads ran.
// The caller only waits for chunks that a running thread has claimed, so it
// cannot deadlock even if the pool's threads are all busy (or it runs on one).

int64_t MaxThreads();  // SPARSEJAX_NUM_THREADS caps the worker count.

namespace internal {
struct ParallelState {
  std::atomic<int64_t> next{0};
  int64_t num_chunks = 0;
  int64_t n = 0;
  int64_t grain = 0;
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;  // guarded by mu
  void* body = nullptr;
  void (*invoke)(void*, int64_t, int64_t) = nullptr;

  void RunChunks() {
    int64_t finished = 0;
    for (;;) {
      int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) break;
      int64_t begin = c * grain;
      int64_t end = std::min(n, begin + grain);
      invoke(body, begin, end);
      ++finished;
    }
    if (finished > 0) {
      std::lock_guard<std::mutex> lock(mu);
      done += finished;
      if (done == num_chunks) cv.notify_all();
    }
  }
};
}  // namespace internal

template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t grain, F&& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t num_chunks = (n + grain - 1) / grain;
  int64_t threads = std::min<int64_t>({pool.num_threads() + 1, MaxThreads(),
                                       num_chunks});
  if (threads <= 1) {
    for (int64_t b = 0; b < n; b += grain) body(b, std::min(n, b + grain));
    return;
  }
  auto state = std::make_shared<internal::ParallelState>();
  state->num_chunks = num_chunks;
  state->n = n;
  state->grain = grain;
  using Fn = std::remove_reference_t<F>;
  state->body = const_cast<void*>(static_cast<const void*>(&body));
  state->invoke = [](void* f, int64_t b, int64_t e) { (*static_cast<Fn*>(f))(b, e); };
  for (int64_t t = 1; t < threads; ++t) {
    // A task that starts after all chunks are claimed touches only `state`,
    // which it co-owns, never `body`.
    pool.Schedule([state] { state->RunChunks(); });
  }
  state->RunChunks();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done == state->num_chunks; });
}

// Hot loops are compiled for several ISAs and picked at load time (GCC
// function multiversioning). No -ffast-math and no FP contraction: every
// variant computes the same floats.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SJ_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SJ_MULTIVERSION
#endif

// --- Counter-based hashing (seeded, order-free randomness) ------------------

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

inline uint64_t HashCombine(uint64_t a, uint64_t b) {
  return SplitMix64(a ^ (SplitMix64(b) + 0x632BE59BD9B4E019ULL));
}

inline uint64_t Hash3(uint64_t a, uint64_t b, uint64_t c) {
  return HashCombine(HashCombine(a, b), c);
}

// Uniform integer in [0, n) from a 64-bit hash (Lemire's multiply-shift).
inline uint64_t Bounded(uint64_t h, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(h) * n) >> 64);
}

// Dot product with a fixed 16-way association order: vectorizes (1 AVX-512,
// 2 AVX2 or 4 SSE registers) without -ffast-math, and gives the same bits on
// every ISA, thread and run.
inline float Dot(const float* a, const float* b, int64_t d) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i < d; ++i, ++j) acc[j] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0];
}

// Fetches the cache lines of [p, p + bytes) toward L1 ahead of use.
// Volatile asm, not __builtin_prefetch: GCC deletes a loop that only holds
// __builtin_prefetch calls when its trip count is a runtime value.
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__) && defined(__GNUC__)
    asm volatile("prefetcht0 %0" : : "m"(c[i]));
#else
    __builtin_prefetch(c + i);
#endif
  }
}

// y += alpha * x
inline void Axpy(float alpha, const float* __restrict__ x, float* __restrict__ y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += alpha * x[i];
}

}  // namespace sparsejax

#endif  // SPARSEJAX_FFI_COMMON_H_

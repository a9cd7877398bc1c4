// Shared helpers for sparsejax's XLA FFI handlers: the checks that buffer
// types cannot express (sizes that must agree, id ranges), handlers that turn
// any exception into an error, a deterministic and exception-safe
// parallel-for on XLA's intra-op thread pool, and counter-based hashing used
// as a seeded RNG.
#ifndef SPARSEJAX_FFI_COMMON_H_
#define SPARSEJAX_FFI_COMMON_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace sparsejax {

namespace ffi = xla::ffi;

#define SJ_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::xla::ffi::Error sj_err_ = (expr);       \
    if (sj_err_.failure()) return sj_err_;    \
  } while (0)

// Id used for padding in every id array: skipped by all kernels. The Python
// side's one copy is sparsejax.padding.PAD_ID.
inline constexpr int32_t kPadId = -1;

// Buffer types by dtype and rank: XLA checks both when it decodes a call.
// A result buffer is ffi::Result<F32R2> etc.
using F32R0 = ffi::BufferR0<ffi::F32>;
using F32R1 = ffi::BufferR1<ffi::F32>;
using F32R2 = ffi::BufferR2<ffi::F32>;
using S32R0 = ffi::BufferR0<ffi::S32>;
using S32R1 = ffi::BufferR1<ffi::S32>;
using S32R2 = ffi::BufferR2<ffi::S32>;
using S32R3 = ffi::BufferR3<ffi::S32>;
using U32R0 = ffi::BufferR0<ffi::U32>;

// --- Argument checks ----------------------------------------------------------
//
// Buffer types (ffi::BufferR2<ffi::F32>, ...) check dtypes and ranks when XLA
// decodes a call. A Checker checks the rest, in the idiom of the Python
// wrappers' sparsejax._checks: each argument's and result's shape is given
// as symbols ({"B", "d"}), bound by the first buffer that has them and
// compared for every later one. The first failure is kept (later checks do
// nothing) and every message names the op, the argument and its expected
// shape, e.g. "gather_dot: argument 'x' must have shape [B, d] with d = 12
// (from 'weight'), got [6, 5]". A symbol that is a number is a literal size.
class Checker {
 public:
  using Dims = ffi::AnyBuffer::Dimensions;

  // An expected shape: one symbol per axis (up to 4).
  class Spec {
   public:
    Spec(std::initializer_list<const char*> axes) : rank_(std::min<size_t>(axes.size(), 4)) {
      std::copy(axes.begin(), axes.begin() + rank_, axes_.begin());
    }
    const char* const* begin() const { return axes_.data(); }
    const char* const* end() const { return axes_.data() + rank_; }
    size_t size() const { return rank_; }

   private:
    std::array<const char*, 4> axes_{};
    size_t rank_;
  };

  explicit Checker(std::string_view op) : op_(op) {}
  const char* op() const { return op_.c_str(); }

  template <typename Buffer>
  Checker& Arg(const char* name, const Buffer& b, const Spec& shape, const char* note = nullptr) {
    Shape("argument", name, b.dimensions(), shape, note);
    return *this;
  }
  template <typename Buffer>
  Checker& Ret(const char* name, const Buffer& b, const Spec& shape) {
    Shape("result", name, b.dimensions(), shape, nullptr);
    return *this;
  }
  // Binds a symbol to a size that no shape holds (an attribute, a value).
  Checker& Bind(const char* symbol, int64_t value, const char* source);
  // The value bound to `symbol` (which must be bound).
  int64_t operator[](const char* symbol) const;

  // Checks that every id in ids[0..n) is in [0, limit) (limit: the value of
  // a bound symbol) or, if allow_pad, equal to kPadId. Reports the first
  // (lowest-index) offender, so the message does not depend on thread count.
  Checker& Ids(const char* name, const int32_t* ids, int64_t n, const char* limit, bool allow_pad,
               int64_t row_len = 0);

  // Fails with make_message() unless ok (the message is built only then).
  template <typename MakeMessage>
  Checker& Require(bool ok, MakeMessage make_message) {
    if (error_.empty() && !ok) Fail(make_message());
    return *this;
  }
  void Fail(const std::string& message);

  bool ok() const { return error_.empty(); }
  ffi::Error status() const {
    return ok() ? ffi::Error::Success() : ffi::Error::InvalidArgument(error_);
  }

 private:
  struct Symbol {
    const char* name;
    int64_t value;
    const char* source;
  };
  const Symbol* Find(const char* name) const;
  void Shape(const char* kind, const char* name, Dims dims, const Spec& shape, const char* note);

  std::string op_;
  std::array<Symbol, 16> symbols_{};
  int num_symbols_ = 0;
  std::string error_;
};

// The error for an exception that escaped a kernel: "out of memory" for
// std::bad_alloc. Kernels never let exceptions cross the C API.
ffi::Error ExceptionError(std::string_view op, std::exception_ptr e);

// Runs fn(checker) for op `op`, turning any exception into an error. Every
// handler's body runs inside one.
template <typename Fn>
ffi::Error Guarded(std::string_view op, Fn&& fn) {
  try {
    Checker c(op);
    return fn(c);
  } catch (...) {
    return ExceptionError(op, std::current_exception());
  }
}

// Starts an in-place output from its input, should XLA ever hand us distinct
// buffers.
template <typename Buffer>
void CopyIfDistinct(const Buffer& in, ffi::Result<Buffer>& out) {
  if (out->untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

// --- Deterministic parallel for ---------------------------------------------
//
// Splits [0, n) into fixed chunks of `grain` (independent of the thread
// count) and Run() calls body(worker, begin, end) for each chunk on XLA's intra-op
// thread pool, the calling thread included. Each output element must be
// written by exactly one chunk, so results never depend on how many threads
// ran. `worker` is in [0, workers()) and is held by one thread at a time: it
// indexes per-worker scratch allocated before the loop (so that running out
// of memory is reported before any work starts).
//
// The caller only waits for chunks that a running thread has claimed, so it
// cannot deadlock even if the pool's threads are all busy (or it runs on
// one). An exception in a chunk is caught there; the chunks not yet started
// are skipped, Run() waits until no thread runs a chunk (the body's frame
// stays alive until then) and returns the error.

int64_t MaxThreads();  // SPARSEJAX_NUM_THREADS caps the worker count.

namespace internal {
struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  int64_t num_chunks = 0;
  int64_t n = 0;
  int64_t grain = 0;
  void* body = nullptr;
  void (*invoke)(void*, int64_t, int64_t, int64_t) = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;                  // guarded by mu
  std::exception_ptr error;          // guarded by mu: of the lowest failed chunk
  int64_t error_chunk = -1;          // guarded by mu

  void RunChunks(int64_t worker) noexcept;
};
}  // namespace internal

class ParallelLoop {
 public:
  ParallelLoop(ffi::ThreadPool& pool, int64_t n, int64_t grain);
  int64_t workers() const { return workers_; }

  template <typename F>
  ffi::Error Run(const char* op, F&& body) {
    if (n_ <= 0) return ffi::Error::Success();
    auto state = std::make_shared<internal::ParallelState>();
    state->num_chunks = (n_ + grain_ - 1) / grain_;
    state->n = n_;
    state->grain = grain_;
    using Fn = std::remove_reference_t<F>;
    state->body = const_cast<void*>(static_cast<const void*>(&body));
    state->invoke = [](void* f, int64_t w, int64_t b, int64_t e) { (*static_cast<Fn*>(f))(w, b, e); };
    for (int64_t t = 1; t < workers_; ++t) {
      // A task that starts after all chunks are claimed touches only `state`,
      // which it co-owns, never `body`.
      try {
        pool_.Schedule([state, t] { state->RunChunks(t); });
      } catch (...) {
        break;  // Fewer helpers; the calling thread still runs every chunk.
      }
    }
    state->RunChunks(0);
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done == state->num_chunks; });
    if (state->error) return ExceptionError(op, state->error);
    return ffi::Error::Success();
  }

 private:
  ffi::ThreadPool& pool_;
  int64_t n_, grain_, workers_;
};

// Hot loops are compiled for several ISAs and picked at load time (GCC
// function multiversioning). No -ffast-math and no FP contraction: every
// variant computes the same floats.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SJ_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SJ_MULTIVERSION
#endif
// What a multiversioned function calls must be inlined into each of its
// clones: a callee the compiler leaves out of line is compiled once, for the
// baseline ISA (measured: the per-slot loop of row_sparse_adam, and a gather-dot
// that computed four rows at once, ran 1.3x and 4x slower that way). Every
// helper of the hot loops is declared with it.
#define SJ_INLINE [[gnu::always_inline]] inline

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

// bfloat16 values travel as their bits; Load widens them to float (exactly).
using bf16 = uint16_t;
// A key whose ascending order is the scores' descending order, with NaN last (after -inf) and -0 == +0.
SJ_INLINE uint32_t DescendingKey(float x) {
  if (std::isnan(x)) return 0xFFFFFFFFu;
  if (x == 0.0f) x = 0.0f;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with the float
  return ~u;
}

// A ranking key of score x at index i (a column, a cluster id < 2^32): ascending = best first, ties to the lower
// index. A strict total order, so a ranking is unique, and integer compares keep selections cheap.
SJ_INLINE uint64_t RankKey(float x, int64_t i) {
  return static_cast<uint64_t>(DescendingKey(x)) << 32 | static_cast<uint64_t>(i);
}

SJ_INLINE float Load(float x) { return x; }
SJ_INLINE float Load(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Dot product with a fixed 16-way association order: vectorizes (1 AVX-512,
// 2 AVX2 or 4 SSE registers) without -ffast-math, and gives the same bits on
// every ISA, thread and run. `b` may be float or bfloat16 (a weight row).
template <typename T>
SJ_INLINE float Dot(const float* a, const T* b, int64_t d) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * Load(b[i + j]);
  }
  for (int j = 0; i < d; ++i, ++j) acc[j] += a[i] * Load(b[i]);
  // The lanes are summed pairwise, halves first: acc[j] + acc[j + 8], then
  // + 4, + 2, + 1. Written out with a fixed size per level: GCC compiled the
  // loop over levels to scalar adds through the stack, half of a dot's time.
  float a8[8], a4[4];
  for (int j = 0; j < 8; ++j) a8[j] = acc[j] + acc[j + 8];
  for (int j = 0; j < 4; ++j) a4[j] = a8[j] + a8[j + 4];
  return (a4[0] + a4[2]) + (a4[1] + a4[3]);
}

// Fetches the cache lines of [p, p + bytes) toward L1 ahead of use.
// Volatile asm, not __builtin_prefetch: GCC deletes a loop that only holds
// __builtin_prefetch calls when its trip count is a runtime value.
SJ_INLINE void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
#if defined(__x86_64__) && defined(__GNUC__)
    asm volatile("prefetcht0 %0" : : "m"(c[i]));
#else
    __builtin_prefetch(c + i);
#endif
  }
}

// y += alpha * x (x float or bfloat16)
template <typename T>
SJ_INLINE void Axpy(float alpha, const T* __restrict__ x, float* __restrict__ y, int64_t d) {
  for (int64_t i = 0; i < d; ++i) y[i] += alpha * Load(x[i]);
}

}  // namespace sparsejax

// Lets XLA infer a handler's binding from its signature (the two-argument
// XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, Impl)) when it takes the intra-op
// thread pool: each buffer's type is then written once.
template <>
struct xla::ffi::CtxBinding<xla::ffi::ThreadPool> {
  using Ctx = xla::ffi::ThreadPool;
};

#endif  // SPARSEJAX_FFI_COMMON_H_

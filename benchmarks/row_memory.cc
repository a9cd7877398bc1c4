// How fast can this machine update random rows of big arrays? The floor under
// row-sparse Adam. No JAX. Standalone (random rows), build and run:
//
//   g++ -O3 -march=native -pthread benchmarks/row_memory.cc -o /tmp/row_memory && /tmp/row_memory [threads]
//
// or as a library (benchmarks/ops.py builds it with -shared -fPIC and calls
// row_memory_floor on the rows a step touches, in the same run):
//
//   double row_memory_floor(int kind, const int64_t* rows, int64_t n_rows, int64_t N, int64_t d, int threads);
//
// Rows (standalone: 122,000 distinct random rows of N = 2,000,000, what one
// step of benchmarks/ops.py touches at that N; d = 128) are sorted, split
// over T threads, each row's lines prefetched 4 rows ahead (as the kernels
// do). Arrays are on 2 MiB pages. Every run starts with the caches flushed (a
// 1 GiB sweep), as a training step finds them. The figure is the best of 9
// runs (after one warm-up).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kAhead = 4;
constexpr int kRepeats = 10;

void* Alloc(size_t bytes) {
  const size_t huge = size_t{1} << 21, size = (bytes + huge - 1) / huge * huge;
  void* p = std::aligned_alloc(huge, size);
  if (p == nullptr) return nullptr;
  madvise(p, size, MADV_HUGEPAGE);
  std::memset(p, 0, size);
  return p;
}

inline void Prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) asm volatile("prefetcht0 %0" : : "m"(static_cast<const char*>(p)[i]));
}

inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t F32ToBf16Stochastic(float f, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + (r & 0xffff)) >> 16);
}

// One row's Adam update with weights of type W and moments of type M (float, or bf16 bits).
template <typename W, typename M>
void AdamRow(W* w, M* m, M* v, int64_t d, uint32_t seed) {
  for (int64_t i = 0; i < d; ++i) {
    const float g = 0.01f;
    float mi, vi;
    uint32_t h = (seed + static_cast<uint32_t>(i)) * 0x9E3779B1u;
    h ^= h >> 16;
    if constexpr (sizeof(M) == 4) {
      mi = m[i] = 0.9f * m[i] + 0.1f * g;
      vi = v[i] = 0.999f * v[i] + 0.001f * g * g;
    } else {
      mi = 0.9f * Bf16ToF32(m[i]) + 0.1f * g;
      vi = 0.999f * Bf16ToF32(v[i]) + 0.001f * g * g;
      m[i] = F32ToBf16Stochastic(mi, h);
      v[i] = F32ToBf16Stochastic(vi, h >> 16);
    }
    if constexpr (sizeof(W) == 4) {
      w[i] -= 1e-3f * mi / (std::sqrt(vi) + 1e-8f);
    } else {
      w[i] = F32ToBf16Stochastic(Bf16ToF32(w[i]) - 1e-3f * mi / (std::sqrt(vi) + 1e-8f), ~h);
    }
  }
}

// Row-wise Adam: per-element first moment, one second moment per row.
void RowwiseAdamRow(float* w, float* m, float* v_row, int64_t d) {
  const float g = 0.01f;
  const float vi = *v_row = 0.999f * *v_row + 0.001f * g * g;
  const float inv = 1e-3f / (std::sqrt(vi) + 1e-8f);
  for (int64_t i = 0; i < d; ++i) {
    const float mi = m[i] = 0.9f * m[i] + 0.1f * g;
    w[i] -= inv * mi;
  }
}

std::vector<int64_t> DrawRows(std::mt19937_64& rng, int64_t N, int64_t n_rows) {
  std::vector<char> seen(N, 0);
  std::vector<int64_t> rows;
  while (static_cast<int64_t>(rows.size()) < n_rows) {
    const int64_t r = static_cast<int64_t>(rng() % N);
    if (!seen[r]) seen[r] = 1, rows.push_back(r);
  }
  std::sort(rows.begin(), rows.end());
  return rows;
}

// Evicts the arrays from every cache level (the L3 here is 480 MiB).
void FlushCaches() {
  static auto* junk = static_cast<char*>(Alloc(size_t{1} << 30));
  for (size_t i = 0; i < (size_t{1} << 30); i += 64) junk[i] += 1;
}

// Best wall time (s) of body(row, row prefetched next) over the rows
// (draw() gives each run's rows), on `threads` threads.
template <typename Draw, typename Body>
double Time(Draw draw, int threads, Body body) {
  double best = 1e9;
  for (int rep = 0; rep < kRepeats; ++rep) {
    const std::vector<int64_t> rows = draw();
    const int64_t n = static_cast<int64_t>(rows.size());
    FlushCaches();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    const int64_t per = (n + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const int64_t a = std::min<int64_t>(n, t * per), b = std::min<int64_t>(n, a + per);
        for (int64_t i = a; i < b; ++i) body(rows[i], i + kAhead < b ? rows[i + kAhead] : -1);
      });
    }
    for (auto& th : pool) th.join();
    if (rep >= 1) best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// What a floor measures, per row.
enum Kind : int {
  kRead = 0,             // read the W row (8 lines at d = 128)
  kReadWrite = 1,        // read and write back the W row (write-backs land after the timed region)
  kAdam = 2,             // Adam, float32 W, m, v (3 arrays; 24 lines)
  kAdamBf16 = 3,         // Adam, float32 W, bfloat16 m, v (16 lines)
  kAdamInterleaved = 4,  // Adam, float32 W | m | v in one array (24 lines)
  kRowwiseAdam = 5,      // row-wise Adam: float32 W, m and one v per row (16 lines + 1)
  kAdamBf16Weight = 6,   // Adam, bfloat16 W, float32 m, v (20 lines)
  kAdamAllBf16 = 7,      // Adam, bfloat16 W, m, v (12 lines)
  kNumKinds = 8,
};

const char* const kKindNames[kNumKinds] = {
    "read 512-B rows", "read + write back 512-B rows", "Adam, float32 W, m, v (3 arrays)",
    "Adam, float32 W, bfloat16 m, v (3 arrays)", "Adam, float32 W|m|v interleaved (1 array)",
    "row-wise Adam, float32 W, m, v[row]", "Adam, bfloat16 W, float32 m, v (3 arrays)",
    "Adam, bfloat16 W, m, v (3 arrays)"};
const int kKindLines[kNumKinds] = {8, 8, 24, 16, 24, 17, 20, 12};

template <typename Draw>
double Floor(int kind, Draw draw, int64_t N, int64_t d, int threads) {
  const int64_t row_bytes = d * 4;
  double s = -1;
  volatile uint32_t sink = 0;
  auto* w = static_cast<float*>(Alloc(N * d * 4));
  if (w == nullptr) return -1;
  if (kind == kRead) {
    s = Time(draw, threads, [&](int64_t r, int64_t next) {
      if (next >= 0) Prefetch(w + next * d, row_bytes);
      uint32_t x = 0;
      for (int64_t i = 0; i < d; ++i) { uint32_t u; std::memcpy(&u, w + r * d + i, 4); x ^= u; }
      sink = sink ^ x;
    });
  } else if (kind == kReadWrite) {
    s = Time(draw, threads, [&](int64_t r, int64_t next) {
      if (next >= 0) Prefetch(w + next * d, row_bytes);
      for (int64_t i = 0; i < d; ++i) w[r * d + i] += 1.0f;
    });
  } else if (kind == kAdam || kind == kRowwiseAdam) {
    auto* m = static_cast<float*>(Alloc(N * d * 4));
    auto* v = static_cast<float*>(Alloc(kind == kAdam ? N * d * 4 : N * 4));
    if (m != nullptr && v != nullptr && kind == kAdam) {
      s = Time(draw, threads, [&](int64_t r, int64_t next) {
        if (next >= 0) Prefetch(w + next * d, row_bytes), Prefetch(m + next * d, row_bytes), Prefetch(v + next * d, row_bytes);
        AdamRow(w + r * d, m + r * d, v + r * d, d, static_cast<uint32_t>(r));
      });
    } else if (m != nullptr && v != nullptr) {
      s = Time(draw, threads, [&](int64_t r, int64_t next) {
        if (next >= 0) Prefetch(w + next * d, row_bytes), Prefetch(m + next * d, row_bytes), Prefetch(v + next, 4);
        RowwiseAdamRow(w + r * d, m + r * d, v + r, d);
      });
    }
    std::free(m), std::free(v);
  } else if (kind == kAdamBf16) {
    auto* m = static_cast<uint16_t*>(Alloc(N * d * 2));
    auto* v = static_cast<uint16_t*>(Alloc(N * d * 2));
    if (m != nullptr && v != nullptr) {
      s = Time(draw, threads, [&](int64_t r, int64_t next) {
        if (next >= 0) Prefetch(w + next * d, row_bytes), Prefetch(m + next * d, row_bytes / 2), Prefetch(v + next * d, row_bytes / 2);
        AdamRow(w + r * d, m + r * d, v + r * d, d, static_cast<uint32_t>(r));
      });
    }
    std::free(m), std::free(v);
  } else if (kind == kAdamBf16Weight || kind == kAdamAllBf16) {
    auto* wb = static_cast<uint16_t*>(Alloc(N * d * 2));  // the bfloat16 weights (w stays unused)
    const int64_t mb = kind == kAdamAllBf16 ? 2 : 4;      // bytes per moment
    void* m = Alloc(N * d * mb);
    void* v = Alloc(N * d * mb);
    if (wb != nullptr && m != nullptr && v != nullptr) {
      s = Time(draw, threads, [&](int64_t r, int64_t next) {
        if (next >= 0) {
          Prefetch(wb + next * d, row_bytes / 2);
          Prefetch(static_cast<char*>(m) + next * d * mb, d * mb), Prefetch(static_cast<char*>(v) + next * d * mb, d * mb);
        }
        if (kind == kAdamAllBf16) {
          AdamRow(wb + r * d, static_cast<uint16_t*>(m) + r * d, static_cast<uint16_t*>(v) + r * d, d,
                  static_cast<uint32_t>(r));
        } else {
          AdamRow(wb + r * d, static_cast<float*>(m) + r * d, static_cast<float*>(v) + r * d, d,
                  static_cast<uint32_t>(r));
        }
      });
    }
    std::free(wb), std::free(m), std::free(v);
  } else if (kind == kAdamInterleaved) {
    auto* wmv = static_cast<float*>(Alloc(N * 3 * d * 4));  // W | m | v per row
    if (wmv != nullptr) {
      s = Time(draw, threads, [&](int64_t r, int64_t next) {
        if (next >= 0) Prefetch(wmv + next * 3 * d, 3 * row_bytes);
        float* p = wmv + r * 3 * d;
        AdamRow(p, p + d, p + 2 * d, d, static_cast<uint32_t>(r));
      });
    }
    std::free(wmv);
  }
  std::free(w);
  return s;
}

}  // namespace

// The floor (best seconds) of `kind` over the given distinct rows of an
// [N, d] array, on `threads` threads; -1 for a bad kind or no memory.
extern "C" double row_memory_floor(int kind, const int64_t* rows, int64_t n_rows, int64_t N, int64_t d,
                                   int threads) {
  if (kind < 0 || kind >= kNumKinds || n_rows < 0 || N <= 0 || d <= 0 || threads <= 0) return -1;
  std::vector<int64_t> sorted(rows, rows + n_rows);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t r : sorted) {
    if (r < 0 || r >= N) return -1;
  }
  return Floor(kind, [&] { return sorted; }, N, d, threads);
}

#ifndef ROW_MEMORY_LIBRARY
int main(int argc, char** argv) {
  constexpr int64_t kN = 2000000, kD = 128, kRows = 122000;
  const int threads = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  std::mt19937_64 rng(1);
  std::printf("%lld random rows of %lld, d = %lld, %d threads\n", static_cast<long long>(kRows),
              static_cast<long long>(kN), static_cast<long long>(kD), threads);
  for (int kind = 0; kind < kNumKinds; ++kind) {
    const double s = Floor(kind, [&] { return DrawRows(rng, kN, kRows); }, kN, kD, threads);
    std::printf("%-44s %2d lines/row  %6.2f ms  %5.1f ns per line per thread\n", kKindNames[kind], kKindLines[kind],
                s * 1e3, s * 1e9 * threads / (double(kRows) * kKindLines[kind]));
  }
  return 0;
}
#endif

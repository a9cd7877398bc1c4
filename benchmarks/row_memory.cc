// How fast can this machine update random rows of big arrays? The floor under
// row-sparse Adam. Standalone (no JAX); build and run:
//
//   g++ -O3 -march=native -pthread benchmarks/row_memory.cc -o /tmp/row_memory && /tmp/row_memory
//
// Rows: 122,000 distinct random rows of N = 2,000,000 (what one step of
// benchmarks/ops.py touches at that N), d = 128, sorted, split over T threads,
// each row's lines prefetched 4 rows ahead (as the kernels do). Arrays are on
// 2 MiB pages. Every run draws new rows and starts with the caches flushed (a
// 1 GiB sweep), as a training step finds them. Prints the best of 10 runs.
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

constexpr int64_t kN = 2000000, kD = 128, kRows = 122000, kAhead = 4;

void* Alloc(size_t bytes) {
  const size_t huge = size_t{1} << 21, size = (bytes + huge - 1) / huge * huge;
  void* p = std::aligned_alloc(huge, size);
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

// One row's Adam update with moments of type M (float, or bf16 bits).
template <typename M>
void AdamRow(float* w, M* m, M* v, uint32_t seed) {
  for (int64_t i = 0; i < kD; ++i) {
    const float g = 0.01f;
    float mi, vi;
    if constexpr (sizeof(M) == 4) {
      mi = m[i] = 0.9f * m[i] + 0.1f * g;
      vi = v[i] = 0.999f * v[i] + 0.001f * g * g;
    } else {
      mi = 0.9f * Bf16ToF32(m[i]) + 0.1f * g;
      vi = 0.999f * Bf16ToF32(v[i]) + 0.001f * g * g;
      uint32_t h = (seed + static_cast<uint32_t>(i)) * 0x9E3779B1u;
      h ^= h >> 16;
      m[i] = F32ToBf16Stochastic(mi, h);
      v[i] = F32ToBf16Stochastic(vi, h >> 16);
    }
    w[i] -= 1e-3f * mi / (std::sqrt(vi) + 1e-8f);
  }
}

std::vector<int64_t> DrawRows(std::mt19937_64& rng) {
  std::vector<char> seen(kN, 0);
  std::vector<int64_t> rows;
  while (static_cast<int64_t>(rows.size()) < kRows) {
    const int64_t r = static_cast<int64_t>(rng() % kN);
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

// Best wall time (s) of body(row, row prefetched next) over fresh rows, on
// `threads` threads.
template <typename Body>
double Time(std::mt19937_64& rng, int threads, Body body) {
  double best = 1e9;
  for (int rep = 0; rep < 10; ++rep) {
    const std::vector<int64_t> rows = DrawRows(rng);
    FlushCaches();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    const int64_t per = (kRows + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const int64_t a = t * per, b = std::min<int64_t>(kRows, a + per);
        for (int64_t i = a; i < b; ++i) body(rows[i], i + kAhead < b ? rows[i + kAhead] : -1);
      });
    }
    for (auto& th : pool) th.join();
    if (rep >= 1) best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  std::mt19937_64 rng(1);

  auto* w = static_cast<float*>(Alloc(kN * kD * 4));
  auto* m = static_cast<float*>(Alloc(kN * kD * 4));
  auto* v = static_cast<float*>(Alloc(kN * kD * 4));
  auto* m16 = static_cast<uint16_t*>(Alloc(kN * kD * 2));
  auto* v16 = static_cast<uint16_t*>(Alloc(kN * kD * 2));
  auto* wmv = static_cast<float*>(Alloc(kN * 3 * kD * 4));  // W | m | v per row
  const int64_t row_bytes = kD * 4;

  auto report = [&](const char* what, int lines, double s) {
    std::printf("%-44s %2d lines/row  %6.2f ms  %5.1f ns per line per thread\n", what, lines, s * 1e3,
                s * 1e9 * threads / (double(kRows) * lines));
  };
  std::printf("%lld random rows of %lld, d = %lld, %d threads\n", static_cast<long long>(kRows),
              static_cast<long long>(kN), static_cast<long long>(kD), threads);
  volatile uint32_t sink = 0;
  report("read 512-B rows", 8, Time(rng, threads, [&](int64_t r, int64_t next) {
    if (next >= 0) Prefetch(w + next * kD, row_bytes);
    uint32_t x = 0;
    for (int64_t i = 0; i < kD; ++i) { uint32_t u; std::memcpy(&u, w + r * kD + i, 4); x ^= u; }
    sink = sink ^ x;
  }));
  report("read + write back 512-B rows", 8, Time(rng, threads, [&](int64_t r, int64_t next) {
    if (next >= 0) Prefetch(w + next * kD, row_bytes);
    for (int64_t i = 0; i < kD; ++i) w[r * kD + i] += 1.0f;
  }));
  report("Adam, float32 W, m, v (3 arrays)", 24, Time(rng, threads, [&](int64_t r, int64_t next) {
    if (next >= 0) {
      Prefetch(w + next * kD, row_bytes), Prefetch(m + next * kD, row_bytes), Prefetch(v + next * kD, row_bytes);
    }
    AdamRow(w + r * kD, m + r * kD, v + r * kD, static_cast<uint32_t>(r));
  }));
  report("Adam, float32 W, bfloat16 m, v (3 arrays)", 16, Time(rng, threads, [&](int64_t r, int64_t next) {
    if (next >= 0) {
      Prefetch(w + next * kD, row_bytes), Prefetch(m16 + next * kD, row_bytes / 2);
      Prefetch(v16 + next * kD, row_bytes / 2);
    }
    AdamRow(w + r * kD, m16 + r * kD, v16 + r * kD, static_cast<uint32_t>(r));
  }));
  report("Adam, float32 W|m|v interleaved (1 array)", 24, Time(rng, threads, [&](int64_t r, int64_t next) {
    if (next >= 0) Prefetch(wmv + next * 3 * kD, 3 * row_bytes);
    float* p = wmv + r * 3 * kD;
    AdamRow(p, p + kD, p + 2 * kD, static_cast<uint32_t>(r));
  }));
  return 0;
}

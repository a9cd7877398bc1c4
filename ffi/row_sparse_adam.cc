// Row-sparse ("lazy") Adam. The gradient of a sparse layer's weight W [N, d]
// arrives as factors: dW[ids[b, j]] += g[b, j] * x[b]. Only the rows named in
// ids are touched: their gradient rows are summed over duplicates (in the
// fixed order of their positions), then their moments and weights are updated
// in place. Work is O(B * k * d) and never O(N * d).
#include <cmath>
#include <cstring>

#include "common.h"

namespace sparsejax {
namespace {

// Rows are split into this many contiguous id ranges, processed in parallel.
// A constant (not the thread count), so the work split is the same everywhere.
constexpr int64_t kNumRanges = 256;

struct AdamConsts {
  float b1, b2, eps, weight_decay, step_size, inv_bc1, inv_bc2;
};

// One row's Adam update; restrict pointers let the compiler vectorize it.
SJ_MULTIVERSION void AdamRow(float* __restrict__ w, float* __restrict__ m, float* __restrict__ v,
                    const float* __restrict__ g, int64_t d, const AdamConsts& h) {
  for (int64_t i = 0; i < d; ++i) {
    m[i] = h.b1 * m[i] + (1.0f - h.b1) * g[i];
    v[i] = h.b2 * v[i] + (1.0f - h.b2) * g[i] * g[i];
    const float update = (m[i] * h.inv_bc1) / (std::sqrt(v[i] * h.inv_bc2) + h.eps);
    w[i] -= h.step_size * (update + h.weight_decay * w[i]);
  }
}

// Rows are visited in increasing id order but far apart: fetch the cache
// lines of the rows a few steps ahead while this one is updated.
constexpr int kPrefetchRows = 4;
inline void Prefetch(int64_t row, int64_t d, const float* w, const float* m, const float* v) {
  for (int64_t i = 0; i < d; i += 16) {
    __builtin_prefetch(w + row * d + i, 1);
    __builtin_prefetch(m + row * d + i, 1);
    __builtin_prefetch(v + row * d + i, 1);
  }
}

ffi::Error RowSparseAdamImpl(ffi::ThreadPool pool, ffi::AnyBuffer weight,
                             ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                             ffi::AnyBuffer ids, ffi::AnyBuffer g,
                             ffi::AnyBuffer x, ffi::AnyBuffer lr,
                             ffi::AnyBuffer count, ffi::RemainingArgs /*after*/,
                             float b1, float b2,
                             float eps, float weight_decay,
                             ffi::Result<ffi::AnyBuffer> weight_out,
                             ffi::Result<ffi::AnyBuffer> mu_out,
                             ffi::Result<ffi::AnyBuffer> nu_out,
                             ffi::Result<ffi::AnyBuffer> touched) {
  ArgChecker c("row_sparse_adam");
  SJ_RETURN_IF_ERROR(c.Dtype(weight, ffi::F32, "weight"));
  SJ_RETURN_IF_ERROR(c.Dtype(mu, ffi::F32, "mu"));
  SJ_RETURN_IF_ERROR(c.Dtype(nu, ffi::F32, "nu"));
  SJ_RETURN_IF_ERROR(c.Dtype(ids, ffi::S32, "ids"));
  SJ_RETURN_IF_ERROR(c.Dtype(g, ffi::F32, "g"));
  SJ_RETURN_IF_ERROR(c.Dtype(x, ffi::F32, "x"));
  SJ_RETURN_IF_ERROR(c.Dtype(lr, ffi::F32, "learning_rate"));
  SJ_RETURN_IF_ERROR(c.Dtype(count, ffi::S32, "count"));
  // A rank-1 weight (a bias [N]) is a weight of width d = 1.
  const bool is_vector = weight.dimensions().size() == 1;
  if (!is_vector) SJ_RETURN_IF_ERROR(c.Shape(weight, {-1, -1}, "weight", "[N, d] or [N]"));
  const int64_t N = weight.dimensions()[0], d = is_vector ? 1 : weight.dimensions()[1];
  const std::vector<int64_t> wshape = is_vector ? std::vector<int64_t>{N} : std::vector<int64_t>{N, d};
  const char* wspec = is_vector ? "[N]" : "[N, d]";
  SJ_RETURN_IF_ERROR(c.Shape(mu, wshape, "mu", wspec));
  SJ_RETURN_IF_ERROR(c.Shape(nu, wshape, "nu", wspec));
  SJ_RETURN_IF_ERROR(c.Shape(ids, {-1, -1}, "ids", "[B, k]"));
  const int64_t B = ids.dimensions()[0], k = ids.dimensions()[1];
  SJ_RETURN_IF_ERROR(c.Shape(g, {B, k}, "g", "[B, k]"));
  SJ_RETURN_IF_ERROR(c.Shape(x, {B, d}, "x", "[B, d]"));
  SJ_RETURN_IF_ERROR(c.Shape(lr, {}, "learning_rate", "[]"));
  SJ_RETURN_IF_ERROR(c.Shape(count, {}, "count", "[]"));
  const int32_t* ip = ids.typed_data<int32_t>();
  const int64_t M = B * k;
  if (M >= (int64_t{1} << 31)) return c.Fail("ids has too many entries (B * k must be < 2^31)");
  SJ_RETURN_IF_ERROR(CheckIds(c, ip, M, N, "ids", "N", /*allow_pad=*/true, k));
  const int32_t t = *count.typed_data<int32_t>();
  if (t < 1) return c.Fail("argument 'count' (the step number after this update) must be >= 1, got " + std::to_string(t));
  if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1 && eps >= 0)) {
    return c.Fail("need 0 <= b1, b2 < 1 and eps >= 0");
  }

  float* w = weight_out->typed_data<float>();
  float* m = mu_out->typed_data<float>();
  float* v = nu_out->typed_data<float>();
  // Outputs alias the inputs (updated in place). Should XLA ever hand us
  // distinct buffers, start them from the inputs' values.
  if (w != weight.typed_data<float>()) std::memcpy(w, weight.untyped_data(), weight.size_bytes());
  if (m != mu.typed_data<float>()) std::memcpy(m, mu.untyped_data(), mu.size_bytes());
  if (v != nu.typed_data<float>()) std::memcpy(v, nu.untyped_data(), nu.size_bytes());

  const float step_size = *lr.typed_data<float>();
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
  const AdamConsts h{b1, b2, eps, weight_decay, step_size, 1.0f / bc1, 1.0f / bc2};
  const float* gp = g.typed_data<float>();
  const float* xp = x.typed_data<float>();

  // Bucket the positions by id range (counting sort: keeps position order).
  const int64_t R = std::min<int64_t>(kNumRanges, std::max<int64_t>(N, 1));
  auto range_of = [&](int32_t id) { return static_cast<int64_t>(id) * R / N; };
  std::vector<int64_t> start(R + 1, 0);
  for (int64_t p = 0; p < M; ++p) if (ip[p] != kPadId) ++start[range_of(ip[p]) + 1];
  for (int64_t r = 0; r < R; ++r) start[r + 1] += start[r];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  // Key = id << 32 | position: sorting keys orders by id, then by position.
  std::vector<uint64_t> keys(start[R]);
  for (int64_t p = 0; p < M; ++p) {
    if (ip[p] != kPadId) {
      keys[fill[range_of(ip[p])]++] = (static_cast<uint64_t>(ip[p]) << 32) | static_cast<uint64_t>(p);
    }
  }
  std::vector<int64_t> unique_in_range(R, 0);

  ParallelFor(pool, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> grad(d);
    for (int64_t r = r0; r < r1; ++r) {
      uint64_t* kb = keys.data() + start[r];
      uint64_t* ke = keys.data() + start[r + 1];
      std::sort(kb, ke);
      int64_t n_unique = 0;
      // A cursor kPrefetchRows distinct rows ahead prefetches the rows to come.
      uint64_t* pf = kb;
      auto prefetch_next = [&] {
        if (pf == ke) return;
        const uint64_t row = *pf >> 32;
        Prefetch(static_cast<int64_t>(row), d, w, m, v);
        while (pf != ke && (*pf >> 32) == row) ++pf;
      };
      for (int i = 0; i < kPrefetchRows; ++i) prefetch_next();
      for (uint64_t* it = kb; it != ke;) {
        prefetch_next();
        const int64_t row = static_cast<int64_t>(*it >> 32);
        std::fill(grad.begin(), grad.end(), 0.0f);
        for (; it != ke && static_cast<int64_t>(*it >> 32) == row; ++it) {
          const int64_t pos = static_cast<int64_t>(*it & 0xffffffffULL);
          Axpy(gp[pos], xp + (pos / k) * d, grad.data(), d);
        }
        AdamRow(w + row * d, m + row * d, v + row * d, grad.data(), d, h);
        // Unique ids are written, in order, over the front of this range's
        // key slots (already consumed): no extra buffer needed.
        kb[n_unique++] = static_cast<uint64_t>(row);
      }
      unique_in_range[r] = n_unique;
    }
  });

  int32_t* out_ids = touched->typed_data<int32_t>();
  int64_t n = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < unique_in_range[r]; ++i) {
      out_ids[n++] = static_cast<int32_t>(keys[start[r] + i]);
    }
  }
  std::fill(out_ids + n, out_ids + M, kPadId);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowSparseAdam, RowSparseAdamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // weight [N, d]
                                  .Arg<ffi::AnyBuffer>()  // mu [N, d]
                                  .Arg<ffi::AnyBuffer>()  // nu [N, d]
                                  .Arg<ffi::AnyBuffer>()  // ids [B, k]
                                  .Arg<ffi::AnyBuffer>()  // g [B, k]
                                  .Arg<ffi::AnyBuffer>()  // x [B, d]
                                  .Arg<ffi::AnyBuffer>()  // learning_rate []
                                  .Arg<ffi::AnyBuffer>()  // count []
                                  // Unread operands that order the update after
                                  // other reads of weight (so it can be in place).
                                  .RemainingArgs()
                                  .Attr<float>("b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Ret<ffi::AnyBuffer>()   // weight
                                  .Ret<ffi::AnyBuffer>()   // mu
                                  .Ret<ffi::AnyBuffer>()   // nu
                                  .Ret<ffi::AnyBuffer>()); // touched [B * k]

}  // namespace sparsejax

// Row-sparse ("lazy") Adam. The gradient of a sparse layer's weight W [N, d]
// arrives as factors: dW[ids[b, j]] += g[b, j] * x[b]. Only the rows named in
// ids are touched: their gradient rows are summed over duplicates (in the
// fixed order of their positions), then their moments and weights are updated
// in place. Work is O(B * k * d) and never O(N * d).
//
// A bias b [N] of the same layer (gradient db[ids[b, j]] += g[b, j]) can ride
// along: its rows are updated in the same pass, so the ids are sorted once and
// the bias's cache lines are fetched together with the weight rows.
//
// Moments are float32, or bfloat16 rounded stochastically (unbiased; with
// round-to-nearest, b2 = 0.999 would freeze the second moment, whose per-step
// change is below bfloat16's resolution). The random bits are a hash of
// (step, row, column): the result depends on nothing else, threads included.
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

using bf16 = uint16_t;  // bfloat16 bits

inline float Load(float m) { return m; }
inline float Load(bf16 m) {
  const uint32_t u = static_cast<uint32_t>(m) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void Store(float* p, float x, uint32_t /*random*/) { *p = x; }
// Stochastic rounding: add 16 random bits below the kept mantissa, truncate.
inline void Store(bf16* p, float x, uint32_t random) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const bool finite = (u & 0x7f800000u) != 0x7f800000u;
  *p = static_cast<bf16>((finite ? u + (random & 0xffffu) : u) >> 16);
}

// 32 random bits for element i of a row (seed: a hash of step and row).
inline uint32_t ElementBits(uint32_t seed, int64_t i) {
  uint32_t h = (seed + static_cast<uint32_t>(i)) * 0x9E3779B1u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  return h;
}

// One row's Adam update; restrict pointers let the compiler vectorize it.
template <typename M>
inline void AdamRowT(float* __restrict__ w, M* __restrict__ m, M* __restrict__ v,
                     const float* __restrict__ g, int64_t d, const AdamConsts& h, uint32_t seed) {
  for (int64_t i = 0; i < d; ++i) {
    const float mi = h.b1 * Load(m[i]) + (1.0f - h.b1) * g[i];
    const float vi = h.b2 * Load(v[i]) + (1.0f - h.b2) * g[i] * g[i];
    uint32_t bits = 0;
    if constexpr (sizeof(M) == 2) bits = ElementBits(seed, i);
    Store(m + i, mi, bits);
    Store(v + i, vi, bits >> 16 | bits << 16);
    // The weight update uses the unrounded moments.
    const float update = (mi * h.inv_bc1) / (std::sqrt(vi * h.inv_bc2) + h.eps);
    w[i] -= h.step_size * (update + h.weight_decay * w[i]);
  }
}

SJ_MULTIVERSION void AdamRow(float* w, float* m, float* v, const float* g, int64_t d,
                             const AdamConsts& h, uint32_t seed) {
  AdamRowT(w, m, v, g, d, h, seed);
}
SJ_MULTIVERSION void AdamRow(float* w, bf16* m, bf16* v, const float* g, int64_t d,
                             const AdamConsts& h, uint32_t seed) {
  AdamRowT(w, m, v, g, d, h, seed);
}

// The rows of one parameter (weight or bias) with their moments.
template <typename M>
struct Rows {
  float* w = nullptr;
  M* m = nullptr;
  M* v = nullptr;
  int64_t d = 0;

  // Rows are visited in increasing id order but far apart: fetch the cache
  // lines of rows a few steps ahead while this one is updated.
  void Prefetch(int64_t row) const {
    PrefetchBytes(w + row * d, d * sizeof(float));
    PrefetchBytes(m + row * d, d * sizeof(M));
    PrefetchBytes(v + row * d, d * sizeof(M));
  }
};
constexpr int kPrefetchRows = 4;

template <typename M>
void UpdateRanges(ffi::ThreadPool& pool, const Rows<M>& weight, const Rows<M>& bias,
                  const std::vector<int64_t>& start, std::vector<uint64_t>& keys,
                  std::vector<int64_t>& unique_in_range, const float* gp, const float* xp,
                  int64_t k, const AdamConsts& h, int32_t step) {
  const int64_t d = weight.d;
  const bool has_bias = bias.w != nullptr;
  const int64_t R = static_cast<int64_t>(unique_in_range.size());
  const uint64_t step_seed = SplitMix64(static_cast<uint64_t>(step));
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
        weight.Prefetch(static_cast<int64_t>(row));
        if (has_bias) bias.Prefetch(static_cast<int64_t>(row));
        while (pf != ke && (*pf >> 32) == row) ++pf;
      };
      for (int i = 0; i < kPrefetchRows; ++i) prefetch_next();
      for (uint64_t* it = kb; it != ke;) {
        prefetch_next();
        const int64_t row = static_cast<int64_t>(*it >> 32);
        std::fill(grad.begin(), grad.end(), 0.0f);
        float grad_bias = 0.0f;
        for (; it != ke && static_cast<int64_t>(*it >> 32) == row; ++it) {
          const int64_t pos = static_cast<int64_t>(*it & 0xffffffffULL);
          Axpy(gp[pos], xp + (pos / k) * d, grad.data(), d);
          grad_bias += gp[pos];
        }
        const uint64_t seed = HashCombine(step_seed, static_cast<uint64_t>(row));
        AdamRow(weight.w + row * d, weight.m + row * d, weight.v + row * d, grad.data(), d, h,
                static_cast<uint32_t>(seed));
        if (has_bias) {
          AdamRow(bias.w + row, bias.m + row, bias.v + row, &grad_bias, 1, h,
                  static_cast<uint32_t>(seed >> 32));
        }
        // Unique ids are written, in order, over the front of this range's
        // key slots (already consumed): no extra buffer needed.
        kb[n_unique++] = static_cast<uint64_t>(row);
      }
      unique_in_range[r] = n_unique;
    }
  });
}

// Starts an in-place output from its input, should XLA ever hand us distinct
// buffers.
void CopyIfDistinct(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

ffi::Error RowSparseAdamImpl(ffi::ThreadPool pool, ffi::AnyBuffer weight,
                             ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                             ffi::AnyBuffer bias, ffi::AnyBuffer bias_mu,
                             ffi::AnyBuffer bias_nu,
                             ffi::AnyBuffer ids, ffi::AnyBuffer g,
                             ffi::AnyBuffer x, ffi::AnyBuffer lr,
                             ffi::AnyBuffer count, ffi::RemainingArgs /*after*/,
                             float b1, float b2,
                             float eps, float weight_decay,
                             ffi::Result<ffi::AnyBuffer> weight_out,
                             ffi::Result<ffi::AnyBuffer> mu_out,
                             ffi::Result<ffi::AnyBuffer> nu_out,
                             ffi::Result<ffi::AnyBuffer> bias_out,
                             ffi::Result<ffi::AnyBuffer> bias_mu_out,
                             ffi::Result<ffi::AnyBuffer> bias_nu_out,
                             ffi::Result<ffi::AnyBuffer> touched) {
  ArgChecker c("row_sparse_adam");
  SJ_RETURN_IF_ERROR(c.Dtype(weight, ffi::F32, "weight"));
  const ffi::DataType moment_type = mu.element_type();
  if (moment_type != ffi::F32 && moment_type != ffi::BF16) {
    return c.Fail(std::string("argument 'mu' must be float32 or bfloat16, got ") + DtypeName(moment_type));
  }
  SJ_RETURN_IF_ERROR(c.Dtype(nu, moment_type, "nu"));
  SJ_RETURN_IF_ERROR(c.Dtype(bias, ffi::F32, "bias"));
  SJ_RETURN_IF_ERROR(c.Dtype(bias_mu, moment_type, "bias_mu"));
  SJ_RETURN_IF_ERROR(c.Dtype(bias_nu, moment_type, "bias_nu"));
  SJ_RETURN_IF_ERROR(c.Dtype(ids, ffi::S32, "ids"));
  SJ_RETURN_IF_ERROR(c.Dtype(g, ffi::F32, "g"));
  SJ_RETURN_IF_ERROR(c.Dtype(x, ffi::F32, "x"));
  SJ_RETURN_IF_ERROR(c.Dtype(lr, ffi::F32, "learning_rate"));
  SJ_RETURN_IF_ERROR(c.Dtype(count, ffi::S32, "count"));
  // A rank-1 weight (a bias [N] on its own) is a weight of width d = 1.
  const bool is_vector = weight.dimensions().size() == 1;
  if (!is_vector) SJ_RETURN_IF_ERROR(c.Shape(weight, {-1, -1}, "weight", "[N, d] or [N]"));
  const int64_t N = weight.dimensions()[0], d = is_vector ? 1 : weight.dimensions()[1];
  const std::vector<int64_t> wshape = is_vector ? std::vector<int64_t>{N} : std::vector<int64_t>{N, d};
  const char* wspec = is_vector ? "[N]" : "[N, d]";
  SJ_RETURN_IF_ERROR(c.Shape(mu, wshape, "mu", wspec));
  SJ_RETURN_IF_ERROR(c.Shape(nu, wshape, "nu", wspec));
  // The bias is [N], or [0] for none.
  SJ_RETURN_IF_ERROR(c.Shape(bias, {-1}, "bias", "[N] or [0]"));
  const bool has_bias = bias.dimensions()[0] != 0;
  if (has_bias && is_vector) return c.Fail("a bias needs a rank-2 weight [N, d]");
  const int64_t nb = has_bias ? N : 0;
  SJ_RETURN_IF_ERROR(c.Shape(bias, {nb}, "bias", "[N] or [0]"));
  SJ_RETURN_IF_ERROR(c.Shape(bias_mu, {nb}, "bias_mu", "the bias's shape"));
  SJ_RETURN_IF_ERROR(c.Shape(bias_nu, {nb}, "bias_nu", "the bias's shape"));
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

  CopyIfDistinct(weight, weight_out);
  CopyIfDistinct(mu, mu_out);
  CopyIfDistinct(nu, nu_out);
  CopyIfDistinct(bias, bias_out);
  CopyIfDistinct(bias_mu, bias_mu_out);
  CopyIfDistinct(bias_nu, bias_nu_out);

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

  auto run = [&](auto* moment_type_tag) {
    using M = std::remove_pointer_t<decltype(moment_type_tag)>;
    Rows<M> wr{weight_out->typed_data<float>(), static_cast<M*>(mu_out->untyped_data()),
               static_cast<M*>(nu_out->untyped_data()), d};
    Rows<M> br;
    if (has_bias) {
      br = Rows<M>{bias_out->typed_data<float>(), static_cast<M*>(bias_mu_out->untyped_data()),
                   static_cast<M*>(bias_nu_out->untyped_data()), 1};
    }
    UpdateRanges(pool, wr, br, start, keys, unique_in_range, gp, xp, k, h, t);
  };
  if (moment_type == ffi::F32) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<bf16*>(nullptr));
  }

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
                                  .Arg<ffi::AnyBuffer>()  // weight [N, d] or [N]
                                  .Arg<ffi::AnyBuffer>()  // mu, weight's shape
                                  .Arg<ffi::AnyBuffer>()  // nu, weight's shape
                                  .Arg<ffi::AnyBuffer>()  // bias [N] or [0]
                                  .Arg<ffi::AnyBuffer>()  // bias_mu
                                  .Arg<ffi::AnyBuffer>()  // bias_nu
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
                                  .Ret<ffi::AnyBuffer>()   // bias
                                  .Ret<ffi::AnyBuffer>()   // bias_mu
                                  .Ret<ffi::AnyBuffer>()   // bias_nu
                                  .Ret<ffi::AnyBuffer>()); // touched [B * k]

}  // namespace sparsejax

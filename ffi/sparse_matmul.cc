// The two products between a batch and a few gathered rows of a weight
// matrix that make up every sparse layer, forward and backward:
//
//   gather_dot:     out[b, j] = <x[b], W[ids[b, j]]> (+ bias[ids[b, j]])  [B, d] -> [B, k]
//   gather_combine: out[b]    = sum_j g[b, j] * W[ids[b, j]]  [B, k] -> [B, d]
//
// sparse_logits is gather_dot (+ bias) and its input gradient gather_combine;
// the embedding bag is gather_combine and its value gradient gather_dot.
// Cost is O(B * k * d) whatever N is. Id -1 is padding (contributes 0).
#include "common.h"

namespace sparsejax {
namespace {

// Rows are gathered in random order; prefetching a few ahead hides latency.
constexpr int64_t kPrefetchAhead = 8;

inline void PrefetchRow(const float* w, const float* bias, const int32_t* ids, int64_t j, int64_t k,
                        int64_t d) {
  if (j >= k) return;
  const int32_t id = ids[j];
  if (id == kPadId) return;
  PrefetchBytes(w + id * d, d * sizeof(float));
  if (bias != nullptr) PrefetchBytes(bias + id, sizeof(float));
}

struct GatherArgs {
  int64_t B, k, d, N;
  const float* bias;  // [N], or null for none
};

ffi::Error CheckGatherArgs(const ArgChecker& c, const ffi::AnyBuffer& dense,
                           const char* dense_name, const char* dense_shape,
                           bool dense_is_x, const ffi::AnyBuffer& weight,
                           const ffi::AnyBuffer& ids, GatherArgs* a) {
  SJ_RETURN_IF_ERROR(c.Dtype(dense, ffi::F32, dense_name));
  SJ_RETURN_IF_ERROR(c.Dtype(weight, ffi::F32, "weight"));
  SJ_RETURN_IF_ERROR(c.Dtype(ids, ffi::S32, "ids"));
  SJ_RETURN_IF_ERROR(c.Shape(weight, {-1, -1}, "weight", "[N, d]"));
  a->N = weight.dimensions()[0];
  a->d = weight.dimensions()[1];
  SJ_RETURN_IF_ERROR(c.Shape(ids, {-1, -1}, "ids", "[B, k]"));
  a->B = ids.dimensions()[0];
  a->k = ids.dimensions()[1];
  SJ_RETURN_IF_ERROR(c.Shape(dense, {a->B, dense_is_x ? a->d : a->k},
                             dense_name, dense_shape));
  return CheckIds(c, ids.typed_data<int32_t>(), a->B * a->k, a->N, "ids", "N",
                  /*allow_pad=*/true, a->k);
}

SJ_MULTIVERSION void GatherDotRows(const float* x, const float* w, const int32_t* ids, float* out,
                                   int64_t b0, int64_t b1, const GatherArgs& a) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * a.d;
    for (int64_t j = 0; j < a.k; ++j) {
      PrefetchRow(w, a.bias, ids + b * a.k, j + kPrefetchAhead, a.k, a.d);
      const int32_t id = ids[b * a.k + j];
      if (id == kPadId) {
        out[b * a.k + j] = 0.0f;
      } else {
        const float dot = Dot(xb, w + id * a.d, a.d);
        out[b * a.k + j] = a.bias != nullptr ? dot + a.bias[id] : dot;
      }
    }
  }
}

SJ_MULTIVERSION void GatherCombineRows(const float* g, const float* w, const int32_t* ids, float* out,
                                       int64_t b0, int64_t b1, const GatherArgs& a) {
  for (int64_t b = b0; b < b1; ++b) {
    float* ob = out + b * a.d;
    std::fill(ob, ob + a.d, 0.0f);
    for (int64_t j = 0; j < a.k; ++j) {
      PrefetchRow(w, nullptr, ids + b * a.k, j + kPrefetchAhead, a.k, a.d);
      const int32_t id = ids[b * a.k + j];
      if (id != kPadId) Axpy(g[b * a.k + j], w + id * a.d, ob, a.d);
    }
  }
}

// Validates, then runs `rows(dense, weight, ids, out, b0, b1, args)` over
// blocks of samples in parallel.
template <typename RowsFn>
ffi::Error GatherImpl(const char* op, const char* dense_name, const char* dense_shape, bool dense_is_x,
                      ffi::ThreadPool& pool, const ffi::AnyBuffer& dense, const ffi::AnyBuffer& weight,
                      const ffi::AnyBuffer& ids, const ffi::AnyBuffer* bias,
                      ffi::Result<ffi::AnyBuffer>& out, RowsFn rows) {
  ArgChecker c(op);
  GatherArgs a;
  SJ_RETURN_IF_ERROR(CheckGatherArgs(c, dense, dense_name, dense_shape, dense_is_x, weight, ids, &a));
  a.bias = nullptr;
  if (bias != nullptr) {  // [N], or [0] for none
    SJ_RETURN_IF_ERROR(c.Dtype(*bias, ffi::F32, "bias"));
    SJ_RETURN_IF_ERROR(c.Shape(*bias, {-1}, "bias", "[N] or [0]"));
    if (bias->dimensions()[0] != 0) {
      SJ_RETURN_IF_ERROR(c.Shape(*bias, {a.N}, "bias", "[N] or [0]"));
      a.bias = bias->typed_data<float>();
    }
  }
  const float* dp = dense.typed_data<float>();
  const float* wp = weight.typed_data<float>();
  const int32_t* ip = ids.typed_data<int32_t>();
  float* op_data = out->typed_data<float>();
  ParallelFor(pool, a.B, 1, [&](int64_t b0, int64_t b1) { rows(dp, wp, ip, op_data, b0, b1, a); });
  return ffi::Error::Success();
}

ffi::Error GatherDotImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer ids,
                         ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out) {
  return GatherImpl("gather_dot", "x", "[B, d]", true, pool, x, weight, ids, &bias, out, GatherDotRows);
}

ffi::Error GatherCombineImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer weight, ffi::AnyBuffer ids,
                             ffi::Result<ffi::AnyBuffer> out) {
  return GatherImpl("gather_combine", "g", "[B, k]", false, pool, g, weight, ids, nullptr, out,
                    GatherCombineRows);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherDot, GatherDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x [B, d]
                                  .Arg<ffi::AnyBuffer>()   // weight [N, d]
                                  .Arg<ffi::AnyBuffer>()   // ids [B, k]
                                  .Arg<ffi::AnyBuffer>()   // bias [N] or [0]
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherCombine, GatherCombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace sparsejax

// The two products between a batch and a few gathered rows of a weight
// matrix that make up every sparse layer, forward and backward:
//
//   gather_dot:     out[b, j] = <x[b], W[ids[b, j]]> (+ bias[ids[b, j]])  [B, d] -> [B, k]
//   gather_combine: out[b]    = sum_j g[b, j] * W[ids[b, j]]  [B, k] -> [B, d]
//
// sparse_logits is gather_dot (+ bias) and its input gradient gather_combine;
// the embedding bag is gather_combine and its value gradient gather_dot.
// Cost is O(B * k * d) whatever N is. Id -1 is padding (contributes 0).
// The weight is float32 or bfloat16 (one handler each; products in float32).
#include <string>
#include <string_view>

#include "common.h"

namespace sparsejax {
namespace {

// Rows are gathered in random order; prefetching a few ahead hides latency.
constexpr int64_t kPrefetchAhead = 8;

template <typename W>
SJ_INLINE void PrefetchRow(const W* w, const float* bias, const int32_t* ids, int64_t j, int64_t k, int64_t d) {
  if (j >= k) return;
  const int32_t id = ids[j];
  if (id == kPadId) return;
  PrefetchBytes(w + id * d, d * sizeof(W));
  if (bias != nullptr) PrefetchBytes(bias + id, sizeof(float));
}

struct GatherArgs {
  int64_t B, k, d, N;
  const float* bias;  // [N], or null for none
};

template <typename W>
SJ_INLINE void GatherDotRowsT(const float* x, const W* w, const int32_t* ids, float* out, int64_t b0, int64_t b1,
                              const GatherArgs& a) {
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

template <typename W>
SJ_INLINE void GatherCombineRowsT(const float* g, const W* w, const int32_t* ids, float* out, int64_t b0,
                                  int64_t b1, const GatherArgs& a) {
  for (int64_t b = b0; b < b1; ++b) {
    float* ob = out + b * a.d;
    std::fill(ob, ob + a.d, 0.0f);
    for (int64_t j = 0; j < a.k; ++j) {
      PrefetchRow(w, static_cast<const float*>(nullptr), ids + b * a.k, j + kPrefetchAhead, a.k, a.d);
      const int32_t id = ids[b * a.k + j];
      if (id != kPadId) Axpy(g[b * a.k + j], w + id * a.d, ob, a.d);
    }
  }
}

// Multiversioned (per-ISA) instances, one per weight type.
#define SJ_GATHER_ROWS(W)                                                                                      \
  SJ_MULTIVERSION void GatherDotRows(const float* x, const W* w, const int32_t* ids, float* out, int64_t b0,   \
                                     int64_t b1, const GatherArgs& a) {                                        \
    GatherDotRowsT(x, w, ids, out, b0, b1, a);                                                                 \
  }                                                                                                            \
  SJ_MULTIVERSION void GatherCombineRows(const float* g, const W* w, const int32_t* ids, float* out,           \
                                         int64_t b0, int64_t b1, const GatherArgs& a) {                        \
    GatherCombineRowsT(g, w, ids, out, b0, b1, a);                                                             \
  }
SJ_GATHER_ROWS(float)
SJ_GATHER_ROWS(bf16)
#undef SJ_GATHER_ROWS

// Checks the ids against the weight, then runs `rows(dense, weight, ids,
// out, b0, b1, args)` over blocks of samples in parallel. The caller has
// checked `dense` and `out` (the shapes that differ between the products).
template <typename WeightBuffer, typename RowsFn>
ffi::Error GatherImpl(Checker& c, ffi::ThreadPool& pool, const F32R2& dense, const WeightBuffer& weight,
                      const S32R2& ids, const char* ids_name, const float* bias, ffi::Result<F32R2>& out,
                      RowsFn rows) {
  c.Ids(ids_name, ids.typed_data(), ids.element_count(), "N", /*allow_pad=*/true, c["k"]);
  SJ_RETURN_IF_ERROR(c.status());
  const GatherArgs a{c["B"], c["k"], c["d"], c["N"], bias};
  const float* dp = dense.typed_data();
  const auto* wp = weight.typed_data();
  const int32_t* ip = ids.typed_data();
  float* op = out->typed_data();
  return ParallelLoop(pool, a.B, 1).Run(c.op(), [&](int64_t, int64_t b0, int64_t b1) {
    rows(dp, wp, ip, op, b0, b1, a);
  });
}

// The products serve several public ops (sparse_logits, embedding_bag and
// their VJPs): the caller passes its own name and that of its ids argument,
// which the errors then use.
constexpr char kOp[] = "op";
constexpr char kIdsName[] = "ids_name";
using OpName = ffi::Attr<std::string_view, kOp>;
using IdsName = ffi::Attr<std::string_view, kIdsName>;

template <ffi::DataType WT>
using Weight = ffi::BufferR2<WT>;
template <ffi::DataType WT>
using WeightPtr = const ffi::NativeType<WT>*;

// x [B, d], weight [N, d], ids [B, k], bias [N] or [0] -> out [B, k]
template <ffi::DataType WT>
ffi::Error GatherDotImpl(ffi::ThreadPool pool, F32R2 x, Weight<WT> weight, S32R2 ids, F32R1 bias, OpName op,
                         IdsName ids_name_attr, ffi::Result<F32R2> out) {
  const std::string ids_name(*ids_name_attr);
  return Guarded(*op, [&](Checker& c) {
    c.Arg("weight", weight, {"N", "d"}).Arg(ids_name.c_str(), ids, {"B", "k"}).Arg("x", x, {"B", "d"});
    c.Ret("out", *out, {"B", "k"});
    const bool has_bias = bias.element_count() != 0;
    if (has_bias) c.Arg("bias", bias, {"N"}, "(or [0] for none)");
    return GatherImpl(c, pool, x, weight, ids, ids_name.c_str(), has_bias ? bias.typed_data() : nullptr, out,
                      [](const float* dp, WeightPtr<WT> wp, const int32_t* ip, float* o, int64_t b0, int64_t b1,
                         const GatherArgs& a) { GatherDotRows(dp, wp, ip, o, b0, b1, a); });
  });
}

// g [B, k], weight [N, d], ids [B, k] -> out [B, d]
template <ffi::DataType WT>
ffi::Error GatherCombineImpl(ffi::ThreadPool pool, F32R2 g, Weight<WT> weight, S32R2 ids, OpName op,
                             IdsName ids_name_attr, ffi::Result<F32R2> out) {
  const std::string ids_name(*ids_name_attr);
  return Guarded(*op, [&](Checker& c) {
    c.Arg("weight", weight, {"N", "d"}).Arg(ids_name.c_str(), ids, {"B", "k"}).Arg("g", g, {"B", "k"});
    c.Ret("out", *out, {"B", "d"});
    return GatherImpl(c, pool, g, weight, ids, ids_name.c_str(), nullptr, out,
                      [](const float* gp, WeightPtr<WT> wp, const int32_t* ip, float* o, int64_t b0, int64_t b1,
                         const GatherArgs& a) { GatherCombineRows(gp, wp, ip, o, b0, b1, a); });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherDot, GatherDotImpl<ffi::F32>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherDotBF16Weight, GatherDotImpl<ffi::BF16>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherCombine, GatherCombineImpl<ffi::F32>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherCombineBF16Weight, GatherCombineImpl<ffi::BF16>);

}  // namespace sparsejax

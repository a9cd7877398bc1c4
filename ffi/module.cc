// Python module exposing the FFI handlers as PyCapsules for
// jax.ffi.register_ffi_target (registered lazily by sparsejax._ffi).
#include <nanobind/nanobind.h>

#include <utility>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Every FFI target: X(name without the "sparsejax_" prefix, handler).
#define SJ_TARGETS(X)                                                              \
  X(gather_dot, GatherDot)                                                         \
  X(gather_combine, GatherCombine)                                                 \
  X(gather_dot_bfloat16_weight, GatherDotBF16Weight)                               \
  X(gather_combine_bfloat16_weight, GatherCombineBF16Weight)                       \
  X(row_sparse_adam_float32, RowSparseAdamF32)                                     \
  X(row_sparse_adam_bfloat16, RowSparseAdamBF16)                                   \
  X(row_sparse_adam_float32_bfloat16_weight, RowSparseAdamF32BF16Weight)           \
  X(row_sparse_adam_bfloat16_bfloat16_weight, RowSparseAdamBF16BF16Weight)         \
  X(simhash, SimHash)                                                              \
  X(dwta, Dwta)                                                                    \
  X(lsh_tables_insert, LshTablesInsert)                                            \
  X(lsh_query, LshQuery)                                                           \
  X(merge_candidates, MergeCandidates)                                             \
  X(cluster_probe, ClusterProbe)                                                   \
  X(row_topk, RowTopk)                                                             \
  X(logistic_regression, LogisticRegression)

namespace sparsejax {
extern "C" {
#define SJ_DECLARE(name, handler) XLA_FFI_Error* handler(XLA_FFI_CallFrame*);
SJ_TARGETS(SJ_DECLARE)
#undef SJ_DECLARE
}
}  // namespace sparsejax

namespace {
nb::capsule Capsule(XLA_FFI_Handler* fn) { return nb::capsule(reinterpret_cast<void*>(fn)); }
}  // namespace

NB_MODULE(_sparsejax, m) {
  m.def("registrations", []() {
    static const std::pair<const char*, XLA_FFI_Handler*> kTargets[] = {
#define SJ_ENTRY(name, handler) {"sparsejax_" #name, sparsejax::handler},
        SJ_TARGETS(SJ_ENTRY)
#undef SJ_ENTRY
    };
    nb::dict d;
    for (const auto& [name, fn] : kTargets) d[name] = Capsule(fn);
    return d;
  });
}

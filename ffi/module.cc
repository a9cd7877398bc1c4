// Python module exposing the FFI handlers as PyCapsules for
// jax.ffi.register_ffi_target (registered lazily by sparsejax._ffi).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace sparsejax {
extern "C" {
XLA_FFI_Error* GatherDot(XLA_FFI_CallFrame*);
XLA_FFI_Error* GatherCombine(XLA_FFI_CallFrame*);
XLA_FFI_Error* GatherDotBF16Weight(XLA_FFI_CallFrame*);
XLA_FFI_Error* GatherCombineBF16Weight(XLA_FFI_CallFrame*);
XLA_FFI_Error* RowSparseAdamF32BF16Weight(XLA_FFI_CallFrame*);
XLA_FFI_Error* RowSparseAdamBF16BF16Weight(XLA_FFI_CallFrame*);
XLA_FFI_Error* RowSparseAdamF32(XLA_FFI_CallFrame*);
XLA_FFI_Error* RowSparseAdamBF16(XLA_FFI_CallFrame*);
XLA_FFI_Error* SimHash(XLA_FFI_CallFrame*);
XLA_FFI_Error* Dwta(XLA_FFI_CallFrame*);
XLA_FFI_Error* LshTablesInsert(XLA_FFI_CallFrame*);
XLA_FFI_Error* LshQuery(XLA_FFI_CallFrame*);
XLA_FFI_Error* MergeCandidates(XLA_FFI_CallFrame*);
}
}  // namespace sparsejax

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_sparsejax, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["sparsejax_gather_dot"] = Capsule(sparsejax::GatherDot);
    d["sparsejax_gather_combine"] = Capsule(sparsejax::GatherCombine);
    d["sparsejax_row_sparse_adam_float32"] = Capsule(sparsejax::RowSparseAdamF32);
    d["sparsejax_row_sparse_adam_bfloat16"] = Capsule(sparsejax::RowSparseAdamBF16);
    // bfloat16 weights
    d["sparsejax_gather_dot_bfloat16_weight"] = Capsule(sparsejax::GatherDotBF16Weight);
    d["sparsejax_gather_combine_bfloat16_weight"] = Capsule(sparsejax::GatherCombineBF16Weight);
    d["sparsejax_row_sparse_adam_float32_bfloat16_weight"] = Capsule(sparsejax::RowSparseAdamF32BF16Weight);
    d["sparsejax_row_sparse_adam_bfloat16_bfloat16_weight"] = Capsule(sparsejax::RowSparseAdamBF16BF16Weight);
    d["sparsejax_simhash"] = Capsule(sparsejax::SimHash);
    d["sparsejax_dwta"] = Capsule(sparsejax::Dwta);
    d["sparsejax_lsh_tables_insert"] = Capsule(sparsejax::LshTablesInsert);
    d["sparsejax_lsh_query"] = Capsule(sparsejax::LshQuery);
    d["sparsejax_merge_candidates"] = Capsule(sparsejax::MergeCandidates);
    return d;
  });
}

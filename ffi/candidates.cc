// merge_candidates: each sample's active set from an already ranked list of
// candidate ids (e.g. the members of the clusters of a clustered index that
// score highest for the sample, best cluster first).
//
//   candidates [B, C] int32  ranked candidate ids, -1 = none (skipped)
//   labels     [B, M] int32  true labels, -1 padded (training; M may be 0)
//   seed       []     uint32 random fill
//   num_rows   []     int32  N, ids are in [0, N)
//   -> active [B, k] int32: distinct labels, then the first distinct
//      candidates in rank order (at most max_from_candidates of them), then
//      distinct random ids; num_from_candidates [B] int32.
//
// One thread builds each row, randomness hashes (seed, row, position): the
// result is the same for any thread count.
#include "active_set.h"
#include "common.h"

namespace sparsejax {
namespace {

ffi::Error MergeCandidatesImpl(ffi::ThreadPool pool, ffi::AnyBuffer candidates, ffi::AnyBuffer labels,
                               ffi::AnyBuffer seed, ffi::AnyBuffer num_rows, int64_t max_from_candidates,
                               ffi::Result<ffi::AnyBuffer> active, ffi::Result<ffi::AnyBuffer> num_from_candidates) {
  ArgChecker c("merge_candidates");
  SJ_RETURN_IF_ERROR(c.Dtype(candidates, ffi::S32, "candidates"));
  SJ_RETURN_IF_ERROR(c.Shape(candidates, {-1, -1}, "candidates", "[B, C]"));
  const int64_t B = candidates.dimensions()[0];
  const int64_t C = candidates.dimensions()[1];
  SJ_RETURN_IF_ERROR(c.Dtype(labels, ffi::S32, "labels"));
  SJ_RETURN_IF_ERROR(c.Shape(labels, {B, -1}, "labels", "[B, max_labels]"));
  SJ_RETURN_IF_ERROR(c.Dtype(seed, ffi::U32, "seed"));
  SJ_RETURN_IF_ERROR(c.Shape(seed, {}, "seed", "[]"));
  SJ_RETURN_IF_ERROR(c.Dtype(num_rows, ffi::S32, "num_rows"));
  SJ_RETURN_IF_ERROR(c.Shape(num_rows, {}, "num_rows", "[]"));
  SJ_RETURN_IF_ERROR(c.Dtype(*active, ffi::S32, "active"));
  SJ_RETURN_IF_ERROR(c.Shape(*active, {B, -1}, "active", "[B, k]"));
  SJ_RETURN_IF_ERROR(c.Dtype(*num_from_candidates, ffi::S32, "num_from_candidates"));
  SJ_RETURN_IF_ERROR(c.Shape(*num_from_candidates, {B}, "num_from_candidates", "[B]"));
  const int64_t k = active->dimensions()[1];
  const int64_t N = *num_rows.typed_data<int32_t>();
  if (k < 1 || k > N) {
    return c.Fail("k (active set size) = " + std::to_string(k) + " must be in [1, N = " + std::to_string(N) + "]");
  }
  if (max_from_candidates < 0) {
    return c.Fail("max_from_candidates must be >= 0, got " + std::to_string(max_from_candidates));
  }
  const int64_t LM = labels.dimensions()[1];
  const int32_t* lp = labels.typed_data<int32_t>();
  const int32_t* cp = candidates.typed_data<int32_t>();
  SJ_RETURN_IF_ERROR(CheckIds(c, lp, B * LM, N, "labels", "N", /*allow_pad=*/true, LM));
  // Candidates come from caller state (an index built for some layer): checked like labels.
  SJ_RETURN_IF_ERROR(CheckIds(c, cp, B * C, N, "candidates", "N", /*allow_pad=*/true, C));
  const uint64_t s = *seed.typed_data<uint32_t>();
  int32_t* out = active->typed_data<int32_t>();
  int32_t* from = num_from_candidates->typed_data<int32_t>();
  std::vector<int64_t> too_many_labels(B, -1);

  ParallelFor(pool, B, 4, [&](int64_t b0, int64_t b1) {
    IdSet set(k);
    std::vector<int32_t> unused;
    for (int64_t b = b0; b < b1; ++b) {
      int32_t* o = out + b * k;
      int64_t n;
      from[b] = 0;
      set.Clear();
      too_many_labels[b] = PutLabels(lp + b * LM, LM, k, set, o, &n);
      if (too_many_labels[b] >= 0) continue;
      const int64_t stop = std::min(k, n + max_from_candidates);
      int32_t taken = 0;
      for (int64_t j = 0; j < C && n < stop; ++j) {
        const int32_t id = cp[b * C + j];
        if (id != kPadId && set.Insert(id)) { o[n++] = id; ++taken; }
      }
      from[b] = taken;
      FillRandom(s, b, N, k, set, o, n, unused);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    if (too_many_labels[b] >= 0) {
      return c.Fail("row " + std::to_string(b) + " of 'labels' has more distinct labels than k = " +
                    std::to_string(k) + " (the active set must hold all of them)");
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MergeCandidates, MergeCandidatesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // candidates [B, C]
                                  .Arg<ffi::AnyBuffer>()  // labels [B, max_labels]
                                  .Arg<ffi::AnyBuffer>()  // seed []
                                  .Arg<ffi::AnyBuffer>()  // num_rows []
                                  .Attr<int64_t>("max_from_candidates")
                                  .Ret<ffi::AnyBuffer>()   // active [B, k]
                                  .Ret<ffi::AnyBuffer>()); // num_from_candidates [B]

}  // namespace sparsejax

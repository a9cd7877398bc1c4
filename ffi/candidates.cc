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
#include <string>
#include <vector>

#include "active_set.h"
#include "common.h"

namespace sparsejax {
namespace {

constexpr char kMaxFromCandidates[] = "max_from_candidates";

// candidates [B, C], labels [B, max_labels], seed [], num_rows [] -> active [B, k], num_from_candidates [B]
ffi::Error MergeCandidatesImpl(ffi::ThreadPool pool, S32R2 candidates, S32R2 labels, U32R0 seed, S32R0 num_rows,
                               ffi::Attr<int64_t, kMaxFromCandidates> max_from_attr, ffi::Result<S32R2> active,
                               ffi::Result<S32R1> num_from_candidates) {
  const int64_t max_from = *max_from_attr;
  return Guarded("merge_candidates", [&](Checker& c) {
    c.Arg("candidates", candidates, {"B", "C"}).Arg("labels", labels, {"B", "max_labels"});
    c.Ret("active", *active, {"B", "k"}).Ret("num_from_candidates", *num_from_candidates, {"B"});
    CheckActiveSet(c, num_rows, labels);
    c.Require(max_from >= 0, [&] {
      return "attribute 'max_from_candidates' must be >= 0, got " + std::to_string(max_from);
    });
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t B = c["B"], C = c["C"], LM = c["max_labels"], N = c["N"], k = c["k"];
    // Candidates come from caller state (an index built for some layer): checked like labels.
    c.Ids("candidates", candidates.typed_data(), candidates.element_count(), "N", /*allow_pad=*/true, C);
    SJ_RETURN_IF_ERROR(c.status());
    const int32_t* lp = labels.typed_data();
    const int32_t* cp = candidates.typed_data();
    const uint64_t s = *seed.typed_data();
    int32_t* out = active->typed_data();
    int32_t* from = num_from_candidates->typed_data();
    // Per-row error slots, reported after the parallel loop (lowest row first).
    std::vector<int64_t> too_many_labels(B, -1);
    ParallelLoop loop(pool, B, 4);
    std::vector<ActiveSetScratch> scratch;
    scratch.reserve(loop.workers());
    for (int64_t w = 0; w < loop.workers(); ++w) scratch.emplace_back(k, N);
    SJ_RETURN_IF_ERROR(loop.Run(c.op(), [&](int64_t w, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int32_t* o = out + b * k;
        int64_t n;
        from[b] = 0;
        too_many_labels[b] = PutLabels(lp + b * LM, LM, k, scratch[w], o, &n);
        if (too_many_labels[b] >= 0) continue;
        const int64_t stop = std::min(k, n + max_from);
        int32_t taken = 0;
        for (int64_t j = 0; j < C && n < stop; ++j) {
          const int32_t id = cp[b * C + j];
          if (id != kPadId && scratch[w].set.Insert(id)) {
            o[n++] = id;
            ++taken;
          }
        }
        from[b] = taken;
        FillRandom(s, b, N, k, scratch[w], o, n);
      }
    }));
    for (int64_t b = 0; b < B && c.ok(); ++b) {
      c.Require(too_many_labels[b] < 0, [&] {
        return "row " + std::to_string(b) + " of 'labels' has more distinct labels than k = " + std::to_string(k) +
               " (the active set must hold all of them)";
      });
    }
    return c.status();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MergeCandidates, MergeCandidatesImpl);

}  // namespace sparsejax

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
//
// cluster_probe: the ranked candidates themselves, from a clustered index.
//
//   scores  [B, C]   float32  each query's score of each cluster
//   offsets [C + 1]  int32    cluster c's members are rows[offsets[c]:offsets[c + 1]]
//   rows    [R]      int32    member ids grouped by cluster (passed through unread)
//   -> ids [B, count] int32: the members of the query's best clusters (score
//      descending, lower cluster first on ties, NaN last, empty clusters
//      skipped), at most `probes` clusters, best cluster first; -1 after.
//
// A partial sort of only as many clusters as the members need: O(C log m)
// per query for the m clusters used, where a full top_k over C (XLA:CPU
// sorts the whole row) cost most of a training step's candidate query.
#include <algorithm>
#include <cmath>
#include <cstring>
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

constexpr char kProbes[] = "probes";

// scores [B, C], offsets [C + 1], rows [R] -> ids [B, count]
ffi::Error ClusterProbeImpl(ffi::ThreadPool pool, F32R2 scores, S32R1 offsets, S32R1 rows,
                            ffi::Attr<int64_t, kProbes> probes_attr, ffi::Result<S32R2> ids) {
  const int64_t probes = *probes_attr;
  return Guarded("index_probe", [&](Checker& c) {
    c.Arg("scores", scores, {"B", "C"}).Arg("rows", rows, {"R"}).Ret("ids", *ids, {"B", "count"});
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t B = c["B"], C = c["C"], R = c["R"], count = c["count"];
    c.Require(offsets.element_count() == C + 1, [&] {
      return "argument 'index.offsets' must have shape [C + 1] with C = " + std::to_string(C) +
             " (from 'scores'), got [" + std::to_string(offsets.element_count()) + "]";
    });
    c.Require(probes >= 1, [&] { return "attribute 'probes' must be >= 1, got " + std::to_string(probes); });
    SJ_RETURN_IF_ERROR(c.status());
    // The offsets come from caller state: a decreasing or out-of-range one would read past 'rows'.
    const int32_t* off = offsets.typed_data();
    for (int64_t k = 0; k <= C && c.ok(); ++k) {
      const int64_t lo = k == 0 ? 0 : off[k - 1];
      c.Require(off[k] >= lo && off[k] <= R, [&] {
        return "argument 'index.offsets' must be non-decreasing in [0, R = " + std::to_string(R) +
               "] (R from 'rows'), got offsets[" + std::to_string(k) + "] = " + std::to_string(off[k]) +
               (k == 0 ? std::string() : " after " + std::to_string(lo));
      });
    }
    SJ_RETURN_IF_ERROR(c.status());
    const float* sp = scores.typed_data();
    const int32_t* rp = rows.typed_data();
    int32_t* out = ids->typed_data();
    const int64_t max_probes = std::min(probes, C);
    // Clusters sorted per query at first: twice the average number the members need, and more if they fall short.
    const int64_t members = off[C] - off[0];
    const int64_t guess = members > 0 ? 2 * ((count * C + members - 1) / members) + 8 : C;
    ParallelLoop loop(pool, B, 8);
    std::vector<std::vector<uint64_t>> order(loop.workers());
    for (auto& o : order) o.reserve(C);
    SJ_RETURN_IF_ERROR(loop.Run(c.op(), [&](int64_t w, int64_t b0, int64_t b1) {
      std::vector<uint64_t>& ord = order[w];
      for (int64_t b = b0; b < b1; ++b) {
        // One integer key per non-empty cluster, ascending = best first: the score's bits made monotone
        // (descending), NaN after everything, then the cluster id (ties to the lower id). A strict total
        // order, so the result is unique, and integer compares keep the selection cheap.
        const float* s = sp + b * C;
        ord.clear();
        for (int64_t k = 0; k < C; ++k) {
          if (off[k + 1] > off[k]) ord.push_back((static_cast<uint64_t>(DescendingKey(s[k])) << 32) | k);
        }
        const int64_t usable = std::min<int64_t>(max_probes, ord.size());
        int32_t* o = out + b * count;
        int64_t n = 0, sorted = 0;
        for (int64_t p = 0; p < usable && n < count; ++p) {
          if (p == sorted) {  // rank the next batch of clusters among those not yet ranked: O(C) + O(m log m)
            const int64_t upto = std::min<int64_t>(usable, sorted == 0 ? guess : 2 * sorted);
            std::nth_element(ord.begin() + sorted, ord.begin() + (upto - 1), ord.end());
            std::sort(ord.begin() + sorted, ord.begin() + upto);
            sorted = upto;
          }
          const int64_t k = static_cast<int64_t>(ord[p] & 0xFFFFFFFFu);
          for (int64_t j = off[k]; j < off[k + 1] && n < count; ++j) o[n++] = rp[j];
        }
        std::fill(o + n, o + count, kPadId);
      }
    }));
    return c.status();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MergeCandidates, MergeCandidatesImpl);
XLA_FFI_DEFINE_HANDLER_SYMBOL(ClusterProbe, ClusterProbeImpl);

}  // namespace sparsejax

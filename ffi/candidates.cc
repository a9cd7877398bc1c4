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
//   rows    [R]      int32    member ids grouped by cluster, in [0, R): the index holds one entry per row of
//                             the layer (its rows past offsets[C] are -1, outside every cluster), so R is N
//   -> ids [B, count] int32: the members of the query's best clusters (score
//      descending, lower cluster first on ties, NaN last, empty clusters
//      skipped), at most `probes` clusters, best cluster first; -1 after.
//
// A partial sort of only as many clusters as the members need: O(C log m)
// per query for the m clusters used, where a full top_k over C (XLA:CPU
// sorts the whole row) cost most of a training step's candidate query. From
// 1,024 clusters on, only the clusters below a threshold sampled from every
// 16th cluster are ranked (one pass over the scores, no selection among all
// C); all of them only where those fall short. The same result either way.
// Every member copied out is checked against [0, R) as it is copied (the ids come from caller state, e.g. an
// index loaded from a file): a bad one is an error naming its position in 'rows', never a returned id. Only the
// copied members are checked, in the copy's own pass (a check of all R ids would read the whole index, N ids,
// on every training step, where a probe copies B * count).
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
constexpr uint64_t kEmpty = ~uint64_t{0};

// Sorts keys[from:upto] into place as the next best of keys[from:end] (O(end - from) + O(m log m)): a ranking
// in batches, for as many keys as turn out to be needed.
void SortNextBatch(std::vector<uint64_t>& keys, int64_t from, int64_t upto, int64_t end) {
  std::nth_element(keys.begin() + from, keys.begin() + (upto - 1), keys.begin() + end);
  std::sort(keys.begin() + from, keys.begin() + upto);
}

// Copies the members of clusters keys[0:m] (in that order) to o[*n:], up to `count`; whether `count` was reached.
// A member outside [0, limit) is copied too, and the first one's position in `rows` goes to *bad (if still -1).
bool TakeMembers(const uint64_t* keys, int64_t m, const int32_t* off, const int32_t* rows, int64_t count,
                 uint32_t limit, int32_t* o, int64_t* n, int64_t* bad) {
  for (int64_t p = 0; p < m && *n < count; ++p) {
    const int64_t k = static_cast<int64_t>(keys[p] & 0xFFFFFFFFu);
    const int64_t take = std::min<int64_t>(off[k + 1] - off[k], count - *n);
    const int32_t* from = rows + off[k];
    uint32_t outside = 0;  // branch-free (vectorized with the copy); a negative id is a huge unsigned one
    for (int64_t i = 0; i < take; ++i) {
      o[*n + i] = from[i];
      outside |= static_cast<uint32_t>(static_cast<uint32_t>(from[i]) >= limit);
    }
    for (int64_t i = 0; outside && *bad < 0 && i < take; ++i) {
      if (static_cast<uint32_t>(from[i]) >= limit) *bad = off[k] + i;
    }
    *n += take;
  }
  return *n >= count;
}

// Narrows a probe to the clusters most likely to supply its members: keys[0:q] gets, in any order, every cluster
// whose key is at most a threshold, and q is returned. The threshold comes from every 16th cluster, ranked: the
// key at which the sampled clusters' members, 16 times over, reach twice `count`. So the clusters below it hold
// about 2 count members however the sizes go with the scores (the best clusters can be the smallest ones).
// One pass over the C scores and a partial sort of C / 16 keys (`first_batch` of them at first), where a
// selection among all C keys (nth_element's mispredicted branches) took most of a probe. Returns 0 (keys
// untouched) where there are too few clusters to gain, or the sample does not reach the members within its better
// half.
int64_t AdmitBelowSampledThreshold(const float* s, const uint64_t* empty_key, const int32_t* off, int64_t C,
                                   int64_t count, int64_t first_batch, std::vector<uint64_t>& sample,
                                   std::vector<uint64_t>& keys) {
  constexpr int64_t kStride = 16;
  if (C < 1024) return 0;
  sample.clear();
  for (int64_t k = 0; k < C; k += kStride) sample.push_back(std::max(RankKey(s[k], k), empty_key[k]));
  const int64_t size = static_cast<int64_t>(sample.size()), half = size / 2;
  int64_t r = 0, members = 0, sorted = 0;
  for (; r < half && kStride * members < 2 * count; ++r) {
    if (r == sorted) {  // sort the sample in batches too: first twice what the average cluster size says
      const int64_t upto = std::min(size, sorted == 0 ? first_batch : 2 * sorted);
      SortNextBatch(sample, sorted, upto, size);
      sorted = upto;
    }
    const int64_t k = static_cast<int64_t>(sample[r] & 0xFFFFFFFFu);
    members += sample[r] == kEmpty ? 0 : off[k + 1] - off[k];
  }
  if (kStride * members < 2 * count || sample[r - 1] == kEmpty) return 0;
  const uint64_t threshold = sample[r - 1];
  keys.resize(C);
  int64_t q = 0;
  for (int64_t k = 0; k < C; ++k) {  // branch-free: every key is stored, the count moves past those below
    const uint64_t key = std::max(RankKey(s[k], k), empty_key[k]);
    keys[q] = key;
    q += key <= threshold;
  }
  return q;
}

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
    // Empty clusters never take a probe: their key is kEmpty, above every cluster's (ids are < 2^32 - 1).
    std::vector<uint64_t> empty_key(C);
    int64_t nonempty = 0;
    for (int64_t k = 0; k < C; ++k) {
      const bool empty = off[k + 1] == off[k];
      empty_key[k] = empty ? kEmpty : 0;
      nonempty += !empty;
    }
    const int64_t usable = std::min(max_probes, nonempty);
    // The sampled clusters (every 16th) that twice `count` members need if sizes were even, twice over.
    const int64_t sample_batch = std::max<int64_t>(4, guess / 8 + 2);
    // Per-query error slots (the position in 'rows' of its first member outside [0, R)), reported after the
    // parallel loop, lowest query first: the message does not depend on the thread count.
    std::vector<int64_t> bad_member(B, -1);
    const uint32_t limit = static_cast<uint32_t>(std::min<int64_t>(R, int64_t{1} << 31));
    ParallelLoop loop(pool, B, 8);
    std::vector<std::vector<uint64_t>> order(loop.workers()), sample(loop.workers());
    for (auto& o : order) o.reserve(C);
    SJ_RETURN_IF_ERROR(loop.Run(c.op(), [&](int64_t w, int64_t b0, int64_t b1) {
      std::vector<uint64_t>& ord = order[w];
      for (int64_t b = b0; b < b1; ++b) {
        const float* s = sp + b * C;
        int32_t* o = out + b * count;
        // Rank the clusters batch by batch, at first among those below a sampled threshold (their members
        // usually suffice), else (or if they fall short) among all of them: the same clusters either way.
        int64_t n = 0;
        for (int64_t among = AdmitBelowSampledThreshold(s, empty_key.data(), off, C, count, sample_batch, sample[w],
                                                      ord);;) {
          const bool narrowed = among > 0;
          if (!narrowed) {
            ord.clear();
            for (int64_t k = 0; k < C; ++k) {
              if (empty_key[k] == 0) ord.push_back(RankKey(s[k], k));
            }
            among = static_cast<int64_t>(ord.size());
          }
          n = 0;
          bad_member[b] = -1;  // a narrowed pass that falls short is taken again in full
          int64_t p = 0, sorted = 0;
          for (; p < usable && n < count; ++p) {
            if (p == sorted) {  // rank the next batch of clusters among those not yet ranked
              if (sorted == among) break;  // only when narrowed: all of those taken
              const int64_t upto = std::min({usable, among, sorted == 0 ? guess : 2 * sorted});
              SortNextBatch(ord, sorted, upto, among);
              sorted = upto;
            }
            TakeMembers(ord.data() + p, 1, off, rp, count, limit, o, &n, &bad_member[b]);
          }
          if (!narrowed || n >= count || p == usable) break;
          among = 0;  // the clusters below the threshold fell short: again, among all
        }
        std::fill(o + n, o + count, kPadId);
      }
    }));
    for (int64_t b = 0; b < B && c.ok(); ++b) {
      c.Require(bad_member[b] < 0, [&] {
        const int64_t i = bad_member[b];
        const int64_t k = std::upper_bound(off, off + C + 1, static_cast<int32_t>(i)) - off - 1;
        return "argument 'index.rows' has id " + std::to_string(rp[i]) + " at position " + std::to_string(i) +
               " (a member of cluster " + std::to_string(k) + ", probed for query " + std::to_string(b) +
               "), outside [0, N = " + std::to_string(R) + ") (N: the length of 'rows', one entry per row)";
      });
    }
    return c.status();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MergeCandidates, MergeCandidatesImpl);
XLA_FFI_DEFINE_HANDLER_SYMBOL(ClusterProbe, ClusterProbeImpl);

}  // namespace sparsejax

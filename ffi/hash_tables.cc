// LSH hash tables over the rows of a weight matrix, held as plain arrays:
//   buckets [L, 2^K, S] int32  row ids, -1 where empty
//   counts  [L, 2^K]    int32  how many rows were ever offered to the bucket
//
// lsh_tables_insert offers rows to their buckets (FIFO ring or reservoir
// sampling once a bucket holds S ids), optionally clearing the tables first
// (a full build). lsh_query turns each query's L codes into a fixed-size,
// duplicate-free active set: true labels, then table candidates ranked by how
// many tables returned them, then distinct random fill.
//
// Every table (insert) or query row (query) is handled by one thread in a
// fixed order, and randomness is a hash of (seed, position), so results are
// the same for any thread count.
#include <cstring>

#include "active_set.h"
#include "common.h"

namespace sparsejax {
namespace {

// Which id a full bucket gives up for a new one (the "policy" attribute).
enum class Policy : int32_t { kFifo = 0, kReservoir = 1 };

}  // namespace
}  // namespace sparsejax

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(sparsejax::Policy);

namespace sparsejax {
namespace {

// Counts are capped so they never overflow; a FIFO count keeps its value mod
// S (the ring position) and stays >= S (the bucket stays full).
constexpr int32_t kCountCap = 1 << 30;

// Binds L, num_buckets and bucket_size from the tables, `rows` from the codes
// (one code per table for each of them), and checks the codes' range.
void CheckTablesAndCodes(Checker& c, const S32R3& buckets, const S32R2& counts, const S32R2& codes,
                         const char* rows) {
  c.Arg("buckets", buckets, {"L", "num_buckets", "bucket_size"}).Arg("counts", counts, {"L", "num_buckets"});
  c.Arg("codes", codes, {rows, "L"});
  if (!c.ok()) return;
  c.Require(c["bucket_size"] >= 1, [] { return std::string("bucket_size (buckets.shape[2]) must be >= 1"); });
  c.Ids("codes", codes.typed_data(), codes.element_count(), "num_buckets", /*allow_pad=*/false, c["L"]);
}

// Offers rows (ids, codes) to table l's buckets, in order. Returns false if
// a bucket's count is corrupt (not from init_tables/insert); *bad_count then
// holds it.
bool InsertIntoTable(int64_t l, int32_t* table, int32_t* tcount, const int32_t* ids, const int32_t* codes,
                     int64_t n, int64_t L, int64_t NB, int64_t S, Policy policy, uint64_t seed, int32_t* bad_count) {
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (id == kPadId) continue;
    const int64_t bucket = codes[i * L + l];
    int32_t* slots = table + bucket * S;
    const int32_t seen = tcount[bucket];
    if (seen < 0 || seen >= kCountCap) {
      *bad_count = seen;
      return false;
    }
    const int64_t filled = std::min<int64_t>(seen, S);
    // A re-inserted row that is still in its bucket is not added twice.
    if (std::find(slots, slots + filled, id) != slots + filled) continue;
    int64_t slot = -1;
    if (seen < S) {
      slot = seen;
    } else if (policy == Policy::kFifo) {
      slot = seen % S;
    } else {
      const uint64_t r = Bounded(Hash3(seed, l * NB + bucket, seen), static_cast<uint64_t>(seen) + 1);
      if (r < static_cast<uint64_t>(S)) slot = static_cast<int64_t>(r);
    }
    if (slot >= 0) slots[slot] = id;
    int32_t next = seen + 1;
    if (next >= kCountCap) {
      next = policy == Policy::kFifo ? static_cast<int32_t>(S + next % S) : kCountCap - 1;
    }
    tcount[bucket] = next;
  }
  return true;
}

constexpr char kPolicy[] = "policy";
constexpr char kReset[] = "reset";
constexpr char kNumRows[] = "num_rows";

// buckets [L, NB, S], counts [L, NB], codes [n, L], ids [n], seed [] -> buckets, counts
ffi::Error InsertImpl(ffi::ThreadPool pool, S32R3 buckets, S32R2 counts, S32R2 codes, S32R1 ids, U32R0 seed,
                      ffi::Attr<Policy, kPolicy> policy_attr, ffi::Attr<bool, kReset> reset,
                      ffi::Attr<int64_t, kNumRows> num_rows_attr, ffi::Result<S32R3> buckets_out,
                      ffi::Result<S32R2> counts_out) {
  const Policy policy = *policy_attr;
  const int64_t num_rows = *num_rows_attr;
  return Guarded("lsh_tables_insert", [&](Checker& c) {
    CheckTablesAndCodes(c, buckets, counts, codes, "n");
    c.Arg("ids", ids, {"n"});
    c.Ret("buckets", *buckets_out, {"L", "num_buckets", "bucket_size"}).Ret("counts", *counts_out, {"L", "num_buckets"});
    c.Require(policy == Policy::kFifo || policy == Policy::kReservoir, [&] {
      return "attribute 'policy' must be 0 (fifo) or 1 (reservoir), got " + std::to_string(static_cast<int>(policy));
    });
    c.Require(num_rows >= 0 && num_rows < (int64_t{1} << 31), [&] {
      return "attribute 'num_rows' must be in [0, 2^31 - 1], got " + std::to_string(num_rows);
    });
    c.Bind("num_rows", num_rows, "attribute 'num_rows'");
    c.Ids("ids", ids.typed_data(), ids.element_count(), "num_rows", /*allow_pad=*/true);
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t L = c["L"], NB = c["num_buckets"], S = c["bucket_size"], n = c["n"];
    int32_t* bk = buckets_out->typed_data();
    int32_t* cnt = counts_out->typed_data();
    if (*reset) {
      std::fill(bk, bk + L * NB * S, kPadId);  // A full build: the old contents are not needed.
      std::fill(cnt, cnt + L * NB, 0);
    } else {
      CopyIfDistinct(buckets, buckets_out);
      CopyIfDistinct(counts, counts_out);
    }
    const int32_t* cp = codes.typed_data();
    const int32_t* idp = ids.typed_data();
    const uint64_t s = *seed.typed_data();
    // Per-table error slots, reported after the parallel loop (lowest table first).
    std::vector<char> table_ok(L, 1);
    std::vector<int32_t> bad_count(L, 0);
    SJ_RETURN_IF_ERROR(ParallelLoop(pool, L, 1).Run(c.op(), [&](int64_t, int64_t l0, int64_t l1) {
      for (int64_t l = l0; l < l1; ++l) {
        table_ok[l] = InsertIntoTable(l, bk + l * NB * S, cnt + l * NB, idp, cp, n, L, NB, S, policy, s,
                                      &bad_count[l]);
      }
    }));
    for (int64_t l = 0; l < L; ++l) {
      c.Require(table_ok[l], [&] {
        return "argument 'counts' holds " + std::to_string(bad_count[l]) + " in table " + std::to_string(l) +
               ", outside [0, 2^30): the tables must come from init_tables";
      });
    }
    return c.status();
  });
}

// One worker's scratch for lsh_query, allocated before the parallel loop.
struct QueryScratch {
  QueryScratch(int64_t k, int64_t max_candidates, int64_t N) : row(k, N) {
    cand.reserve(max_candidates);
    ranked.reserve(max_candidates);
  }
  ActiveSetScratch row;
  std::vector<int32_t> cand;
  std::vector<std::pair<uint64_t, int32_t>> ranked;  // (rank key, id)
};

struct QueryArgs {
  int64_t L, NB, S, LM, k, N;
  const int32_t *buckets, *counts, *codes, *labels;
  uint64_t seed;
};

// Fills row b's active set out[0..k) and returns how many came from the
// tables, or -1 if the labels do not fit (then *bad = the label's column),
// or -2 if a table holds an id outside [0, N) (then *bad = that id).
int32_t QueryRow(const QueryArgs& q, int64_t b, QueryScratch& w, int32_t* out, int64_t* bad) {
  const int64_t k = q.k, N = q.N;
  int64_t n;
  *bad = PutLabels(q.labels + b * q.LM, q.LM, k, w.row, out, &n);
  if (*bad >= 0) return -1;
  // Table candidates, ranked by frequency over the L tables.
  w.cand.clear();
  for (int64_t l = 0; l < q.L; ++l) {
    const int64_t bucket = q.codes[b * q.L + l];
    const int64_t filled = std::min<int64_t>(q.counts[l * q.NB + bucket], q.S);
    const int32_t* slots = q.buckets + (l * q.NB + bucket) * q.S;
    for (int64_t i = 0; i < filled; ++i) {
      // Tables are caller state: they may have been built for another layer.
      if (slots[i] >= N || slots[i] < kPadId) {
        *bad = slots[i];
        return -2;
      }
      if (slots[i] != kPadId) w.cand.push_back(slots[i]);
    }
  }
  std::sort(w.cand.begin(), w.cand.end());
  w.ranked.clear();
  for (size_t i = 0; i < w.cand.size();) {
    size_t j = i;
    while (j < w.cand.size() && w.cand[j] == w.cand[i]) ++j;
    // Higher frequency first; ties in a seeded random order.
    const uint64_t key = (static_cast<uint64_t>(q.L * q.S - (j - i)) << 40) |
                         (HashCombine(q.seed, static_cast<uint64_t>(w.cand[i])) >> 24);
    w.ranked.emplace_back(key, w.cand[i]);
    i = j;
  }
  std::sort(w.ranked.begin(), w.ranked.end());
  int32_t taken = 0;
  for (const auto& r : w.ranked) {
    if (n == k) break;
    if (w.row.set.Insert(r.second)) {
      out[n++] = r.second;
      ++taken;
    }
  }
  FillRandom(q.seed, b, N, k, w.row, out, n);
  return taken;
}

// buckets [L, NB, S], counts [L, NB], codes [B, L], labels [B, max_labels],
// seed [], num_rows [] -> active [B, k], num_from_tables [B]
ffi::Error QueryImpl(ffi::ThreadPool pool, S32R3 buckets, S32R2 counts, S32R2 codes, S32R2 labels, U32R0 seed,
                     S32R0 num_rows, ffi::Result<S32R2> active, ffi::Result<S32R1> num_from_tables) {
  return Guarded("lsh_query", [&](Checker& c) {
    CheckTablesAndCodes(c, buckets, counts, codes, "B");
    c.Arg("labels", labels, {"B", "max_labels"});
    c.Ret("active", *active, {"B", "k"}).Ret("num_from_tables", *num_from_tables, {"B"});
    CheckActiveSet(c, num_rows, labels);
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t B = c["B"], LM = c["max_labels"], N = c["N"], k = c["k"];
    const QueryArgs q{c["L"], c["num_buckets"], c["bucket_size"], LM, k, N, buckets.typed_data(),
                      counts.typed_data(), codes.typed_data(), labels.typed_data(), *seed.typed_data()};
    int32_t* out = active->typed_data();
    int32_t* from_tables = num_from_tables->typed_data();
    // Per-row error slots, reported after the parallel loop (lowest row first).
    std::vector<int64_t> bad(B, 0);
    ParallelLoop loop(pool, B, 4);
    std::vector<QueryScratch> scratch;
    scratch.reserve(loop.workers());
    for (int64_t w = 0; w < loop.workers(); ++w) scratch.emplace_back(k, q.L * q.S, N);
    SJ_RETURN_IF_ERROR(loop.Run(c.op(), [&](int64_t w, int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) from_tables[b] = QueryRow(q, b, scratch[w], out + b * k, &bad[b]);
    }));
    for (int64_t b = 0; b < B && c.ok(); ++b) {
      c.Require(from_tables[b] != -1, [&] {
        return "row " + std::to_string(b) + " of 'labels' has more distinct labels than k = " + std::to_string(k) +
               " (the active set must hold all of them)";
      });
      c.Require(from_tables[b] != -2, [&] {
        return "the tables hold id " + std::to_string(bad[b]) + ", outside [0, N = " + std::to_string(N) +
               "): were they built for a layer of another size?";
      });
    }
    return c.status();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LshTablesInsert, InsertImpl);
XLA_FFI_DEFINE_HANDLER_SYMBOL(LshQuery, QueryImpl);

}  // namespace sparsejax

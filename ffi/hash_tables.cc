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

enum class Policy : int32_t { kFifo = 0, kReservoir = 1 };

// Counts are capped so they never overflow; a FIFO count keeps its value mod
// S (the ring position) and stays >= S (the bucket stays full).
constexpr int32_t kCountCap = 1 << 30;

struct TableShape {
  int64_t L, NB, S;
};

ffi::Error CheckTables(const ArgChecker& c, const ffi::AnyBuffer& buckets,
                       const ffi::AnyBuffer& counts, TableShape* t) {
  SJ_RETURN_IF_ERROR(c.Dtype(buckets, ffi::S32, "buckets"));
  SJ_RETURN_IF_ERROR(c.Dtype(counts, ffi::S32, "counts"));
  SJ_RETURN_IF_ERROR(c.Shape(buckets, {-1, -1, -1}, "buckets", "[L, num_buckets, bucket_size]"));
  t->L = buckets.dimensions()[0];
  t->NB = buckets.dimensions()[1];
  t->S = buckets.dimensions()[2];
  SJ_RETURN_IF_ERROR(c.Shape(counts, {t->L, t->NB}, "counts", "[L, num_buckets]"));
  if (t->S < 1) return c.Fail("bucket_size must be >= 1");
  return ffi::Error::Success();
}

ffi::Error CheckCodes(const ArgChecker& c, const ffi::AnyBuffer& codes,
                      const TableShape& t, int64_t* n) {
  SJ_RETURN_IF_ERROR(c.Dtype(codes, ffi::S32, "codes"));
  SJ_RETURN_IF_ERROR(c.Shape(codes, {-1, t.L}, "codes", "[n, L]"));
  *n = codes.dimensions()[0];
  return CheckIds(c, codes.typed_data<int32_t>(), *n * t.L, t.NB, "codes",
                  "num_buckets", /*allow_pad=*/false, t.L);
}

ffi::Error InsertImpl(ffi::ThreadPool pool, ffi::AnyBuffer buckets,
                      ffi::AnyBuffer counts, ffi::AnyBuffer codes,
                      ffi::AnyBuffer ids, ffi::AnyBuffer seed, int32_t policy,
                      bool reset, int64_t num_rows,
                      ffi::Result<ffi::AnyBuffer> buckets_out,
                      ffi::Result<ffi::AnyBuffer> counts_out) {
  ArgChecker c("lsh_tables_insert");
  TableShape t;
  SJ_RETURN_IF_ERROR(CheckTables(c, buckets, counts, &t));
  int64_t n;
  SJ_RETURN_IF_ERROR(CheckCodes(c, codes, t, &n));
  SJ_RETURN_IF_ERROR(c.Dtype(ids, ffi::S32, "ids"));
  SJ_RETURN_IF_ERROR(c.Shape(ids, {n}, "ids", "[n]"));
  SJ_RETURN_IF_ERROR(c.Dtype(seed, ffi::U32, "seed"));
  SJ_RETURN_IF_ERROR(c.Shape(seed, {}, "seed", "[]"));
  if (policy != 0 && policy != 1) return c.Fail("policy must be 0 (fifo) or 1 (reservoir)");
  const int32_t* idp = ids.typed_data<int32_t>();
  SJ_RETURN_IF_ERROR(CheckIds(c, idp, n, num_rows, "ids", "num_rows", /*allow_pad=*/true));

  int32_t* bk = buckets_out->typed_data<int32_t>();
  int32_t* cnt = counts_out->typed_data<int32_t>();
  if (reset) {
    // A full build: no need to copy the old contents.
  } else {
    if (bk != buckets.typed_data<int32_t>()) std::memcpy(bk, buckets.untyped_data(), buckets.size_bytes());
    if (cnt != counts.typed_data<int32_t>()) std::memcpy(cnt, counts.untyped_data(), counts.size_bytes());
  }
  const int32_t* cp = codes.typed_data<int32_t>();
  const uint64_t s = *seed.typed_data<uint32_t>();
  const Policy pol = static_cast<Policy>(policy);
  const int64_t S = t.S;
  ParallelFor(pool, t.L, 1, [&](int64_t l0, int64_t l1) {
    for (int64_t l = l0; l < l1; ++l) {
      int32_t* table = bk + l * t.NB * S;
      int32_t* tcount = cnt + l * t.NB;
      if (reset) {
        std::fill(table, table + t.NB * S, kPadId);
        std::fill(tcount, tcount + t.NB, 0);
      }
      for (int64_t i = 0; i < n; ++i) {
        const int32_t id = idp[i];
        if (id == kPadId) continue;
        const int64_t bucket = cp[i * t.L + l];
        int32_t* slots = table + bucket * S;
        const int32_t seen = tcount[bucket];
        const int64_t filled = std::min<int64_t>(seen, S);
        // A re-inserted row that is still in its bucket is not added twice.
        if (std::find(slots, slots + filled, id) != slots + filled) continue;
        int64_t slot = -1;
        if (seen < S) {
          slot = seen;
        } else if (pol == Policy::kFifo) {
          slot = seen % S;
        } else {
          const uint64_t r = Bounded(Hash3(s, l * t.NB + bucket, seen), static_cast<uint64_t>(seen) + 1);
          if (r < static_cast<uint64_t>(S)) slot = static_cast<int64_t>(r);
        }
        if (slot >= 0) slots[slot] = id;
        int32_t next = seen + 1;
        if (next >= kCountCap) {
          next = pol == Policy::kFifo ? static_cast<int32_t>(S + next % S) : kCountCap - 1;
        }
        tcount[bucket] = next;
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error QueryImpl(ffi::ThreadPool pool, ffi::AnyBuffer buckets,
                     ffi::AnyBuffer counts, ffi::AnyBuffer codes,
                     ffi::AnyBuffer labels, ffi::AnyBuffer seed,
                     ffi::AnyBuffer num_rows, ffi::Result<ffi::AnyBuffer> active,
                     ffi::Result<ffi::AnyBuffer> num_from_tables) {
  ArgChecker c("lsh_query");
  TableShape t;
  SJ_RETURN_IF_ERROR(CheckTables(c, buckets, counts, &t));
  int64_t B;
  SJ_RETURN_IF_ERROR(CheckCodes(c, codes, t, &B));
  SJ_RETURN_IF_ERROR(c.Dtype(labels, ffi::S32, "labels"));
  SJ_RETURN_IF_ERROR(c.Shape(labels, {B, -1}, "labels", "[B, max_labels]"));
  SJ_RETURN_IF_ERROR(c.Dtype(seed, ffi::U32, "seed"));
  SJ_RETURN_IF_ERROR(c.Shape(seed, {}, "seed", "[]"));
  SJ_RETURN_IF_ERROR(c.Dtype(*active, ffi::S32, "active"));
  SJ_RETURN_IF_ERROR(c.Shape(*active, {B, -1}, "active", "[B, k]"));
  const int64_t k = active->dimensions()[1];
  // An operand, not an attribute: the shards of a layer split unevenly may
  // differ in size but run the same program.
  SJ_RETURN_IF_ERROR(c.Dtype(num_rows, ffi::S32, "num_rows"));
  SJ_RETURN_IF_ERROR(c.Shape(num_rows, {}, "num_rows", "[]"));
  const int64_t N = *num_rows.typed_data<int32_t>();
  if (k < 1 || k > N) {
    return c.Fail("k (active set size) = " + std::to_string(k) + " must be in [1, N = " + std::to_string(N) + "]");
  }
  const int64_t LM = labels.dimensions()[1];
  const int32_t* lp = labels.typed_data<int32_t>();
  SJ_RETURN_IF_ERROR(CheckIds(c, lp, B * LM, N, "labels", "N", /*allow_pad=*/true, LM));
  const int32_t* bk = buckets.typed_data<int32_t>();
  const int32_t* cnt = counts.typed_data<int32_t>();
  const int32_t* cp = codes.typed_data<int32_t>();
  const uint64_t s = *seed.typed_data<uint32_t>();
  int32_t* out = active->typed_data<int32_t>();
  int32_t* from_tables = num_from_tables->typed_data<int32_t>();
  // Per-row error slots, reported after the parallel loop (lowest row first).
  std::vector<int64_t> too_many_labels(B, -1);
  std::vector<int32_t> bad_table_id(B, 0);

  ParallelFor(pool, B, 4, [&](int64_t b0, int64_t b1) {
    IdSet set(k);
    std::vector<int32_t> cand;
    cand.reserve(t.L * t.S);
    std::vector<std::pair<uint64_t, int32_t>> ranked;  // (rank key, id)
    std::vector<int32_t> unused;
    for (int64_t b = b0; b < b1; ++b) {
      int32_t* o = out + b * k;
      int64_t n;
      set.Clear();
      too_many_labels[b] = PutLabels(lp + b * LM, LM, k, set, o, &n);
      if (too_many_labels[b] >= 0) continue;
      // Table candidates, ranked by frequency over the L tables.
      cand.clear();
      for (int64_t l = 0; l < t.L; ++l) {
        const int64_t bucket = cp[b * t.L + l];
        const int64_t filled = std::min<int64_t>(cnt[l * t.NB + bucket], t.S);
        const int32_t* slots = bk + (l * t.NB + bucket) * t.S;
        for (int64_t i = 0; i < filled; ++i) {
          // Tables are caller state: they may have been built for another layer.
          if (slots[i] >= N || slots[i] < kPadId) bad_table_id[b] = slots[i];
          else if (slots[i] >= 0) cand.push_back(slots[i]);
        }
      }
      if (bad_table_id[b] != 0) continue;
      std::sort(cand.begin(), cand.end());
      ranked.clear();
      for (size_t i = 0; i < cand.size();) {
        size_t j = i;
        while (j < cand.size() && cand[j] == cand[i]) ++j;
        // Higher frequency first; ties in a seeded random order.
        const uint64_t key = (static_cast<uint64_t>(t.L * t.S - (j - i)) << 40) |
                             (HashCombine(s, static_cast<uint64_t>(cand[i])) >> 24);
        ranked.emplace_back(key, cand[i]);
        i = j;
      }
      std::sort(ranked.begin(), ranked.end());
      int32_t taken = 0;
      for (const auto& r : ranked) {
        if (n == k) break;
        if (set.Insert(r.second)) { o[n++] = r.second; ++taken; }
      }
      from_tables[b] = taken;
      FillRandom(s, b, N, k, set, o, n, unused);
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    if (too_many_labels[b] >= 0) {
      return c.Fail("row " + std::to_string(b) + " of 'labels' has more distinct labels than k = " +
                    std::to_string(k) + " (the active set must hold all of them)");
    }
    if (bad_table_id[b] != 0) {
      return c.Fail("the tables hold id " + std::to_string(bad_table_id[b]) + ", outside [0, N = " +
                    std::to_string(N) + "): were they built for a layer of another size?");
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LshTablesInsert, InsertImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // buckets [L, NB, S]
                                  .Arg<ffi::AnyBuffer>()  // counts [L, NB]
                                  .Arg<ffi::AnyBuffer>()  // codes [n, L]
                                  .Arg<ffi::AnyBuffer>()  // ids [n]
                                  .Arg<ffi::AnyBuffer>()  // seed []
                                  .Attr<int32_t>("policy")
                                  .Attr<bool>("reset")
                                  .Attr<int64_t>("num_rows")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LshQuery, QueryImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // buckets [L, NB, S]
                                  .Arg<ffi::AnyBuffer>()  // counts [L, NB]
                                  .Arg<ffi::AnyBuffer>()  // codes [B, L]
                                  .Arg<ffi::AnyBuffer>()  // labels [B, max_labels]
                                  .Arg<ffi::AnyBuffer>()  // seed []
                                  .Arg<ffi::AnyBuffer>()  // num_rows []
                                  .Ret<ffi::AnyBuffer>()   // active [B, k]
                                  .Ret<ffi::AnyBuffer>()); // num_from_tables [B]

}  // namespace sparsejax

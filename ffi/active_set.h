// Building one sample's active set: a duplicate-free row of k ids holding the
// sample's true labels first, then candidates (from hash tables or a
// clustered index), then distinct uniformly random ids. Shared by lsh_query
// and merge_candidates; randomness is a hash of (seed, row, position), so a
// row's result does not depend on the thread that builds it.
#ifndef SPARSEJAX_FFI_ACTIVE_SET_H_
#define SPARSEJAX_FFI_ACTIVE_SET_H_

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace sparsejax {

// A set of ids in [0, N) with a cheap reset. Where N is small enough, a
// bitmap over [0, N): an insert tests and sets one bit, and a reset clears
// only the words of the ids inserted (at most k + 1 per row). Else open
// addressing sized by the most ids one row holds, reset in O(capacity).
// Callers insert only ids already checked to be in [0, N).
class IdSet {
 public:
  // Larger N use the hash set: a bitmap of 2^22 bits (512 KB) still stays in L2.
  static constexpr int64_t kMaxBitmapIds = int64_t{1} << 22;

  IdSet(int64_t max_size, int64_t N) : bitmap_(N >= 1 && N <= kMaxBitmapIds) {
    if (bitmap_) {
      bits_.assign((N + 63) / 64, 0);
      inserted_.reserve(max_size + 1);  // PutLabels may insert one label past k
      return;
    }
    int64_t cap = 16;
    while (cap < 2 * max_size) cap <<= 1;
    slots_.assign(cap, -1);
    mask_ = cap - 1;
  }
  void Clear() {
    if (bitmap_) {
      for (const int32_t id : inserted_) bits_[id >> 6] = 0;
      inserted_.clear();
      return;
    }
    std::fill(slots_.begin(), slots_.end(), -1);
  }
  // Returns true if the id was not yet in the set.
  bool Insert(int32_t id) {
    if (bitmap_) {
      uint64_t& word = bits_[id >> 6];
      const uint64_t bit = uint64_t{1} << (id & 63);
      if (word & bit) return false;
      word |= bit;
      inserted_.push_back(id);
      return true;
    }
    uint64_t h = SplitMix64(static_cast<uint64_t>(id)) & mask_;
    while (slots_[h] >= 0) {
      if (slots_[h] == id) return false;
      h = (h + 1) & mask_;
    }
    slots_[h] = id;
    return true;
  }

 private:
  bool bitmap_;
  std::vector<uint64_t> bits_;
  std::vector<int32_t> inserted_;
  std::vector<int32_t> slots_;
  uint64_t mask_ = 0;
};

// One worker's scratch for building rows of k ids out of [0, N), allocated
// before the parallel loop (a kernel's only allocation that can fail).
struct ActiveSetScratch {
  ActiveSetScratch(int64_t k, int64_t N) : set(k, N) {
    if (2 * k > N) {  // random fill by listing the unused ids
      used.resize(N);
      unused.reserve(N);
    }
  }
  IdSet set;
  std::vector<char> used;
  std::vector<int32_t> unused;
};

// Checks what every active-set kernel shares, after the shapes were bound
// (k from active.shape[1], max_labels from the labels): binds N from the
// num_rows operand and checks 1 <= k <= N and the labels' ids. N is an
// operand, not an attribute: the shards of a layer split unevenly may differ
// in size but run the same program.
inline void CheckActiveSet(Checker& c, const S32R0& num_rows, const S32R2& labels) {
  if (!c.ok()) return;
  const int64_t N = *num_rows.typed_data(), k = c["k"];
  c.Bind("N", N, "argument 'num_rows'");
  c.Require(k >= 1 && k <= N, [&] {
    return "k (active set size, active.shape[1]) = " + std::to_string(k) + " must be in [1, N = " +
           std::to_string(N) + "] (N: argument 'num_rows')";
  });
  c.Ids("labels", labels.typed_data(), labels.element_count(), "N", /*allow_pad=*/true, c["max_labels"]);
}

// Starts a row: clears the set and writes the distinct non-padding labels of
// one sample to out[0..). Returns the column of the first label that does not
// fit in k slots (-1 if all fit); *n receives the number written.
inline int64_t PutLabels(const int32_t* labels, int64_t num_labels, int64_t k, ActiveSetScratch& w, int32_t* out,
                         int64_t* n) {
  w.set.Clear();
  *n = 0;
  for (int64_t j = 0; j < num_labels; ++j) {
    const int32_t y = labels[j];
    if (y == kPadId || !w.set.Insert(y)) continue;
    if (*n == k) return j;
    out[(*n)++] = y;
  }
  return -1;
}

// Fills out[n..k) of row `row` with distinct ids drawn uniformly from [0, N)
// that are not yet in the row.
inline void FillRandom(uint64_t seed, int64_t row, int64_t N, int64_t k, ActiveSetScratch& w, int32_t* out,
                       int64_t n) {
  if (n >= k) return;
  const uint64_t fill_seed = seed ^ 0x5bd1e995ULL;
  if (2 * k <= N) {
    // Rejection sampling: at most half of [0, N) is taken, so each try
    // succeeds with probability >= 1/2.
    for (uint64_t a = 0; n < k; ++a) {
      const int32_t id = static_cast<int32_t>(Bounded(Hash3(fill_seed, row, a), N));
      if (w.set.Insert(id)) out[n++] = id;
    }
    return;
  }
  // k > N / 2, so N < 2k: list the unused ids and draw without replacement.
  std::fill(w.used.begin(), w.used.end(), 0);
  for (int64_t i = 0; i < n; ++i) w.used[out[i]] = 1;
  w.unused.clear();
  for (int64_t id = 0; id < N; ++id) {
    if (!w.used[id]) w.unused.push_back(static_cast<int32_t>(id));
  }
  for (int64_t i = 0; n < k; ++i) {
    const int64_t r = i + Bounded(Hash3(fill_seed, row, i), w.unused.size() - i);
    std::swap(w.unused[i], w.unused[r]);
    out[n++] = w.unused[i];
  }
}

}  // namespace sparsejax

#endif  // SPARSEJAX_FFI_ACTIVE_SET_H_

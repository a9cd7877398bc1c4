// row_topk: each row's k highest scores and their columns.
//
//   scores [n, C] float32, attribute k (1 <= k <= C)
//   -> values [n, k] float32, columns [n, k] int32: best first (score
//      descending, -0 == +0, ties to the lower column, NaN last), the order
//      in which cluster_probe ranks clusters.
//
// XLA:CPU's TopK over a row took about 3.6 ns per score (k = 5 to 10 over
// 2e5 outputs: three times the matmul that made them), its argmax (k-means
// assignment) longer than the matmul too. Here a row is one vectorized pass:
// each block of 16 scores is compared with the current k-th best, and only
// scores that beat it are kept. For k <= kSortedMaxK the best k stay sorted
// and each score that enters moves the k-th best at once (a random row admits
// about k ln(C/k) scores, O(k) each); for larger k a buffer of 2k is cut back
// to the best k by nth_element when full (O(C) for any k). Cutting a buffer
// of 2 (k = 1, the k-means assignment) at every other entry had cost 2.3 ns
// per score at C = 145. One thread per row: the result is the same for any
// thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common.h"

namespace sparsejax {
namespace {

constexpr char kK[] = "k";
constexpr int kBlock = 16;
constexpr int64_t kSortedMaxK = 16;

// Which of a block's 16 scores beat the threshold (bit j: s[j]): s > t for a
// number t (NaN never does; -0 and +0 tie), any number when t is NaN.
SJ_INLINE uint32_t BetterMask(const float* s, float t, bool t_is_nan) {
  uint32_t mask = 0;
  if (t_is_nan) {
    for (int j = 0; j < kBlock; ++j) mask |= static_cast<uint32_t>(s[j] == s[j]) << j;
  } else {
    for (int j = 0; j < kBlock; ++j) mask |= static_cast<uint32_t>(s[j] > t) << j;
  }
  return mask;
}

// The selection of one row: RankKey(score, column) in buf (capacity >= 2k),
// ascending = best first, so that one integer order settles scores, ties and
// NaN. sorted: buf holds the best k so far in order (k <= kSortedMaxK).
struct RowSelection {
  const float* s;
  int64_t k;
  uint64_t* buf;
  int64_t capacity;
  bool sorted;
  int64_t n = 0;
  uint64_t threshold_key = ~uint64_t{0};
  float threshold = 0.0f;
  bool threshold_is_nan = false;

  SJ_INLINE uint64_t Key(int64_t c) const { return RankKey(s[c], c); }

  SJ_INLINE void SetThreshold(uint64_t key) {
    threshold_key = key;
    threshold = s[key & 0xFFFFFFFFu];
    threshold_is_nan = std::isnan(threshold);
  }

  // Keeps the best k of the buffer; the k-th best becomes the threshold.
  SJ_INLINE void Cut() {
    if (n > k) std::nth_element(buf, buf + (k - 1), buf + n);
    n = k;
    SetThreshold(*std::max_element(buf, buf + k));
  }

  // Column c (after every kept column) enters if its key is below the k-th best's: an equal score loses the tie.
  SJ_INLINE void Offer(int64_t c) {
    const uint64_t key = Key(c);
    if ((key >> 32) >= (threshold_key >> 32)) return;
    if (sorted) {  // insert in order, dropping the k-th best
      int64_t i = k - 1;
      for (; i > 0 && buf[i - 1] > key; --i) buf[i] = buf[i - 1];
      buf[i] = key;
      SetThreshold(buf[k - 1]);
      return;
    }
    if (n == capacity) Cut();
    buf[n++] = key;
  }
};

// Leaves the row's k best keys, best first, in buf[0, k). Multiversioned as a
// whole, so that the block test is inlined and vectorized per ISA.
SJ_MULTIVERSION void SelectRow(const float* s, int64_t C, int64_t k, uint64_t* buf, int64_t capacity) {
  RowSelection sel{s, k, buf, capacity, k <= kSortedMaxK};
  for (int64_t c = 0; c < k; ++c) buf[c] = sel.Key(c);
  sel.n = k;
  if (sel.sorted) {
    std::sort(buf, buf + k);
    sel.SetThreshold(buf[k - 1]);
  } else {
    sel.Cut();
  }
  // Only the scores that beat a block's first threshold are offered (in column order); the threshold only rises,
  // so no other score of the block could enter. The last block is padded with NaN, which never beats a threshold.
  float tail[kBlock];
  for (int64_t c = k; c < C; c += kBlock) {
    const float* block = s + c;
    if (c + kBlock > C) {
      std::fill(tail, tail + kBlock, std::numeric_limits<float>::quiet_NaN());
      std::copy(s + c, s + C, tail);
      block = tail;
    }
    for (uint32_t mask = BetterMask(block, sel.threshold, sel.threshold_is_nan); mask; mask &= mask - 1) {
      sel.Offer(c + __builtin_ctz(mask));
    }
  }
  if (!sel.sorted) {
    sel.Cut();
    std::sort(buf, buf + k);
  }
}

// scores [n, C] -> values [n, k], columns [n, k]
ffi::Error RowTopkImpl(ffi::ThreadPool pool, F32R2 scores, ffi::Attr<int64_t, kK> k_attr,
                       ffi::Result<F32R2> values, ffi::Result<S32R2> columns) {
  const int64_t k = *k_attr;
  return Guarded("row_topk", [&](Checker& c) {
    c.Arg("scores", scores, {"n", "C"}).Ret("values", *values, {"n", "k"}).Ret("columns", *columns, {"n", "k"});
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t n = c["n"], C = c["C"];
    c.Require(c["k"] == k, [&] {
      return "results must have k = " + std::to_string(k) + " columns (attribute 'k'), got " +
             std::to_string(c["k"]);
    });
    c.Require(k >= 1 && k <= C && C < (int64_t{1} << 31), [&] {
      return "attribute 'k' must be in [1, C = " + std::to_string(C) + "] (C from 'scores', below 2^31), got " +
             std::to_string(k);
    });
    SJ_RETURN_IF_ERROR(c.status());
    const float* sp = scores.typed_data();
    float* vp = values->typed_data();
    int32_t* cp = columns->typed_data();
    const int64_t capacity = 2 * k;
    ParallelLoop loop(pool, n, std::max<int64_t>(1, 65536 / C));
    std::vector<std::vector<uint64_t>> bufs(loop.workers(), std::vector<uint64_t>(capacity));
    return loop.Run(c.op(), [&](int64_t w, int64_t r0, int64_t r1) {
      uint64_t* buf = bufs[w].data();
      for (int64_t r = r0; r < r1; ++r) {
        const float* s = sp + r * C;
        SelectRow(s, C, k, buf, capacity);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t col = static_cast<int64_t>(buf[j] & 0xFFFFFFFFu);
          cp[r * k + j] = static_cast<int32_t>(col);
          vp[r * k + j] = s[col];
        }
      }
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowTopk, RowTopkImpl);

}  // namespace sparsejax

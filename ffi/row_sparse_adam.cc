// Row-sparse ("lazy") Adam. The gradient of a sparse layer's weight W [N, d]
// arrives as factors: dW[ids[b, j]] += g[b, j] * x[b]. Only the rows named in
// ids are touched: their gradient rows are summed over duplicates (in the
// fixed order of their positions), then their moments and weights are updated
// in place. Work is O(B * k * d) and never O(N * d).
//
// A bias b [N] of the same layer (gradient db[ids[b, j]] += g[b, j]) can ride
// along: its rows are updated in the same pass, so the ids are sorted once and
// the bias's cache lines are fetched together with the weight rows.
//
// Optionally the same pass also computes the backward product of the layer
// that the ids came from, combined[b] = sum_j g[b, j] * W[ids[b, j]] with W
// read before its update (for sparse_logits, the input gradient dh): each row
// is then read from memory once per step for both, not once by a separate
// gather and again here. Rows are visited by id, so the products land in
// per-slab [B, d] accumulators (a fixed split of the id ranges, independent
// of the thread count) that are summed in slab order at the end.
//
// Second moments are per element (Adam) or, with nu of shape [N], one per row
// (row-wise Adam: a third fewer bytes per touched row).
//
// The weight may be bfloat16 (half the bytes of every touched row), updated
// in float32 and stored rounded stochastically like bfloat16 moments; a bias
// stays float32.
//
// Moments are float32, or bfloat16 rounded stochastically (unbiased; with
// round-to-nearest, b2 = 0.999 would freeze the second moment, whose per-step
// change is below bfloat16's resolution). The random bits are a hash of
// (step, row, column): the result depends on nothing else, threads included.
#include <cmath>
#include <cstring>

#include "common.h"

namespace sparsejax {
namespace {

// Rows are split into this many contiguous id ranges, processed in parallel.
// A constant (not the thread count), so the work split is the same everywhere.
constexpr int64_t kNumRanges = 256;
// With a combined output, consecutive ranges form this many slabs, each with
// its own accumulator and run by one thread at a time.
constexpr int64_t kNumSlabs = 32;
// Positions per block of the parallel bucketing of ids by range.
constexpr int64_t kBucketBlock = 8192;
// A range's slots are counting-sorted when its ids span at most this many
// times as many values as it has slots (else std::sort): sizes the scratch too.
constexpr int64_t kCountingSortSpan = 4;

struct AdamConsts {
  float b1, b2, eps, weight_decay, step_size, inv_bc1, inv_bc2;
};

SJ_INLINE void Store(float* p, float x, uint32_t /*random*/) { *p = x; }
// Stochastic rounding: add 16 random bits below the kept mantissa, truncate.
SJ_INLINE void Store(bf16* p, float x, uint32_t random) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const bool finite = (u & 0x7f800000u) != 0x7f800000u;
  *p = static_cast<bf16>((finite ? u + (random & 0xffffu) : u) >> 16);
}

// 32 random bits for element i of a row (seed: a hash of step and row).
SJ_INLINE uint32_t ElementBits(uint32_t seed, int64_t i) {
  uint32_t h = (seed + static_cast<uint32_t>(i)) * 0x9E3779B1u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  return h;
}

// The random bits that round element i of a bfloat16 weight row (a stream
// apart from the moments').
SJ_INLINE uint32_t WeightBits(uint32_t seed, int64_t i) { return ElementBits(~seed, i); }

// Writes a row's new weight (stochastically rounded when bfloat16).
template <typename W>
SJ_INLINE void StoreWeight(W* w, int64_t i, float x, uint32_t seed) {
  uint32_t bits = 0;
  if constexpr (sizeof(W) == 2) bits = WeightBits(seed, i);
  Store(w + i, x, bits);
}

// One row's row-wise Adam update (as FBGEMM's row-wise optimizers): per-element
// first moments m, and one second moment *v for the row, of the mean of the
// squared gradient over the row (summed in Dot's fixed order).
template <typename W, typename M>
SJ_INLINE void RowwiseAdamRowT(W* __restrict__ w, M* __restrict__ m, M* __restrict__ v,
                               const float* __restrict__ g, int64_t d, const AdamConsts& h, uint32_t seed) {
  const float mean_sq = Dot(g, g, d) / static_cast<float>(d);
  const float vi = h.b2 * Load(*v) + (1.0f - h.b2) * mean_sq;
  Store(v, vi, sizeof(M) == 2 ? ElementBits(seed, d) : 0);
  const float scale = h.inv_bc1 / (std::sqrt(vi * h.inv_bc2) + h.eps);
  for (int64_t i = 0; i < d; ++i) {
    const float mi = h.b1 * Load(m[i]) + (1.0f - h.b1) * g[i];
    uint32_t bits = 0;
    if constexpr (sizeof(M) == 2) bits = ElementBits(seed, i);
    Store(m + i, mi, bits);
    const float wi = Load(w[i]);
    StoreWeight(w, i, wi - h.step_size * (mi * scale + h.weight_decay * wi), seed);
  }
}

// One row's Adam update; restrict pointers let the compiler vectorize it.
template <typename W, typename M>
SJ_INLINE void AdamRowT(W* __restrict__ w, M* __restrict__ m, M* __restrict__ v, const float* __restrict__ g,
                        int64_t d, const AdamConsts& h, uint32_t seed) {
  for (int64_t i = 0; i < d; ++i) {
    const float mi = h.b1 * Load(m[i]) + (1.0f - h.b1) * g[i];
    const float vi = h.b2 * Load(v[i]) + (1.0f - h.b2) * g[i] * g[i];
    uint32_t bits = 0;
    if constexpr (sizeof(M) == 2) bits = ElementBits(seed, i);
    Store(m + i, mi, bits);
    Store(v + i, vi, bits >> 16 | bits << 16);
    // The weight update uses the unrounded moments.
    const float update = (mi * h.inv_bc1) / (std::sqrt(vi * h.inv_bc2) + h.eps);
    const float wi = Load(w[i]);
    StoreWeight(w, i, wi - h.step_size * (update + h.weight_decay * wi), seed);
  }
}

// Multiversioned (per-ISA) instances for each (weight, moment) type pair.
#define SJ_ADAM_ROWS(W, M)                                                                                   \
  SJ_MULTIVERSION void AdamRow(W* w, M* m, M* v, const float* g, int64_t d, const AdamConsts& h,              \
                               uint32_t seed) {                                                              \
    AdamRowT(w, m, v, g, d, h, seed);                                                                        \
  }                                                                                                          \
  SJ_MULTIVERSION void RowwiseAdamRow(W* w, M* m, M* v, const float* g, int64_t d, const AdamConsts& h,       \
                                      uint32_t seed) {                                                       \
    RowwiseAdamRowT(w, m, v, g, d, h, seed);                                                                 \
  }
SJ_ADAM_ROWS(float, float)
SJ_ADAM_ROWS(float, bf16)
SJ_ADAM_ROWS(bf16, float)
SJ_ADAM_ROWS(bf16, bf16)
#undef SJ_ADAM_ROWS

// The per-slot half of the pass: one row's gradient, summed over its n slots
// (sample << 32 | the bits of g, in position order) into grad, and, with
// `combined`, g * w_row added to each slot's sample's row of it. Returns the
// bias gradient (the sum of the slots' g). Columns are taken kSlotBlock at a
// time, so a block of the row's gradient and weight stays in registers over
// all of its slots; each element still sums its slots in the same order (the
// same floats as one slot at a time). Multiversioned like the Adam rows
// (elementwise, no contraction: the same floats on every ISA).
constexpr int64_t kSlotBlock = 64;

SJ_INLINE float SlotG(uint64_t slot) {
  const uint32_t bits = static_cast<uint32_t>(slot);
  float g;
  std::memcpy(&g, &bits, 4);
  return g;
}

// Columns [c0, c0 + width) of SumRowSlots (width = kWidth, or at most
// kSlotBlock when kWidth is 0).
template <int64_t kWidth, typename W>
SJ_INLINE void SumSlotColumns(const uint64_t* slots, int64_t n, const float* __restrict__ xp, int64_t d, int64_t c0,
                              int64_t width, const W* __restrict__ w_row, float* __restrict__ grad,
                              float* __restrict__ combined) {
  const int64_t cols = kWidth > 0 ? kWidth : width;
  float acc[kSlotBlock] = {0.0f};
  float wb[kSlotBlock];
  for (int64_t j = 0; j < cols; ++j) wb[j] = Load(w_row[c0 + j]);
  for (int64_t i = 0; i < n; ++i) {
    const float gv = SlotG(slots[i]);
    const int64_t sample = static_cast<int64_t>(slots[i] >> 32);
    const float* __restrict__ xs = xp + sample * d + c0;
    for (int64_t j = 0; j < cols; ++j) acc[j] += gv * xs[j];
    if (combined != nullptr) {
      float* __restrict__ cs = combined + sample * d + c0;
      for (int64_t j = 0; j < cols; ++j) cs[j] += gv * wb[j];
    }
  }
  std::copy(acc, acc + cols, grad + c0);
}

template <typename W>
SJ_INLINE float SumRowSlotsT(const uint64_t* slots, int64_t n, const float* __restrict__ xp, int64_t d,
                             const W* __restrict__ w_row, float* __restrict__ grad, float* __restrict__ combined) {
  float grad_bias = 0.0f;
  for (int64_t i = 0; i < n; ++i) grad_bias += SlotG(slots[i]);
  int64_t c0 = 0;
  for (; c0 + kSlotBlock <= d; c0 += kSlotBlock) {
    SumSlotColumns<kSlotBlock>(slots, n, xp, d, c0, kSlotBlock, w_row, grad, combined);
  }
  if (c0 < d) SumSlotColumns<0>(slots, n, xp, d, c0, d - c0, w_row, grad, combined);
  return grad_bias;
}
#define SJ_ROW_SLOTS(W)                                                                                     \
  SJ_MULTIVERSION float SumRowSlots(const uint64_t* slots, int64_t n, const float* xp, int64_t d,          \
                                    const W* w_row, float* grad, float* combined) {                        \
    return SumRowSlotsT(slots, n, xp, d, w_row, grad, combined);                                           \
  }
SJ_ROW_SLOTS(float)
SJ_ROW_SLOTS(bf16)
#undef SJ_ROW_SLOTS

// floor(2^32 * scale / divisor): with it, x * scale / divisor (all three below
// 2^32) is (x * reciprocal) >> 32 or one more, without a division per x. The
// pass's two quotients (a slot's sample, an id's range) use it; a divisor of 0
// (no slots, or a layer of no rows) has nothing to divide and gets 0.
inline uint64_t FixedPointReciprocal(uint64_t scale, uint64_t divisor) {
  return divisor > 0 ? (scale << 32) / divisor : 0;
}

// Writes, index for index with a range's sorted keys, what the per-slot sums
// read (sample << 32 | the bits of g[pos]) into `slots`: one pass of
// independent loads, so that the scattered reads of g overlap instead of each
// stalling its slot's sums. sample = pos / k by FixedPointReciprocal(1, k),
// corrected by one where it falls short.
inline void GatherSlots(const uint64_t* kb, int64_t n, const float* gp, uint32_t k, uint64_t reciprocal_k,
                        uint64_t* slots) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t pos = static_cast<uint32_t>(kb[i]);
    uint64_t sample = (static_cast<uint64_t>(pos) * reciprocal_k) >> 32;
    sample += pos - sample * k >= k;
    uint32_t bits;
    std::memcpy(&bits, gp + pos, 4);
    slots[i] = sample << 32 | bits;
  }
}

// Orders one range's keys by id, keeping position order among equal ids (they
// arrive in position order): the order std::sort gives these distinct keys,
// by a counting sort over the range's ids [lo, lo + width) when that is the
// cheaper one. `count` has width + 1 slots and `tmp` the range's size.
inline void SortRangeKeys(uint64_t* kb, uint64_t* ke, int64_t lo, int64_t width, int64_t* count, uint64_t* tmp) {
  const int64_t n = ke - kb;
  if (n < 2) return;
  if (width > kCountingSortSpan * n) {
    std::sort(kb, ke);
    return;
  }
  std::fill(count, count + width + 1, 0);
  for (uint64_t* it = kb; it != ke; ++it) ++count[static_cast<int64_t>(*it >> 32) - lo + 1];
  for (int64_t i = 1; i <= width; ++i) count[i] += count[i - 1];
  for (uint64_t* it = kb; it != ke; ++it) tmp[count[static_cast<int64_t>(*it >> 32) - lo]++] = *it;
  std::copy(tmp, tmp + n, kb);
}

// The rows of one parameter (weight or bias) with their moments.
template <typename W, typename M>
struct Rows {
  W* w = nullptr;
  M* m = nullptr;
  M* v = nullptr;
  int64_t d = 0;
  bool rowwise = false;  // v holds one second moment per row

  M* v_of(int64_t row) const { return v + (rowwise ? row : row * d); }

  // Rows are visited in increasing id order but far apart: fetch the cache
  // lines of rows a few steps ahead while this one is updated.
  void Prefetch(int64_t row) const {
    PrefetchBytes(w + row * d, d * sizeof(W));
    PrefetchBytes(m + row * d, d * sizeof(M));
    PrefetchBytes(v_of(row), (rowwise ? 1 : d) * sizeof(M));
  }

  void Update(int64_t row, const float* g, const AdamConsts& h, uint32_t seed) const {
    if (rowwise) {
      RowwiseAdamRow(w + row * d, m + row * d, v_of(row), g, d, h, seed);
    } else {
      AdamRow(w + row * d, m + row * d, v_of(row), g, d, h, seed);
    }
  }
};
constexpr int kPrefetchRows = 4;

// Updates the rows of id ranges [r0, r1): keys[start[r] .. start[r + 1]) are
// range r's (id << 32 | position) keys, range r's ids are [first[r],
// first[r + 1]). `grad` is scratch of d floats, `count` and `tmp` of
// SortRangeKeys' sizes (tmp then holds the range's slots for SumRowSlots).
// Not inlined: perf (and the prefetch test) can then name it.
// `combined` (or null): the slab's [B, d] accumulator of g[pos] * W[row].
template <typename W, typename M>
[[gnu::noinline]] void UpdateRanges(int64_t r0, int64_t r1, const Rows<W, M>& weight, const Rows<float, M>& bias,
                  const int64_t* start, const int64_t* first,
                  uint64_t* keys, int64_t* unique_in_range, const float* gp, const float* xp, int64_t k,
                  const AdamConsts& h, uint64_t step_seed, float* grad, int64_t* count, uint64_t* tmp,
                  float* combined) {
  const int64_t d = weight.d;
  const bool has_bias = bias.w != nullptr;
  const uint64_t reciprocal_k = FixedPointReciprocal(1, static_cast<uint64_t>(k));
  for (int64_t r = r0; r < r1; ++r) {
    uint64_t* kb = keys + start[r];
    uint64_t* ke = keys + start[r + 1];
    SortRangeKeys(kb, ke, first[r], first[r + 1] - first[r], count, tmp);
    // The sort is done with tmp: it now holds the slots' (sample, g), index for index with the keys.
    GatherSlots(kb, ke - kb, gp, static_cast<uint32_t>(k), reciprocal_k, tmp);
    int64_t n_unique = 0;
    // A cursor kPrefetchRows distinct rows ahead prefetches the rows to come.
    uint64_t* pf = kb;
    auto prefetch_next = [&] {
      if (pf == ke) return;
      const uint64_t row = *pf >> 32;
      weight.Prefetch(static_cast<int64_t>(row));
      if (has_bias) bias.Prefetch(static_cast<int64_t>(row));
      while (pf != ke && (*pf >> 32) == row) ++pf;
    };
    for (int i = 0; i < kPrefetchRows; ++i) prefetch_next();
    for (uint64_t* it = kb; it != ke;) {
      prefetch_next();
      const int64_t row = static_cast<int64_t>(*it >> 32);
      uint64_t* row_end = it;
      while (row_end != ke && static_cast<int64_t>(*row_end >> 32) == row) ++row_end;
      float grad_bias = SumRowSlots(tmp + (it - kb), row_end - it, xp, d, weight.w + row * d, grad, combined);
      it = row_end;
      const uint64_t seed = HashCombine(step_seed, static_cast<uint64_t>(row));
      weight.Update(row, grad, h, static_cast<uint32_t>(seed));
      if (has_bias) bias.Update(row, &grad_bias, h, static_cast<uint32_t>(seed >> 32));
      // Unique ids are written, in order, over the front of this range's
      // key slots (already consumed): no extra buffer needed.
      kb[n_unique++] = static_cast<uint64_t>(row);
    }
    unique_in_range[r] = n_unique;
  }
}

template <ffi::DataType MT>
using Moments = ffi::Buffer<MT>;  // the weight's shape, [N, d] or [N]

// One handler per (weight, moment) dtype pair: XLA checks every buffer's dtype.
template <ffi::DataType WT, ffi::DataType MT>
ffi::Error RowSparseAdamImpl(ffi::ThreadPool pool, ffi::Buffer<WT> weight, Moments<MT> mu, Moments<MT> nu,
                             F32R1 bias, ffi::BufferR1<MT> bias_mu, ffi::BufferR1<MT> bias_nu, S32R2 ids,
                             F32R2 g, F32R2 x, F32R0 lr, S32R0 count, ffi::RemainingArgs /*after*/, float b1,
                             float b2, float eps, float weight_decay, ffi::Result<ffi::Buffer<WT>> weight_out,
                             ffi::Result<Moments<MT>> mu_out, ffi::Result<Moments<MT>> nu_out,
                             ffi::Result<F32R1> bias_out, ffi::Result<ffi::BufferR1<MT>> bias_mu_out,
                             ffi::Result<ffi::BufferR1<MT>> bias_nu_out, ffi::Result<S32R1> touched,
                             ffi::Result<F32R2> combined) {
  return Guarded("row_sparse_adam", [&](Checker& c) {
    // A rank-1 weight (a bias [N] on its own) is a weight of width d = 1.
    const size_t rank = weight.dimensions().size();
    c.Require(rank == 1 || rank == 2, [&] {
      return "argument 'weight' must have shape [N, d] or [N], got rank " + std::to_string(rank);
    });
    SJ_RETURN_IF_ERROR(c.status());
    const bool is_vector = rank == 1;
    const Checker::Spec wshape = is_vector ? Checker::Spec{"N"} : Checker::Spec{"N", "d"};
    c.Arg("weight", weight, wshape);
    if (is_vector) c.Bind("d", 1, "weight");
    // nu [N] for a weight [N, d]: row-wise Adam (one second moment per row).
    const bool rowwise = !is_vector && nu.dimensions().size() == 1;
    const Checker::Spec vshape = rowwise ? Checker::Spec{"N"} : wshape;
    c.Arg("mu", mu, wshape).Arg("nu", nu, vshape, is_vector ? nullptr : "(or [N] for row-wise Adam)");
    c.Ret("weight", *weight_out, wshape).Ret("mu", *mu_out, wshape).Ret("nu", *nu_out, vshape);
    // The bias is [N], or [0] for none; its moments and results have its shape.
    const bool has_bias = bias.element_count() != 0;
    c.Require(!(has_bias && is_vector), [] { return std::string("a bias needs a rank-2 weight [N, d]"); });
    const Checker::Spec bshape = has_bias ? Checker::Spec{"N"} : Checker::Spec{"0"};
    c.Arg("bias", bias, bshape, "(or [0] for none)").Arg("bias_mu", bias_mu, bshape).Arg("bias_nu", bias_nu, bshape);
    c.Ret("bias", *bias_out, bshape).Ret("bias_mu", *bias_mu_out, bshape).Ret("bias_nu", *bias_nu_out, bshape);
    c.Arg("ids", ids, {"B", "k"}).Arg("g", g, {"B", "k"}).Arg("x", x, {"B", "d"});
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t N = c["N"], d = c["d"], B = c["B"], k = c["k"], M = B * k;
    c.Bind("B * k", M, "ids").Ret("touched", *touched, {"B * k"});
    // combined: [B, d] to compute it, [0, d] not to.
    const bool combine = combined->dimensions().size() == 2 && combined->dimensions()[0] != 0;
    c.Ret("combined", *combined, combine ? Checker::Spec{"B", "d"} : Checker::Spec{"0", "d"});
    c.Require(M < (int64_t{1} << 31), [] { return std::string("ids has too many entries (B * k must be < 2^31)"); });
    const int32_t* ip = ids.typed_data();
    c.Ids("ids", ip, M, "N", /*allow_pad=*/true, k);
    const int32_t t = *count.typed_data();
    c.Require(t >= 1, [&] {
      return "argument 'count' (the step number after this update) must be >= 1, got " + std::to_string(t);
    });
    c.Require(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1 && eps >= 0, [&] {
      return "attributes must satisfy 0 <= b1, b2 < 1 and eps >= 0, got b1 = " + std::to_string(b1) +
             ", b2 = " + std::to_string(b2) + ", eps = " + std::to_string(eps);
    });
    SJ_RETURN_IF_ERROR(c.status());

    CopyIfDistinct(weight, weight_out);
    CopyIfDistinct(mu, mu_out);
    CopyIfDistinct(nu, nu_out);
    CopyIfDistinct(bias, bias_out);
    CopyIfDistinct(bias_mu, bias_mu_out);
    CopyIfDistinct(bias_nu, bias_nu_out);

    const float step_size = *lr.typed_data();
    const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
    const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
    const AdamConsts h{b1, b2, eps, weight_decay, step_size, 1.0f / bc1, 1.0f / bc2};

    // Bucket the positions by id range (a counting sort that keeps position
    // order), in parallel: fixed blocks of positions count their ids per
    // range, a prefix over (range, block) gives each block its slots, and
    // each block fills them in position order: the same keys on any number
    // of threads.
    const int64_t R = std::min<int64_t>(kNumRanges, std::max<int64_t>(N, 1));
    // Range r's ids are those with id * R / N == r: [ceil(r * N / R), ceil((r + 1) * N / R)).
    std::vector<int64_t> first(R + 1);
    for (int64_t r = 0; r <= R; ++r) first[r] = (r * N + R - 1) / R;
    // id * R / N without a division per id: a 32-bit fixed-point reciprocal
    // (never above R / N) gives it or one less, and first[] settles which.
    const uint64_t reciprocal = FixedPointReciprocal(static_cast<uint64_t>(R), static_cast<uint64_t>(N));
    auto range_of = [&](int32_t id) {
      int64_t r = static_cast<int64_t>((static_cast<uint64_t>(id) * reciprocal) >> 32);
      return r + (id >= first[r + 1]);
    };
    const int64_t num_blocks = (M + kBucketBlock - 1) / kBucketBlock;
    std::vector<int64_t> slots(num_blocks * R, 0);  // [block][range]: counts, then first slots
    SJ_RETURN_IF_ERROR(ParallelLoop(pool, num_blocks, 1).Run(c.op(), [&](int64_t, int64_t k0, int64_t k1) {
      for (int64_t blk = k0; blk < k1; ++blk) {
        int64_t* count_of = slots.data() + blk * R;
        for (int64_t p = blk * kBucketBlock, pe = std::min(M, p + kBucketBlock); p < pe; ++p) {
          if (ip[p] != kPadId) ++count_of[range_of(ip[p])];
        }
      }
    }));
    std::vector<int64_t> start(R + 1, 0);
    for (int64_t r = 0, next = 0; r < R; ++r) {
      start[r] = next;
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t n = slots[blk * R + r];
        slots[blk * R + r] = next;
        next += n;
      }
      start[r + 1] = next;
    }
    // Key = id << 32 | position: sorting keys orders by id, then by position.
    // Not value-initialized (a serial memset of 8 bytes per id): the parallel fill below writes every slot.
    std::unique_ptr<uint64_t[]> keys(new uint64_t[std::max<int64_t>(start[R], 1)]);
    SJ_RETURN_IF_ERROR(ParallelLoop(pool, num_blocks, 1).Run(c.op(), [&](int64_t, int64_t k0, int64_t k1) {
      for (int64_t blk = k0; blk < k1; ++blk) {
        int64_t* slot_of = slots.data() + blk * R;
        for (int64_t p = blk * kBucketBlock, pe = std::min(M, p + kBucketBlock); p < pe; ++p) {
          if (ip[p] != kPadId) {
            keys[slot_of[range_of(ip[p])]++] = (static_cast<uint64_t>(ip[p]) << 32) | static_cast<uint64_t>(p);
          }
        }
      }
    }));
    std::vector<int64_t> unique_in_range(R, 0);

    using M_t = ffi::NativeType<MT>;
    using W_t = ffi::NativeType<WT>;
    const Rows<W_t, M_t> wr{weight_out->typed_data(), mu_out->typed_data(), nu_out->typed_data(), d, rowwise};
    const Rows<float, M_t> br = has_bias ? Rows<float, M_t>{bias_out->typed_data(), bias_mu_out->typed_data(),
                                                            bias_nu_out->typed_data(), 1, false}
                                         : Rows<float, M_t>{};
    const uint64_t step_seed = SplitMix64(static_cast<uint64_t>(t));
    // Without a combined output every range is a chunk; with one, a slab is.
    const int64_t slab = combine ? (R + kNumSlabs - 1) / kNumSlabs : 1;
    const int64_t num_slabs = (R + slab - 1) / slab;
    ParallelLoop loop(pool, R, slab);
    std::vector<float> grad(loop.workers() * d);
    int64_t max_width = 0, max_keys = 0;
    for (int64_t r = 0; r < R; ++r) {
      max_width = std::max(max_width, first[r + 1] - first[r]);
      max_keys = std::max(max_keys, start[r + 1] - start[r]);
    }
    // Counting-sort scratch, only as wide as SortRangeKeys uses it.
    const int64_t count_size = std::min(max_width, kCountingSortSpan * max_keys) + 1;
    const int64_t tmp_size = std::max<int64_t>(max_keys, 1);
    std::vector<int64_t> count(loop.workers() * count_size);
    std::vector<uint64_t> tmp(loop.workers() * tmp_size);
    std::unique_ptr<float[]> acc(combine ? new float[num_slabs * B * d] : nullptr);  // zeroed by its slab
    SJ_RETURN_IF_ERROR(loop.Run(c.op(), [&](int64_t w, int64_t r0, int64_t r1) {
      float* slab_acc = combine ? acc.get() + (r0 / slab) * B * d : nullptr;
      if (combine) std::fill(slab_acc, slab_acc + B * d, 0.0f);
      UpdateRanges(r0, r1, wr, br, start.data(), first.data(), keys.get(), unique_in_range.data(),
                   g.typed_data(), x.typed_data(), k, h, step_seed, grad.data() + w * d,
                   count.data() + w * count_size, tmp.data() + w * tmp_size, slab_acc);
    }));
    if (combine) {  // combined[b] = sum over slabs, in slab order
      float* out = combined->typed_data();
      SJ_RETURN_IF_ERROR(ParallelLoop(pool, B, 8).Run(c.op(), [&](int64_t, int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          float* ob = out + b * d;
          std::copy(acc.get() + b * d, acc.get() + (b + 1) * d, ob);
          for (int64_t s = 1; s < num_slabs; ++s) Axpy(1.0f, acc.get() + (s * B + b) * d, ob, d);
        }
      }));
    }

    // The distinct ids of each range, in range order, then padding.
    int32_t* out_ids = touched->typed_data();
    std::vector<int64_t> out_start(R + 1, 0);
    for (int64_t r = 0; r < R; ++r) out_start[r + 1] = out_start[r] + unique_in_range[r];
    std::fill(out_ids + out_start[R], out_ids + M, kPadId);
    SJ_RETURN_IF_ERROR(ParallelLoop(pool, R, 16).Run(c.op(), [&](int64_t, int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < unique_in_range[r]; ++i) {
          out_ids[out_start[r] + i] = static_cast<int32_t>(keys[start[r] + i]);
        }
      }
    }));
    return ffi::Error::Success();
  });
}

// The binding of RowSparseAdamImpl<WT, MT>.
template <ffi::DataType WT, ffi::DataType MT>
auto RowSparseAdamBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<WT>>()        // weight [N, d] or [N]
      .template Arg<Moments<MT>>()            // mu, weight's shape
      .template Arg<Moments<MT>>()            // nu, weight's shape, or [N] (row-wise)
      .template Arg<F32R1>()                  // bias [N] or [0]
      .template Arg<ffi::BufferR1<MT>>()      // bias_mu, bias's shape
      .template Arg<ffi::BufferR1<MT>>()      // bias_nu, bias's shape
      .template Arg<S32R2>()                  // ids [B, k]
      .template Arg<F32R2>()                  // g [B, k]
      .template Arg<F32R2>()                  // x [B, d]
      .template Arg<F32R0>()                  // learning_rate []
      .template Arg<S32R0>()                  // count []
      // Unread operands that order the update after other reads of weight
      // (so it can be in place).
      .RemainingArgs()
      .template Attr<float>("b1")
      .template Attr<float>("b2")
      .template Attr<float>("eps")
      .template Attr<float>("weight_decay")
      .template Ret<ffi::Buffer<WT>>()        // weight
      .template Ret<Moments<MT>>()            // mu
      .template Ret<Moments<MT>>()            // nu
      .template Ret<F32R1>()                  // bias
      .template Ret<ffi::BufferR1<MT>>()      // bias_mu
      .template Ret<ffi::BufferR1<MT>>()      // bias_nu
      .template Ret<S32R1>()                  // touched [B * k]
      .template Ret<F32R2>();                 // combined [B, d], or [0, d] for none
}

}  // namespace

// Named by moment dtype; the BF16Weight ones take a bfloat16 weight.
#define SJ_ADAM_HANDLER(NAME, WT, MT)                                                   \
  constexpr auto NAME##Impl = RowSparseAdamImpl<WT, MT>;                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, NAME##Impl, (RowSparseAdamBinding<WT, MT>()));
SJ_ADAM_HANDLER(RowSparseAdamF32, ffi::F32, ffi::F32)
SJ_ADAM_HANDLER(RowSparseAdamBF16, ffi::F32, ffi::BF16)
SJ_ADAM_HANDLER(RowSparseAdamF32BF16Weight, ffi::BF16, ffi::F32)
SJ_ADAM_HANDLER(RowSparseAdamBF16BF16Weight, ffi::BF16, ffi::BF16)
#undef SJ_ADAM_HANDLER

}  // namespace sparsejax

// Locality-sensitive hashing of dense vectors into L codes of K bits each.
//
// simhash: signed random projections. Hash bit h of x is [<P[h], x> > 0],
// each projection P[h] a sparse +-1 vector over a random subset of the dims (a
// third of them, as in SLIDE), stored dense and transposed ([d, L * K]) so
// that all projections of a row accumulate in one vectorized pass.
// Table l's code packs bits l*K .. l*K+K-1.
//
// dwta: densified winner-take-all. Each hash is the argmax position among a
// bin of `bin_size` (a power of two) dims, giving log2(bin_size) bits; table l
// packs K / log2(bin_size) bins with shifts of exactly log2(bin_size) bits, so
// every one of the 2^K codes is reachable. A bin whose dims are all zero is
// "empty" and borrows the value of another bin chosen by a seeded hash
// (densification, Chen & Shrivastava 2018). NaN inputs count as zeros.
#include "common.h"

namespace sparsejax {
namespace {

// Hashes rows [b0, b1). All H = L * K projections are accumulated at once
// (one axpy per input dim: no dependency chains, vectorizes), in increasing
// dim order, so every ISA variant below computes the same floats. `acc` is
// scratch of H floats.
SJ_MULTIVERSION void SimHashRows(const float* x, const float* proj_t, int64_t b0, int64_t b1,
                                 int64_t d, int64_t L, int64_t K, float* acc, int32_t* out) {
  const int64_t H = L * K;
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * d;
    std::fill(acc, acc + H, 0.0f);
    for (int64_t i = 0; i < d; ++i) {
      if (xb[i] != 0.0f) Axpy(xb[i], proj_t + i * H, acc, H);  // zeros add nothing
    }
    for (int64_t l = 0; l < L; ++l) {
      uint32_t code = 0;
      for (int64_t bit = 0; bit < K; ++bit) code |= static_cast<uint32_t>(acc[l * K + bit] > 0.0f) << bit;
      out[b * L + l] = static_cast<int32_t>(code);
    }
  }
}

// x [B, d], projections_t [d, L * K] -> codes [B, L]
ffi::Error SimHashImpl(ffi::ThreadPool pool, F32R2 x, F32R2 projections_t, ffi::Result<S32R2> codes) {
  return Guarded("lsh_hash[simhash]", [&](Checker& c) {
    c.Arg("x", x, {"B", "d"}).Arg("projections_t", projections_t, {"d", "L * K"}).Ret("codes", *codes, {"B", "L"});
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t B = c["B"], d = c["d"], H = c["L * K"], L = c["L"];
    c.Require(L >= 1 && H % L == 0 && H / L >= 1 && H / L <= 30, [&] {
      return "projections_t has " + std::to_string(H) + " columns, which must be L * K with L = " +
             std::to_string(L) + " tables and 1 <= K <= 30 bits";
    });
    SJ_RETURN_IF_ERROR(c.status());
    const float* proj = projections_t.typed_data();
    const float* xp = x.typed_data();
    int32_t* out = codes->typed_data();
    // Small chunks: a step hashes only its batch's B queries, which must still spread over every core.
    ParallelLoop loop(pool, B, 8);
    std::vector<float> acc(loop.workers() * H);
    return loop.Run(c.op(), [&](int64_t w, int64_t b0, int64_t b1) {
      SimHashRows(xp, proj, b0, b1, d, L, H / L, acc.data() + w * H, out);
    });
  });
}

constexpr int kDensifyAttempts = 100;

// The position of the largest nonzero value among x[bin[0..size)], or -1 if
// there is none (an empty bin). NaN counts as zero (it never wins), so the
// winner does not depend on where a NaN sits.
inline int32_t BinWinner(const float* x, const int32_t* bin, int64_t size) {
  int32_t best = -1;
  float best_val = 0.0f;
  for (int64_t t = 0; t < size; ++t) {
    const float val = x[bin[t]];
    if (val != 0.0f && (best < 0 ? val == val : val > best_val)) {
      best = static_cast<int32_t>(t);
      best_val = val;
    }
  }
  return best;
}

// x [B, d], bin_idx [L * bins_per_table, bin_size], seed [] -> codes [B, L]
ffi::Error DwtaImpl(ffi::ThreadPool pool, F32R2 x, S32R2 bin_idx, U32R0 seed, ffi::Result<S32R2> codes) {
  return Guarded("lsh_hash[dwta]", [&](Checker& c) {
    c.Arg("x", x, {"B", "d"}).Arg("bin_idx", bin_idx, {"L * bins_per_table", "bin_size"});
    c.Ret("codes", *codes, {"B", "L"});
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t B = c["B"], d = c["d"], total_bins = c["L * bins_per_table"], bin_size = c["bin_size"];
    const int64_t L = c["L"];
    int bits_per_bin = 0;
    while ((int64_t{1} << bits_per_bin) < bin_size) ++bits_per_bin;
    c.Require(bin_size >= 2 && (int64_t{1} << bits_per_bin) == bin_size, [&] {
      return "bin_size (bin_idx.shape[1]) must be a power of two >= 2, got " + std::to_string(bin_size);
    });
    c.Require(L >= 1 && total_bins % L == 0 && total_bins / L >= 1 && (total_bins / L) * bits_per_bin <= 30, [&] {
      return "bin_idx has " + std::to_string(total_bins) + " bins, which must be L * bins_per_table with L = " +
             std::to_string(L) + " and 1 <= bins_per_table * log2(bin_size) <= 30 bits";
    });
    const int32_t* idx = bin_idx.typed_data();
    c.Ids("bin_idx", idx, total_bins * bin_size, "d", /*allow_pad=*/false, bin_size);
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t per_table = total_bins / L;
    const uint64_t s = *seed.typed_data();
    const float* xp = x.typed_data();
    int32_t* out = codes->typed_data();
    ParallelLoop loop(pool, B, 4);  // a step's B queries over every core
    std::vector<int32_t> winners(loop.workers() * total_bins);
    return loop.Run(c.op(), [&](int64_t w, int64_t b0, int64_t b1) {
      int32_t* win = winners.data() + w * total_bins;
      for (int64_t b = b0; b < b1; ++b) {
        const float* xb = xp + b * d;
        for (int64_t j = 0; j < total_bins; ++j) win[j] = BinWinner(xb, idx + j * bin_size, bin_size);
        for (int64_t l = 0; l < L; ++l) {
          uint32_t code = 0;
          for (int64_t i = 0; i < per_table; ++i) {
            const int64_t j = l * per_table + i;
            int32_t winner = win[j];
            for (int a = 1; winner < 0 && a <= kDensifyAttempts; ++a) {
              winner = win[Bounded(Hash3(s, j, a), total_bins)];
            }
            code |= static_cast<uint32_t>(winner < 0 ? 0 : winner) << (i * bits_per_bin);
          }
          out[b * L + l] = static_cast<int32_t>(code);
        }
      }
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SimHash, SimHashImpl);
XLA_FFI_DEFINE_HANDLER_SYMBOL(Dwta, DwtaImpl);

}  // namespace sparsejax

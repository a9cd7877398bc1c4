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
// (densification, Chen & Shrivastava 2018).
#include "common.h"

namespace sparsejax {
namespace {

ffi::Error CheckX(const ArgChecker& c, const ffi::AnyBuffer& x, int64_t* B, int64_t* d) {
  SJ_RETURN_IF_ERROR(c.Dtype(x, ffi::F32, "x"));
  SJ_RETURN_IF_ERROR(c.Shape(x, {-1, -1}, "x", "[B, d]"));
  *B = x.dimensions()[0];
  *d = x.dimensions()[1];
  return ffi::Error::Success();
}

// Hashes rows [b0, b1). All H = L * K projections are accumulated at once
// (one axpy per input dim: no dependency chains, vectorizes), in increasing
// dim order, so every ISA variant below computes the same floats.
SJ_MULTIVERSION void SimHashRows(const float* x, const float* proj_t, int64_t b0, int64_t b1,
                                 int64_t d, int64_t L, int64_t K, int32_t* out) {
  const int64_t H = L * K;
  std::vector<float> acc(H);
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * d;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < d; ++i) {
      if (xb[i] != 0.0f) Axpy(xb[i], proj_t + i * H, acc.data(), H);  // zeros add nothing
    }
    for (int64_t l = 0; l < L; ++l) {
      uint32_t code = 0;
      for (int64_t bit = 0; bit < K; ++bit) code |= static_cast<uint32_t>(acc[l * K + bit] > 0.0f) << bit;
      out[b * L + l] = static_cast<int32_t>(code);
    }
  }
}

ffi::Error SimHashImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::AnyBuffer projections_t,
                       ffi::Result<ffi::AnyBuffer> codes) {
  ArgChecker c("lsh_hash[simhash]");
  int64_t B, d;
  SJ_RETURN_IF_ERROR(CheckX(c, x, &B, &d));
  SJ_RETURN_IF_ERROR(c.Dtype(projections_t, ffi::F32, "projections_t"));
  SJ_RETURN_IF_ERROR(c.Shape(projections_t, {d, -1}, "projections_t", "[d, L * K]"));
  const int64_t H = projections_t.dimensions()[1];
  SJ_RETURN_IF_ERROR(c.Dtype(*codes, ffi::S32, "codes"));
  SJ_RETURN_IF_ERROR(c.Shape(*codes, {B, -1}, "codes", "[B, L]"));
  const int64_t L = codes->dimensions()[1];
  if (L < 1 || H % L != 0 || H / L > 30) {
    return c.Fail("projections_t has " + std::to_string(H) + " columns, which must be L * K with L = " +
                  std::to_string(L) + " tables and 1 <= K <= 30 bits");
  }
  const float* proj = projections_t.typed_data<float>();
  const float* xp = x.typed_data<float>();
  int32_t* out = codes->typed_data<int32_t>();
  ParallelFor(pool, B, 64, [&](int64_t b0, int64_t b1) {
    SimHashRows(xp, proj, b0, b1, d, L, H / L, out);
  });
  return ffi::Error::Success();
}

constexpr int kDensifyAttempts = 100;

ffi::Error DwtaImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                    ffi::AnyBuffer bin_idx, ffi::AnyBuffer seed,
                    ffi::Result<ffi::AnyBuffer> codes) {
  ArgChecker c("lsh_hash[dwta]");
  int64_t B, d;
  SJ_RETURN_IF_ERROR(CheckX(c, x, &B, &d));
  SJ_RETURN_IF_ERROR(c.Dtype(bin_idx, ffi::S32, "bin_idx"));
  SJ_RETURN_IF_ERROR(c.Shape(bin_idx, {-1, -1}, "bin_idx", "[L * bins_per_table, bin_size]"));
  SJ_RETURN_IF_ERROR(c.Dtype(seed, ffi::U32, "seed"));
  SJ_RETURN_IF_ERROR(c.Shape(seed, {}, "seed", "[]"));
  SJ_RETURN_IF_ERROR(c.Dtype(*codes, ffi::S32, "codes"));
  SJ_RETURN_IF_ERROR(c.Shape(*codes, {B, -1}, "codes", "[B, L]"));
  const int64_t total_bins = bin_idx.dimensions()[0];
  const int64_t bin_size = bin_idx.dimensions()[1];
  const int64_t L = codes->dimensions()[1];
  int bits_per_bin = 0;
  while ((int64_t{1} << bits_per_bin) < bin_size) ++bits_per_bin;
  if (bin_size < 2 || (int64_t{1} << bits_per_bin) != bin_size) {
    return c.Fail("bin_size (bin_idx.shape[1]) must be a power of two >= 2, got " + std::to_string(bin_size));
  }
  if (L < 1 || total_bins % L != 0 || (total_bins / L) * bits_per_bin > 30) {
    return c.Fail("bin_idx has " + std::to_string(total_bins) + " bins, which must be L * bins_per_table with L = " +
                  std::to_string(L) + " and bins_per_table * log2(bin_size) <= 30 bits");
  }
  const int64_t per_table = total_bins / L;
  const int32_t* idx = bin_idx.typed_data<int32_t>();
  SJ_RETURN_IF_ERROR(CheckIds(c, idx, total_bins * bin_size, d, "bin_idx", "d", false, bin_size));
  const uint64_t s = *seed.typed_data<uint32_t>();
  const float* xp = x.typed_data<float>();
  int32_t* out = codes->typed_data<int32_t>();
  ParallelFor(pool, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> win(total_bins);
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = xp + b * d;
      for (int64_t j = 0; j < total_bins; ++j) {
        const int32_t* bin = idx + j * bin_size;
        int32_t best = -1;  // -1: empty bin (all zero)
        float best_val = 0.0f;
        for (int64_t t = 0; t < bin_size; ++t) {
          const float val = xb[bin[t]];
          if (val != 0.0f && (best < 0 || val > best_val)) {
            best = static_cast<int32_t>(t);
            best_val = val;
          }
        }
        win[j] = best;
      }
      for (int64_t l = 0; l < L; ++l) {
        uint32_t code = 0;
        for (int64_t i = 0; i < per_table; ++i) {
          const int64_t j = l * per_table + i;
          int32_t w = win[j];
          for (int a = 1; w < 0 && a <= kDensifyAttempts; ++a) {
            w = win[Bounded(Hash3(s, j, a), total_bins)];
          }
          code |= static_cast<uint32_t>(w < 0 ? 0 : w) << (i * bits_per_bin);
        }
        out[b * L + l] = static_cast<int32_t>(code);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SimHash, SimHashImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [B, d]
                                  .Arg<ffi::AnyBuffer>()  // projections_t [d, L*K]
                                  .Ret<ffi::AnyBuffer>()); // codes [B, L]

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dwta, DwtaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [B, d]
                                  .Arg<ffi::AnyBuffer>()  // bin_idx [L*bins, bin_size]
                                  .Arg<ffi::AnyBuffer>()  // seed []
                                  .Ret<ffi::AnyBuffer>()); // codes [B, L]

}  // namespace sparsejax

// logistic_regression: an L2-regularised logistic regression per label on
// sparse rows, by dual coordinate descent (Yu, Huang and Lin, "Dual
// coordinate descent methods for logistic regression and maximum entropy
// models", 2011: liblinear's L2R_LR_DUAL).
//
//   indptr [n + 1] int32, indices [nnz] int32, values [nnz] float32: the rows
//     x_i (CSR, feature ids in [0, F))
//   positive_offsets [K + 1] int32, positive_rows [P] int32: label j's
//     positive rows are positive_rows[positive_offsets[j], positive_offsets[j + 1])
//   attributes num_features F, c > 0, tolerance > 0, max_epochs >= 1, seed
//   -> weights [K, F] float32, bias [K] float32, epochs [K] int32
//
// Label j's model minimises 0.5 (|w|^2 + b^2) + c sum_i log(1 + exp(-y_i (x_i . w + b)))
// with y_i = +1 on its positive rows, -1 on the others: the bias is a
// constant feature of value 1 (penalised, as liblinear's -B 1). Its dual has
// one variable per row in (0, c); an epoch visits the rows in a seeded random
// order and solves each one's one-dimensional problem by Newton's method,
// keeping w = sum_i y_i alpha_i x_i up to date (O(nnz(x_i)) per row). It stops
// where the largest gradient of an epoch's one-variable problems, each at its
// starting point, is below `tolerance` (liblinear's rule) or after
// `max_epochs` epochs (`epochs` says which). Rows must not repeat a feature id
// (|x_i|^2 is summed per stored value). The head rankers' L-BFGS solve of
// the primal took 32 s for 17 labels on the suite's debian_depends; this one
// reaches a better-solved model in about a tenth of that.
//
// One label per task, in double precision: the result is the same for any
// thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common.h"

namespace sparsejax {
namespace {

constexpr char kNumFeatures[] = "num_features";
constexpr char kC[] = "c";
constexpr char kTolerance[] = "tolerance";
constexpr char kMaxEpochs[] = "max_epochs";
constexpr char kSeed[] = "seed";
constexpr int kMaxNewtonSteps = 100;
constexpr double kTiny = std::numeric_limits<double>::min();
constexpr double kEpsilon = std::numeric_limits<double>::epsilon();

// The rows, shared by every label's solve.
struct Rows {
  const int32_t* indptr;
  const int32_t* indices;
  const float* values;
  int64_t n;
  int64_t num_features;
  const double* squared_norms;  // |x_i|^2 + 1 (the bias feature)
};

SJ_INLINE double RowDot(const Rows& x, int64_t i, const double* w) {
  double s = w[x.num_features];  // the bias feature
  for (int32_t p = x.indptr[i]; p < x.indptr[i + 1]; ++p) s += w[x.indices[p]] * static_cast<double>(x.values[p]);
  return s;
}

SJ_INLINE void RowAxpy(const Rows& x, int64_t i, double a, double* w) {
  w[x.num_features] += a;
  for (int32_t p = x.indptr[i]; p < x.indptr[i + 1]; ++p) w[x.indices[p]] += a * static_cast<double>(x.values[p]);
}

// Scratch of one worker: w (F + 1), alpha and C - alpha per row, the sign and visiting order of the rows.
struct Scratch {
  std::vector<double> w, alpha;
  std::vector<int8_t> sign;
  std::vector<int32_t> order;
  Scratch(int64_t n, int64_t F) : w(F + 1), alpha(2 * n), sign(n), order(n) {}
};

// Solves one label; returns the epochs it took.
int64_t SolveLabel(const Rows& x, const int32_t* positives, int64_t num_positives, double c, double tolerance,
                   int64_t max_epochs, uint64_t seed, Scratch& s) {
  const int64_t n = x.n;
  std::fill(s.w.begin(), s.w.end(), 0.0);
  std::fill(s.sign.begin(), s.sign.end(), int8_t{-1});
  for (int64_t p = 0; p < num_positives; ++p) s.sign[positives[p]] = 1;
  // alpha[2i] is row i's dual variable, alpha[2i + 1] = c - alpha[2i]; both start near their bounds' inside.
  const double start = std::min(1e-3 * c, 1e-8);
  for (int64_t i = 0; i < n; ++i) {
    s.alpha[2 * i] = start;
    s.alpha[2 * i + 1] = c - start;
    RowAxpy(x, i, s.sign[i] * start, s.w.data());
  }
  for (int64_t i = 0; i < n; ++i) s.order[i] = static_cast<int32_t>(i);
  double inner_tolerance = 1e-2;
  const double least_inner_tolerance = std::min(1e-8, tolerance);
  int64_t epoch = 0;
  while (epoch < max_epochs) {
    for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates from a counter-based hash: the same order on any thread
      std::swap(s.order[i], s.order[Bounded(Hash3(seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(i)),
                                            static_cast<uint64_t>(i + 1))]);
    }
    int64_t newton_steps = 0;
    double largest_gradient = 0.0;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t i = s.order[t];
      const double y = static_cast<double>(s.sign[i]);
      const double a = x.squared_norms[i];
      const double b = y * RowDot(x, i, s.w.data());
      // The sub-problem in z = alpha[which], alpha[other] = c - z: min 0.5 a (z - z0)^2 + sign b z + z log z +
      // (c - z) log(c - z) over (0, c); the one of the pair nearer its optimum's side is moved.
      int64_t which = 2 * i, other = 2 * i + 1;
      double direction = 1.0;
      if (0.5 * a * (s.alpha[other] - s.alpha[which]) + b < 0) {
        std::swap(which, other);
        direction = -1.0;
      }
      const double z0 = s.alpha[which];
      double z = z0;
      if (c - z < 0.5 * c) z *= 0.1;
      double gradient = a * (z - z0) + direction * b + std::log(z / (c - z));
      largest_gradient = std::max(largest_gradient, std::fabs(gradient));
      int64_t steps = 0;
      while (steps <= kMaxNewtonSteps && std::fabs(gradient) >= inner_tolerance) {
        const double curvature = a + c / (c - z) / z;
        const double next = z - gradient / curvature;
        // Kept inside (0, c), where the logarithms are finite: a margin so large that z underflows (liblinear
        // would take log(0) there and spread NaN into w) stops at the smallest normal double.
        z = std::clamp(next <= 0 ? z * 0.1 : next, kTiny, c * (1.0 - kEpsilon));
        gradient = a * (z - z0) + direction * b + std::log(z / (c - z));
        ++steps;
      }
      newton_steps += steps;
      if (steps > 0) {
        s.alpha[which] = z;
        s.alpha[other] = c - z;
        RowAxpy(x, i, direction * (z - z0) * y, s.w.data());
      }
    }
    ++epoch;
    if (largest_gradient < tolerance) break;
    if (newton_steps <= n / 10) inner_tolerance = std::max(least_inner_tolerance, 0.1 * inner_tolerance);
  }
  return epoch;
}

ffi::Error LogisticRegressionImpl(ffi::ThreadPool pool, S32R1 indptr, S32R1 indices, F32R1 values,
                                  S32R1 positive_offsets, S32R1 positive_rows,
                                  ffi::Attr<int64_t, kNumFeatures> num_features_attr, ffi::Attr<float, kC> c_attr,
                                  ffi::Attr<float, kTolerance> tolerance_attr,
                                  ffi::Attr<int64_t, kMaxEpochs> max_epochs_attr, ffi::Attr<int64_t, kSeed> seed_attr,
                                  ffi::Result<F32R2> weights, ffi::Result<F32R1> bias, ffi::Result<S32R1> epochs) {
  const int64_t F = *num_features_attr, max_epochs = *max_epochs_attr;
  const double penalty_c = *c_attr, tolerance = *tolerance_attr;
  return Guarded("logistic_regression", [&](Checker& c) {
    // n and K come from the offsets' lengths (n + 1, K + 1): bound before the results, so that a result's wrong
    // shape is named as its own.
    const int64_t n = static_cast<int64_t>(indptr.element_count()) - 1;
    const int64_t K = static_cast<int64_t>(positive_offsets.element_count()) - 1;
    c.Require(n >= 0, [&] { return std::string("argument 'indptr' must have shape [n + 1], got [0]"); });
    c.Require(K >= 0, [&] { return std::string("argument 'positive_offsets' must have shape [K + 1], got [0]"); });
    c.Require(F >= 1 && F < (int64_t{1} << 31),
              [&] { return "attribute 'num_features' must be in [1, 2^31), got " + std::to_string(F); });
    c.Require(n < (int64_t{1} << 31), [&] { return "argument 'indptr' must have fewer than 2^31 + 1 offsets"; });
    SJ_RETURN_IF_ERROR(c.status());
    c.Bind("F", F, "attribute 'num_features'").Bind("n", n, "argument 'indptr' (n + 1 offsets)");
    c.Bind("K", K, "argument 'positive_offsets' (K + 1 offsets)");
    c.Arg("indices", indices, {"nnz"}).Arg("values", values, {"nnz"}).Arg("positive_rows", positive_rows, {"P"});
    c.Ret("weights", *weights, {"K", "F"}).Ret("bias", *bias, {"K"}).Ret("epochs", *epochs, {"K"});
    c.Require(std::isfinite(penalty_c) && penalty_c > 0,
              [&] { return "attribute 'c' must be a positive number, got " + std::to_string(penalty_c); });
    c.Require(std::isfinite(tolerance) && tolerance > 0, [&] {
      return "attribute 'tolerance' must be a positive number, got " + std::to_string(tolerance);
    });
    c.Require(max_epochs >= 1 && max_epochs < (int64_t{1} << 31),
              [&] { return "attribute 'max_epochs' must be in [1, 2^31), got " + std::to_string(max_epochs); });
    SJ_RETURN_IF_ERROR(c.status());
    const int64_t nnz = c["nnz"], P = c["P"];
    // Offsets come from the caller: a decreasing or out-of-range one would read past the rows.
    auto check_offsets = [&](const char* name, const int32_t* off, int64_t count, int64_t end, const char* what) {
      for (int64_t k = 0; k <= count && c.ok(); ++k) {
        const int64_t lo = k == 0 ? 0 : off[k - 1];
        const bool ends_ok = (k > 0 || off[k] == 0) && (k < count || off[k] == end);
        c.Require(off[k] >= lo && off[k] <= end && ends_ok, [&] {
          return std::string("argument '") + name + "' must be non-decreasing from 0 to " + what + " = " +
                 std::to_string(end) + ", got " + name + "[" + std::to_string(k) + "] = " + std::to_string(off[k]) +
                 (k == 0 ? std::string() : " after " + std::to_string(lo));
        });
      }
    };
    check_offsets("indptr", indptr.typed_data(), n, nnz, "nnz (from 'indices')");
    check_offsets("positive_offsets", positive_offsets.typed_data(), K, P, "P (from 'positive_rows')");
    c.Ids("indices", indices.typed_data(), nnz, "F", false);
    c.Ids("positive_rows", positive_rows.typed_data(), P, "n", false);
    SJ_RETURN_IF_ERROR(c.status());
    std::vector<double> squared_norms(n);
    const float* v = values.typed_data();
    for (int64_t i = 0; i < n; ++i) {
      double s = 1.0;
      for (int32_t p = indptr.typed_data()[i]; p < indptr.typed_data()[i + 1]; ++p) s += double(v[p]) * v[p];
      squared_norms[i] = s;
    }
    const Rows x{indptr.typed_data(), indices.typed_data(), v, n, F, squared_norms.data()};
    ParallelLoop loop(pool, K, 1);
    std::vector<Scratch> scratch;
    scratch.reserve(loop.workers());
    for (int64_t w = 0; w < loop.workers(); ++w) scratch.emplace_back(n, F);
    const int32_t* off = positive_offsets.typed_data();
    return loop.Run(c.op(), [&](int64_t worker, int64_t k0, int64_t k1) {
      Scratch& s = scratch[worker];
      for (int64_t k = k0; k < k1; ++k) {
        epochs->typed_data()[k] = static_cast<int32_t>(
            SolveLabel(x, positive_rows.typed_data() + off[k], off[k + 1] - off[k], penalty_c, tolerance, max_epochs,
                       HashCombine(static_cast<uint64_t>(*seed_attr), static_cast<uint64_t>(k)), s));
        float* out = weights->typed_data() + k * F;
        for (int64_t f = 0; f < F; ++f) out[f] = static_cast<float>(s.w[f]);
        bias->typed_data()[k] = static_cast<float>(s.w[F]);
      }
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LogisticRegression, LogisticRegressionImpl);

}  // namespace sparsejax

#include "common.h"

namespace sparsejax {

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    default: return "other";
  }
}

std::string ShapeString(const ffi::AnyBuffer& b) {
  std::ostringstream s;
  s << "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << "]";
  return s.str();
}

ffi::Error ArgChecker::Dtype(const ffi::AnyBuffer& b, ffi::DataType t,
                             const char* name) const {
  if (b.element_type() == t) return ffi::Error::Success();
  return Fail(std::string("argument '") + name + "' must have dtype " +
              DtypeName(t) + ", got " + DtypeName(b.element_type()));
}

ffi::Error ArgChecker::Shape(const ffi::AnyBuffer& b,
                             std::vector<int64_t> expected, const char* name,
                             const char* shape) const {
  auto dims = b.dimensions();
  bool ok = dims.size() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) {
    ok = expected[i] < 0 || dims[i] == expected[i];
  }
  if (ok) return ffi::Error::Success();
  std::ostringstream want;
  want << "[";
  for (size_t i = 0; i < expected.size(); ++i) {
    want << (i ? ", " : "");
    if (expected[i] < 0) want << "*"; else want << expected[i];
  }
  want << "]";
  return Fail(std::string("argument '") + name + "' must have shape " + shape +
              " = " + want.str() + ", got " + ShapeString(b));
}

ffi::Error CheckIds(const ArgChecker& c, const int32_t* ids, int64_t n,
                    int64_t limit, const char* name, const char* limit_name,
                    bool allow_pad, int64_t row_len) {
  for (int64_t i = 0; i < n; ++i) {
    int32_t v = ids[i];
    if ((v >= 0 && v < limit) || (allow_pad && v == kPadId)) continue;
    std::ostringstream s;
    s << "argument '" << name << "' has id " << v << " at flat position " << i;
    if (row_len > 0) s << " (row " << i / row_len << ", column " << i % row_len << ")";
    s << ", outside [0, " << limit_name << " = " << limit << ")";
    if (allow_pad) s << " (" << kPadId << " is allowed as padding)";
    return c.Fail(s.str());
  }
  return ffi::Error::Success();
}

int64_t MaxThreads() {
  static const int64_t cap = [] {
    const char* env = std::getenv("SPARSEJAX_NUM_THREADS");
    if (env == nullptr) return int64_t{1} << 30;
    int64_t v = std::atoll(env);
    return v > 0 ? v : int64_t{1} << 30;
  }();
  return cap;
}

}  // namespace sparsejax

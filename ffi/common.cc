#include "common.h"

#include <cstring>
#include <new>
#include <sstream>

namespace sparsejax {
namespace {

// "[B, d]" from symbols, "[6, 5]" from sizes.
template <typename Seq>
std::string Bracketed(const Seq& items) {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (const auto& item : items) {
    s << (first ? "" : ", ") << item;
    first = false;
  }
  s << "]";
  return s.str();
}

// A symbol that is a number ("0") is a literal size.
bool ParseLiteral(const char* symbol, int64_t* value) {
  char* end = nullptr;
  const long long v = std::strtoll(symbol, &end, 10);
  if (end == symbol || *end != '\0') return false;
  *value = v;
  return true;
}

}  // namespace

const Checker::Symbol* Checker::Find(const char* name) const {
  for (int i = 0; i < num_symbols_; ++i) {
    if (std::strcmp(symbols_[i].name, name) == 0) return &symbols_[i];
  }
  return nullptr;
}

Checker& Checker::Bind(const char* symbol, int64_t value, const char* source) {
  if (const Symbol* s = Find(symbol)) {
    if (s->value != value) {
      Fail(std::string(source) + " gives " + symbol + " = " + std::to_string(value) + ", but " + s->source +
           " gives " + std::to_string(s->value));
    }
    return *this;
  }
  if (num_symbols_ == static_cast<int>(symbols_.size())) {
    Fail("internal error: too many shape symbols");
    return *this;
  }
  symbols_[num_symbols_++] = Symbol{symbol, value, source};
  return *this;
}

int64_t Checker::operator[](const char* symbol) const {
  const Symbol* s = Find(symbol);
  if (s == nullptr) std::abort();  // a kernel reads a symbol it never bound
  return s->value;
}

void Checker::Fail(const std::string& message) {
  if (error_.empty()) error_ = op_ + ": " + message;
}

void Checker::Shape(const char* kind, const char* name, Dims dims, const Spec& shape, const char* note) {
  if (!ok()) return;
  const std::string want = Bracketed(shape) + (note ? std::string(" ") + note : std::string());
  auto fail = [&](const std::string& why) {
    Fail(std::string(kind) + " '" + name + "' must have shape " + want + why + ", got " + Bracketed(dims));
  };
  if (dims.size() != shape.size()) return fail(" (rank " + std::to_string(shape.size()) + ")");
  int64_t axis = 0;
  for (const char* symbol : shape) {
    const int64_t got = dims[axis];
    int64_t literal;
    if (ParseLiteral(symbol, &literal)) {
      if (got != literal) return fail(" with axis " + std::to_string(axis) + " = " + symbol);
    } else if (const Symbol* s = Find(symbol)) {
      if (got != s->value) {
        return fail(std::string(" with ") + symbol + " = " + std::to_string(s->value) + " (from '" + s->source + "')");
      }
    } else {
      Bind(symbol, got, name);
    }
    ++axis;
  }
}

Checker& Checker::Ids(const char* name, const int32_t* ids, int64_t n, const char* limit_symbol, bool allow_pad,
                      int64_t row_len) {
  if (!ok()) return *this;
  const int64_t limit = (*this)[limit_symbol];
  // A branch-free pass (vectorized: this check runs on every step's B * k ids) finds whether any id is bad;
  // only then is the first one looked for.
  const uint32_t lim = static_cast<uint32_t>(std::clamp<int64_t>(limit, 0, int64_t{1} << 31));
  const uint32_t pad = static_cast<uint32_t>(kPadId);
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = static_cast<uint32_t>(ids[i]);
    bad |= static_cast<uint32_t>(v >= lim) & static_cast<uint32_t>(!allow_pad || v != pad);
  }
  if (bad == 0) return *this;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = ids[i];
    if ((v >= 0 && v < limit) || (allow_pad && v == kPadId)) continue;
    std::ostringstream s;
    s << "argument '" << name << "' has id " << v << " at flat position " << i;
    if (row_len > 0) s << " (row " << i / row_len << ", column " << i % row_len << ")";
    s << ", outside [0, " << limit_symbol << " = " << limit << ")";
    if (allow_pad) s << " (" << kPadId << " is allowed as padding)";
    Fail(s.str());
    break;
  }
  return *this;
}

ffi::Error ExceptionError(std::string_view op_name, std::exception_ptr e) {
  const std::string op(op_name);
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      op + ": out of memory (std::bad_alloc): the kernel's working memory could not "
                      "be allocated; use smaller inputs (batch, k, num_rows) or free memory");
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(op + ": unexpected C++ exception: " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(op + ": unexpected C++ exception");
  }
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

ParallelLoop::ParallelLoop(ffi::ThreadPool& pool, int64_t n, int64_t grain)
    : pool_(pool), n_(n), grain_(std::max<int64_t>(1, grain)) {
  const int64_t num_chunks = n_ > 0 ? (n_ + grain_ - 1) / grain_ : 0;
  workers_ = std::max<int64_t>(1, std::min<int64_t>({pool.num_threads() + 1, MaxThreads(), num_chunks}));
}

namespace internal {

void ParallelState::RunChunks(int64_t worker) noexcept {
  int64_t finished = 0;
  for (;;) {
    const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
    if (c >= num_chunks) break;
    ++finished;
    if (failed.load(std::memory_order_relaxed)) continue;  // skip the rest after a failure
    try {
      const int64_t begin = c * grain;
      invoke(body, worker, begin, std::min(n, begin + grain));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (error_chunk < 0 || c < error_chunk) {
        error_chunk = c;
        error = std::current_exception();
      }
      failed.store(true, std::memory_order_relaxed);
    }
  }
  if (finished > 0) {
    std::lock_guard<std::mutex> lock(mu);
    done += finished;
    if (done == num_chunks) cv.notify_all();
  }
}

}  // namespace internal
}  // namespace sparsejax

// Errors raised by the host API. Every message names the argument or input that is wrong; the
// C ABI (and CUDA paths) turn these into status codes.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvpolicy {

// Thrown for invalid arguments: shapes, strides, budgets, NaN input, bad spec strings.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument("kvpolicy: " + what) {}
};

namespace detail {
// The arguments streamed into one string.
template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(cat(std::forward<Args>(args)...));
}
}  // namespace detail

// KVP_REQUIRE(cond, "budget ", b, " is below the protected count ", p)
#define KVP_REQUIRE(cond, ...)                 \
  do {                                         \
    if (!(cond)) ::kvpolicy::detail::fail(__VA_ARGS__); \
  } while (0)

}  // namespace kvpolicy

// The message of the kvpolicy::Error `f` throws; "<no exception>" or "<other exception>"
// otherwise, so that a wrong exception type fails the Contains() checks on the message.
#pragma once
#include <functional>
#include <string>

#include <kvpolicy/core/error.hpp>

namespace kvtest {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kvpolicy::Error& e) {
    return e.what();
  } catch (...) {
    return "<other exception>";
  }
  return "<no exception>";
}

}  // namespace kvtest

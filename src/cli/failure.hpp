// The one kind of error `kvpolicy compress` reports: what is wrong (`problem`) with which file or
// option (`subject`). main.cpp prints it as one line, `kvpolicy compress: <subject>: <problem>`.
#pragma once
#include <stdexcept>
#include <string>

namespace kvpolicy_cli {

class Failure : public std::runtime_error {
 public:
  Failure(std::string subject, const std::string& problem)
      : std::runtime_error(problem), subject_(std::move(subject)) {}
  const std::string& subject() const { return subject_; }

 private:
  std::string subject_;
};

}  // namespace kvpolicy_cli

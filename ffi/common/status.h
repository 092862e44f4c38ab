/*! \file status.h
    \brief Error value returned by the kernels' host entry points. The FFI glue turns a
           failed Status into an ffi::Error; nothing below the glue throws or aborts.
*/
#pragma once

#include <string>
#include <utility>

namespace jax_flash {

class Status {
 public:
  enum class Code { kOk, kInvalidArgument, kInternal };

  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string message) {
    return Status(Code::kInvalidArgument, std::move(message));
  }
  static Status Internal(std::string message) { return Status(Code::kInternal, std::move(message)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

}  // namespace jax_flash

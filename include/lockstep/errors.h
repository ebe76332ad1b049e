// Typed exceptions of the trainer, data and collective layers.
//
// libtorch already reports its own failures as c10::Error, so the layers built on
// it throw too; the coordination layer, where timeouts and dead peers are normal
// outcomes, returns absl::Status and is converted to these at one boundary (one
// error model per layer). Every message names the thing that was wrong.
#ifndef LOCKSTEP_ERRORS_H_
#define LOCKSTEP_ERRORS_H_

#include <stdexcept>
#include <string>

namespace lockstep {

// Base of every exception Lockstep throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a value that can never work (a bad option, mismatched shapes).
class InvalidArgumentError : public Error {
 public:
  using Error::Error;
};

// Input data could not be read or is malformed (missing file, bad IDX header).
class DataError : public Error {
 public:
  using Error::Error;
};

}  // namespace lockstep

#endif  // LOCKSTEP_ERRORS_H_

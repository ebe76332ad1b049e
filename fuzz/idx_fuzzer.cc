// Fuzzes the IDX reader (ReadIdxFile: Fashion-MNIST's format, or any file a config
// names as a dataset). The input is the file. Properties: any file is a tensor whose
// shape and size the header describes, or a DataError with a message; never a crash,
// an out-of-bounds read or another exception.
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "lockstep/data.h"
#include "lockstep/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = (lockstep::fuzz::ScratchDir() / "input.idx").string();
  lockstep::fuzz::WriteWholeFile(path, std::string(reinterpret_cast<const char*>(data), size));
  try {
    const at::Tensor tensor = lockstep::ReadIdxFile(path);
    LOCKSTEP_FUZZ_CHECK(tensor.defined(), "an undefined tensor");
    if (size >= 4 && data[0] == 0 && data[1] == 0) {  // not gzip-compressed: the header is the input's
      const int64_t dims = data[3];
      LOCKSTEP_FUZZ_CHECK(tensor.dim() == dims, "the tensor's rank is not the header's");
      const int64_t payload = static_cast<int64_t>(size) - 4 - 4 * dims;
      LOCKSTEP_FUZZ_CHECK(tensor.numel() * static_cast<int64_t>(tensor.element_size()) == payload,
                          "the tensor's size is not the file's payload");
    }
  } catch (const lockstep::DataError& e) {
    LOCKSTEP_FUZZ_CHECK(e.what()[0] != '\0', "a DataError without a message");
  }
  return 0;
}

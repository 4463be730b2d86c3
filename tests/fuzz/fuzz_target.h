// The one entry point every fuzz target defines (libFuzzer's). A target returns 0 for any input
// and ends the process (fuzz_check) when the code under test breaks a promise: a crash, a
// sanitizer report or a failed property is a finding; a typed error for bad input is not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

// The input as a stream of choices: next() gives the next byte, 0 once the input is used up (so
// every input, however short, is a complete run).
class FuzzBytes {
 public:
  FuzzBytes(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool empty() const { return at_ >= size_; }
  std::uint8_t next() { return at_ < size_ ? data_[at_++] : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_, at_ = 0;
};

// Not assert(): it must hold in every build type, Release included (the replay tests run there).
#define FUZZ_CHECK(cond, what)                                                               \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "fuzz property failed at %s:%d: %s\n", __FILE__, __LINE__, what); \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

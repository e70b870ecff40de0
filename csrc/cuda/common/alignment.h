// The 16-byte alignment the CUDA kernels' vector loads and TMA need.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace cake {

inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace cake

// The optional bias [N] and residual [M, N] every linear kernel here adds to its output (bias
// first), checked once against the output's shape and dtype and handed over as raw pointers.

#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace pdserve {

struct Epilogue {
  const void* bias = nullptr;      // [n]
  const void* residual = nullptr;  // rows of res_stride
  int64_t res_stride = 0;
};

inline Epilogue epilogue(const c10::optional<torch::Tensor>& bias,
                         const c10::optional<torch::Tensor>& residual, int64_t rows, int64_t n,
                         c10::ScalarType dtype, const char* name) {
  Epilogue e;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "bias must be ", name, " [out_features]");
    e.bias = bias->data_ptr();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == n &&
                    residual->stride(1) == 1 && residual->scalar_type() == dtype,
                "residual must be ", name, " [M, N] with contiguous rows");
    e.residual = residual->data_ptr();
    e.res_stride = residual->stride(0);
  }
  return e;
}

}  // namespace pdserve

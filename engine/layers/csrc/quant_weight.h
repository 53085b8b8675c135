// A linear layer's weights on their blocks (quant_formats.h's tiles, quant_gemm.h's kernels),
// and its Python binding: what engine/layers/quantized.py's modules hold.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "linear_epilogue.h"
#include "quant_formats.h"
#include "quant_gemm.h"

namespace pdserve::quant {

// One matrix of a linear layer: the rows it gives, in one block type. A layer stacking several
// checkpoint matrices (q, k, v) keeps one part per matrix: they may differ in type.
struct Part {
  torch::Tensor tiles;
  int64_t type, n;
};

// A linear layer's weights on their blocks: y = x W^T with W the parts' rows stacked.
class QuantWeight {
 public:
  // float_activations: multiply float32 activations by the weights dequantized in registers
  // (the float path's bits), instead of int8 activations by the codes.
  QuantWeight(int64_t k, bool float_activations)
      : k_(k), float_activations_(float_activations) {
    TORCH_CHECK(k > 0 && k % kQK == 0, "in_features must be a multiple of ", kQK);
  }

  // Append the rows of a GGUF tensor (uint8 [n, k / block weights * block bytes]).
  void add(const torch::Tensor& raw, int64_t type) {
    auto tiles = pack(raw, type, k_);
    parts_.push_back(Part{tiles, type, raw.size(0)});
    n_ += raw.size(0);
  }

  int64_t in_features() const { return k_; }
  bool float_activations() const { return float_activations_; }
  int64_t out_features() const { return n_; }
  int64_t nbytes() const {
    int64_t total = 0;
    for (const auto& p : parts_) total += p.tiles.numel();
    return total;
  }
  std::vector<int64_t> types() const {
    std::vector<int64_t> t;
    for (const auto& p : parts_) t.push_back(p.type);
    return t;
  }

  // Raw entry (the fused decode step's): shapes checked by the caller; y may be the residual.
  void into(const float* x, int64_t x_stride, int64_t rows, const float* bias,
            const float* residual, int64_t res_stride, float* y, int64_t y_stride,
            Kernel kernel = Kernel::kBest) const {
    if (rows <= 0) return;
    std::vector<XBlock> xq(float_activations_ ? 0 : static_cast<size_t>(rows * k_ / kQK));
    if (!float_activations_) quantize_rows(x, x_stride, rows, k_, xq.data());
    int64_t offset = 0;
    for (const auto& p : parts_) {
      const Operands o{float_activations_ ? nullptr : xq.data(), x, x_stride,
                       p.tiles.data_ptr<uint8_t>(), p.type, k_ / block_weights(p.type), p.n,
                       bias == nullptr ? nullptr : bias + offset,
                       residual == nullptr ? nullptr : residual + offset, res_stride,
                       y + offset, y_stride};
      const int64_t groups_n = (p.n + kCols - 1) / kCols;
      const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
      // One contiguous range of tile groups per thread: the weights stream once.
      const int64_t grain = std::max<int64_t>(1, (groups_n + threads - 1) / threads);
      at::parallel_for(0, groups_n, grain, [&](int64_t begin, int64_t end) {
        groups(o, rows, begin, end, kernel);
      });
      offset += p.n;
    }
  }

  // x [M, K] (rows contiguous); bias [N] or None; residual [M, N] or None (after the bias).
  torch::Tensor forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias,
                        const c10::optional<torch::Tensor>& residual,
                        const std::string& kernel) const {
    TORCH_CHECK(kernel == "best" || kernel == "portable" || kernel == "avx2",
                "kernel must be best, portable or avx2");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 &&
                    x.size(1) == k_,
                "x must be float32 [M, ", k_, "] with contiguous rows");
    const int64_t rows = x.size(0);
    auto y = torch::empty({rows, n_}, x.options());
    const Epilogue e = epilogue(bias, residual, rows, n_, torch::kFloat, "float32");
    const Kernel which = kernel == "portable" ? Kernel::kPortable
                         : kernel == "avx2"   ? Kernel::kAvx2
                                              : Kernel::kBest;
    into(x.data_ptr<float>(), x.stride(0), rows, static_cast<const float*>(e.bias),
         static_cast<const float*>(e.residual), e.res_stride, y.data_ptr<float>(), n_, which);
    return y;
  }

  // Rows `ids` of W as float32 [len(ids), K] (an embedding table's lookup).
  torch::Tensor rows(const torch::Tensor& ids) const {
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "ids must be int64 [T]");
    const auto flat = ids.contiguous();
    const int64_t count = flat.size(0);
    auto out = torch::empty({count, k_}, torch::TensorOptions().dtype(torch::kFloat));
    const int64_t* id = flat.data_ptr<int64_t>();
    for (int64_t t = 0; t < count; ++t) {
      TORCH_CHECK(id[t] >= 0 && id[t] < n_, "row ", id[t], " outside the table of ", n_);
      int64_t row = id[t];
      for (const auto& p : parts_) {
        if (row < p.n) {
          dequantize_row(p.tiles.data_ptr<uint8_t>(), p.type, k_, row,
                         out.data_ptr<float>() + t * k_);
          break;
        }
        row -= p.n;
      }
    }
    return out;
  }

 private:
  int64_t k_, n_ = 0;
  bool float_activations_;
  std::vector<Part> parts_;
};

inline void bind(pybind11::module& m) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<QuantWeight, std::shared_ptr<QuantWeight>>(m, "QuantWeight")
      .def(pybind11::init<int64_t, bool>(), pybind11::arg("in_features"),
           pybind11::arg("float_activations") = false)
      .def("add", &QuantWeight::add, "Append GGUF rows (uint8 [n, row bytes]) of a block type")
      .def_property_readonly("in_features", &QuantWeight::in_features)
      .def_property_readonly("float_activations", &QuantWeight::float_activations)
      .def_property_readonly("out_features", &QuantWeight::out_features)
      .def_property_readonly("nbytes", &QuantWeight::nbytes)
      .def_property_readonly("types", &QuantWeight::types)
      .def("forward", &QuantWeight::forward, pybind11::arg("x"),
           pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
           pybind11::arg("kernel") = "best", NoGil())
      .def("rows", &QuantWeight::rows, "Rows of W as float32 (embedding lookups)", NoGil());
  m.def("quant_int8_kernels", &int8_kernels, "The int8 kernels built here, best first");
}

}  // namespace pdserve::quant

// One decode step of a Llama-family model on a CPU, float32, in a single call.
//
// Why: a decode step is ~15 small operations per layer (norms, rotary, K/V writes, residual
// adds, SiLU * up) around the linears. Through torch each costs a dispatch, an allocation and a
// pass over memory; over 30 layers that is a third of a single-stream step of a 135M model on
// two cores. Here a layer is: RMSNorm -> qkv linear (+bias) -> per-head q/k RMSNorm (Qwen3) ->
// rotary in place -> K/V into their paged slots -> paged attention -> o linear with the residual
// added in its epilogue -> RMSNorm -> gate_up linear -> SiLU(gate) * up -> down linear with the
// residual; buffers are allocated once per step and reused by every layer. The module path
// (engine/models/llama.py) stays the reference this must agree with (tests/unit/test_fused_decode.py).
// The linears' weights are packed in column blocks (blocked_gemm.h), shared with the module path,
// or kept on their GGUF quantized blocks (quant_weight.h): each linear is one or the other.
//
// A tensor-parallel rank (`join`) holds its share of the heads and of the MLP: its o and down
// linears give partial sums, summed over the ranks through shared memory (shm_collectives.h)
// before the residual is added, as the module path's all-reduce does.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "blocked_gemm.h"
#include "paged_attention.h"
#include "quant_weight.h"
#include "shm_collectives.h"
#include "vec_math.h"

namespace pdserve::fused {

// A layer's tensors in the order Python passes them; absent ones (biases, q/k norms) are None.
enum Slot { kInNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kGateUp, kGateUpBias,
            kDown, kDownBias, kSlots };

// The four linears, in the order Python passes their quantized weights.
enum Linear { kQkvLinear, kOLinear, kGateUpLinear, kDownLinear, kLinears };
constexpr Slot kLinearSlot[kLinears] = {kQkv, kO, kGateUp, kDown};

using QuantWeights = std::vector<std::shared_ptr<quant::QuantWeight>>;

struct Layer {
  const float* p[kSlots] = {};
  std::shared_ptr<quant::QuantWeight> q[kLinears];  // set: that linear computes on its blocks
};

inline const float* data_or_null(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// x * rsqrt(mean(x^2) + eps) * w over rows of width n (src and dst may alias).
inline void rms_norm_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride,
                          const float* w, int64_t rows, int64_t n, float eps) {
  const auto one = [&](int64_t r) {
    const float* x = src + r * src_stride;
    float* y = dst + r * dst_stride;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
  };
  for (int64_t r = 0; r < rows; ++r) one(r);
}

// Hugging Face's rotate-half rotary on `heads` heads of width d starting at x (stride d).
inline void rotate(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

class Decoder {
 public:
  Decoder(const std::vector<std::vector<c10::optional<torch::Tensor>>>& layers,
          torch::Tensor final_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
          double eps, const std::vector<QuantWeights>& quant_layers)
      : final_norm_(std::move(final_norm)), heads_(heads), kv_heads_(kv_heads),
        head_dim_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(!layers.empty() && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                    head_dim % 2 == 0,
                "bad model geometry");
    hidden_ = final_norm_.size(0);
    const auto& first = layers[0];
    TORCH_CHECK(first.size() == kSlots, "bad layer list");
    TORCH_CHECK(quant_layers.empty() || quant_layers.size() == layers.size(),
                "one list of quantized weights per layer, or none");
    const auto quant = [&](size_t l) {
      return quant_layers.empty() ? QuantWeights(kLinears) : quant_layers[l];
    };
    // The MLP's inner width: from the down projection, packed [N/16, inner, 16] or quantized.
    const QuantWeights first_quant = quant(0);
    TORCH_CHECK(first_quant.size() == kLinears, "each layer passes ", kLinears,
                " quantized weights (or None)");
    const auto& down_q = first_quant[kDownLinear];
    TORCH_CHECK(down_q != nullptr || (first[kDown].has_value() && first[kDown]->dim() == 3),
                "bad layer list");
    inner_ = down_q != nullptr ? down_q->in_features() : first[kDown]->size(1);
    qk_norm_ = first[kQNorm].has_value();
    keep_.push_back(final_norm_);
    for (size_t l = 0; l < layers.size(); ++l) layers_.push_back(adopt(layers[l], quant(l)));
  }

  // hidden [B, H] (the embedded input tokens, one per request) -> the final-normed hidden
  // states. cos/sin [B, D]: rotary rows of each token's position. kv_caches: every layer's
  // [num_blocks, 2, block_size, Hkv, D] view. slot_block/slot_offset [B]: where each token's
  // K/V goes. block_table [B, max_blocks], seq_lens [B] (this token included).
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                        const torch::Tensor& sin, const std::vector<torch::Tensor>& kv_caches,
                        const torch::Tensor& slot_block, const torch::Tensor& slot_offset,
                        const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                        int64_t window, double scale) const {
    const int64_t rows = hidden.size(0), d = head_dim_;
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_ &&
                    hidden.scalar_type() == torch::kFloat,
                "hidden must be float32 [B, hidden_size]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat &&
                    sin.scalar_type() == torch::kFloat && cos.numel() == rows * d &&
                    sin.numel() == rows * d,
                "cos and sin must be contiguous float32 [B, head_dim]");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache view per layer");
    const int64_t q_width = heads_ * d, kv_width = kv_heads_ * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    auto h = hidden.contiguous().clone();
    auto opts = h.options();
    auto xn = torch::empty({rows, hidden_}, opts);
    auto qkv = torch::empty({rows, qkv_width}, opts);
    auto attn = torch::empty({rows, heads_, d}, opts);
    auto gate_up = torch::empty({rows, 2 * inner_}, opts);
    auto act = torch::empty({rows, inner_}, opts);
    auto partial = group_size_ == 1 ? torch::Tensor() : torch::empty({rows, hidden_}, opts);
    float* hp = h.data_ptr<float>();
    float* xp = xn.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* gp = gate_up.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const auto query = qkv.narrow(1, 0, q_width).view({rows, heads_, d});
    const auto key = qkv.narrow(1, q_width, kv_width).view({rows, kv_heads_, d});
    const auto value = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads_, d});
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      for_rows(rows, [&](int64_t r) {
        rms_norm_rows(hp + r * hidden_, 0, xp + r * hidden_, 0, w.p[kInNorm], 1, hidden_, eps_);
      });
      linear(w, kQkvLinear, xp, hidden_, w.p[kQkvBias], nullptr, 0, qkvp, qkv_width, rows);
      for_rows(rows, [&](int64_t r) {
        float* q = qkvp + r * qkv_width;
        if (qk_norm_) {
          rms_norm_rows(q, d, q, d, w.p[kQNorm], heads_, d, eps_);
          rms_norm_rows(q + q_width, d, q + q_width, d, w.p[kKNorm], kv_heads_, d, eps_);
        }
        rotate(q, heads_ + kv_heads_, d, cp + r * d, sp + r * d);  // q and k heads adjoin
      });
      attention::write_kv(kv_caches[l], key, value, slot_block, slot_offset);
      attention::paged_decode_attention(attn, query, kv_caches[l], block_table, seq_lens, window,
                                        scale);
      if (group_size_ == 1) {
        linear(w, kOLinear, attn.data_ptr<float>(), q_width, w.p[kOBias], hp, hidden_, hp, hidden_,
               rows);
      } else {
        linear(w, kOLinear, attn.data_ptr<float>(), q_width, w.p[kOBias], nullptr, 0,
               partial.data_ptr<float>(), hidden_, rows);
        add_reduced(partial, hp);
      }
      for_rows(rows, [&](int64_t r) {
        rms_norm_rows(hp + r * hidden_, 0, xp + r * hidden_, 0, w.p[kPostNorm], 1, hidden_, eps_);
      });
      linear(w, kGateUpLinear, xp, hidden_, w.p[kGateUpBias], nullptr, 0, gp, 2 * inner_, rows);
      silu_mul(gp, ap, rows);
      if (group_size_ == 1) {
        linear(w, kDownLinear, ap, inner_, w.p[kDownBias], hp, hidden_, hp, hidden_, rows);
      } else {
        linear(w, kDownLinear, ap, inner_, w.p[kDownBias], nullptr, 0, partial.data_ptr<float>(),
               hidden_, rows);
        add_reduced(partial, hp);
      }
    }
    auto out = torch::empty_like(h);
    rms_norm_rows(hp, hidden_, out.data_ptr<float>(), hidden_, final_norm_.data_ptr<float>(), rows,
                  hidden_, eps_);
    return out;
  }

  // Make this decoder a tensor-parallel rank of the shared-memory group in `region`.
  void join(torch::Tensor region, int64_t rank, int64_t size, int64_t slot_bytes,
            int64_t parent_pid) {
    shm::region_of(region, rank, size, slot_bytes, parent_pid);  // checks the geometry
    region_ = std::move(region);
    group_rank_ = rank;
    group_size_ = size;
    slot_bytes_ = slot_bytes;
    parent_pid_ = parent_pid;
  }

  // Seconds spent in all-reduces since the last call (exchanging, and waiting for other ranks).
  double take_collective_seconds() {
    const double seconds = collective_s_;
    collective_s_ = 0;
    return seconds;
  }

 private:
  // y = x W^T (+ bias) (+ residual) for one of the layer's linears, on whichever weights it has
  // (x has the linear's in_features, y its out_features; y may be the residual).
  void linear(const Layer& w, Linear which, const float* x, int64_t x_stride, const float* bias,
              const float* residual, int64_t res_stride, float* y, int64_t y_stride,
              int64_t rows) const {
    const auto& q = w.q[which];
    if (q != nullptr) {
      q->into(x, x_stride, rows, bias, residual, res_stride, y, y_stride);
      return;
    }
    const int64_t n = which == kQkvLinear      ? (heads_ + 2 * kv_heads_) * head_dim_
                      : which == kGateUpLinear ? 2 * inner_
                                               : hidden_;
    const int64_t k = which == kOLinear ? heads_ * head_dim_ : which == kDownLinear ? inner_ : hidden_;
    blocked::linear_into(x, x_stride, w.p[kLinearSlot[which]], n, k, bias, residual, res_stride, y,
                         y_stride, rows);
  }

  // hp += the sum over the ranks of `partial` (which the sum overwrites).
  void add_reduced(const torch::Tensor& partial, float* hp) const {
    const auto start = std::chrono::steady_clock::now();
    shm::all_reduce(region_, group_rank_, group_size_, slot_bytes_, parent_pid_, partial);
    collective_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const float* sum = partial.data_ptr<float>();
    const int64_t n = partial.numel();
    for (int64_t i = 0; i < n; ++i) hp[i] += sum[i];
  }

  // act[r, i] = silu(gate[r, i]) * up[r, i], gate and up side by side in each row.
  void silu_mul(const float* gate_up, float* act, int64_t rows) const {
    const int64_t n = inner_;
    for_rows(rows, [&](int64_t r) {
      const float* g = gate_up + r * 2 * n;
      vec::silu_mul(g, g + n, act + r * n, n);
    });
  }

  // fn(r) for every row; over the threads when there are enough rows to pay for waking them.
  template <typename F>
  static void for_rows(int64_t rows, const F& fn) {
    if (rows < kParallelRows) {
      for (int64_t r = 0; r < rows; ++r) fn(r);
      return;
    }
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) fn(r);
    });
  }

  static constexpr int64_t kParallelRows = 4;

  Layer adopt(const std::vector<c10::optional<torch::Tensor>>& tensors, const QuantWeights& quant) {
    TORCH_CHECK(tensors.size() == kSlots, "each layer passes ", kSlots, " tensors (or None)");
    TORCH_CHECK(quant.size() == kLinears, "each layer passes ", kLinears, " quantized weights (or None)");
    const int64_t d = head_dim_, qkv_width = (heads_ + 2 * kv_heads_) * d;
    const int64_t expected[kSlots][2] = {
        {hidden_, 0},    {qkv_width, hidden_}, {qkv_width, 0}, {d, 0},
        {d, 0},          {hidden_, heads_ * d}, {hidden_, 0},  {hidden_, 0},
        {2 * inner_, hidden_}, {2 * inner_, 0}, {hidden_, inner_}, {hidden_, 0}};
    Layer layer;
    for (int l = 0; l < kLinears; ++l) {
      const auto& q = quant[l];
      if (q == nullptr) continue;
      const int64_t s = kLinearSlot[l];
      TORCH_CHECK(!tensors[s].has_value(), "linear ", l, " has both float and quantized weights");
      TORCH_CHECK(q->out_features() == expected[s][0] && q->in_features() == expected[s][1],
                  "quantized linear ", l, " has the wrong shape");
      layer.q[l] = q;
    }
    for (int s = 0; s < kSlots; ++s) {
      const auto& t = tensors[s];
      const bool quantized = (s == kQkv && layer.q[kQkvLinear]) || (s == kO && layer.q[kOLinear]) ||
                             (s == kGateUp && layer.q[kGateUpLinear]) ||
                             (s == kDown && layer.q[kDownLinear]);
      const bool optional = s == kQkvBias || s == kOBias || s == kGateUpBias || s == kDownBias ||
                            s == kQNorm || s == kKNorm || quantized;
      TORCH_CHECK(t.has_value() || optional, "layer tensor ", s, " is required");
      if (!t.has_value()) continue;
      TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(),
                  "layer tensors must be contiguous float32");
      // Matrices come packed by blocked::pack: [padded(out) / 16, in, 16].
      const bool matrix = expected[s][1] != 0;
      const bool ok = matrix ? t->dim() == 3 && t->size(0) * blocked::kBlock ==
                                                   blocked::padded(expected[s][0]) &&
                                   t->size(1) == expected[s][1] && t->size(2) == blocked::kBlock
                             : t->dim() == 1 && t->size(0) == expected[s][0];
      TORCH_CHECK(ok, "layer tensor ", s, " has the wrong shape");
      keep_.push_back(*t);
      layer.p[s] = t->data_ptr<float>();
    }
    TORCH_CHECK((layer.p[kQNorm] != nullptr) == qk_norm_ && (layer.p[kKNorm] != nullptr) == qk_norm_,
                "q/k norms must be present in every layer or none");
    return layer;
  }

  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0, inner_ = 0;
  float eps_;
  bool qk_norm_ = false;
  std::vector<Layer> layers_;
  std::vector<torch::Tensor> keep_;  // the weights stay alive while their pointers are used
  torch::Tensor region_;               // tensor parallelism: the group's shared memory
  int64_t group_rank_ = 0, group_size_ = 1, slot_bytes_ = 0, parent_pid_ = 0;
  mutable double collective_s_ = 0;
};

inline void bind(pybind11::module& m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<const std::vector<std::vector<c10::optional<torch::Tensor>>>&,
                          torch::Tensor, int64_t, int64_t, int64_t, double,
                          const std::vector<QuantWeights>&>(),
           pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"),
           pybind11::arg("quant_layers") = std::vector<QuantWeights>())
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("join", &Decoder::join)
      .def("take_collective_seconds", &Decoder::take_collective_seconds);
}

}  // namespace pdserve::fused

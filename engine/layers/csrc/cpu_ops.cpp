// The CPU kernel module (one build, cached per machine by engine/layers/cpu_kernels.py):
// paged decode attention and K/V writes (paged_attention.h), float32 linears over column-blocked
// weights (blocked_gemm.h) and bfloat16 ones (bf16_gemm.h), linears on llama.cpp's quantized
// blocks (quant_weight.h), the fused decode step of the Llama family (fused_decode.h), its
// vectorized SiLU (vec_math.h), KV block checksums (block_checksum.h), the tensor-parallel
// ranks' shared-memory collectives (shm_collectives.h), and a read-bandwidth probe.

#include <torch/extension.h>

#include "bf16_gemm.h"
#include "block_checksum.h"
#include "blocked_gemm.h"
#include "fused_decode.h"
#include "paged_attention.h"
#include "quant_weight.h"
#include "shm_collectives.h"
#include "vec_math.h"

namespace {

// The sum of a float32 buffer, read as fast as this machine's threads can stream memory. Each
// thread reads its contiguous share as `streams` interleaved sequential streams (one 8-lane
// vector from each in turn, two accumulators per stream): the hardware prefetchers follow
// several streams at once, and the blocked GEMM reads a few W column blocks side by side, so
// one stream per thread under-measures what the weights can be read at (2 cores here: ~29-30
// GB/s with 1 stream, ~33-34 with 4-8). `pdserve bench latency` takes the best over stream
// counts, on a buffer far larger than the caches, as the bandwidth bound.
double stream_sum(const torch::Tensor& buffer, int64_t streams) {
  TORCH_CHECK(buffer.scalar_type() == torch::kFloat && buffer.is_contiguous(),
              "a contiguous float32 buffer");
  TORCH_CHECK(streams >= 1 && streams <= 64, "streams must be in [1, 64]");
  typedef float Vec __attribute__((vector_size(32)));
  const float* p = buffer.data_ptr<float>();
  const int64_t vectors = buffer.numel() / 8;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<double> partial(static_cast<size_t>(threads), 0.0);
  const auto load = [&](int64_t i) {
    Vec v;
    std::memcpy(&v, p + i * 8, sizeof v);
    return v;
  };
  at::parallel_for(0, vectors, (vectors + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    const int64_t length = (end - begin) / streams / 2 * 2;  // vectors per stream, even
    std::vector<Vec> acc(static_cast<size_t>(2 * streams), Vec{});
    for (int64_t i = 0; i < length; i += 2)
      for (int64_t s = 0; s < streams; ++s) {
        acc[2 * s] += load(begin + s * length + i);
        acc[2 * s + 1] += load(begin + s * length + i + 1);
      }
    double sum = 0;
    for (const Vec& a : acc)
      for (int64_t l = 0; l < 8; ++l) sum += a[l];
    for (int64_t i = begin + streams * length; i < end; ++i)  // what the streams left over
      for (int64_t l = 0; l < 8; ++l) sum += p[i * 8 + l];
    partial[static_cast<size_t>(at::get_thread_num())] += sum;
  });
  double total = 0;
  for (double s : partial) total += s;
  for (int64_t i = vectors * 8; i < buffer.numel(); ++i) total += p[i];
  return total;
}

// silu(gate) * up for x = [gate | up] rows, [M, 2n] -> [M, n]: the fused decode step's
// activation, exposed so tests can hold its vectorized exp to torch's.
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  x.size(1) % 2 == 0,
              "x must be a contiguous float32 [M, 2n] tensor");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  const float* g = x.data_ptr<float>();
  float* a = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) pdserve::vec::silu_mul(g + r * 2 * n, g + r * 2 * n + n, a + r * n, n);
  return out;
}

}  // namespace

// Every kernel lets go of the GIL while it computes, as torch's own operators do: with async
// scheduling the engine schedules the next step in Python while this one runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &pdserve::attention::paged_decode_attention,
        "Decode attention over a paged KV cache (CPU)", NoGil());
  m.def("write_kv", &pdserve::attention::write_kv, "Write K/V rows into their paged slots (CPU)",
        NoGil());
  m.def("pack_blocked", &pdserve::blocked::pack, "W [N, K] -> column blocks [N/16, K, 16]");
  m.def("blocked_linear", &pdserve::blocked::linear,
        "y = x W^T (+ bias) (+ residual), float32, W from pack_blocked", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        NoGil());
  pdserve::fused::bind(m);
  pdserve::quant::bind(m);
  m.def("bf16_available", &pdserve::bf16::available, "Whether the AVX-512 BF16 kernel was built");
  m.def("pack_bf16", &pdserve::bf16::pack, "W [N, K] bf16 -> [N/16, K/2, 16, 2] pairs");
  m.def("bf16_linear", &pdserve::bf16::linear, "y = x W^T (+ bias) (+ residual), bfloat16",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        NoGil());
  m.def("block_checksums", &pdserve::checksum::block_checksums,
        "Checksums of KV cache blocks (connector/checksums.py)", NoGil());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :n]) * x[:, n:], float32", NoGil());
  m.def("stream_sum", &stream_sum, "Sum of a float32 buffer at full read bandwidth",
        pybind11::arg("buffer"), pybind11::arg("streams") = 1, NoGil());
  m.def("shm_region_bytes", &pdserve::shm::region_bytes, "Bytes of a shared-memory group");
  m.def("shm_all_reduce", &pdserve::shm::all_reduce, "Sum x over the ranks, in place", NoGil());
  m.def("shm_all_gather", &pdserve::shm::all_gather, "Columns of every rank, side by side",
        NoGil());
  m.def("shm_abort", &pdserve::shm::abort, "Fail every rank waiting in a collective");
}

// All-reduce and all-gather between the tensor-parallel ranks of one engine, which are
// processes on one host, through a shared memory region (engine/parallel/group.py's ShmGroup
// maps it).
//
// Why not gloo: on the 2-core CI machine a gloo all-reduce of one decode step's hidden states
// takes 0.7-1.5 ms (its I/O threads wake through the kernel), and a step makes two per layer.
// Here a rank copies its part into its slot, publishes a sequence number, spins until every
// rank has published the same number, then reads every slot: ~10 us for a decode step.
//
// Every rank sums the slots in rank order 0, 1, ..., n-1, so every rank gets the same bits:
// the ranks sample from identical logits (engine/parallel/workers.py checks they agree).
//
// Region layout (bytes): one 64-byte line per rank for its published sequence number, one
// line for the abort flag, two banks of one line per rank for the signature of what it
// published (the collective and its size), then two banks of n slots of `slot_bytes` each.
// Collective number s uses bank s % 2: a rank writes bank s % 2 again only at s + 2, after
// every rank published s + 1, which each does only after it finished reading collective s.
// Ranks that disagree on a collective (a bug that would sum unrelated numbers) fail loudly.

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>

namespace pdserve::shm {

constexpr int64_t kLine = 64;

struct Region {
  uint8_t* base;
  int64_t rank, size, slot_bytes;
  int64_t parent_pid;  // a follower's engine process (0: none to watch)

  std::atomic<uint64_t>* published(int64_t r) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + r * kLine);
  }
  std::atomic<uint64_t>* abort_flag() const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + size * kLine);
  }
  uint64_t* signature(uint64_t seq, int64_t r) const {
    return reinterpret_cast<uint64_t*>(base + (size + 1 + (seq & 1) * size + r) * kLine);
  }
  uint8_t* slot(uint64_t seq, int64_t r) const {
    return base + (3 * size + 1) * kLine + ((seq & 1) * size + r) * slot_bytes;
  }
};

inline int64_t region_bytes(int64_t size, int64_t slot_bytes) {
  return (3 * size + 1) * kLine + 2 * size * slot_bytes;
}

// What a rank publishes with a sequence number: which collective, and how many bytes.
enum Op : uint64_t { kAllReduce = 1, kAllGather = 2 };
inline uint64_t signature_of(Op op, int64_t bytes) {
  return (static_cast<uint64_t>(op) << 56) | static_cast<uint64_t>(bytes);
}

inline Region region_of(const torch::Tensor& region, int64_t rank, int64_t size,
                        int64_t slot_bytes, int64_t parent_pid) {
  TORCH_CHECK(region.scalar_type() == torch::kByte && region.is_contiguous(),
              "region must be contiguous uint8");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "rank outside the group");
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kLine == 0, "slot_bytes must be a multiple of 64");
  TORCH_CHECK(region.numel() >= region_bytes(size, slot_bytes), "region too small");
  return Region{region.data_ptr<uint8_t>(), rank, size, slot_bytes, parent_pid};
}

// Publish `seq` for this rank and wait until every rank has. Spins (a step's collectives come
// microseconds apart), then yields the core, and past 2 ms sleeps 50 us between looks (a rank
// that waits long, e.g. for one the host has descheduled, must not take the core it needs);
// every ~1 ms of waiting it checks the abort flag (a rank died: the engine process sets it)
// and, in a follower, that its engine still runs.
inline void publish_and_wait(const Region& g, uint64_t seq, uint64_t signature) {
  *g.signature(seq, g.rank) = signature;  // ordered before the sequence number (release)
  g.published(g.rank)->store(seq, std::memory_order_release);
  const auto start = std::chrono::steady_clock::now();
  auto last_check = start;
  for (int64_t r = 0; r < g.size; ++r) {
    int64_t spins = 0;
    while (g.published(r)->load(std::memory_order_acquire) < seq) {
      if (++spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now - start < std::chrono::milliseconds(2)) {
        sched_yield();
      } else {
        usleep(50);
      }
      if (now - last_check < std::chrono::milliseconds(1)) continue;
      last_check = now;
      TORCH_CHECK(g.abort_flag()->load(std::memory_order_relaxed) == 0,
                  "a tensor-parallel rank of this engine failed");
      TORCH_CHECK(g.parent_pid == 0 || getppid() == g.parent_pid,
                  "the engine process of this tensor-parallel rank is gone");
    }
    TORCH_CHECK(*g.signature(seq, r) == signature, "tensor-parallel rank ", r,
                " is in another collective than rank ", g.rank, ": the ranks are out of step");
  }
}

inline uint64_t next_seq(const Region& g) {
  return g.published(g.rank)->load(std::memory_order_relaxed) + 1;
}

// x (float32, contiguous) becomes the sum of every rank's x, in place.
inline void all_reduce(const torch::Tensor& region, int64_t rank, int64_t size,
                       int64_t slot_bytes, int64_t parent_pid, const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32");
  const Region g = region_of(region, rank, size, slot_bytes, parent_pid);
  float* data = x.data_ptr<float>();
  const int64_t chunk = slot_bytes / static_cast<int64_t>(sizeof(float));
  for (int64_t start = 0; start < x.numel(); start += chunk) {
    const int64_t n = std::min(chunk, x.numel() - start);
    const uint64_t seq = next_seq(g);
    std::memcpy(g.slot(seq, rank), data + start, n * sizeof(float));
    publish_and_wait(g, seq, signature_of(kAllReduce, n * sizeof(float)));
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      float* out = data + start;
      const float* first = reinterpret_cast<const float*>(g.slot(seq, 0));
      for (int64_t i = begin; i < end; ++i) out[i] = first[i];
      for (int64_t r = 1; r < size; ++r) {
        const float* part = reinterpret_cast<const float*>(g.slot(seq, r));
        for (int64_t i = begin; i < end; ++i) out[i] += part[i];
      }
    });
  }
}

// local [rows, cols] (contiguous, any dtype) from every rank -> out [rows, size * cols], rank
// r's columns at r * cols.
inline void all_gather(const torch::Tensor& region, int64_t rank, int64_t size,
                       int64_t slot_bytes, int64_t parent_pid, const torch::Tensor& local,
                       const torch::Tensor& out) {
  TORCH_CHECK(local.dim() == 2 && local.is_contiguous() && out.is_contiguous() &&
                  out.scalar_type() == local.scalar_type() && out.size(0) == local.size(0) &&
                  out.size(1) == size * local.size(1),
              "local [rows, cols] and out [rows, size * cols], contiguous, one dtype");
  const Region g = region_of(region, rank, size, slot_bytes, parent_pid);
  const int64_t row_bytes = local.size(1) * local.element_size();
  TORCH_CHECK(row_bytes > 0 && row_bytes <= slot_bytes, "a row must fit one slot");
  const int64_t rows_per_chunk = slot_bytes / row_bytes;
  const auto* src = static_cast<const uint8_t*>(local.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t start = 0; start < local.size(0); start += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, local.size(0) - start);
    const uint64_t seq = next_seq(g);
    std::memcpy(g.slot(seq, rank), src + start * row_bytes, rows * row_bytes);
    publish_and_wait(g, seq, signature_of(kAllGather, rows * row_bytes));
    for (int64_t r = 0; r < size; ++r) {
      const uint8_t* part = g.slot(seq, r);
      for (int64_t row = 0; row < rows; ++row)
        std::memcpy(dst + ((start + row) * size + r) * row_bytes, part + row * row_bytes,
                    row_bytes);
    }
  }
}

// Wake every rank waiting in a collective with an error (a rank died).
inline void abort(const torch::Tensor& region, int64_t size, int64_t slot_bytes) {
  const Region g = region_of(region, 0, size, slot_bytes, 0);
  g.abort_flag()->store(1, std::memory_order_relaxed);
}

}  // namespace pdserve::shm

"""Which slice of the model one tensor-parallel rank holds (Megatron's split, as vLLM does it).

Per rank `r` of `n`:
- q heads: a contiguous `num_attention_heads / n` of them;
- KV heads: `num_key_value_heads / n` of them, or, where there are fewer KV heads than ranks,
  the one KV head its q heads read (each KV head replicated on `n / num_key_value_heads` ranks);
- the MLP's inner width: `intermediate_size / n`;
- the vocabulary (embedding rows and head rows): `ceil(vocab_size / n)`, the last rank's
  padded with zero rows, which the gathered logits drop.

QKV and gate/up are split by output rows (column-parallel), o_proj and down_proj by input
columns (row-parallel): their partial outputs are summed over the ranks (all-reduce), and
their biases are added by rank 0 only, once.

    # 9 q heads, 3 KV heads, n = 3: rank 1 holds q heads 3..5 and KV head 1 (q head h reads
    # KV head h // 3); n = 6 would not divide the q heads, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.models.config import ModelArchConfig

if TYPE_CHECKING:  # the router reads GGUF metadata (and this module) without torch
    import torch

# Where a checkpoint tensor's slice lies for one rank: (dimension, start, stop); `stop` may
# pass the tensor's end (the vocabulary's padding), the loader then pads with zeros.
TensorSlice = tuple[int, int, int]
SKIP = "skip"  # a tensor this rank does not hold (a row-parallel bias on ranks other than 0)


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `size` over one model's architecture."""

    arch: ModelArchConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        check_tensor_parallel(self.arch, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.size}")

    @property
    def num_heads(self) -> int:
        return self.arch.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.arch.num_key_value_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head (of the whole model) this rank holds."""
        kv_heads = self.arch.num_key_value_heads
        if kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv_heads)  # replicated: the one its q heads read

    @property
    def intermediate_size(self) -> int:
        return self.arch.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Embedding and head rows per rank (the vocabulary padded to a multiple of size)."""
        return -(-self.arch.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def own_heads(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a cache [blocks, layers, 2, block_size, heads, head_dim] that
        holds every head (a view; the cache itself where it holds only this rank's)."""
        if kv_cache.shape[4] == self.num_kv_heads:
            return kv_cache
        return kv_cache.narrow(4, self.first_kv_head, self.num_kv_heads)

    def tensor_slice(self, name: str) -> TensorSlice | str | None:
        """This rank's slice of checkpoint tensor `name` (Hugging Face names); None: all of
        it; SKIP: none of it."""
        if self.size == 1:
            return None
        part = name.rsplit(".", 2)
        projection, kind = (part[-2], part[-1]) if len(part) == 3 else ("", "")
        head_dim = self.arch.head_dim
        if projection == "q_proj":
            rows = self.num_heads * head_dim
            return 0, self.rank * rows, (self.rank + 1) * rows
        if projection in ("k_proj", "v_proj"):
            start = self.first_kv_head * head_dim
            return 0, start, start + self.num_kv_heads * head_dim
        if projection in ("gate_proj", "up_proj"):
            rows = self.intermediate_size
            return 0, self.rank * rows, (self.rank + 1) * rows
        if projection in ("o_proj", "down_proj"):
            if kind == "bias":
                return None if self.rank == 0 else SKIP
            width = self.num_heads * head_dim if projection == "o_proj" else self.intermediate_size
            return 1, self.rank * width, (self.rank + 1) * width
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab_start, self.vocab_start + self.vocab_rows
        return None  # norms: every rank holds them whole


def shares_kv_cache(arch: ModelArchConfig, size: int, device: str, choice: str = "auto") -> bool:
    """Whether the `size` ranks of one engine keep one KV cache of every head, each attending
    over its own heads: on a CPU host (`device` "cpu"), where no KV head is replicated (no
    rank writes a head another writes too), unless `choice` (tensor_parallel_kv_cache) asks
    for a cache per rank."""
    return (
        size > 1
        and device == "cpu"
        and arch.num_key_value_heads % size == 0
        and choice != "per_rank"
    )


def check_tensor_parallel(arch: ModelArchConfig, size: int) -> None:
    """ValueError unless `size` ranks can split `arch` evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"its {kv_heads} KV heads (nor is it a multiple of them)")
    if arch.intermediate_size % size:
        problems.append(f"its MLP width {arch.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide {' or '.join(problems)}; "
            "choose a size that divides the model's heads"
        )


def cores_by_rank(allowed: list[int], size: int, threads: int) -> list[tuple[int, ...]]:
    """Each rank's cores out of `allowed`, `threads` each: rank 0 the first, ranks 1..n-1 the
    last (a share of its own each); none for anyone where there are fewer than size x threads.

        # allowed 0..4, 2 ranks of 2 threads -> [(0, 1), (3, 4)]
    """
    allowed = sorted(allowed)
    if threads < 1 or len(allowed) < size * threads:
        return [() for _ in range(size)]
    end = len(allowed)
    return [tuple(allowed[:threads])] + [
        tuple(allowed[end - (size - rank) * threads :][:threads]) for rank in range(1, size)
    ]

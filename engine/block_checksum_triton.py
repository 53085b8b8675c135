"""The KV block checksum (engine/block_checksums.py) as a Triton kernel over blocks in device
memory: what a GPU engine runs, where torch's integer ops would widen every word to 64 bits in
a temporary first.

Each program sums one slice of one block: words x_i zero-extended to 64 bits, times their odd
weights w_i, added modulo 2**64 (unsigned wrapping). The slices' sums are added on the host,
as Python integers, modulo 2**64: the same value as the CPU kernel's and the definition's.
Importing this module needs Triton; launching it needs a GPU, or TRITON_INTERPRET=1 (the tests
run it on the CPU that way, against the definition).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # words per vector step of a program
_SLICE_WORDS = 1 << 16  # words one program sums (256 KiB): a 2 MiB block is 8 programs
_MASK64 = (1 << 64) - 1


@triton.jit
def _slice_sums(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
    words_ptr,  # int32 [num_blocks, words]: the cache's 32-bit words
    ids_ptr,  # int64 [n]: the blocks to sum
    weights_ptr,  # int32 [words]: the weights' bits
    out_ptr,  # int64 [n, num_slices]: each slice's sum's bits
    words,
    slice_words,
    num_slices,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = words_ptr + tl.load(ids_ptr + row) * words
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    first = part * slice_words
    for start in range(first, first + slice_words, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < words
        x = tl.load(base + offsets, mask=inside, other=0)
        w = tl.load(weights_ptr + offsets, mask=inside, other=0)
        # Zero-extended (a plain cast would sign-extend): 32 x 32 -> 64-bit products.
        x64 = x.to(tl.uint32, bitcast=True).to(tl.uint64)
        w64 = w.to(tl.uint32, bitcast=True).to(tl.uint64)
        acc += x64 * w64
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + row * num_slices + part, total.to(tl.int64, bitcast=True))


def block_sums(blocks: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> list[int]:
    """The unsigned sums of blocks[ids] ([num_blocks, block_bytes] uint8, contiguous,
    block_bytes a multiple of 4) with `weights` (int32 [block_bytes / 4]), on the blocks'
    device."""
    return reduce_slices(launch(blocks, ids, weights))


def launch(blocks: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Start the kernel (asynchronous on a GPU): int64 [len(ids), slices], each slice's sum."""
    if not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous [num_blocks, block_bytes] tensor")
    words = blocks.view(torch.int32)
    num_words = words.shape[1]
    slice_words = min(_SLICE_WORDS, -(-num_words // _BLOCK) * _BLOCK)
    num_slices = -(-num_words // slice_words)
    out = torch.empty((len(ids), num_slices), dtype=torch.int64, device=blocks.device)
    sizes = (num_words, slice_words, num_slices)
    # Triton launches on the current device: make it the blocks' (an engine on cuda:1).
    with _on(blocks.device):
        _slice_sums[(len(ids), num_slices)](words, ids, weights, out, *sizes, BLOCK=_BLOCK)
    return out


def reduce_slices(out: torch.Tensor) -> list[int]:
    """Each row's slice sums added as Python integers, modulo 2**64 (waits for the kernel)."""
    return [sum(row) & _MASK64 for row in out.tolist()]


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

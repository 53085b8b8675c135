"""KV block checksums (engine/block_checksums.py): the CPU kernel, the Triton kernel (under
Triton's interpreter), torch's ops and the definition written out in Python agree; every
single-bit change is caught; bad input is refused."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from engine import block_checksums as checksums
from engine.block_checksums import block_checksums, parse_checksums

_MASK = (1 << 64) - 1


def _weight(i: int) -> int:
    """The definition's w_i, in plain integers: splitmix64(i) | 1, low 32 bits."""
    z = (i + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) | 1) & 0xFFFFFFFF


def _by_definition(block: torch.Tensor) -> str:
    data = block.contiguous().view(torch.uint8).numpy().tobytes()
    words = struct.unpack(f"<{len(data) // 4}I", data)
    return f"{sum(_weight(i) * w for i, w in enumerate(words)) & _MASK:016x}"


@pytest.fixture
def cache() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(9, 2, 3, 8, 4)  # [blocks, K/V, heads, slots, head_dim], float32


def test_kernel_torch_and_the_definition_agree(cache):
    ids = [0, 4, 8, 4]
    want = [_by_definition(cache[b]) for b in ids]
    assert block_checksums(cache, ids) == want  # the CPU kernel (built for the suite)
    blocks = cache.view(9, -1).view(torch.uint8)
    weights = checksums._weights(blocks.shape[1] // 4, blocks.device)
    sums = checksums._torch_sums(blocks, torch.tensor(ids), weights)  # other devices' path
    assert [checksums.to_hex(s) for s in sums.tolist()] == want


def test_a_half_precision_cache_is_summed_by_its_bytes():
    cache = torch.randn(4, 2, 16, 6).to(torch.bfloat16)
    assert block_checksums(cache, [1, 3]) == [_by_definition(cache[1]), _by_definition(cache[3])]


def test_every_single_bit_change_is_caught(cache):
    reference = block_checksums(cache, [5])
    flat = cache.view(9, -1).view(torch.uint8)
    rng = random.Random(3)
    for offset in rng.sample(range(flat.shape[1]), 64):
        for bit in (0, 3, 7):
            flat[5, offset] ^= 1 << bit
            assert block_checksums(cache, [5]) != reference, (offset, bit)
            flat[5, offset] ^= 1 << bit
    assert block_checksums(cache, [5]) == reference


def test_swapped_words_and_another_blocks_bytes_are_caught(cache):
    reference = block_checksums(cache, [2])
    words = cache.view(9, -1)
    words[2, [10, 11]] = words[2, [11, 10]]
    assert block_checksums(cache, [2]) != reference
    words[2] = words[3]
    assert block_checksums(cache, [2]) == block_checksums(cache, [3]) != reference


def test_bad_input_is_refused(cache):
    with pytest.raises(ValueError, match="outside"):
        block_checksums(cache, [9])
    with pytest.raises(ValueError, match="contiguous"):
        block_checksums(cache.transpose(1, 2), [0])
    with pytest.raises(ValueError, match="32-bit words"):
        block_checksums(torch.zeros(3, 6, dtype=torch.uint8), [0])
    assert block_checksums(cache, []) == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (None, "one checksum per remote block"),
        (["0" * 16], "one checksum per remote block"),
        (["0" * 15, "0" * 16], "16-digit hex"),
        (["z" * 16, "0" * 16], "16-digit hex"),
        ([7, "0" * 16], "16-digit hex"),
        (["0x" + "0" * 14, "0" * 16], "16-digit hex"),  # int(..., 16) would take these
        (["0000_00000000000", "0" * 16], "16-digit hex"),
    ],
)
def test_params_checksums_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        parse_checksums(values, 2)
    assert parse_checksums(["ABCDEF0123456789", "0" * 16], 2) == ["abcdef0123456789", "0" * 16]


# Run in a process of its own with TRITON_INTERPRET=1: Triton decides whether a kernel (and
# its library's, tl.zeros and tl.sum among them) is interpreted when it is decorated, so the
# flag must be set before Triton is first imported.
_INTERPRETED = """
import sys, torch
from engine import block_checksum_triton as checksum_triton, block_checksums as checksums
sums = []
for cache, ids in torch.load(sys.argv[1]):
    blocks = cache.view(cache.shape[0], -1).view(torch.uint8)
    weights = checksums._weights(blocks.shape[1] // 4, blocks.device)
    found = checksum_triton.block_sums(blocks, torch.tensor(ids), weights)
    sums.append([checksums.to_hex(s) for s in found])
torch.save(sums, sys.argv[2])
"""


def _interpreted(tmp_path, cases: list[tuple[torch.Tensor, list[int]]]) -> list[list[str]]:
    """engine/block_checksum_triton.py's kernel, its own code run by Triton's
    interpreter on the CPU (no GPU here): the hex sums of each (cache, block ids)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    given, found = tmp_path / "cases.pt", tmp_path / "sums.pt"
    torch.save(cases, given)
    subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(given), str(found)],
        check=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    return torch.load(found)


def test_the_triton_kernel_agrees_with_the_definition_and_the_cpu_kernel(tmp_path, cache):
    # A 1 MiB + 4 B block: 5 slices of 64 Ki words, the last one word long (masked steps).
    torch.manual_seed(1)
    big = torch.randn(3, (1 << 18) + 1)
    flipped = big.clone()
    flipped.view(torch.int32)[2, -1] ^= 1 << 31  # the top bit of the very last word
    half = cache.half()  # summed by its bytes like any other
    cases = [(cache, [0, 4, 8, 4]), (half, [1, 3]), (big, [2, 0]), (flipped, [2])]
    sums = _interpreted(tmp_path, cases)
    assert sums[0] == [_by_definition(cache[b]) for b in (0, 4, 8, 4)]
    assert sums[1] == [_by_definition(half[b]) for b in (1, 3)]
    assert sums[2] == block_checksums(big, [2, 0])  # the CPU kernel
    assert sums[3] == block_checksums(flipped, [2]) and sums[3][0] != sums[2][0]


def test_a_failing_triton_kernel_falls_back_to_torch_ops_for_good(monkeypatch, caplog):
    """The GPU path (checksums._gpu_sums) where the kernel cannot launch (as where Triton's
    launcher fails to build; no GPU here, so the launch is made to fail): the sums come from
    torch's ops, the same values, and Triton is not tried again."""
    import threading

    from engine import block_checksum_triton as checksum_triton

    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("failed to build the launcher")

    monkeypatch.setattr(checksums, "_triton_failed", threading.Event())
    monkeypatch.setattr(checksum_triton, "block_sums", failing)
    torch.manual_seed(2)
    cache = torch.randn(4, 2, 64)
    blocks = cache.view(4, -1).view(torch.uint8)
    weights = checksums._weights(blocks.shape[1] // 4, blocks.device)
    with caplog.at_level("ERROR", logger="engine.block_checksums"):
        sums = checksums._gpu_sums(blocks, torch.tensor([3, 1]), weights)
    assert [checksums.to_hex(s) for s in sums] == block_checksums(cache, [3, 1])
    assert "the Triton checksum kernel failed" in caplog.text
    again = checksums._gpu_sums(blocks, torch.tensor([0]), weights)
    assert [checksums.to_hex(s) for s in again] == block_checksums(cache, [0])
    assert len(calls) == 1  # not tried again

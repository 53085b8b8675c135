"""The KV checksum's GPU check, as one short script that prints one JSON object.

`pdserve bench gpu` (the prepared GPU check: `python3 -m pdserve bench gpu` on a GPU machine,
from the repository root) runs it as its `checksums` section; alone:
`python3 tools/device_check.py` (torch and Triton only). It finishes in well under a minute.

- KV block checksums (engine/block_checksums.py) on 1 GiB of 2 MiB blocks in GPU memory: the
  Triton kernel (engine/block_checksum_triton.py, its launch alone) and torch's integer ops,
  timed (CUDA events, median of 10 after warm-up), against a device-to-device copy of the same
  bytes; every block's sum must be equal by all three ways (Triton, torch on the GPU, torch on
  a host copy), or the script exits 2.
  `checksum_over_copy` is what checking costs against moving the bytes once in HBM; a NIXL
  read from another GPU moves them at NIC or NVLink speed, far below HBM's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import block_checksum_triton as checksum_triton
from engine import block_checksums as checksums

_BLOCK_BYTES = 2 << 20
_NUM_BLOCKS = 512
_REPEATS = 10


def _timed_ms(fn) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up (Triton compiles here)
    times = []
    for _ in range(_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def checksum_report() -> dict[str, object]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (_NUM_BLOCKS, _BLOCK_BYTES // 4)
    words = torch.randint(-(2**31), 2**31 - 1, shape, device="cuda", generator=generator)
    blocks = words.to(torch.int32).view(torch.uint8)
    ids = torch.arange(_NUM_BLOCKS, device="cuda")
    weights = checksums._weights(_BLOCK_BYTES // 4, blocks.device)
    triton_sums = checksum_triton.block_sums(blocks, ids, weights)
    torch_sums = checksums._torch_sums(blocks, ids, weights).tolist()
    few = min(8, _NUM_BLOCKS)  # summed again on the host
    host_sums = checksums._torch_sums(blocks[:few].cpu(), torch.arange(few), weights.cpu())
    exact = [s & checksums._MASK64 for s in torch_sums] == triton_sums and [
        s & checksums._MASK64 for s in host_sums.tolist()
    ] == triton_sums[:few]
    copy = torch.empty_like(blocks)
    num_bytes = blocks.numel()
    # The kernel alone (the slices' sums are added on the host after, a few thousand ints).
    triton_ms = _timed_ms(lambda: checksum_triton.launch(blocks, ids, weights))
    torch_ms = _timed_ms(lambda: checksums._torch_sums(blocks, ids, weights))
    copy_ms = _timed_ms(lambda: copy.copy_(blocks))
    return {
        "bytes": num_bytes,
        "blocks": _NUM_BLOCKS,
        "exact": exact,
        "triton_gbps": round(num_bytes / triton_ms / 1e6, 1),
        "torch_ops_gbps": round(num_bytes / torch_ms / 1e6, 1),
        "copy_gbps": round(num_bytes / copy_ms / 1e6, 1),  # bytes moved once
        "checksum_over_copy": round(triton_ms / copy_ms, 3),
    }


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        sys.exit(1)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["checksums"] = checksums_figures = checksum_report()
    print(json.dumps(report))
    if not checksums_figures["exact"]:
        sys.exit(2)  # the kernels disagree: the figures are not to be trusted


if __name__ == "__main__":
    main()

"""CUDA graphs for decode steps: a whole forward pass replayed as one launch.

Why: on a GPU a decode step of a small model is bound by kernel launches, not by the GPU.
SmolLM2 (30 layers, some 35 kernels each) took 22 ms per step on an H100 whose memory streams
its weights in 0.1 ms, at one stream as at 32. A captured graph replays the step's ~1000
kernels with one launch.

What is captured: embedding, layers, final norm and output head of a decode-only step (every
scheduled request computes one token), per (batch size, context length) bucket:
- the batch is padded to the next capture size; padding rows write their K/V into the null
  block's first slot and attend to that slot alone;
- the context is padded to the next power of two blocks; positions past a row's length are
  masked, as eager decoding masks the positions past each row's own length.
Inputs go through static device buffers, filled by one host-to-device copy from a pinned
staging buffer; logits land in a static buffer. Graphs are captured on first use and share
one memory pool (steps never overlap). Sampling and logits processors, prefills and
speculative verification stay eager.

On a CPU (tests) the same buffers, padding and buckets run the pass eagerly instead of
replaying a graph: everything but the capture is checked without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.kv_cache_utils import cdiv
from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from engine.worker.input_batch import InputBatch

# Padding a batch of 9 to 16 costs little next to a graph per size (vLLM's sizes are alike).
_SMALL_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 8
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8, up to the largest
    batch the scheduler runs (at most MAX_CAPTURE_SIZE; larger batches run eagerly).

    # max_num_seqs 20 -> (1, 2, 4, 8, 16, 24)
    """
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in _SMALL_SIZES if s < top]
    sizes += range(_SIZE_STEP, top + _SIZE_STEP, _SIZE_STEP) if top > _SIZE_STEP else [top]
    return tuple(sorted(set(sizes)))


def context_blocks(num_blocks: int, max_blocks: int) -> int:
    """Blocks of context a graph attends over: the next power of two, at most `max_blocks`."""
    return min(1 << max(num_blocks - 1, 0).bit_length(), max_blocks)


@dataclass(frozen=True)
class _Views:
    """One graph's inputs: slices of the static device buffer, fixed for the graph's life."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_block: torch.Tensor  # [B]
    slot_offset: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, blocks]


def _layout(size: int, blocks: int) -> tuple[int, int]:
    """Where the block table starts in the buffer (after five [size] vectors), and the end."""
    return 5 * size, 5 * size + size * blocks


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_layers: list[torch.Tensor],
        backend: AttentionBackend,
        *,
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
    ) -> None:
        self.model, self.kv_layers, self.backend = model, kv_layers, backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks, self.block_size = max_blocks, block_size
        self.sliding_window = sliding_window
        self.captures = device.type == "cuda"
        largest = self.sizes[-1]
        numel = _layout(largest, max_blocks)[1]
        self._host = torch.zeros(numel, dtype=torch.int64, pin_memory=self.captures)
        self._host_np = self._host.numpy()
        self._device_buffer = torch.zeros(numel, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if self.captures else None
        self._decode_rows = torch.arange(largest, device=device)
        vocab = model.lm_head.weight.shape[0]
        self._logits = torch.empty(largest, vocab, dtype=torch.float32, device=device)
        self._pool = torch.cuda.graph_pool_handle() if self.captures else None
        # (batch size, context blocks) -> what runs the pass: a graph's replay, or on a CPU
        # the pass itself.
        self._graphs: dict[tuple[int, int], Callable[[], None]] = {}

    def prepare(
        self, batch: InputBatch, rows: np.ndarray, computed: np.ndarray
    ) -> tuple[int, int] | None:
        """Stage the inputs of one decode token for each row; the graph to replay for them
        (captured now if it is new), or None where no graph fits the batch."""
        size = next((s for s in self.sizes if s >= len(rows)), None)
        if size is None:
            return None
        seq_lens = computed + 1
        blocks = context_blocks(cdiv(int(seq_lens.max()), self.block_size), self.max_blocks)
        self._stage(batch, rows, computed, size, blocks)
        key = (size, blocks)
        if key not in self._graphs:
            self._graphs[key] = self._capture(size, blocks)
        return key

    def replay(self, key: tuple[int, int], count: int) -> torch.Tensor:
        """Logits [count, vocab] of the staged rows: a view of the static output, to be read
        before the next step."""
        self._graphs[key]()
        return self._logits[:count]

    def _stage(
        self, batch: InputBatch, rows: np.ndarray, computed: np.ndarray, size: int, blocks: int
    ) -> None:
        """Fill the inputs of (size, blocks) and send them to the device in one copy.
        Padding rows: token 0 at position 0, written to and read from slot 0 of block 0 (the
        null block, which no request reads unmasked)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the staging buffer
        count = len(rows)
        table_start, end = _layout(size, blocks)
        host = self._host_np
        host[:end] = 0
        slot_block, slot_offset = batch.block_table.slot_mapping(rows, computed)
        columns = (batch.token_ids[rows, computed], computed, slot_block, slot_offset)
        for i, values in enumerate(columns):
            host[i * size : i * size + count] = values
        host[4 * size : 5 * size] = 1
        host[4 * size : 4 * size + count] = computed + 1
        table = host[table_start:end].reshape(size, blocks)
        table[:count] = batch.block_table.table[rows, :blocks]
        self._device_buffer[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _views(self, size: int, blocks: int) -> _Views:
        buffer = self._device_buffer
        table_start, end = _layout(size, blocks)
        ids, positions, slot_block, slot_offset, seq_lens = (
            buffer[i * size : (i + 1) * size] for i in range(5)
        )
        table = buffer[table_start:end].view(size, blocks)
        return _Views(ids, positions, slot_block, slot_offset, seq_lens, table)

    def _forward(self, size: int, blocks: int) -> Callable[[], None]:
        views = self._views(size, blocks)
        logits = self._logits[:size]

        def forward() -> None:
            # Metadata built inside the pass: its decode slots (a cached property) are then
            # computed by kernels of the graph, from the static inputs, at every replay.
            metadata = AttentionMetadata(
                num_tokens=size,
                block_size=self.block_size,
                slot_block=views.slot_block,
                slot_offset=views.slot_offset,
                block_table=views.block_table,
                decode_token_indices=self._decode_rows[:size],
                decode_block_table=views.block_table,
                decode_seq_lens=views.seq_lens,
                prefills=[],
                sliding_window=self.sliding_window,
                decode_context_len=blocks * self.block_size,
            )
            hidden = self.model(
                views.input_ids, views.positions, self.kv_layers, metadata, self.backend
            )
            logits.copy_(self.model.compute_logits(hidden))

        return forward

    def run_largest_eagerly(self) -> None:
        """The largest pass a graph may hold (largest batch, longest context), run eagerly:
        the model runner measures its memory before it sizes the KV cache."""
        self._forward(self.sizes[-1], self.max_blocks)()

    def _capture(self, size: int, blocks: int) -> Callable[[], None]:
        forward = self._forward(size, blocks)
        if not self.captures:
            return forward
        # One eager pass on a side stream first, as torch's graph docs ask (libraries set up
        # workspaces on first use). It computes this step's own K/V and logits: the replay
        # that follows writes the same values again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: another thread's CUDA calls (a KV transfer) do not break the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            forward()
        return graph.replay


__all__ = ["MAX_CAPTURE_SIZE", "DecodeGraphs", "capture_sizes", "context_blocks"]


def measure_graph_memory(
    build: Callable[[list[torch.Tensor]], DecodeGraphs],
    probe_layers: list[torch.Tensor],
    device: torch.device,
) -> int:
    """What decode graphs will hold on `device`: their buffers and the activations of the
    largest pass, measured by running it eagerly over `probe_layers` (a one-block cache)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    probe = build(probe_layers)
    with torch.inference_mode():
        probe.run_largest_eagerly()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    return peak

"""Per-request block tables in one array, and the slot mapping of a step's tokens."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Row r holds the physical block ids of the request in batch row r."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self._check_room(row, n)
        self.table[row, :n] = block_ids
        self.num_blocks[row] = n

    def append_row(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self._check_room(row, end)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks[src])
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n
        self.num_blocks[src] = 0

    def slot_mapping(
        self, rows: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Block and in-block offset of each token (rows and positions per token).

        # rows = [0, 0, 1], positions = [4, 5, 0], block_size 4, table[0] = [7, 9], table[1] = [3]
        #   -> blocks [9, 9, 3], offsets [0, 1, 0]
        """
        blocks = self.table[rows, positions // self.block_size]
        return blocks, positions % self.block_size

    def _check_room(self, row: int, num_blocks: int) -> None:
        if num_blocks > self.table.shape[1]:
            raise ValueError(
                f"row {row} needs {num_blocks} blocks, more than max_model_len allows "
                f"({self.table.shape[1]})"
            )

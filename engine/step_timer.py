"""Where an engine step's time goes: wall seconds per phase, for `pdserve bench latency`.

Off by default (the engine holds None and pays one attribute test per phase). On CUDA the
timer synchronizes at each mark, or the forward pass's time would land in whichever phase
first waits for the GPU; that costs the overlap a real run has, so a breakdown is taken in a
run of its own, never in the one whose throughput is reported.

Phases: `schedule`; `prepare_inputs` (the runner's batch update, the connector's load start and
the step's input tensors); `forward` (the model and the logits); `sample` (sampling and the
runner's bookkeeping); `kv_connector` (finished transfers, and the whole of a step that had
nothing to compute); `update` (the scheduler's output processing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "kv_connector", "update")


class StepTimer:
    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._synchronize = synchronize
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or start) was spent in `phase`."""
        if self._synchronize is not None:
            self._synchronize()
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def end_step(self) -> None:
        self.mark("update")
        self.steps += 1

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

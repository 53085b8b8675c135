"""Holding an engine's loop thread inside a step until the test lets it go on: what the test
queues meanwhile (requests, aborts) is applied together once the step ends, and nothing runs
ahead of the test, however fast or slow the machine. Instead of slowing every step down."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest

GATE_TIMEOUT_S = 30.0  # a held step goes on by itself after this (a test that failed)


class StepGate:
    """Wraps `core.runner.execute_model`: from step number `free_steps` on (0: the first),
    each step, its model run done, waits for `open()`. `held` is set once a step waits."""

    def __init__(self, core: Any, monkeypatch: pytest.MonkeyPatch, free_steps: int = 0) -> None:
        self.held = threading.Event()
        self._gate = threading.Event()
        run = core.runner.execute_model
        steps = itertools.count()

        def gated(scheduler_output: Any) -> Any:
            output = run(scheduler_output)
            if next(steps) >= free_steps and not self._gate.is_set():
                self.held.set()
                self._gate.wait(GATE_TIMEOUT_S)
            return output

        monkeypatch.setattr(core.runner, "execute_model", gated)

    def open(self) -> None:
        """Every step from now on runs freely."""
        self._gate.set()

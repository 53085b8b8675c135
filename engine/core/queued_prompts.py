"""Prompt tokens still to compute, counted exactly and read every step at a small cost.

The engine reports them after every step (EngineStats.queued_prompt_tokens): a router weighs
them as the work ahead of the engine. Walking every unfinished request each step would cost as
much as scheduling the step, so the count is split by what a request can be doing:

- *fresh*: added and never admitted (WAITING, nothing computed). It counts its whole prompt,
  kept as a running sum: the hundreds of requests that wait behind a full batch cost nothing.
- *watched*: admitted at least once, so its computed tokens may be anywhere. These are walked;
  one seen RUNNING with its whole prompt computed stops being watched, until something sends
  its computed tokens back below the prompt (a preemption, a rewind after a failed KV load),
  and whoever does that watches it again.

A request whose KV is being read from another engine (WAITING_FOR_REMOTE_KVS) counts nothing:
its prompt is not computed here. Finished requests count nothing either.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class QueuedPromptTokens:
    """The scheduler tells it when a request arrives, is admitted, loses computed tokens, or
    finishes; `count()` is then exact (tests/unit/test_queued_prompts.py recounts by brute
    force)."""

    def __init__(self) -> None:
        self._fresh: set[Request] = set()
        self._fresh_tokens = 0  # the prompts of `_fresh`, summed
        self._watched: set[Request] = set()

    def add(self, request: Request) -> None:
        """A request joined the waiting queue, nothing computed yet."""
        self._fresh.add(request)
        self._fresh_tokens += request.num_prompt_tokens

    def watch(self, request: Request) -> None:
        """Its computed tokens changed, or may fall below its prompt's again."""
        if request in self._fresh:
            self._fresh.remove(request)
            self._fresh_tokens -= request.num_prompt_tokens
        self._watched.add(request)

    def forget(self, request: Request) -> None:
        """It finished: nothing of it is queued any more."""
        if request in self._fresh:
            self._fresh.remove(request)
            self._fresh_tokens -= request.num_prompt_tokens
        self._watched.discard(request)

    def count(self) -> int:
        """Prompt tokens of unfinished requests not computed (nor being read) yet."""
        queued = self._fresh_tokens
        done = []
        for request in self._watched:
            status = request.status
            missing = request.num_prompt_tokens - request.num_computed_tokens
            if missing <= 0:
                if status is _RUNNING:
                    done.append(request)  # only a preemption or a rewind brings it back
            elif status.is_finished:
                done.append(request)
            elif status is not _WAITING_FOR_REMOTE_KVS:
                queued += missing
        self._watched.difference_update(done)
        return queued

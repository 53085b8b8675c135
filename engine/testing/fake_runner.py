"""A model runner without a model: worker-side state from SchedulerOutput, fake tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Rolling fingerprints of every prefix: fp[p] identifies tokens[0..p] as a whole.
    fingerprints: list[int] = field(default_factory=list)


def next_fake_token(req_id_hash: int, position: int, vocab_size: int) -> int:
    """Deterministic 'sampling': the same request and position give the same token."""
    return (req_id_hash * 1_000_003 + position * 7919) % vocab_size


class FakeModelRunner:
    """Executes a SchedulerOutput the way a worker would, minus the model.

    With `check_kv=True` it also simulates the paged KV cache: every computed slot stores the
    fingerprint of the prefix it encodes, and every read checks that the slots the request's
    block table points at hold that request's own prefix. A wrong prefix-cache hit, a block
    freed while in use, or a bad block table fails loudly here.
    """

    def __init__(
        self, block_size: int, num_blocks: int, vocab_size: int = 32000, check_kv: bool = False
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.check_kv = check_kv
        self.kv: list[int | None] = [None] * (num_blocks * block_size) if check_kv else []
        self.reqs: dict[str, _WorkerRequest] = {}
        self._hashes: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_state_changes(so)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            if end > len(state.token_ids):
                raise AssertionError(f"{req_id}: scheduled past its tokens ({end})")
            if self.check_kv:
                self._check_and_write_kv(req_id, state, start, end)
            state.num_computed_tokens = end
            req_ids.append(req_id)
            if end == len(state.token_ids):
                token = next_fake_token(self._hashes[req_id], end, self.vocab_size)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _apply_state_changes(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            tokens = [*new.prompt_token_ids, *new.output_token_ids]
            self.reqs[new.req_id] = _WorkerRequest(
                tokens, list(new.block_ids), new.num_computed_tokens
            )
            self._hashes[new.req_id] = hash(new.req_id) & 0xFFFF
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                self.reqs[req_id] = _WorkerRequest(
                    list(cached.resumed_token_ids[req_id]),
                    list(cached.new_block_ids[i] or []),
                    cached.num_computed_tokens[i],
                )
                continue
            state = self.reqs[req_id]
            if state.num_computed_tokens != cached.num_computed_tokens[i]:
                raise AssertionError(
                    f"{req_id}: worker computed {state.num_computed_tokens} tokens, "
                    f"scheduler says {cached.num_computed_tokens[i]}"
                )
            new_block_ids = cached.new_block_ids[i]
            if new_block_ids:
                state.block_ids.extend(new_block_ids)

    def _slot(self, state: _WorkerRequest, position: int) -> int:
        block_id = state.block_ids[position // self.block_size]
        if block_id == 0:
            raise AssertionError(f"position {position} maps to the null block")
        return block_id * self.block_size + position % self.block_size

    def _check_and_write_kv(self, req_id: str, state: _WorkerRequest, start: int, end: int) -> None:
        fps = state.fingerprints
        while len(fps) < end:
            prev = fps[-1] if fps else 0
            fps.append(hash((prev, state.token_ids[len(fps)])))
        for position in range(start):  # every earlier position is read by attention
            if self.kv[self._slot(state, position)] != fps[position]:
                raise AssertionError(f"{req_id}: KV at position {position} is not its own")
        for position in range(start, end):
            self.kv[self._slot(state, position)] = fps[position]

    def invalidate_blocks(self, block_ids: set[int]) -> None:
        """Simulate a failed load: these blocks hold garbage."""
        for block_id in block_ids:
            for offset in range(self.block_size):
                self.kv[block_id * self.block_size + offset] = None

    def load_blocks(self, token_ids: list[int], block_ids: list[int], num_tokens: int) -> None:
        """Simulate a successful remote load of `num_tokens` tokens into `block_ids`."""
        prev = 0
        for position in range(num_tokens):
            prev = hash((prev, token_ids[position]))
            block_id = block_ids[position // self.block_size]
            self.kv[block_id * self.block_size + position % self.block_size] = prev

"""Rank 0's model runner: each step goes to the other ranks before rank 0 runs it too."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.inputs import ReasoningTokens
from engine.models.config import ModelArchConfig
from engine.parallel.layout import TPLayout
from engine.parallel.workers import Followers, Sampled, TensorParallelError
from engine.tokenizer import Tokenizer
from engine.worker.kv_cache import KVShard, create_shared_kv_file, map_shared_kv_cache
from engine.worker.model_runner import ModelRunner


class Rank0Runner(ModelRunner):
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        reasoning: ReasoningTokens | None,
        tokenizer: Tokenizer | None,
        followers: Followers,
    ) -> None:
        layout = TPLayout(arch, 0, followers.size)
        super().__init__(config, arch, reasoning, tokenizer, layout, followers.group)
        self.followers = followers
        self._last_sampled: Sampled | None = None  # what the followers must have sampled too

    def load_model(self) -> None:
        super().load_model()
        self.followers.wait_loaded()  # they load theirs meanwhile

    def initialize_kv_cache(
        self,
        num_blocks: int,
        kv_cache: torch.Tensor | None = None,
        other_shards: Sequence[KVShard] = (),
    ) -> None:
        """Every rank allocates as many blocks. On one CPU host the ranks share one cache of
        every head, mapped from /dev/shm, each attending over its own heads: what a KV
        connector on rank 0 registers holds every head, so engines of any tensor-parallel
        sizes exchange whole blocks as engines of one rank do. Elsewhere each rank has its
        own (connector/kv_shards.py maps heads between engines)."""
        assert kv_cache is None and not other_shards, "rank 0 makes the caches of its ranks"
        if not self.shares_kv_cache:
            # Each rank keeps its own heads' cache. A KV connector and the KV tier move every
            # head: the other ranks' caches are mapped here too (a /dev/shm file of each on
            # CPUs, CUDA IPC on GPUs) beside rank 0's, one shard each.
            wanted = self.config.kv_transfer is not None or bool(
                self.config.cache.kv_offloading_size
            )
            sent = self.followers.initialize_kv_cache(num_blocks, None, share_back=wanted)
            shards = []
            for rank, cache in enumerate(sent, start=1):
                if cache is not None:
                    first = TPLayout(self.arch, rank, self.followers.size).first_kv_head
                    shards.append(KVShard(self._mapped(cache, num_blocks), first))
            super().initialize_kv_cache(num_blocks, other_shards=shards)
            return
        spec = self.kv_cache_spec()
        path = create_shared_kv_file(spec, num_blocks)
        try:
            shared = map_shared_kv_cache(path, spec, num_blocks)
            self.followers.initialize_kv_cache(num_blocks, path)  # they have mapped it
        finally:
            os.unlink(path)
        super().initialize_kv_cache(num_blocks, shared)

    def _mapped(self, sent: torch.Tensor | str, num_blocks: int) -> torch.Tensor:
        """A follower's own cache, mapped here: from its /dev/shm file (unlinked once mapped:
        the mappings keep it), or the tensor its CUDA IPC handle gave."""
        if isinstance(sent, torch.Tensor):
            return sent
        try:
            return map_shared_kv_cache(sent, self.kv_cache_spec(), num_blocks)
        finally:
            os.unlink(sent)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        # The other ranks write into their cache (the shared one, or their own that rank 0
        # maps) as soon as they get the step: a preemption's blocks must be in the tier first.
        self.submit_tier_copies(so)
        self.followers.send_step(so, self._last_sampled)
        try:
            output = super().execute_model(so)
        except BaseException as exc:
            # The other ranks wait in a collective for this one, or failed first (and said
            # why: that is the story, not the collective's error here).
            self.group.abort()
            reason = self.followers.failure(wait_s=1.0) or f"tensor-parallel rank 0 failed: {exc}"
            raise TensorParallelError(reason) from exc
        self._last_sampled = (output.req_ids, output.sampled_token_ids)
        return output

"""ModelRunner: executes a SchedulerOutput (prepare inputs -> forward -> sample)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.config import CacheConfig, EngineConfig
from engine.core.sched_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine.inputs import ReasoningTokens
from engine.kv_connector import KVConnectorBase
from engine.layers.attention import get_attention_backend
from engine.layers.linear import pack_linears
from engine.layers.linear import warm_up as warm_up_linears
from engine.layers.quantized import QUANTIZED_BACKENDS
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_fused import FusedDecodeStep
from engine.models.loader import load_model
from engine.models.quantized_loading import block_kernels
from engine.offload.stores import make_store
from engine.offload.tier_worker import TierWorker
from engine.outputs import TokenLogprobs
from engine.parallel.group import SINGLE_RANK, TPGroup, rank_device
from engine.parallel.layout import TPLayout, shares_kv_cache
from engine.request import SamplingParams
from engine.sample import Sampler, SamplingMetadata
from engine.sample.logits_processor import (
    LogitsProcessorConfig,
    build_logits_processors,
)
from engine.spec_decode.ngram import can_speculate
from engine.spec_decode.verify import DraftVerification
from engine.step_timer import StepTimer
from engine.tokenizer import Tokenizer
from engine.worker.cuda_graphs import DecodeGraphs, measure_graph_memory
from engine.worker.draft_model import DraftModelProposer
from engine.worker.draft_steps import keep_accepted, sample_drafted
from engine.worker.host_memory import return_freed_memory
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    KVShard,
    allocate_kv_cache,
    check_cuda_kv_budget,
    cuda_kv_cache_budget,
    layer_views,
)
from engine.worker.step_inputs import StepPlan, plan_step, prepare_step_inputs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        reasoning: ReasoningTokens | None = None,
        tokenizer: Tokenizer | None = None,
        layout: TPLayout | None = None,
        group: TPGroup = SINGLE_RANK,
    ) -> None:
        reasoning = reasoning or ReasoningTokens()
        self.config = config
        self.arch = arch
        # Tensor parallelism: this rank's slice of the model, and its group (engine/parallel/).
        self.layout = layout or TPLayout(arch)
        self.group = group
        self.device = rank_device(config.model.device, self.layout.rank)
        # Ranks on one CPU host share one KV cache of every head (engine/parallel/rank0.py).
        self.shares_kv_cache = shares_kv_cache(
            arch, self.layout.size, self.device.type, config.parallel.kv_cache
        )
        self.dtype = _DTYPES[config.model.dtype]
        sched = config.scheduler
        self.max_model_len = sched.max_model_len
        self.input_batch = InputBatch(
            sched.max_num_seqs, sched.max_model_len, config.cache.block_size
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.attn_backend = get_attention_backend(config.model.attention_backend, self.device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.logitsprocs = build_logits_processors(
            LogitsProcessorConfig(
                vocab_size=arch.vocab_size,
                max_num_seqs=sched.max_num_seqs,
                eos_token_id=arch.eos_token_id,
                reasoning_start_token_id=reasoning.start,
                reasoning_end_token_id=reasoning.end,
                tokenizer=tokenizer,
            ),
            self.device,
            config.model.logits_processors,
        )
        self.model: LlamaForCausalLM | None = None
        self.drafter: DraftModelProposer | None = None  # speculative method draft_model
        self.connector: KVConnectorBase | None = None
        self.tier: TierWorker | None = None  # the KV tier's copies (start_tier)
        self.kv_cache: torch.Tensor | None = None
        self.kv_shards: list[KVShard] = []
        self.kv_layers: list[torch.Tensor] = []
        # Decode steps on CUDA replay captured graphs (set up with the KV cache).
        self.use_cuda_graphs = (
            self.device.type == "cuda" and not config.model.enforce_eager and group.size == 1
        )
        self.graphs: DecodeGraphs | None = None
        self.step_timer: StepTimer | None = None  # bench latency's breakdown

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        self.model = self._build_model(self.config.model.model, self.arch, draft=False)
        speculative = self.config.speculative
        # Drafts are rank 0's alone (the scheduler sends them to every rank to verify): the
        # draft model runs there whole, the other ranks hold none of it.
        if speculative is not None and speculative.uses_draft_model and self.layout.rank == 0:
            assert speculative.model is not None  # checked by SpeculativeConfig
            arch = ModelArchConfig.from_pretrained(speculative.model)
            self.drafter = DraftModelProposer(
                self._build_model(speculative.model, arch, draft=True),
                arch,
                speculative.num_speculative_tokens,
                self.max_model_len,
                self.attn_backend,
                self.device,
                self.config.scheduler.max_num_batched_tokens,
            )
        return_freed_memory()

    def _build_model(self, path: str, arch: ModelArchConfig, draft: bool) -> LlamaForCausalLM:
        # +1 position: the token sampled at max_model_len - 1 is never fed back, but the
        # rotary table is indexed by every position the runner may see.
        backend = self.config.model.linear_backend
        # A draft model is not split (rank 0 runs it whole): no slice, no collectives.
        layout, group = (TPLayout(arch), SINGLE_RANK) if draft else (self.layout, self.group)
        model = load_model(
            path,
            arch,
            self.dtype,
            self.device,
            self.max_model_len + 1,
            layout,
            group,
            # A draft model keeps its blocks like the target where it can, never insists.
            block_kernels(path, backend, self.device, self.dtype, insist=not draft),
            load_format="auto" if draft else self.config.model.load_format,
        )
        # What stayed float (norms aside: other types, other files) packs as under `auto`.
        if pack_linears(model, "auto" if backend in QUANTIZED_BACKENDS else backend, self.device):
            warm_up_linears(model, self.config.scheduler.max_num_seqs)
        model.fused_decode = FusedDecodeStep.build(model, self.attn_backend)
        model.attends_token_by_token = self.config.model.batch_invariant  # step_inputs.plan_step
        model.model.ops = self.attn_backend.layer_ops()
        return model

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.arch.num_hidden_layers,
            # Every head where the ranks share the cache, else this rank's.
            num_kv_heads=self.arch.num_key_value_heads
            if self.shares_kv_cache
            else self.layout.num_kv_heads,
            head_dim=self.arch.head_dim,
            block_size=self.config.cache.block_size,
            dtype=self.dtype,
        )

    def determine_num_blocks(self) -> int:
        """From the override, or the memory budget of this device (a draft model's KV shares
        it: each block id holds K/V of both models)."""
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        if self.device.type == "cuda":
            budget = cuda_kv_cache_budget(self.device, self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        per_block = self.kv_cache_spec().bytes_per_block
        if self.drafter is not None:
            block_size = self.config.cache.block_size
            per_block += self.drafter.kv_cache_spec(block_size, self.dtype).bytes_per_block
        if self.device.type == "cuda":
            if self.use_cuda_graphs:
                probe = layer_views(allocate_kv_cache(self.kv_cache_spec(), 1, self.device))
                budget -= measure_graph_memory(self.build_decode_graphs, probe, self.device)
            check_cuda_kv_budget(budget, per_block, self.device, self.config.gpu_memory_utilization)
        return budget // per_block

    def build_decode_graphs(self, kv_layers: list[torch.Tensor]) -> DecodeGraphs:
        """Decode graphs over `kv_layers` (on a CPU they run each pass eagerly: tests)."""
        assert self.model is not None
        block_size = self.config.cache.block_size
        return DecodeGraphs(
            self.model,
            kv_layers,
            self.attn_backend,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_blocks=self.input_batch.block_table.table.shape[1],
            block_size=block_size,
            sliding_window=self.arch.sliding_window,
            device=self.device,
        )

    def initialize_kv_cache(
        self,
        num_blocks: int,
        kv_cache: torch.Tensor | None = None,
        other_shards: Sequence[KVShard] = (),
    ) -> None:
        """`kv_cache`: one to use (shared by the tensor-parallel ranks, or shared with rank
        0) instead of a new one; `other_shards`: the other ranks' caches, where each keeps
        its own (rank 0's connector registers them too: engine/parallel/rank0.py)."""
        if kv_cache is None:
            kv_cache = allocate_kv_cache(self.kv_cache_spec(), num_blocks, self.device)
        self.kv_cache = kv_cache
        every_head = kv_cache.shape[4] == self.arch.num_key_value_heads
        own = KVShard(kv_cache, 0 if every_head else self.layout.first_kv_head)
        self.kv_shards = [own, *other_shards]  # what a connector registers
        self.kv_layers = layer_views(self.layout.own_heads(kv_cache))
        if self.use_cuda_graphs:
            self.graphs = self.build_decode_graphs(self.kv_layers)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, self.config.cache.block_size, self.dtype)
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_shards)

    # ------------------------------------------------------------------ one step

    def start_tier(self, cache: CacheConfig) -> None:
        """The KV tier's worker over this runner's cache (engine/offload/), its slots as
        `cache` counts them (num_tier_blocks, and num_disk_tier_blocks below them): host
        memory or a file, and a file below host memory."""
        caches = [shard.cache for shard in self.kv_shards]  # each rank's, where rank 0 maps them
        assert caches, "initialize_kv_cache() first"
        num_slots = (cache.num_tier_blocks or 0) + (cache.num_disk_tier_blocks or 0)
        store = make_store(cache, sum(c[0].nbytes for c in caches))
        self.tier = TierWorker(store, caches, num_slots)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        self.submit_tier_copies(so)
        if self.connector is not None:
            self.connector.start_load_kv(so.kv_connector_metadata)
        output = self._run(so) if so.total_num_scheduled_tokens else EMPTY_MODEL_RUNNER_OUTPUT
        if self.tier is not None:
            output = replace(output, tier_report=self.tier.report())
        if self.connector is None:
            return output
        done_sending, done_recving = self.connector.get_finished()
        kv_output = KVConnectorOutput(
            finished_sending=done_sending,
            finished_recving=done_recving,
            invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
            load_problems=self.connector.take_load_problems(),
        )
        return replace(output, kv_connector_output=kv_output)

    def submit_tier_copies(self, so: SchedulerOutput) -> None:
        """Hand the step's tier copies to the tier's worker (once: they are taken off `so`).
        Held blocks are never written by the step; a preemption's stores (unheld: their
        blocks may be reallocated by this very step) are made before any rank starts it."""
        if self.tier is None or not so.tier_copies:
            return
        copies, so.tier_copies = so.tier_copies, []
        self.tier.submit(copies, wait=so.tier_copies_first)

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model is not None, "load_model() first"
        timer = self.step_timer
        drafts = so.scheduled_spec_decode_tokens
        if drafts:
            self.input_batch.place_drafts(drafts)
        by_token = self.model.attends_token_by_token
        plan = plan_step(self.input_batch, so.num_scheduled_tokens, drafts.keys(), by_token)
        if self.graphs is not None and not drafts and plan.all_decode:
            graph = self.graphs.prepare(self.input_batch, plan.rows, plan.computed)
            if graph is not None:
                if timer is not None:
                    timer.mark("prepare_inputs")
                logits = self.graphs.replay(graph, len(plan.rows))
                if timer is not None:
                    timer.mark("forward")
                return self._sampled(logits, plan, timer)
        inputs = prepare_step_inputs(self.input_batch, plan, self.device, self.arch.sliding_window)
        if timer is not None:
            timer.mark("prepare_inputs")
        hidden = self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_layers,
            inputs.attn_metadata,
            self.attn_backend,
        )
        verification, predictions = None, None
        if drafts:
            req_ids = [self.input_batch.req_ids[r] or "" for r in plan.rows.tolist()]
            verification = DraftVerification.build(req_ids, plan.num_scheduled, drafts, self.device)
            all_logits = self.model.compute_logits(hidden[verification.logits_indices])
            logits = all_logits[verification.sampler_rows()]
            predictions = sample_drafted(
                self.input_batch, self.sampler, self.generator, all_logits, verification, plan
            )
        else:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if timer is not None:
            timer.mark("forward")
        return self._sampled(logits, plan, timer, verification, predictions)

    def _sampled(
        self,
        logits: torch.Tensor,
        plan: StepPlan,
        timer: StepTimer | None,
        verification: DraftVerification | None = None,
        predictions: list[int] | None = None,
    ) -> ModelRunnerOutput:
        output = self._sample_and_record(logits, plan)
        if verification is not None:
            assert predictions is not None
            keep_accepted(self.input_batch, output, plan, verification, predictions)
        if self.drafter is not None:
            output.draft_token_ids = self.drafter.propose(
                self.input_batch, self._rows_that_speculate(plan, output)
            )
        if timer is not None:
            timer.mark("sample")
        return output

    def _rows_that_speculate(self, plan: StepPlan, output: ModelRunnerOutput) -> list[int]:
        """Rows that sampled this step and may take drafts for the next."""
        rows = []
        for row, tokens in zip(plan.rows.tolist(), output.sampled_token_ids, strict=True):
            state = self.input_batch.states[row]
            assert state is not None
            params, num_outputs = state.sampling_params, len(state.output_token_ids)
            if tokens and num_outputs < params.max_tokens and can_speculate(params, num_outputs):
                rows.append(row)
        return rows

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        drafter = self.drafter
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            self.requests.pop(req_id, None)
            if drafter is not None:
                drafter.forget(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)  # the state stays: it comes back resumed
            if drafter is not None:
                drafter.forget(req_id)  # its blocks, the draft's K/V with them, are gone
        for new in so.scheduled_new_reqs:
            state = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                new.num_computed_tokens,
            )
            self.requests[new.req_id] = state
            batch.add_request(state, new.block_ids)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if req_id in cached.resumed_req_ids:
                state.num_computed_tokens = cached.num_computed_tokens[i]
                del state.output_token_ids[cached.num_output_tokens[i] :]
                batch.add_request(state, cached.new_block_ids[i] or [])
                continue
            row = batch.req_id_to_index[req_id]
            new_block_ids = cached.new_block_ids[i]
            if new_block_ids:
                batch.block_table.append_row(row, new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens[i]
            if len(state.output_token_ids) > cached.num_output_tokens[i]:
                batch.truncate_outputs(row, cached.num_output_tokens[i])
        batch.condense()
        # Every step, scheduled tokens or not: processors must see each row change in order
        # (a row freed now may be reused by the next step's first new request).
        self.logitsprocs.update_state(batch.batch_update_builder.get_and_reset(batch.num_reqs))

    def validate_params(self, params: SamplingParams) -> None:
        """Refuse, at admission, what a logits processor could only fail on mid-step."""
        for processor in self.logitsprocs.all:
            processor.validate_params(params)

    def _sample_and_record(self, logits: torch.Tensor, plan: StepPlan) -> ModelRunnerOutput:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        completes_prompt = plan.completes_prompt(batch)
        if len(plan.rows) != num_reqs:
            # Processors index rows of the whole batch; unscheduled rows get dummy logits.
            full = logits.new_zeros((num_reqs, logits.shape[1]))
            full[torch.from_numpy(plan.rows).to(self.device)] = logits
            logits = full
        states = [s for s in batch.states[:num_reqs] if s is not None]
        metadata = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            self.logitsprocs,
            self.device,
            self.generator,
        )
        sampled = self.sampler(logits, metadata)
        tokens = sampled.sampled_token_ids.tolist()
        logprobs = None
        if sampled.logprobs is not None:
            logprobs = sampled.logprobs.rows([s.sampling_params.logprobs or 0 for s in states])
        req_ids: list[str] = []
        out_tokens: list[list[int]] = []
        out_logprobs: list[list[TokenLogprobs]] = []
        for i, row in enumerate(plan.rows.tolist()):
            state = batch.states[row]
            assert state is not None
            req_ids.append(state.req_id)
            batch.num_computed_tokens[row] += plan.num_scheduled[i]
            state.num_computed_tokens = int(batch.num_computed_tokens[row])
            if not completes_prompt[i]:
                out_tokens.append([])  # a chunk short of the prompt's end samples nothing
                out_logprobs.append([])
                continue
            batch.append_token(row, tokens[row])
            out_tokens.append([tokens[row]])
            wants_logprobs = logprobs is not None and state.sampling_params.logprobs is not None
            out_logprobs.append([logprobs[row]] if wants_logprobs else [])  # type: ignore[index]
        return ModelRunnerOutput(
            req_ids, out_tokens, logprobs=out_logprobs if logprobs is not None else None
        )


__all__ = ["ModelRunner"]

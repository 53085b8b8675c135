"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm).

One module, switched by the config: the four differ only in biases, per-head norms, RoPE
scaling and sliding windows. Parameter names follow Hugging Face so checkpoints load as-is.

Under tensor parallelism each rank builds the same modules at its slice's sizes
(engine/parallel/layout.py) and sums the row-parallel projections' outputs over its group;
at one rank the group's collectives do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.layer_ops import TORCH_LAYER_OPS, LayerOps
from engine.layers.linear import stacked_rows
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeTables, RotaryEmbedding
from engine.models.config import ModelArchConfig
from engine.parallel.group import SINGLE_RANK, TPGroup
from engine.parallel.layout import TPLayout

if TYPE_CHECKING:  # llama_fused imports this module
    from engine.models.llama_fused import FusedDecodeStep


class StackedLinear(nn.Linear):
    """Several projections of the same input as one matrix (one GEMM instead of several).

    `shard_sizes` are the output widths of the stacked projections, in order; the loader
    writes each checkpoint matrix into its rows.
    """

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_rows(self, index: int) -> slice:
        return stacked_rows(self.shard_sizes, index)


# Checkpoint projection name -> (stacked module name, shard index).
STACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, layout: TPLayout, group: TPGroup) -> None:
        super().__init__()
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM; the loader stacks the checkpoint's three matrices.
        self.qkv_proj = StackedLinear(hidden, (q_size, kv_size, kv_size), config.qkv_bias)
        # Row-parallel: rank 0 alone adds the bias to the partial sums.
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias and layout.rank == 0)
        self.group = group
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if backend.fuses_rotary:  # rotated in the kernel that writes the cache
            q, k, v = self._qkv(hidden)
            out = backend.forward_rotary(q, k, v, rope, kv_cache, metadata, self.scale)
        else:
            q, k, v = self._rotated_qkv(hidden, rope)
            out = backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.group.all_reduce(self.o_proj(out.reshape(hidden.shape[0], -1)))

    def _qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] before rotation (views of the GEMM's output, or
        of the per-head norms' where the model has them)."""
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        sizes = (heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim)
        q, k, v = qkv.split(sizes, dim=-1)
        q = q.view(num_tokens, heads, self.head_dim)
        k = k.view(num_tokens, kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(num_tokens, kv_heads, self.head_dim)

    def _rotated_qkv(
        self, hidden: torch.Tensor, rope: RopeTables
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D], q and k rotated (views into fresh tensors)."""
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        qk_size = (heads + kv_heads) * self.head_dim
        v = qkv[:, qk_size:].view(num_tokens, kv_heads, self.head_dim)
        if not self.qk_norm:
            # q and k side by side in the GEMM output: rotate both heads at once.
            qk = rope.apply(qkv[:, :qk_size].view(num_tokens, heads + kv_heads, self.head_dim))
            return qk[:, :heads], qk[:, heads:], v
        q, k = qkv[:, :qk_size].split((heads * self.head_dim, kv_heads * self.head_dim), dim=-1)
        q = self.q_norm(q.view(num_tokens, heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, kv_heads, self.head_dim))
        return rope.apply(q), rope.apply(k), v


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, layout: TPLayout, group: TPGroup) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, layout.intermediate_size, config.mlp_bias
        self.gate_up_proj = StackedLinear(hidden, (inner, inner), bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias and layout.rank == 0)
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        return self.group.all_reduce(self.down_proj(ops.silu_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layout: TPLayout, group: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layout, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, layout, group)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer (or the
        final norm) adds the two, fused with its norm. The sums are the plain layer's,
        operand for operand: residual + attention, then + MLP."""
        x, residual = ops.add_rms_norm(hidden, residual, self.input_layernorm)
        attn = self.self_attn(x, rope, kv_cache, metadata, backend)
        x, residual = ops.add_rms_norm(attn, residual, self.post_attention_layernorm)
        return self.mlp(x, ops), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelArchConfig, max_positions: int, layout: TPLayout, group: TPGroup
    ) -> None:
        super().__init__()
        # Given its (empty) table, it skips its random init: the checkpoint fills it, and
        # normal_ on the meta device (the loader's) imports sympy, seconds per process.
        rows = layout.vocab_rows  # this rank's share of the vocabulary (all of it at one rank)
        table = torch.empty(rows, config.hidden_size)
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=table)
        # One table for every layer: looked up once per step.
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layout, group) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layout, self.group = layout, group
        # The layers' elementwise ops: torch's, or the attention backend's fused kernels (set by
        # the model runner).
        self.ops: LayerOps = TORCH_LAYER_OPS

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings. Vocab-parallel: each rank looks up the ids in its rows, zeros the
        others, and the sum over ranks is every row exactly (x + 0 == x)."""
        if self.group.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= self.layout.vocab_rows)
        rows = self.embed_tokens(local.masked_fill(outside, 0))
        return self.group.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0.0))


class LlamaForCausalLM(nn.Module):
    """forward() gives hidden states for every scheduled token; compute_logits() only for the
    rows that get sampled (the last token of each request)."""

    def __init__(
        self,
        config: ModelArchConfig,
        max_positions: int,
        layout: TPLayout | None = None,
        group: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.config = config
        self.layout = layout or TPLayout(config)
        self.group = group
        self.model = LlamaModel(config, max_positions, self.layout, group)
        self.lm_head = nn.Linear(config.hidden_size, self.layout.vocab_rows, bias=False)
        self.tie_weights()
        # Set by the model runner where it applies (CPU, float32, blocked linears).
        self.fused_decode: FusedDecodeStep | None = None
        # Every token's attention as a decode's (engine/worker/step_inputs.py: plan_step).
        self.attends_token_by_token = False

    def tie_weights(self) -> None:
        """Share the embedding with the output head (again after the loader makes
        the parameters real, which unties)."""
        embed = self.model.embed_tokens
        # A table kept on its quantized blocks is already shared (QuantEmbedding).
        if self.config.tie_word_embeddings and isinstance(embed, nn.Embedding):
            self.lm_head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if self.fused_decode is not None and self.fused_decode.applies(metadata):
            return self.fused_decode(input_ids, positions, kv_caches, metadata)
        hidden = self.model.embed(input_ids)
        rope = self.model.rotary.tables(positions, hidden.dtype)
        ops, residual = self.model.ops, None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata, backend, ops)
        return ops.add_rms_norm(hidden, residual, self.model.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.group.size == 1:
            return logits
        # Vocab-parallel: every rank gets every column, the padding rows' columns dropped.
        return self.group.all_gather(logits)[:, : self.config.vocab_size]

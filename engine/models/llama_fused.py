"""The fused decode step: a whole decode-only step of a Llama-family model in one C++ call.

Used on CPUs for float32 models whose linears are packed in column blocks (`BlockedLinear`) or
kept on a GGUF file's quantized blocks (`QuantLinear`), and whose attention runs on the CPU
kernel (a tensor-parallel rank too, where its group exchanges through shared memory): then a
step in which every scheduled request decodes one token skips the per-layer Python and torch
dispatch (csrc/fused_decode.h says what it fuses). Anything else — prefills, chunks, mixed
steps, other devices — goes through the modules, which stay the reference the fused step is
tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.attention.cpu import CpuBackend
from engine.layers.linear import BlockedEmbedding, BlockedLinear
from engine.layers.quantized import QuantEmbedding, QuantLinear
from engine.parallel.group import ShmGroup

if TYPE_CHECKING:  # engine.models.llama imports this module
    from engine.models.llama import LlamaForCausalLM


class FusedDecodeStep:
    def __init__(self, model: LlamaForCausalLM, kernel: Any) -> None:
        config = model.config
        self.model = model
        self.decoder = kernel.Decoder(
            [_layer_tensors(layer) for layer in model.model.layers],
            model.model.norm.weight.detach(),
            model.layout.num_heads,
            model.layout.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            [_quant_weights(layer) for layer in model.model.layers],
        )
        self.scale = config.head_dim**-0.5
        group = model.group
        if isinstance(group, ShmGroup):  # a tensor-parallel rank: its heads, its MLP share
            self.decoder.join(*group.fused_join_args())

    @classmethod
    def build(cls, model: LlamaForCausalLM, backend: AttentionBackend) -> FusedDecodeStep | None:
        """The fused step for `model`, or None where it does not apply."""
        if not isinstance(backend, CpuBackend):
            return None
        if model.group.size > 1 and not isinstance(model.group, ShmGroup):
            return None  # the C++ step sums the ranks' halves through shared memory only
        table = model.model.embed_tokens  # an nn.Embedding, the tied head's blocks, quantized
        if not isinstance(table, QuantEmbedding):
            rows = table.packed if isinstance(table, BlockedEmbedding) else table.weight
            if rows.dtype != torch.float32:
                return None
        for layer in model.model.layers:
            if not all(isinstance(linear, _FUSED_LINEARS) for linear in _linears(layer)):
                return None
        return cls(model, backend.kernel)

    def applies(self, metadata: AttentionMetadata) -> bool:
        """Every scheduled token is a decode (one query token per request)."""
        return metadata.num_tokens > 0 and metadata.num_decodes == metadata.num_tokens

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The final-normed hidden states of this step's tokens, as the modules give them."""
        inner = self.model.model
        hidden = inner.embed(input_ids)
        rope = inner.rotary.tables(positions, hidden.dtype)
        rows = hidden.shape[0]
        with record_function("pdserve::fused_decode_step"):  # named in profiler traces
            out = self.decoder.forward(
                hidden,
                rope.cos.reshape(rows, -1).contiguous(),
                rope.sin.reshape(rows, -1).contiguous(),
                kv_caches,
                metadata.slot_block,
                metadata.slot_offset,
                metadata.decode_block_table,
                metadata.decode_seq_lens,
                metadata.sliding_window or 0,
                self.scale,
            )
        if self.model.group.size > 1:
            self.model.group.seconds += self.decoder.take_collective_seconds()
        return out


_FUSED_LINEARS = (BlockedLinear, QuantLinear)


def _linears(layer: Any) -> tuple[Any, Any, Any, Any]:
    """A decoder layer's qkv, o, gate_up and down projections."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer_tensors(layer: Any) -> list[torch.Tensor | None]:
    """In the order csrc/fused_decode.h's Slot enum lists them; absent ones are None (and a
    quantized linear's float matrix: its weight goes in `_quant_weights`)."""
    attn = layer.self_attn
    qkv, o, gate_up, down = _linears(layer)
    q_norm = attn.q_norm.weight.detach() if attn.qk_norm else None
    k_norm = attn.k_norm.weight.detach() if attn.qk_norm else None
    return [
        layer.input_layernorm.weight.detach(),
        _packed(qkv),
        _bias(qkv),
        q_norm,
        k_norm,
        _packed(o),
        _bias(o),
        layer.post_attention_layernorm.weight.detach(),
        _packed(gate_up),
        _bias(gate_up),
        _packed(down),
        _bias(down),
    ]


def _quant_weights(layer: Any) -> list[Any]:
    """In the order of csrc/fused_decode.h's Linear enum: each quantized linear's QuantWeight,
    None for the blocked ones."""
    linears = _linears(layer)
    return [lin.weight_q if isinstance(lin, QuantLinear) else None for lin in linears]


def _packed(linear: Any) -> torch.Tensor | None:
    return linear.packed if isinstance(linear, BlockedLinear) else None


def _bias(linear: Any) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()

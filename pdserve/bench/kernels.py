"""Kernel launches of a GPU decode step, counted by the profiler: what CUDA graphs replay, and
what fused kernels remove (`pdserve bench latency --device cuda` reports it)."""

from __future__ import annotations

from typing import Any

import torch


def _kernels_launched(llm: Any, prompt: list[int], max_tokens: int) -> int:
    """GPU kernels one greedy request of `max_tokens` launches, decode steps eager."""
    from torch.profiler import ProfilerActivity, profile

    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": prompt}], params)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for name in names if not name.startswith(("Memcpy", "Memset")))


def decode_step_kernels(llm: Any, prompt: list[int], steps: int = 8) -> dict[str, float]:
    """Kernels per decode step (a request of steps + 1 tokens less one of 1 token, over
    `steps`), and per layer. Counted eagerly: a captured graph holds the same kernels."""
    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        _kernels_launched(llm, prompt, 2)  # warm-up: compilation, workspaces
        per_step = (
            _kernels_launched(llm, prompt, steps + 1) - _kernels_launched(llm, prompt, 1)
        ) / steps
    finally:
        runner.graphs = graphs
    layers = llm.engine.arch.num_hidden_layers
    return {"per_decode_step": round(per_step, 1), "per_layer": round(per_step / layers, 2)}

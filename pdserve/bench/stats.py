"""Summaries the benchmarks share: mean and nearest-rank percentiles."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def decode_seconds(outputs: Sequence[Any]) -> float:
    """The decode part of one generate call: from the first token any of its requests sampled
    to the last one's end, by the engine's own timestamps (RequestOutput.timing). A prefill
    run timed apart and taken off a full one came out at or below zero on a noisy machine."""
    timings = [o.timing for o in outputs]
    return max(t.finished for t in timings) - min(t.first_token for t in timings)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 when there are none)."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(
    values: Sequence[float], quantiles: Sequence[float] = (0.5, 0.99), digits: int = 2
) -> dict[str, float]:
    """{"mean", "p50", ...} of `values`, rounded to `digits`."""
    ordered = sorted(values)
    summary = {"mean": round(statistics.fmean(ordered), digits) if ordered else 0.0}
    for q in quantiles:
        summary[f"p{q * 100:g}"] = round(percentile(ordered, q), digits)  # p50, p99.9
    return summary

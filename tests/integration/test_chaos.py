"""pdserve bench chaos, short: a bounded run on real local Ray Serve kills one replica of each
role while clients stream, cancel and send malformed requests. Nothing may be lost, no
completed stream may differ from offline generation, no client may read Ray's internals, and
afterwards no engine may hold a block."""

from __future__ import annotations

import pytest

from pdserve.bench.chaos import ChaosConfig, run

pytestmark = pytest.mark.integration


def test_a_short_chaos_run_loses_nothing_and_leaks_nothing() -> None:
    report = run(ChaosConfig(duration_s=45, kill_every_s=12, concurrency=4, max_tokens=32, seed=3))
    print(report)
    assert report["kills"] == {"prefill": 1, "decode": 1, "router": 1}
    assert report["lost"] == 0 and report["timed_out"] == 0
    assert report["completed_mismatch"] == 0
    assert report["failed_unclear"] == 0, report["unclear_examples"]
    assert report["malformed_accepted"] == 0
    assert report["completed_exact"] > 20 and report["malformed_refused"] >= 1
    assert report["idle_after_s"] is not None
    assert report["blocks_held_after"] == 0 and report["requests_held_after"] == 0

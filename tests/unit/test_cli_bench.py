"""`pdserve bench sched` through the real console entry point."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_sched_prints_its_json():
    result = run_cli(
        "bench", "sched", "--num-requests", "40", "--num-blocks", "4096", "--max-num-seqs", "16"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["benchmark"] == "sched"
    assert report["workload"]["num_requests"] == 40
    assert report["steps"] > 0
    for key in ("mean", "p50", "p99"):
        assert report["step_us"][key] > 0
    assert report["steady_decode_steps"] > 0
    assert 0.0 < report["prefix_hit_rate"] < 1.0
    assert report["free_blocks_at_end"] == 4095  # every block came back


def test_bench_sched_bad_argument_is_one_line_and_exit_2():
    result = run_cli("bench", "sched", "--num-requests", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "pdserve: error: num_requests must be >= 1, got 0"
    assert "Traceback" not in result.stderr


def test_bench_sched_kv_cache_too_small_is_refused():
    result = run_cli("bench", "sched", "--num-requests", "4", "--num-blocks", "10")
    assert result.returncode == 2
    assert "cannot hold one sequence" in result.stderr

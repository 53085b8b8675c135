"""Stdout belongs to the caller: an offline engine moving KV over NIXL prints nothing there,
and NIXL's own log records follow the application's logging configuration.

NIXL's Python wrapper logs "NIXL INFO ... Initialized NIXL agent" to stdout unless the connector
routes it through Python logging; a program that prints JSON would break. The engines run in a
child process whose stdout is captured at the file-descriptor level, so C++ output counts too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, logging, sys
    from engine.llm import LLM

    logging.basicConfig(level=logging.WARNING)  # an application that logs warnings only
    from engine.request import SamplingParams

    kv = {"connector": "nixl", "secret": "stdout-test"}
    args = dict(max_model_len=64, kv_cache_memory_bytes=4 << 20, kv_transfer_config=kv)
    prefill, decode = LLM("tiny", **args), LLM("tiny", **args)
    prompt = list(range(1, 40))
    first = prefill.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0), {"do_remote_decode": True}
    )[0]
    out = decode.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0), first.kv_transfer_params
    )[0]
    prefill.drain(10.0)
    report = {"tokens": out.outputs[0].token_ids, "stats": decode.engine.kv_transfer_stats()}
    print(json.dumps(report), file=sys.stderr)
    prefill.close()
    decode.close()
    """
)


def test_offline_engines_with_a_nixl_connector_write_nothing_to_stdout() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""
    # NIXL's records follow the application's level: its INFO lines do not show on stderr.
    assert "Initialized NIXL agent" not in done.stderr
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert len(report["tokens"]) == 4
    # The KV really moved over NIXL (so the agents were created and used).
    assert report["stats"]["blocks_read"] > 0
    assert report["stats"]["reads_failed"] == 0

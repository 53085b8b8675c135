"""A decode engine switching to the prefill role mid-stream, in this process: its decode leg
outstays the switch's drain and moves (the router's migration takes it up from the tokens so
far, on another engine). The answer is offline greedy's, the switch's report counts the
move, and no block stays held."""

from __future__ import annotations

import asyncio

from deployments.protocol import GenerateInput
from deployments.replica.engine_server import DecodeServer
from engine.request import SamplingParams
from tests.model.flow_utils import idle, tokens
from tests.model.orchestrator.shared import ENGINE_ARGS, KV, PROMPT, make_flow


def test_a_decode_leg_that_outstays_a_switch_s_drain_moves_and_ends_token_exact(servers, offline):
    prefill, other = servers
    decode = DecodeServer("tiny", ENGINE_ARGS, KV, role_switching={"drain_timeout_s": 0.05})
    params = SamplingParams(max_tokens=100, temperature=0.0)
    calls: list[str] = []

    def decode_leg(request):
        """The first call reaches the switching engine; a moved request another one."""
        calls.append(request.request_id)
        return (decode if len(calls) == 1 else other).generate(request)

    try:
        flow = make_flow((prefill, decode), decode=decode_leg)

        async def go():
            chunks, switch = [], None
            request = GenerateInput(PROMPT, params)
            async for chunk in flow.generate(request):
                chunks.append(chunk)
                if switch is None and len(tokens(chunks)) >= 3:
                    switch = asyncio.ensure_future(decode.switch_role(None, "prefill"))
            await flow.wait_background()
            return chunks, await switch

        chunks, report = asyncio.run(go())
        expected = offline.generate([PROMPT], params)[0]
        assert tokens(chunks) == expected.outputs[0].token_ids
        assert chunks[-1].migrations == 1 and len(calls) == 2  # moved to the other engine
        assert report["role"] == "prefill" and report["previous_role"] == "decode"
        assert report["epoch"] == 1 and report["moved"] == 1 and report["drained"] == 0
        stats = decode.stats()
        assert stats["role"] == "prefill" and stats["moved_requests"] == 1
        assert idle(decode) and idle(prefill) and idle(other)
    finally:
        decode.__del__()

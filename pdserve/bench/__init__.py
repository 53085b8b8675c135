"""`pdserve bench ...`: each module is one benchmark command and prints one JSON object.

sched (scheduler cost, fake runner), offline (engine vs transformers), latency (decode against
the bandwidth bound), spec (speculative decoding), structured (JSON-schema constraints), kv (KV
transfer between two processes, over the harness in connector/testing.py), handoff (TTFT of a
prefill -> decode hand-off and its checksums' share), serve (a running endpoint), chaos (a
local app under load while its replicas are killed).
"""

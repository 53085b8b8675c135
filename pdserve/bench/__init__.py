"""`pdserve bench ...`: each module is one benchmark command and prints one JSON object.

sched (scheduler cost, fake runner), offline (engine vs transformers), kv (KV transfer between
two processes, over the harness in connector/testing.py), serve (a running endpoint).
"""

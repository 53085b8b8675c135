"""The Ray Serve application, in the shape of its processes.

- `router/`: the router replica (the app's ingress): the OpenAI HTTP and gRPC front ends, the
  orchestrator and its legs, the response stream, migration, the Router's lease calls.
- `replica/`: an engine replica: the engine server, its core pinning, its KV event publisher.
- `cluster/`: what sees every replica: the KV index and its scoring, Serve's request routers
  and the replica sets they publish, cluster health, SLA autoscaling.
- Here, shared by all of them: the wire types (`protocol.py`), the errors clients see
  (`errors.py`), credentials, tracing set-up, the Serve context, and the app's assembly
  (`app.py`: `build_app`; `launch.py`: `pdserve serve`'s local launch).

router/ and replica/ never import each other; cluster/ imports neither (tests/unit/
test_layout.py).
"""

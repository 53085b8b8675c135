"""The router replica: the app's ingress. Tokenizes once, routes both legs, detokenizes once;
the OpenAI-compatible HTTP API and the gRPC API in front of it. Never holds an engine."""

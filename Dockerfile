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

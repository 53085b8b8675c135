# The image KubeRay runs (k8s/base/rayservice.yaml): Ray 2.60 with CUDA, plus pdserve and its stack.
# Builds with the classic builder as well as BuildKit: no BuildKit-only syntax (no RUN --mount,
# COPY --link/--chmod, heredocs or `# syntax=` line); tests/unit/test_manifests.py checks it.
#
# torch==2.13.0 from PyPI is built against CUDA 13: GPU nodes need NVIDIA driver >= 580.
FROM rayproject/ray:2.60.0-py311-gpu
# The classic builder creates a WORKDIR as root, and `pip install -e .` writes its metadata
# into it as the image's user (ray): make the directory the user's first.
USER root
RUN mkdir -p /app && chown ray:users /app
USER ray
WORKDIR /app
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine ./engine
COPY --chown=ray:users connector ./connector
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users protos ./protos
COPY --chown=ray:users pdserve ./pdserve
# torch pinned first (the same pin as pyproject.toml), then pdserve (NIXL, gRPC, OpenTelemetry).
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir -e .
ENV PYTHONPATH=/app
# The small default model (SmolLM2-135M-Instruct, 94 MB GGUF) baked in, for a first try with
# `model: smollm2`; real models come through `pdserve download` (the manifest's init container).
ENV PDSERVE_CACHE_DIR=/app/.cache/pdserve
RUN python -c "from engine.models.catalog import resolve_model; print(resolve_model('smollm2'))"

# syntax=docker/dockerfile:1
# Reflex serving images: docs/serverless.md. Two targets on one builder:
#   runtime (the default): engine + reflex-openai sidecar; Runpod load-balancing endpoints, Kubernetes
#   runpod-queue:          the same plus the Runpod queue worker (serverless/runpod) and its SDK
# No CUDA toolkit or runtime library is in either: the engine loads only libcuda, which the NVIDIA
# container runtime mounts from the host (NVIDIA_DRIVER_CAPABILITIES=compute).
#
#   docker build -t reflex --build-arg MODEL=org/repo:file.gguf --secret id=hf_token,env=HF_TOKEN .
#   docker build -t reflex-queue --target runpod-queue --build-arg MODEL=... .
# Without docker: serverless/image/build.sh (buildah, a Debian base made by debootstrap).

# The runtime base: any Debian-like image with python3 (>= 3.10). The builder uses the same one,
# so that the wheels' Python ABI is the runtime's.
ARG BASE=python:3.11-slim-bookworm
ARG BUILDER_BASE=${BASE}

# -- builder: the wheels, the kernels compiled into reflex-engine's, and the runtime's venv --------
FROM ${BUILDER_BASE} AS builder
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# gcc for _native.c (the host path's C helper); a distribution python also needs its headers and
# venv. The CUDA compiler is the package's own build requirement (NVRTC 12.9 from PyPI, whose
# cubins load on R525+ drivers); a BUILDER_BASE with the CUDA toolkit can use nvcc instead
# (REFLEX_CUDA_COMPILER=nvcc, CUDA_HOME).
# hadolint ignore=DL3008,SC2086
RUN apt-get update \
    && packages="gcc libc6-dev" \
    && if ! python3 -c 'import ensurepip' 2>/dev/null; then packages="$packages python3-venv"; fi \
    && if ! python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))'; then packages="$packages python3-dev"; fi \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/*
# pip trusts the system's CA bundle (a build behind an intercepting proxy adds its CA to the base)
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/build && /opt/build/bin/pip install -q "pip>=24"
WORKDIR /src
COPY pyproject.toml setup.py build_kernels.py MANIFEST.in README.md ./
COPY src ./src
COPY sidecar/pyproject.toml sidecar/README.md ./sidecar/
COPY sidecar/src ./sidecar/src
ARG REFLEX_CUDA_COMPILER=auto
ARG REFLEX_CUDA_ARCH=
# REFLEX_CUDA=1: no CUDA compiler is a build failure, never a CPU-only image
RUN REFLEX_CUDA=1 /opt/build/bin/pip wheel -q -w /wheels . ./sidecar \
    && python3 -m venv --without-pip /opt/reflex \
    && /opt/build/bin/pip --python /opt/reflex/bin/python install -q --no-index --find-links /wheels \
        reflex-engine reflex-openai \
    && test -f /opt/reflex/lib/python3*/site-packages/reflex_engine/cuda_image/manifest.json
# numpy's test suites and type stubs are never read by a server (~19 MB of the image)
RUN find /opt/reflex/lib -depth -path '*/numpy/*' -type d -name tests -exec rm -rf {} + \
    && find /opt/reflex/lib -path '*/numpy/*' -name '*.pyi' -delete

# -- model: MODEL baked in at MODEL_PATH, prepared (`reflex prepare`) -------------------------------
FROM builder AS model
# MODEL: org/repo[@revision]:file.gguf (the HF token as the build secret hf_token, never in a
# layer), or a .gguf path inside the build context; empty: no model (mount one, set REFLEX_MODEL).
ARG MODEL=
ARG MODEL_PATH=/models/model.gguf
# SYSTEM_PROMPT: a text file in the build context whose KV is baked (`prepare --system-prompt`);
# SYSTEM_PROMPT_CHAT=1 bakes it as a chat system message (`--chat`).
ARG SYSTEM_PROMPT=
ARG SYSTEM_PROMPT_CHAT=0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN --mount=type=secret,id=hf_token --mount=type=bind,target=/ctx \
    mkdir -p "$(dirname "$MODEL_PATH")" \
    && if [ -z "$MODEL" ]; then exit 0; fi \
    && if [ -f "/ctx/$MODEL" ]; then cp "/ctx/$MODEL" "$MODEL_PATH"; \
       else /opt/build/bin/pip install -q --find-links /wheels reflex-engine "huggingface_hub>=1.33" \
         && if [ -s /run/secrets/hf_token ]; then HF_TOKEN="$(cat /run/secrets/hf_token)"; export HF_TOKEN; fi \
         && cp "$(HF_HOME=/tmp/hf /opt/build/bin/reflex pull "$MODEL")" "$MODEL_PATH" && rm -rf /tmp/hf; fi \
    && set -- \
    && if [ -n "$SYSTEM_PROMPT" ]; then set -- --system-prompt "/ctx/$SYSTEM_PROMPT" --device cpu; fi \
    && if [ -n "$SYSTEM_PROMPT" ] && [ "$SYSTEM_PROMPT_CHAT" = 1 ]; then set -- "$@" --chat; fi \
    && /opt/reflex/bin/reflex prepare "$MODEL_PATH" "$@"

# -- the Runpod queue worker's venv: the runtime's plus the SDK ------------------------------------
FROM builder AS builder-queue
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY serverless/runpod/pyproject.toml serverless/runpod/README.md ./serverless/runpod/
COPY serverless/runpod/src ./serverless/runpod/src
RUN /opt/build/bin/pip wheel -q -w /wheels ./serverless/runpod \
    && /opt/build/bin/pip --python /opt/reflex/bin/python install -q --no-index --find-links /wheels reflex-runpod

# -- runpod-queue ----------------------------------------------------------------------------------
FROM ${BASE} AS runpod-queue
ARG MODEL_PATH=/models/model.gguf
COPY --from=builder-queue /opt/reflex /opt/reflex
COPY --from=model /models /models
ENV PATH=/opt/reflex/bin:$PATH REFLEX_MODEL=${MODEL_PATH} REFLEX_DEVICE=cuda \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility PYTHONUNBUFFERED=1
CMD ["reflex-runpod"]

# -- runtime (the default target) ------------------------------------------------------------------
FROM ${BASE} AS runtime
ARG MODEL_PATH=/models/model.gguf
COPY --from=builder /opt/reflex /opt/reflex
COPY --from=model /models /models
# The sidecar on 0.0.0.0:$PORT; a Runpod load balancer sets PORT and PORT_HEALTH (/ping there)
ENV PATH=/opt/reflex/bin:$PATH REFLEX_MODEL=${MODEL_PATH} REFLEX_DEVICE=cuda REFLEX_HOST=0.0.0.0 PORT=8000 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility PYTHONUNBUFFERED=1
EXPOSE 8000
CMD ["reflex-openai"]

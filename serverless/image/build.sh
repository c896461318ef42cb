#!/usr/bin/env bash
# Builds the Dockerfile's images with buildah (no Docker daemon), runs the CPU demo inside the
# runtime image, and prints its size. For machines that cannot pull base images: the base is made
# by debian-base.sh (debootstrap), unless BASE names an image buildah already has.
#
#   serverless/image/build.sh                 # runtime, no model: build, measure, run the demo
#   TARGET=runpod-queue serverless/image/build.sh
#   MODEL=build/model.gguf serverless/image/build.sh   # a .gguf in the context (or org/repo:file.gguf)
#
# Environment: BASE, TARGET (runtime), TAG (localhost/reflex-TARGET), MODEL, SYSTEM_PROMPT[_CHAT],
# REFLEX_CUDA_ARCH (all targets unless set), EXTRA_CA (see debian-base.sh), HF_TOKEN_FILE.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
STORAGE=(--storage-driver "${STORAGE_DRIVER:-vfs}")
TARGET=${TARGET:-runtime}
TAG=${TAG:-localhost/reflex-$TARGET}
BASE=${BASE:-localhost/reflex-debian-base:bookworm}

if ! buildah "${STORAGE[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
    "$here/debian-base.sh" "$BASE"
fi
secret=()
if [ -n "${HF_TOKEN_FILE:-}" ]; then secret=(--secret "id=hf_token,src=$HF_TOKEN_FILE"); fi
start=$(date +%s)
buildah "${STORAGE[@]}" bud --isolation chroot --layers --format docker --target "$TARGET" -t "$TAG" \
    --build-arg "BASE=$BASE" --build-arg "MODEL=${MODEL:-}" --build-arg "SYSTEM_PROMPT=${SYSTEM_PROMPT:-}" --build-arg "SYSTEM_PROMPT_CHAT=${SYSTEM_PROMPT_CHAT:-0}" \
    --build-arg "REFLEX_CUDA_ARCH=${REFLEX_CUDA_ARCH:-}" "${secret[@]}" -f "$repo/Dockerfile" "$repo"
echo "built $TAG in $(( $(date +%s) - start )) s"
buildah "${STORAGE[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$TAG"

#!/usr/bin/env bash
# A Python base image from a Debian rootfs, for machines that cannot pull images from a registry:
# debootstrap --variant=minbase with python3 and ca-certificates, trimmed, committed by buildah.
# Pass its tag as the Dockerfile's BASE build argument (serverless/image/build.sh does).
#
#   serverless/image/debian-base.sh [TAG]        (default localhost/reflex-debian-base:bookworm)
#
# Environment: SUITE (bookworm), MIRROR (http://deb.debian.org/debian), ROOTFS (reuse a rootfs
# debootstrap already made), EXTRA_CA (a PEM bundle appended to the image's CA bundle: a machine
# whose HTTPS egress is intercepted needs it for pip in the builder stage).
set -euo pipefail
TAG=${1:-localhost/reflex-debian-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
STORAGE=(--storage-driver "${STORAGE_DRIVER:-vfs}")

rootfs=${ROOTFS:-}
if [ -z "$rootfs" ]; then
    rootfs=$(mktemp -d /tmp/reflex-rootfs.XXXXXX)
    debootstrap --variant=minbase --include=python3,ca-certificates "$SUITE" "$rootfs" "$MIRROR"
fi
if [ -n "${EXTRA_CA:-}" ]; then
    cat "$EXTRA_CA" >> "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
# What a container never reads: downloaded packages, package lists (a builder runs apt-get update),
# documentation, translations.
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*
: > "$rootfs/etc/resolv.conf"

ctr=$(buildah "${STORAGE[@]}" from scratch)
trap 'buildah "${STORAGE[@]}" rm "$ctr" >/dev/null' EXIT
buildah "${STORAGE[@]}" copy "$ctr" "$rootfs" / >/dev/null
buildah "${STORAGE[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
buildah "${STORAGE[@]}" commit --quiet "$ctr" "$TAG" >/dev/null
echo "$TAG"

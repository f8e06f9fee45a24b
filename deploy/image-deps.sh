#!/usr/bin/env bash
# image-deps.sh — the Debian packages of the image and monitoring targets: `make image` and
# `make image-test` (mmdebstrap, podman, buildah, runc), `make check-rules` and
# `make monitoring-test` (prometheus, whose package has promtool; python3-yaml). Never called by
# `make deps`: a machine that only builds and tests kvmesh does not get a container runtime.
# Idempotent: installs only what is missing. Usage: deploy/image-deps.sh [image|monitoring|all]
set -euo pipefail

what=${1:-all}
case $what in
image) PKGS=(mmdebstrap podman buildah runc uidmap catatonit) ;;
monitoring) PKGS=(prometheus python3-yaml) ;;
all) PKGS=(mmdebstrap podman buildah runc uidmap catatonit prometheus python3-yaml) ;;
*) echo "image-deps: unknown set '$what' (image, monitoring, all)" >&2; exit 2 ;;
esac

say() { echo "image-deps: $*"; }
die() { echo "image-deps: error: $*" >&2; exit 1; }
cd "$(dirname "$0")/.."
# shellcheck source=apt.sh
. deploy/apt.sh
km_apt_install "${PKGS[@]}"

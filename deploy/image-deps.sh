#!/usr/bin/env bash
# image-deps.sh — the Debian packages that `make image`, `make image-test`, `make k8s-test` and
# `make check-rules` need (mmdebstrap, podman, buildah, runc, promtool). Never called by
# `make deps`: a machine that only builds and tests kvmesh does not get a container runtime.
# Idempotent: installs only what is missing. Usage: deploy/image-deps.sh [image|monitoring|all]
set -euo pipefail

what=${1:-all}
case $what in
image) PKGS=(mmdebstrap podman buildah runc uidmap) ;;
monitoring) PKGS=(prometheus) ;;
all) PKGS=(mmdebstrap podman buildah runc uidmap prometheus) ;;
*) echo "image-deps: unknown set '$what' (image, monitoring, all)" >&2; exit 2 ;;
esac

say() { echo "image-deps: $*"; }
die() { echo "image-deps: error: $*" >&2; exit 1; }
cd "$(dirname "$0")/.."
# shellcheck source=apt.sh
. deploy/apt.sh
km_apt_install "${PKGS[@]}"

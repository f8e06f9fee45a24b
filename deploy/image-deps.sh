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

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
    say "Debian packages present: ${PKGS[*]}"
    exit 0
fi
say "installing Debian packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "not root and no sudo: install ${missing[*]} by hand"
    SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || die "apt-get update failed: check the network or /etc/apt/sources.list"
# prometheus's recommends pull in a web UI and exporters the tests do not need.
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install failed for: ${missing[*]}"

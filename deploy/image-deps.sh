#!/usr/bin/env bash
# image-deps.sh — the Debian packages of the image and monitoring targets: `make image` and
# `make image-test` (mmdebstrap, podman, buildah, runc; python3-kubernetes for k8s-test's schema
# check), `make check-rules` and `make monitoring-test` (prometheus, whose package has promtool;
# python3-yaml). Never called by
# `make deps`: a machine that only builds and tests kvmesh does not get a container runtime.
# Idempotent: installs only what is missing. Usage: deploy/image-deps.sh [image|monitoring|all]
set -euo pipefail

what=${1:-all}
case $what in
image) PKGS=(mmdebstrap podman buildah runc uidmap catatonit python3-kubernetes) ;;
monitoring) PKGS=(prometheus python3-yaml) ;;
all) PKGS=(mmdebstrap podman buildah runc uidmap catatonit python3-kubernetes prometheus python3-yaml) ;;
*) echo "image-deps: unknown set '$what' (image, monitoring, all)" >&2; exit 2 ;;
esac

say() { echo "image-deps: $*"; }
die() { echo "image-deps: error: $*" >&2; exit 1; }
cd "$(dirname "$0")/.."
# shellcheck source=apt.sh
. deploy/apt.sh
had_prom=$(dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -c "install ok installed" || true)
km_apt_install "${PKGS[@]}"
# Debian's prometheus package starts its own service on *:9090 under systemd; the tests run
# theirs on 127.0.0.1. Stop the one this script brought (an existing install is left alone).
if [ "$had_prom" = 0 ] && [[ " ${PKGS[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    say "stopping and disabling the prometheus service the package started (the tests run their own)"
    $([ "$(id -u)" -eq 0 ] || echo sudo) systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

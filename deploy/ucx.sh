#!/usr/bin/env bash
# ucx.sh — the UCX that peer/ builds against: 1.22.0 from PyPI's libucx-cu12 wheel (pinned by
# version and sha256), unpacked into third_party/ucx (git-ignored). Debian 12's UCX 1.13.1 crashes
# in its TCP connection manager (docs/transfer.md, "Which UCX"); the Makefile links peer/ against
# third_party/ucx when it is there (rpath) and against the system's UCX otherwise.
#
# Kept: the headers, libucp/uct/ucs/ucm, the CMA transport module, ucx_perftest and ucx_info (with
# the wheel's libgomp, which ucx_perftest needs). Left out: the CUDA modules (they need libcuda.so.1
# and only move GPU memory, which peer/ does not) and the static libraries. The wheel is built
# without verbs and rdmacm: a deployment with RDMA NICs builds against its own UCX (UCX_HOME=...).
# Idempotent; exits non-zero (the caller decides whether that is fatal) when the wheel cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."

UCX_VERSION=1.22.0
UCX_PKG=libucx-cu12
UCX_WHEEL=libucx_cu12-1.22.0-py3-none-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
UCX_SHA256=5cbbef0c140a0a158ae3486089af659b38822b2234cd3dc90ba40a5e6553402a
DEST=third_party/ucx

say() { echo "deps: ucx: $*"; }
fail() { echo "deps: ucx: $*" >&2; exit 1; }

if [ -f "$DEST/VERSION" ] && [ "$(cat "$DEST/VERSION")" = "$UCX_VERSION $UCX_SHA256" ] &&
    [ -e "$DEST/lib/libucp.so" ] && [ -e "$DEST/include/ucp/api/ucp.h" ]; then
    say "UCX $UCX_VERSION present: $DEST"
    exit 0
fi
[ "$(uname -m)" = x86_64 ] || fail "the pinned wheel is x86_64 only (this is $(uname -m))"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say "fetching $UCX_PKG==$UCX_VERSION from PyPI"
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$UCX_PKG==$UCX_VERSION" ||
    fail "pip download $UCX_PKG==$UCX_VERSION failed: is PyPI reachable?"
[ -f "$tmp/$UCX_WHEEL" ] || fail "pip gave $(ls "$tmp"), not $UCX_WHEEL"
echo "$UCX_SHA256  $tmp/$UCX_WHEEL" | sha256sum -c --status ||
    fail "sha256 of $UCX_WHEEL does not match $UCX_SHA256: the package changed; refusing it"
unzip -q "$tmp/$UCX_WHEEL" 'libucx/include/*' 'libucx/lib/lib*.so*' 'libucx/lib/ucx/libuct_cma.so*' \
    'libucx/bin/ucx_perftest' 'libucx/bin/ucx_info' 'libucx_cu12.libs/libgomp-*' -d "$tmp/x" ||
    fail "$UCX_WHEEL lacks the expected files"

new="$DEST.new.$$"
rm -rf "$new"
mkdir -p "$new"
mv "$tmp/x/libucx/include" "$tmp/x/libucx/lib" "$tmp/x/libucx/bin" "$new/"
mv "$tmp/x/libucx_cu12.libs"/libgomp-* "$new/lib/"
# A wheel holds no symbolic links: each library came three times (.so, .so.0, .so.0.0.0).
for so in "$new"/lib/lib*.so.0 "$new"/lib/ucx/lib*.so.0; do
    ln -sf "$(basename "$so")" "${so%.0}"
    ln -sf "$(basename "$so")" "$so.0.0"
done
echo "$UCX_VERSION $UCX_SHA256" >"$new/VERSION"
# The libraries must load and report the pinned version before they replace anything.
got=$(LD_LIBRARY_PATH="$new/lib" "$new/bin/ucx_info" -v 2>&1 | sed -n 's/^# Library version: //p')
[ "$got" = "$UCX_VERSION" ] || { rm -rf "$new"; fail "unpacked UCX reports '$got', not $UCX_VERSION"; }
rm -rf "$DEST"
mv "$new" "$DEST"
say "UCX $UCX_VERSION ready: $DEST ($(du -sh "$DEST" | cut -f1))"

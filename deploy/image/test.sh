#!/usr/bin/env bash
# test.sh — `make image-test`: the saved image loads, runs as a non-root user with no compiler,
# every binary starts, and a one-worker `kvmesh up` (controller, worker, router) inside one
# container answers a real completion through the router's HTTP port, published on 127.0.0.1
# only. Exits 0 with "skipped" when podman or the image cannot be used here (and says why).
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "image-test: $*"; }
die() { echo "image-test: FAIL: $*" >&2; exit 1; }
t_start=$SECONDS

# shellcheck source=podman-env.sh
. deploy/image/podman-env.sh
if ! km_podman_setup "$PWD/build/image" 2>/tmp/km-podman-why.$$; then
    say "skipped: $(cat /tmp/km-podman-why.$$)"; rm -f /tmp/km-podman-why.$$; exit 0
fi
rm -f /tmp/km-podman-why.$$
[ -s build/kvmesh-image.tar ] && [ -s build/kvmesh-image.rev ] || die "build/kvmesh-image.tar missing: run make image"
REV=$(cat build/kvmesh-image.rev)
IMG=localhost/kvmesh:$REV

# 1. the archive loads (the tag is removed first, so it is the archive that brings it back)
podman rmi --force "$IMG" >/dev/null 2>&1 || true
podman load --quiet -i build/kvmesh-image.tar >/dev/null || die "podman load -i build/kvmesh-image.tar"
podman image exists "$IMG" || die "$IMG not in the loaded archive"
say "loaded $IMG from build/kvmesh-image.tar"

# 2. user, no compiler, every binary answers --help
run() { podman run --rm --network none --entrypoint /bin/sh "$IMG" -c "$1"; }
uid=$(run 'id -u')
[ "$uid" = 10001 ] || die "runs as uid $uid, not the kvmesh user (10001)"
found=$(run 'for c in gcc cc c99 clang ld as make; do command -v $c; done' || true)
[ -z "$found" ] || die "build tools in the image: $found"
for b in kvmesh kvmesh-worker kvmesh-router kvmesh-controller; do
    run "/usr/local/bin/$b --help >/dev/null" || die "$b --help failed in the image"
done
say "uid 10001, no compiler, the four binaries start"

# 3. a cluster in a container; its router's HTTP port on 127.0.0.1 only
MODELS=$(readlink -f models)
NAME=kvmesh-image-test-$$
cleanup() { podman rm --force --volumes --time 2 "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
podman run -d --name "$NAME" -p 127.0.0.1::8080 -v "$MODELS:/opt/kvmesh/models:ro" "$IMG" \
    up --workers 1 --routers 1 --kv-bytes 64M --run-dir /var/lib/kvmesh/run \
    --router-args "--http-host=0.0.0.0" >/dev/null || die "podman run $IMG up"
HOSTPORT=$(podman port "$NAME" 8080/tcp | head -1)
case $HOSTPORT in 127.0.0.1:*) ;; *) die "HTTP port published on '$HOSTPORT', not 127.0.0.1" ;; esac
URL=http://$HOSTPORT
deadline=$((SECONDS + 240))
until [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/readyz")" = 200 ]; do
    podman container exists "$NAME" && [ "$(podman inspect -f '{{.State.Running}}' "$NAME")" = true ] ||
        { podman logs "$NAME" 2>&1 | tail -20; die "the container stopped"; }
    [ $SECONDS -lt $deadline ] || { podman logs "$NAME" 2>&1 | tail -20; die "router not ready in 240 s"; }
    sleep 1
done
say "router ready at $URL after $((SECONDS - t_start)) s"
KEY=$(podman exec "$NAME" cat /var/lib/kvmesh/run/keys/private/api_key.client) || die "no API key in the run dir"
out=$(curl -s -m 120 -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
    -d '{"model":"default","prompt":"The capital of France is","max_tokens":8,"temperature":0}' \
    "$URL/v1/completions") || die "POST /v1/completions"
text=$(printf '%s' "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["choices"][0]["text"]); assert d["usage"]["completion_tokens"] > 0') ||
    die "bad completion: $out"
say "completion through $URL: $(printf '%q' "$text")"
code=$(curl -s -o /dev/null -w '%{http_code}' -d '{}' "$URL/v1/completions")
[ "$code" = 401 ] || die "a completion without an API key got $code, not 401"
say "passed in $((SECONDS - t_start)) s"

#!/usr/bin/env bash
# test.sh — `make systemd-test`: deploy/systemd's units run under a real systemd, PID 1 of a
# podman container (--systemd=always) on an image of the packages `make image` put in its root
# file system plus systemd. It installs the binaries, the units and env files as
# docs/operations.md ("Running under systemd") says, makes the keys, starts a controller, two
# workers (page transfer on) and a router in one `systemctl enable --now`, and checks: the
# workers and the router start after the controller; a completion over HTTP and one over the
# ZeroMQ front; each daemon runs as kvmesh with its secret key from LoadCredential= (and kvmesh
# cannot read /etc/kvmesh/keys/private/); `kvmesh recover --level 3` drains a worker, which
# hands its chains to its peer, exits 75 and is restarted by systemd; a SIGKILLed worker is
# restarted; then it prints `systemd-analyze security`'s exposure score of each unit.
# Skipped, with the reason, where podman cannot run a container or systemd cannot be PID 1 in
# one. KVMESH_SYSTEMD_KEEP=1 leaves the container running for a look.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "systemd-test: $*"; }
die() {
    echo "systemd-test: FAIL: $*" >&2
    [ -z "${NAME:-}" ] || podman exec "$NAME" journalctl --no-pager -n 40 -o cat 2>/dev/null | sed 's/^/  journal: /' >&2 || true
    exit 1
}
t_start=$SECONDS

# shellcheck source=../image/podman-env.sh
. deploy/image/podman-env.sh
if ! km_podman_setup "$PWD/build/image" >/dev/null 2>"build/image/podman-why.$$"; then
    say "skipped: $(cat "build/image/podman-why.$$")"; rm -f "build/image/podman-why.$$"; exit 0
fi
rm -f "build/image/podman-why.$$"
command -v mmdebstrap >/dev/null || { say "skipped: mmdebstrap not found (bash deploy/image-deps.sh image)"; exit 0; }
[ -s build/kvmesh-image.rev ] || die "no image: run make image"
IMG=localhost/kvmesh:$(cat build/kvmesh-image.rev)
podman image exists "$IMG" || podman load --quiet -i build/kvmesh-image.tar >/dev/null || die "podman load build/kvmesh-image.tar"

# -- the image: the packages of `make image`'s root file system, plus systemd (cached by list)
PKGS=$(podman run --rm --network none --entrypoint /usr/bin/dpkg-query "$IMG" -W -f '${Package}\n' | sort | paste -sd, -)
[ -n "$PKGS" ] || die "cannot list the packages of $IMG"
PKGS=$PKGS,systemd,systemd-sysv
SOURCES=""
for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    [ -s "$f" ] && { SOURCES=$f; break; }
done
HASH=$(printf '%s\n' "$PKGS" "$(cat "$SOURCES" 2>/dev/null)" systemd-v1 | sha256sum | cut -c1-12)
SDIMG=localhost/kvmesh-systemd:$HASH
if ! podman image exists "$SDIMG"; then
    tar=build/image/systemd-$HASH.tar
    if [ ! -s "$tar" ]; then
        say "mmdebstrap bookworm: the image's $(echo "$PKGS" | tr , '\n' | wc -l) packages with systemd, systemd-sysv"
        t0=$SECONDS
        mmdebstrap --quiet --format=tar --variant=essential --include="$PKGS" \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook='echo "kvmesh:x:10001:10001:kvmesh:/var/lib/kvmesh:/usr/sbin/nologin" >>"$1/etc/passwd"' \
            --customize-hook='echo "kvmesh:x:10001:" >>"$1/etc/group"' \
            --customize-hook='mkdir -p "$1/var/lib/kvmesh" && chown 10001:10001 "$1/var/lib/kvmesh" && chmod 0700 "$1/var/lib/kvmesh"' \
            bookworm "$tar.tmp" ${SOURCES:+"$SOURCES"} || die "mmdebstrap failed (is the Debian mirror reachable?)"
        mv "$tar.tmp" "$tar"
        say "root file system in $((SECONDS - t0)) s"
    fi
    podman import --quiet --change 'CMD ["/sbin/init"]' --change 'STOPSIGNAL SIGRTMIN+3' "$tar" "$SDIMG" >/dev/null ||
        die "podman import $tar"
fi

# -- systemd as PID 1. CAP_SYS_ADMIN: the units' ProtectSystem=, PrivateTmp= and credentials
# are mount namespaces systemd sets up.
NAME=kvmesh-systemd-test-$$
cleanup() {
    if [ -n "${KVMESH_SYSTEMD_KEEP:-}" ]; then say "kept: container $NAME"; return; fi
    podman rm --force --time 5 "$NAME" >/dev/null 2>&1 || true
    rm -rf "${STAGE:-/nonexistent}"
}
trap cleanup EXIT
MODELS=$(readlink -f models)
podman run -d --name "$NAME" --systemd=always --cap-add SYS_ADMIN \
    -v "$MODELS:/var/lib/kvmesh/models:ro" "$SDIMG" >/dev/null 2>"build/image/systemd-run.$$" || {
    why=$(cat "build/image/systemd-run.$$"); rm -f "build/image/systemd-run.$$"
    say "skipped: podman run --systemd=always cannot start systemd here: $why"; exit 0
}
rm -f "build/image/systemd-run.$$"
ins() { podman exec "$NAME" "$@"; }
booted() { st=$(ins systemctl is-system-running 2>/dev/null || true); [ "$st" = running ] || [ "$st" = degraded ]; }
deadline=$((SECONDS + 60))
until booted; do
    if [ $SECONDS -ge $deadline ] || [ "$(podman inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then
        say "skipped: systemd did not come up as PID 1 in the container (state '${st:-}'):"
        podman logs "$NAME" 2>&1 | tail -5 | sed 's/^/  /'
        exit 0
    fi
    sleep 0.5
done
say "systemd $(ins systemctl --version | awk 'NR == 1 { print $2 }') is PID 1 of $NAME ($st) after $((SECONDS - t_start)) s"
# systemd makes / a shared mount at boot, but not in a container: it leaves that to the
# container manager (systemd-nspawn does it, podman does not). LoadCredential= needs it: the
# credentials are mounted from a helper's own mount namespace and reach the service's through
# the propagation of /run. Shared inside the container's namespace only; nothing reaches the host.
ins mount --make-rshared / || die "mount --make-rshared / in $NAME"
IP=$(podman inspect -f '{{.NetworkSettings.IPAddress}}' "$NAME")
[ -n "$IP" ] || die "no address for $NAME"

# -- install as the docs say: binaries, the pinned UCX, units, env files (the examples with this
# host's endpoints appended: a later line wins), keys
STAGE=$(mktemp -d /tmp/kvmesh-systemd-XXXXXX)
mkdir -p "$STAGE/usr/local/bin" "$STAGE/usr/local/lib/kvmesh" "$STAGE/etc/systemd/system" "$STAGE/etc/kvmesh"
install -m 755 build/bin/kvmesh build/bin/kvmesh-* "$STAGE/usr/local/bin/"
if ldd build/bin/kvmesh-worker | grep "$(readlink -f third_party)/ucx/lib\|$PWD/third_party/ucx/lib" >/dev/null; then
    cp -a "$(readlink -f third_party/ucx/lib)" "$STAGE/usr/local/lib/kvmesh/ucx"
fi
cp deploy/systemd/*.service "$STAGE/etc/systemd/system/"
{ cat deploy/systemd/controller.env.example; echo "KVMESH_HEARTBEAT=1s"; } >"$STAGE/etc/kvmesh/controller.env"
{
    cat deploy/systemd/router.env.example
    echo "KVMESH_CONTROLLER=tcp://127.0.0.1:7201"
} >"$STAGE/etc/kvmesh/router.env"
for i in 0 1; do
    {
        cat deploy/systemd/worker.env.example
        echo "KVMESH_LISTEN=tcp://127.0.0.1:71${i}0"
        echo "KVMESH_EVENTS=tcp://127.0.0.1:71${i}1"
        echo "KVMESH_ADMIN_PORT=91${i}0"
        echo "KVMESH_CONTROLLER=tcp://127.0.0.1:7200"
        echo "KVMESH_THREADS=1"
        echo "KVMESH_KV_BYTES=64M"
        echo "KVMESH_KV_DISK_BYTES=256M"
        echo "KVMESH_PEER_LISTEN=127.0.0.1:0"
        echo "KVMESH_PEER_VIEW=tcp://127.0.0.1:7201"
    } >"$STAGE/etc/kvmesh/worker-$i.env"
done
chmod -R go-w "$STAGE"
tar -C "$STAGE" --owner=0 --group=0 -c usr etc | podman exec -i "$NAME" tar -C / --no-overwrite-dir -x ||
    die "copying the binaries and units into $NAME"
# `kvmesh keys init` makes keys/ 0700 (root's); the daemons, as kvmesh, read members/,
# operators/ and clients/ in place: the group kvmesh may enter keys/ (not private/, 0700, nor
# cluster.secret, 0600)
ins sh -c 'kvmesh keys init /etc/kvmesh/keys --workers worker-0,worker-1 >/dev/null &&
    chgrp kvmesh /etc/kvmesh/keys && chmod 0750 /etc/kvmesh/keys &&
    kvmesh keys api-add /etc/kvmesh/api_keys acme 2>/dev/null >/etc/kvmesh/acme.key &&
    chown kvmesh:kvmesh /etc/kvmesh/api_keys && chmod 0600 /etc/kvmesh/api_keys' || die "kvmesh keys init"
APIKEY=$(ins cat /etc/kvmesh/acme.key)
UNITS=(kvmesh-controller.service kvmesh-worker@0.service kvmesh-worker@1.service kvmesh-router.service)
ins systemctl daemon-reload
ins systemctl enable --now "${UNITS[@]}" >/dev/null 2>&1 || die "systemctl enable --now ${UNITS[*]}"
say "installed and started: ${UNITS[*]}"

# -- order: After=kvmesh-controller.service in one transaction
prop() { ins systemctl show -p "$2" --value "$1"; }
c0=$(prop kvmesh-controller.service ExecMainStartTimestampMonotonic)
for u in "${UNITS[@]:1}"; do
    t=$(prop "$u" ExecMainStartTimestampMonotonic)
    [ "$t" -gt "$c0" ] || die "$u started at ${t} us, not after kvmesh-controller (${c0} us)"
done
say "order: the workers and the router started $(( ($(prop kvmesh-worker@0.service ExecMainStartTimestampMonotonic) - c0) / 1000 )) ms and" \
    "$(( ($(prop kvmesh-router.service ExecMainStartTimestampMonotonic) - c0) / 1000 )) ms after the controller"

wait_for() { # DESCRIPTION SECONDS COMMAND...
    local what=$1 secs=$2 deadline=$((SECONDS + $2))
    shift 2
    until "$@"; do
        [ $SECONDS -lt $deadline ] || die "$what: not within $secs s"
        sleep 0.5
    done
}
ready() { [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$IP:$1/readyz")" = 200 ]; }
unit_ready() { # UNIT PORT: ready, or the unit failed (then the test fails at once)
    [ "$(prop "$1" ActiveState)" != failed ] || die "$1 failed: $(ins systemctl status --no-pager -n 5 "$1" 2>&1 | tail -5)"
    ready "$2"
}
wait_for "kvmesh-worker@0 ready" 180 unit_ready kvmesh-worker@0.service 9100
wait_for "kvmesh-worker@1 ready" 180 unit_ready kvmesh-worker@1.service 9110
wait_for "kvmesh-router ready" 60 unit_ready kvmesh-router.service 8080
say "all ready after $((SECONDS - t_start)) s"

# -- completions: HTTP from the host, ZeroMQ through the front from inside
complete() {
    curl -s -m 120 -H "Authorization: Bearer $APIKEY" -H 'Content-Type: application/json' \
        -d "{\"model\":\"default\",\"prompt\":\"$1\",\"max_tokens\":${2:-8},\"temperature\":0}" "http://$IP:8080/v1/completions"
}
out=$(complete "The capital of France is")
text=$(printf '%s' "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["usage"]["completion_tokens"] > 0; print(d["choices"][0]["text"])') ||
    die "HTTP completion: $out"
say "HTTP completion: $(printf '%q' "$text")"
zout=$(ins timeout 120 kvmesh generate -r tcp://127.0.0.1:7000 --cert /etc/kvmesh/keys/private/client.key \
    --server-key /etc/kvmesh/keys/members/router.key --max-tokens 8 -p "The capital of Italy is" 2>&1) ||
    die "ZeroMQ generate: $zout"
say "ZeroMQ completion through the front: $(printf '%q' "$zout")"

# -- credentials: each daemon runs as kvmesh and reads its secret key from the credentials
# directory systemd filled; kvmesh itself cannot read the keys' source
for u in "${UNITS[@]}"; do
    pid=$(prop "$u" MainPID)
    uid=$(ins sed -n 's/^Uid:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$pid/status")
    [ "$uid" = 10001 ] || die "$u runs as uid $uid, not kvmesh (10001)"
    cert=$(ins sh -c "tr '\\0' '\\n' </proc/$pid/environ | sed -n 's/^KVMESH_CERT=//p'")
    [ "$cert" = "/run/credentials/$u/cert.key_secret" ] || die "$u: KVMESH_CERT=$cert, not its credentials directory"
    ins test -s "$cert" || die "$u: $cert is empty or missing"
    case $u in kvmesh-worker@*)
        cs=$(ins sh -c "tr '\\0' '\\n' </proc/$pid/environ | sed -n 's/^KVMESH_CLUSTER_SECRET=//p'")
        [ "$cs" = "/run/credentials/$u/cluster.secret" ] || die "$u: KVMESH_CLUSTER_SECRET=$cs, not its credentials directory"
        ins test -s "$cs" || die "$u: $cs is empty or missing" ;;
    esac
done
if ins setpriv --reuid=kvmesh --regid=kvmesh --clear-groups cat /etc/kvmesh/keys/cluster.secret >/dev/null 2>&1; then
    die "the kvmesh user can read /etc/kvmesh/keys/cluster.secret"
fi
if ins setpriv --reuid=kvmesh --regid=kvmesh --clear-groups cat /etc/kvmesh/keys/private/worker-0.key_secret >/dev/null 2>&1; then
    die "the kvmesh user can read /etc/kvmesh/keys/private/worker-0.key_secret"
fi
say "credentials: each daemon is uid 10001 with KVMESH_CERT=/run/credentials/UNIT/cert.key_secret (LoadCredential=), workers also KVMESH_CLUSTER_SECRET (disk pages sealed); kvmesh cannot read /etc/kvmesh/keys/private/ nor cluster.secret"

# -- recovery level 3: the worker holding the pages drains (handoff to its peer), exits 75,
# and systemd restarts it (RestartForceExitStatus=75)
metric() { # PORT NAME{labels}: the sum of the samples whose line starts so (0 while unreachable)
    { curl -s -m 5 "http://$IP:$1/metrics" || true; } |
        awk -v m="$2" 'index($0, m) == 1 { s += $NF } END { print s + 0 }'
}
P="You are a careful assistant. Answer briefly and plainly; do not use lists. Topic number"
for i in 1 2 3 4; do complete "$P $i: tell me about rivers and the sea." 4 >/dev/null; done
hot_pages() {
    w0=$(metric 9100 'kvmesh_worker_kv_pages{tier="hot"')
    w1=$(metric 9110 'kvmesh_worker_kv_pages{tier="hot"')
    [ "${w0%.*}" != 0 ] || [ "${w1%.*}" != 0 ]
}
wait_for "KV pages on a worker" 10 hot_pages
if [ "${w0%.*}" -ge "${w1%.*}" ]; then D=0 O=1; else D=1 O=0; fi
pid0=$(prop "kvmesh-worker@$D.service" MainPID)
rout=$(ins kvmesh recover --controller tcp://127.0.0.1:7200 --cert /etc/kvmesh/keys/private/admin.key \
    --server-key /etc/kvmesh/keys/members/controller.key --worker "worker-$D" --level 3 2>&1) ||
    die "kvmesh recover --level 3: $rout"
say "kvmesh recover --worker worker-$D --level 3 (hot pages: worker-0 $w0, worker-1 $w1): $(printf '%s' "$rout" | head -1)"
restarted() { [ "$(prop "kvmesh-worker@$1.service" NRestarts)" -ge 1 ] && [ "$(prop "kvmesh-worker@$1.service" ActiveState)" = active ]; }
wait_for "kvmesh-worker@$D restarted by systemd" 120 restarted "$D"
# SuccessExitStatus=75: systemd logs "Deactivated successfully", the worker its exit status
ins journalctl -u "kvmesh-worker@$D.service" -o cat --no-pager | grep '"event":"worker_exit","status":75' >/dev/null ||
    die "kvmesh-worker@$D's journal does not show its exit with status 75"
taken() { [ "$(metric "91${O}0" 'kvmesh_kv_handoff_chains_total{outcome="taken"')" != 0 ]; }
wait_for "kvmesh-worker@$O takes worker-$D's chains" 60 taken
wait_for "kvmesh-worker@$D ready again" 120 ready "91${D}0"
[ "$(prop "kvmesh-worker@$D.service" MainPID)" != "$pid0" ] || die "kvmesh-worker@$D has its old pid"
say "level 3: worker-$D exited 75 (journal), systemd restarted it (NRestarts=$(prop "kvmesh-worker@$D.service" NRestarts)), worker-$O took $(metric "91${O}0" 'kvmesh_kv_handoff_chains_total{outcome="taken"') chains"

# -- SIGKILL: Restart=on-failure brings the worker back
pid1=$(prop "kvmesh-worker@$O.service" MainPID)
n1=$(prop "kvmesh-worker@$O.service" NRestarts)
ins sh -c "kill -KILL $pid1"
killed_back() { [ "$(prop "kvmesh-worker@$O.service" NRestarts)" -gt "$n1" ] && [ "$(prop "kvmesh-worker@$O.service" ActiveState)" = active ]; }
wait_for "kvmesh-worker@$O restarted after SIGKILL" 60 killed_back
ins journalctl -u "kvmesh-worker@$O.service" -o cat --no-pager | grep 'code=killed, status=9/KILL' >/dev/null ||
    die "kvmesh-worker@$O's journal does not show the SIGKILL"
wait_for "kvmesh-worker@$O ready again" 120 ready "91${O}0"
out=$(complete "The capital of Spain is")
printf '%s' "$out" | grep -q '"completion_tokens"' || die "completion after the restarts: $out"
say "SIGKILL: worker-$O (pid $pid1) was restarted as pid $(prop "kvmesh-worker@$O.service" MainPID); a completion after both restarts"

# -- the hardening options, scored by systemd-analyze security: exposure from 0 (locked down)
# to 10 (nothing restricted)
for u in kvmesh-controller.service kvmesh-worker@0.service kvmesh-router.service; do
    line=$(ins systemd-analyze security --no-pager "$u" 2>&1 | grep 'Overall exposure level' || true)
    [ -n "$line" ] || die "systemd-analyze security $u gave no score"
    say "systemd-analyze security: ${line#→ }"
done
say "passed in $((SECONDS - t_start)) s (teardown follows)"

#!/usr/bin/env bash
# test.sh — `make k8s-test`: the kustomization, rendered by kubectl, run with `podman kube play`
# (deploy/k8s/play.py does what the controllers and kubelet would) on a podman network of its
# own: one controller, one router, two workers with page transfer, from the image `make image`
# built. It sends a completion through the router's HTTP port and one through its ZeroMQ front,
# drains a worker (SIGTERM to its container: it hands its chains to its peer and exits 75, and
# restartPolicy Always brings it back), scales the workers from 2 to 3 and sees the new one warm
# up from its peers, then tears everything down. Not exercised here (no cluster): Services and
# their DNS, the NetworkPolicy, PodDisruptionBudget, HorizontalPodAutoscaler and probes (play.py
# checks what they name; schema.py, where python3-kubernetes is, every object's fields).
# Skipped, with the reason, where podman, kubectl or PyYAML is missing. KVMESH_K8S_KEEP=1 leaves
# the pods, network and files for a look.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "k8s-test: $*"; }
die() { echo "k8s-test: FAIL: $*" >&2; exit 1; }
t_start=$SECONDS

for t in kubectl podman; do
    command -v $t >/dev/null || { say "skipped: $t not found"; exit 0; }
done
python3 -c 'import yaml' 2>/dev/null || { say "skipped: python3-yaml missing"; exit 0; }
# shellcheck source=../image/podman-env.sh
. deploy/image/podman-env.sh
km_podman_setup "$PWD/build/image" >/dev/null || { say "skipped: podman cannot run here"; exit 0; }
[ -s build/kvmesh-image.rev ] || die "no image: run make image"
REV=$(cat build/kvmesh-image.rev)
podman image exists "localhost/kvmesh:$REV-model" ||
    podman load --quiet -i build/kvmesh-image-model.tar >/dev/null || die "podman load build/kvmesh-image-model.tar"

TMP=$(mktemp -d /tmp/kvmesh-k8s-XXXXXX)
NET=kvmesh-k8s-$$
# a /24 of 10.89.0.0/16 that no route uses yet
for n in $(seq 37 99); do ip route | grep "^10\.89\.$n\." >/dev/null || { SUBNET=10.89.$n; break; }; done
PODS=()
podman volume ls -q >"$TMP/volumes-before"
cleanup() {
    local p
    [ -z "${KVMESH_K8S_KEEP:-}" ] || { say "kept: $TMP, network $NET, pods ${PODS[*]}"; return; }
    for p in "${PODS[@]}"; do podman kube down "$TMP/pods/$p.yaml" >/dev/null 2>&1 || true; done
    # the image's VOLUMEs became anonymous volumes (init containers' too), which kube down
    # leaves: remove those made since the start that nothing uses (no --force)
    local v
    for v in $(podman volume ls -q); do
        grep -qx "$v" "$TMP/volumes-before" || podman volume rm "$v" >/dev/null 2>&1 || true
    done
    podman network rm --force "$NET" >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap cleanup EXIT
wait_for() { # DESCRIPTION SECONDS COMMAND...: polls COMMAND until it succeeds or the deadline
    local what=$1 secs=$2 deadline=$((SECONDS + $2))
    shift 2
    until "$@"; do
        [ $SECONDS -lt $deadline ] || die "$what: not within $secs s"
        sleep 0.5
    done
}

# -- the Secrets kustomization.yaml says to make, as the kubelet would mount them (root's files)
K=$TMP/keys
build/bin/kvmesh keys init "$K" --workers kvmesh-worker-0,kvmesh-worker-1,kvmesh-worker-2 >/dev/null
APIKEY=$(build/bin/kvmesh keys api-add "$TMP/api_keys" acme 2>/dev/null) || die "kvmesh keys api-add"
S=$TMP/secrets
secret() { # NAME MODE FILES...
    local name=$1 mode=$2
    shift 2
    mkdir -p "$S/$name"
    cp "$@" "$S/$name/"
    chmod "$mode" "$S/$name"/*
}
secret kvmesh-members 0444 "$K"/members/*
secret kvmesh-operators 0444 "$K"/operators/*
secret kvmesh-clients 0444 "$K"/clients/*
secret kvmesh-controller-cert 0400 "$K/private/controller.key_secret"
secret kvmesh-router-cert 0400 "$K/private/router.key_secret"
secret kvmesh-worker-certs 0400 "$K"/private/kvmesh-worker-*.key_secret "$K/cluster.secret"
secret kvmesh-api-keys 0400 "$TMP/api_keys"

# -- an overlay: this image, one router, small workers
mkdir -p "$TMP/overlay"
cat >"$TMP/overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $(python3 -c 'import os,sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$PWD/deploy/k8s" "$TMP/overlay")
images:
  - name: localhost/kvmesh
    newTag: $REV-model
replicas:
  - name: kvmesh-router
    count: 1
patches:
  - patch: |
      apiVersion: apps/v1
      kind: StatefulSet
      metadata:
        name: kvmesh-worker
      spec:
        template:
          spec:
            containers:
              - name: worker
                env:
                  - name: KVMESH_THREADS
                    value: "1"
                  - name: KVMESH_KV_BYTES
                    value: 64M
EOF
kubectl kustomize "$TMP/overlay" >"$TMP/rendered.yaml" || die "kubectl kustomize"
grep -q "image: localhost/kvmesh:$REV-model" "$TMP/rendered.yaml" || die "the rendered manifests do not use localhost/kvmesh:$REV-model"
say "rendered deploy/k8s with image localhost/kvmesh:$REV-model"
# the API's schemas, offline, from the Kubernetes Python client (pyenv's python3 may lack it)
SCHEMA_PY=""
for py in python3 /usr/bin/python3; do "$py" -c 'import kubernetes' 2>/dev/null && { SCHEMA_PY=$py; break; }; done
if [ -n "$SCHEMA_PY" ]; then
    "$SCHEMA_PY" deploy/k8s/schema.py "$TMP/rendered.yaml" >"$TMP/schema.out" 2>&1 ||
        { cat "$TMP/schema.out" >&2; die "the rendered manifests fail deploy/k8s/schema.py"; }
    say "schema check: $(grep -c ': valid ' "$TMP/schema.out") objects valid (python3-kubernetes $("$SCHEMA_PY" -c 'import kubernetes; print(kubernetes.__version__)'))"
    grep -v ': valid [A-Za-z0-9]*$' "$TMP/schema.out" | sed 's/^schema.py: /k8s-test: schema check: /' || true
else
    say "schema check skipped: python3-kubernetes missing (bash deploy/image-deps.sh image installs it)"
fi

podman network create --subnet "$SUBNET.0/24" "$NET" >/dev/null || die "podman network create"
CTRL_IP=$SUBNET.10 ROUTER_IP=$SUBNET.11
ipargs=(--ip kvmesh-controller=$CTRL_IP --ip kvmesh-router=$ROUTER_IP)
for i in 0 1 2; do ipargs+=(--ip kvmesh-worker-$i=$SUBNET.2$i); done
play() { # N: renders for N workers and plays each pod not yet running
    local name ip
    python3 deploy/k8s/play.py "$TMP/rendered.yaml" "$TMP/pods" "${ipargs[@]}" --secrets "$S" \
        --volumes "$TMP/volumes" --workers "$1" >"$TMP/play.out" 2>"$TMP/play.err" ||
        { cat "$TMP/play.err" >&2; die "deploy/k8s/play.py"; }
    while read -r name ip; do
        [[ " ${PODS[*]} " == *" $name "* ]] && continue
        PODS+=("$name")
        podman kube play --quiet --network "$NET" --ip "$ip" "$TMP/pods/$name.yaml" >/dev/null \
            2>"$TMP/play-$name.log" || { cat "$TMP/play-$name.log" >&2; die "podman kube play $name"; }
    done <"$TMP/play.out"
}
play 2
# the NetworkPolicy, PodDisruptionBudget and HorizontalPodAutoscaler: checked, not played
sed 's/^play.py: /k8s-test: /' "$TMP/play.err"
say "pods: ${PODS[*]} on $NET ($SUBNET.0/24)"

ROUTER=http://$ROUTER_IP:8080
router_ready() { [ "$(curl -s -o /dev/null -w '%{http_code}' "$ROUTER/readyz")" = 200 ]; }
wait_for "the router is ready (podman logs kvmesh-router-router)" 180 router_ready
say "router ready after $((SECONDS - t_start)) s"

# -- a completion over HTTP, one over the ZeroMQ front
complete() {
    curl -s -m 120 -H "Authorization: Bearer $APIKEY" -H 'Content-Type: application/json' \
        -d "{\"model\":\"default\",\"prompt\":\"$1\",\"max_tokens\":${2:-8},\"temperature\":0}" "$ROUTER/v1/completions"
}
out=$(complete "The capital of France is")
printf '%s' "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["usage"]["completion_tokens"] > 0' ||
    die "HTTP completion: $out"
say "HTTP completion: $(printf '%s' "$out" | python3 -c 'import json,sys; print(repr(json.load(sys.stdin)["choices"][0]["text"]))')"
zout=$(timeout 120 build/bin/kvmesh generate -r "tcp://$ROUTER_IP:7000" --cert "$K/private/client.key" \
    --server-key "$K/members/router.key" --max-tokens 8 -p "The capital of Italy is" 2>&1) || die "ZeroMQ generate: $zout"
say "ZeroMQ completion through the front: $(printf '%q' "$zout")"

# -- drain the worker that holds the pages; its peer takes its chains
metric() { # IP NAME{labels}: the sum of the samples whose line starts so (0 while unreachable)
    { curl -s -m 5 "http://$1:9100/metrics" || true; } |
        awk -v m="$2" 'index($0, m) == 1 { s += $NF } END { print s + 0 }'
}
worker_ready() { [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$1:9100/readyz")" = 200 ]; }
# the router is ready with one worker: both must be before their pages are compared
wait_for "kvmesh-worker-0 ready" 120 worker_ready "$SUBNET.20"
wait_for "kvmesh-worker-1 ready" 120 worker_ready "$SUBNET.21"
P="You are a careful assistant. Answer briefly and plainly; do not use lists. Topic number"
for i in 1 2 3 4; do complete "$P $i: tell me about rivers and the sea." 4 >/dev/null; done
# a worker refreshes its gauges every 250 ms: four short requests can end within one period
hot_pages() {
    w0=$(metric "$SUBNET.20" 'kvmesh_worker_kv_pages{tier="hot"')
    w1=$(metric "$SUBNET.21" 'kvmesh_worker_kv_pages{tier="hot"')
    [ "${w0%.*}" != 0 ] || [ "${w1%.*}" != 0 ]
}
wait_for "KV pages on a worker (their kvmesh_worker_kv_pages)" 10 hot_pages
if [ "${w0%.*}" -ge "${w1%.*}" ]; then D=0 O=1; else D=1 O=0; fi
say "kvmesh-worker-$D holds the pages (hot pages: w0 $w0, w1 $w1); SIGTERM to its container"
podman kill --signal TERM "kvmesh-worker-$D-worker" >/dev/null
taken() { [ "$(metric "$SUBNET.2$O" 'kvmesh_kv_handoff_chains_total{outcome="taken"')" != 0 ]; }
wait_for "kvmesh-worker-$O takes kvmesh-worker-$D's chains" 90 taken
restarted() { [ "$(podman inspect --format '{{.RestartCount}}' "kvmesh-worker-$D-worker" 2>/dev/null)" -ge 1 ]; }
wait_for "kvmesh-worker-$D restarted after its drain" 90 restarted
code=$(podman logs "kvmesh-worker-$D-worker" 2>&1 | sed -n 's/.*"event":"worker_exit","status":\([0-9]*\).*/\1/p' | head -1)
[ "$code" = 75 ] || die "kvmesh-worker-$D exited '$code' after SIGTERM, not 75"
wait_for "kvmesh-worker-$D ready again" 120 worker_ready "$SUBNET.2$D"
# once: a drained worker comes back at its first restart (a port it cannot bind again would
# make it fail and restart until the port is free)
n=$(podman inspect --format '{{.RestartCount}}' "kvmesh-worker-$D-worker")
[ "$n" = 1 ] || die "kvmesh-worker-$D took $n restarts to come back (podman logs kvmesh-worker-$D-worker)"
say "handoff: kvmesh-worker-$O took $(metric "$SUBNET.2$O" 'kvmesh_kv_handoff_chains_total{outcome="taken"') chains;" \
    "kvmesh-worker-$D exited $code and came back at its first restart"

# -- scale 2 -> 3: the new worker warms up from its peers
play 3
wait_for "kvmesh-worker-2 ready" 120 worker_ready "$SUBNET.22"
warm() { [ "$(metric "$SUBNET.22" 'kvmesh_kv_handoff_chains_total{outcome="taken"')" != 0 ]; }
wait_for "kvmesh-worker-2 warms up from its peers" 90 warm
say "scaled to 3: kvmesh-worker-2 took $(metric "$SUBNET.22" 'kvmesh_kv_handoff_chains_total{outcome="taken"') chains," \
    "$(metric "$SUBNET.22" 'kvmesh_kv_transfer_bytes_total{direction="in"') bytes pulled"
out=$(complete "The capital of Spain is")
printf '%s' "$out" | grep -q '"completion_tokens"' || die "completion after scaling: $out"
say "passed in $((SECONDS - t_start)) s (teardown follows)"

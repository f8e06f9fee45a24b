#!/usr/bin/env bash
# scrape_test.sh — `make monitoring-test`: a real Prometheus (Debian's package, on 127.0.0.1 only)
# scrapes a `kvmesh up` cluster (two workers with page transfer, a router, the controller),
# evaluates kvmesh.rules.yml, and answers a query of each rule's expression. The cluster is given
# what the rules look at: completions (some sharing a prefix), a recovery level applied by an
# operator, and a CURVE handshake with a key the cluster does not know (a ZAP denial).
# Skipped, with the reason, where prometheus or PyYAML is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "monitoring-test: $*"; }
die() { echo "monitoring-test: FAIL: $*" >&2; exit 1; }
t_start=$SECONDS
command -v prometheus >/dev/null || { say "skipped: prometheus not found (bash deploy/image-deps.sh monitoring)"; exit 0; }
python3 -c 'import yaml' 2>/dev/null || { say "skipped: python3-yaml missing (bash deploy/image-deps.sh monitoring)"; exit 0; }
[ -x build/bin/kvmesh ] || die "build/bin/kvmesh missing: run make build"

TMP=$(mktemp -d /tmp/kvmesh-monitoring-XXXXXX)
UP_PID="" PROM_PID=""
cleanup() {
    [ -z "$PROM_PID" ] || kill "$PROM_PID" 2>/dev/null || true
    if [ -n "$UP_PID" ]; then
        kill -INT "$UP_PID" 2>/dev/null || true
        wait "$UP_PID" 2>/dev/null || true
    fi
    [ -z "$PROM_PID" ] || wait "$PROM_PID" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT

# wait_for DESCRIPTION SECONDS COMMAND...: polls COMMAND until it succeeds or the deadline passes
wait_for() {
    local what=$1 deadline=$((SECONDS + $2))
    shift 2
    until "$@"; do
        [ $SECONDS -lt $deadline ] || die "$what: not within the deadline"
        sleep 0.5
    done
}

# -- the cluster
build/bin/kvmesh up --workers 2 --base-port 0 --run-dir "$TMP/run" --log-dir "$TMP/logs" \
    --kv-bytes 64M >"$TMP/up.log" 2>&1 &
UP_PID=$!
field() { grep " id=$1 " "$TMP/run/cluster.env" | tr ' ' '\n' | sed -n "s/^$2=//p"; }
all_up() { [ -f "$TMP/run/cluster.env" ] && [ "$(grep -c 'pid=[1-9]' "$TMP/run/cluster.env")" = 4 ]; }
wait_for "cluster.env lists 4 running processes" 60 all_up
HTTP=$(field router http)
router_ready() { [ "$(curl -s -o /dev/null -w '%{http_code}' "$HTTP/readyz")" = 200 ]; }
wait_for "router ready" 120 router_ready
hp() { echo "${1#http://}"; }
K=$TMP/run/keys

# -- Prometheus: every admin port, the router's HTTP port with the admin API key
PROM_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$TMP/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $PWD/deploy/prometheus/kvmesh.rules.yml
scrape_configs:
  - job_name: kvmesh-worker
    static_configs:
      - targets: ["$(hp "$(field w0 admin)")", "$(hp "$(field w1 admin)")"]
  - job_name: kvmesh-controller
    static_configs:
      - targets: ["$(hp "$(field controller admin)")"]
  - job_name: kvmesh-router
    authorization:
      credentials_file: $K/private/api_key.admin
    static_configs:
      - targets: ["$(hp "$HTTP")"]
EOF
prometheus --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn >"$TMP/prometheus.log" 2>&1 &
PROM_PID=$!
PROM=http://127.0.0.1:$PROM_PORT
targets_up() {
    curl -s "$PROM/api/v1/targets?state=active" | python3 -c '
import json, sys
t = json.load(sys.stdin)["data"]["activeTargets"]
sys.exit(0 if len(t) == 4 and all(x["health"] == "up" for x in t) else 1)' 2>/dev/null
}
wait_for "Prometheus scrapes the 4 daemons (log: $TMP/prometheus.log)" 60 targets_up
say "Prometheus at $PROM scrapes 2 workers, the controller and the router"

# -- what the rules look at
KEY=$(cat "$K/private/api_key.client")
complete() {
    curl -s -m 60 -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $KEY" \
        -H 'Content-Type: application/json' -d "{\"model\":\"default\",\"prompt\":\"$1\",\"max_tokens\":6}" \
        "$HTTP/v1/completions"
}
P="You are a helpful assistant. Answer in one short sentence, plainly, without lists or markup."
for i in 1 2 3 4 5 6; do
    [ "$(complete "$P Question $i: what is $i plus $i?")" = 200 ] || die "completion $i"
done
build/bin/kvmesh recover --controller "$(field controller listen)" --cert "$K/private/admin.key" \
    --worker w1 --level 1 >/dev/null || die "kvmesh recover --level 1"
build/bin/kvmesh keys init "$TMP/stranger" >/dev/null
timeout 10 build/bin/kvmesh generate -r "$(field router requests)" --cert "$TMP/stranger/private/client.key" \
    --server-key "$K/members/router.key" --timeout 2 -p hi >/dev/null 2>&1 && die "a stranger's key was admitted"
say "6 completions, recovery level 1 on w1, one stranger's handshake sent"

# -- every rule's expression, asked of Prometheus; series that must have data by now
python3 - "$PROM" deploy/prometheus/kvmesh.rules.yml <<'EOF'
import json, sys, time, urllib.parse, urllib.request
prom, rules = sys.argv[1], sys.argv[2]
import yaml
def query(e):
    u = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": e})
    d = json.load(urllib.request.urlopen(u, timeout=10))
    if d["status"] != "success":
        raise SystemExit(f"monitoring-test: FAIL: query {e!r}: {d}")
    return d["data"]["result"]
# every recorded series but failed pulls (0 here, present) must have data after these events
must = {"kvmesh:kv_hit_ratio:rate5m", "kvmesh_worker:kv_hit_ratio:rate5m", "kvmesh:ttft_seconds:p50_5m",
        "kvmesh:ttft_seconds:p99_5m", "kvmesh_worker:ttft_seconds:p99_5m", "kvmesh:itl_seconds:p50_5m",
        "kvmesh:itl_seconds:p99_5m", "kvmesh_worker:itl_seconds:p99_5m",
        "kvmesh_worker:kv_hot_share:ratio", "kvmesh_worker:kv_pinned_share:ratio",
        "kvmesh:recovery_actions:increase10m", "kvmesh_worker:kv_transfer_failures:rate5m",
        "kvmesh:zap_denials:increase5m"}
deadline = time.monotonic() + 60
groups = yaml.safe_load(open(rules))["groups"]
while True:
    missing = [n for n in sorted(must) if not query(n)]
    if not missing or time.monotonic() > deadline:
        break
    time.sleep(1)
if missing:
    raise SystemExit(f"monitoring-test: FAIL: no data for {missing}")
for g in groups:
    for r in g["rules"]:
        name = r.get("record") or r.get("alert")
        res = query(r["expr"])
        rec = query(name) if "record" in r else None
        vals = ", ".join(f"{ {k: v for k, v in s['metric'].items() if k not in ('__name__', 'job')} } {float(s['value'][1]):.3g}"
                         for s in (rec if rec is not None else res)[:3])
        print(f"monitoring-test: {name}: {len(res)} series" + (f" [{vals}]" if vals else ""))
# the alerts follow their records at the next evaluation
deadline = time.monotonic() + 30
for name in ("KvmeshRecoveryApplied", "KvmeshZapDenials"):
    while not query(f'ALERTS{{alertname="{name}",alertstate="firing"}}'):
        if time.monotonic() > deadline:
            raise SystemExit(f"monitoring-test: FAIL: alert {name} is not firing")
        time.sleep(0.5)
print("monitoring-test: alerts KvmeshRecoveryApplied and KvmeshZapDenials raised")
EOF
say "passed in $((SECONDS - t_start)) s"

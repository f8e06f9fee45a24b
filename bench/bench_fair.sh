#!/usr/bin/env bash
# bench_fair.sh — one API key floods the router while another sends single requests: the
# victim's TTFT p50/p90 on an idle cluster and under the flood, and their ratio (issue 41, 4:
# target <= 2x). A 1-worker `kvmesh up` cluster (insecure ZeroMQ, HTTP API keys: the tenants are
# the two keys), an HTTP load generator in Python (stdlib only):
#  - the flood: FLOOD_CONC connections of key "flood", each sending completions of FLOOD_TOKENS
#    tokens back to back, and on a 429 sending again after 50 ms (it ignores Retry-After, as an
#    abuser would); counts its 200s and 429s;
#  - the victim: VICTIM_N streamed completions of key "victim" one after another, each with a
#    prompt of its own (no cache hit), TTFT = the first content chunk.
# Each run: the victim alone (idle TTFT); the flood starts and 3 s later the victim again (TTFT
# under the flood); then the victim stops and, 2 s later (past the 1 s both the router and the
# worker count a tenant active after its last request), the flood's tokens/s alone over ALONE_S
# seconds (the router's kvmesh_router_tenant_tokens_total: prompt and generated tokens as they
# come), what a tenant alone on the cluster gets; the flood stops and, its last requests done and
# 2 s later, the victim alone again (the idle TTFT after, as other load on the machine moves).
# CONFIGS: runs separated by ';' (each on a fresh cluster), each "ROUTER FLAGS|WORKER FLAGS": by
# default the worker's tenant share off and as shipped (the router's limits as shipped, a smaller
# queue share so the flood meets it), REPEAT times in turn, so the two are compared under the
# same machine load. Prints figures, asserts nothing about time.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin
export KVMESH_MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
FLOOD_CONC=${FLOOD_CONC:-64}
FLOOD_TOKENS=${FLOOD_TOKENS:-32}
VICTIM_N=${VICTIM_N:-20}
VICTIM_TOKENS=${VICTIM_TOKENS:-4}
THREADS=${THREADS:-$(nproc)}
ALONE_S=${ALONE_S:-10}
REPEAT=${REPEAT:-2}
CONFIGS=${CONFIGS:-"--max-queue-per-key=16|--max-running-per-tenant=0;--max-queue-per-key=16|"}
LOGS=build/bench-fair-logs
BENCH_NAME=bench_fair.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh
rm -rf "$LOGS"
mkdir -p "$LOGS"
"$BIN/kvmesh" keys api-add "$LOGS/api_keys" flood | tail -1 >"$LOGS/flood.key"
"$BIN/kvmesh" keys api-add "$LOGS/api_keys" victim | tail -1 >"$LOGS/victim.key"
"$BIN/kvmesh" keys api-add --role operator "$LOGS/api_keys" ops | tail -1 >"$LOGS/ops.key"

trap bench_up_stop EXIT

bench_header "per-key fairness benchmark"
echo "   1 worker, $THREADS threads; flood: $FLOOD_CONC connections x $FLOOD_TOKENS tokens; victim:"
echo "   $VICTIM_N x $VICTIM_TOKENS tokens"
bench_runs "$CONFIGS" "$REPEAT"
RUN=0
for config in "${BENCH_RUNS[@]}"; do
RUN=$((RUN + 1))
rflags=${config%%|*}
wflags=
[[ $config == *"|"* ]] && wflags=${config#*|}
# a 1-worker cluster with those flags too, the tenants its HTTP API keys
bench_up_start "$LOGS/run-$RUN" --workers 1 --threads "$THREADS" \
    --router-args "--api-keys=$LOGS/api_keys $rflags" ${wflags:+--worker-args "$wflags"}
echo
echo "-- run $RUN: router flags: $rflags; worker flags: ${wflags:-(defaults)}; load: $(bench_load)"
python3 - "${BENCH_HTTP##*:}" "$(cat "$LOGS/flood.key")" "$(cat "$LOGS/victim.key")" \
    "$FLOOD_CONC" "$FLOOD_TOKENS" "$VICTIM_N" "$VICTIM_TOKENS" "$ALONE_S" "$(cat "$LOGS/ops.key")" <<'PY'
import http.client, json, sys, threading, time

port, fkey, vkey = int(sys.argv[1]), sys.argv[2], sys.argv[3]
conc, ftok, vn, vtok, alone_s = (int(a) for a in sys.argv[4:9])
okey = sys.argv[9]

def post(key, body, stream):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", json.dumps(body),
              {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return c, c.getresponse()

def victim_ttft(i):
    body = {"model": "default", "max_tokens": vtok, "temperature": 0, "stream": True,
            "prompt": "Question %d of the victim: name a city on the river Seine and say why "
                      "it matters." % (i + 1000 * run[0])}
    t0 = time.monotonic()
    c, r = post(vkey, body, True)
    if r.status != 200:
        raise SystemExit("victim got %d: %s" % (r.status, r.read()[:200]))
    ttft = None
    for line in r:
        if line.startswith(b"data: {") and b'"text":"' in line and ttft is None:
            ttft = time.monotonic() - t0
    c.close()
    return ttft if ttft is not None else time.monotonic() - t0

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

stop = threading.Event()
counts = {"ok": 0, "429": 0, "other": 0}
lock = threading.Lock()

def flooder(k):
    n = 0
    while not stop.is_set():
        n += 1
        body = {"model": "default", "max_tokens": ftok, "temperature": 0,
                "prompt": "Flood %d-%d: write a long story about a dragon." % (k, n)}
        try:
            c, r = post(fkey, body, False)
            r.read()
            c.close()
            key = "ok" if r.status == 200 else "429" if r.status == 429 else "other"
        except OSError:
            key = "other"
        with lock:
            counts[key] += 1
        if key != "ok":
            time.sleep(0.05)

run = [0]
victim_ttft(999)  # warm-up
idle = [victim_ttft(i) for i in range(vn)]
run[0] = 1
ts = [threading.Thread(target=flooder, args=(k,), daemon=True) for k in range(conc)]
for t in ts:
    t.start()
time.sleep(3)  # the flood fills the worker and its queue share first
loaded = [victim_ttft(i) for i in range(vn)]
time.sleep(2)  # the victim no longer counts as active anywhere

def flood_tokens():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/metrics", headers={"Authorization": "Bearer " + okey})
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith('kvmesh_router_tenant_tokens_total{tenant="h:flood"}'):
            return float(line.split()[-1])
    raise SystemExit("no kvmesh_router_tenant_tokens_total for h:flood in /metrics")

t0, tok0 = time.monotonic(), flood_tokens()
time.sleep(alone_s)
alone_tps = (flood_tokens() - tok0) / (time.monotonic() - t0)
stop.set()
for t in ts:  # each flooder ends with its request under way
    t.join(120)
time.sleep(2)
run[0] = 2
after = [victim_ttft(i) for i in range(vn)]  # the idle figure again: the machine's load moves
i50, i90, l50, l90 = pct(idle, .5), pct(idle, .9), pct(loaded, .5), pct(loaded, .9)
a50, a90 = pct(after, .5), pct(after, .9)
print("  victim TTFT idle:  p50 %7.1f ms  p90 %7.1f ms" % (i50 * 1e3, i90 * 1e3))
print("  victim TTFT flood: p50 %7.1f ms  p90 %7.1f ms" % (l50 * 1e3, l90 * 1e3))
print("  under the flood, in order (ms): " + " ".join("%.0f" % (x * 1e3) for x in loaded))
print("  ratio flood/idle:  p50 %5.2fx    p90 %5.2fx   (target <= 2x)" % (l50 / i50, l90 / i90))
print("  victim TTFT idle again after the flood: p50 %7.1f ms  p90 %7.1f ms;"
      " ratio flood/that: p50 %5.2fx  p90 %5.2fx" % (a50 * 1e3, a90 * 1e3, l50 / a50, l90 / a90))
print("  flood alone: %.1f tokens/s (prompt and generated, over %d s)" % (alone_tps, alone_s))
print("  flood answers during the run: %d ok, %d 429, %d other" %
      (counts["ok"], counts["429"], counts["other"]))
PY
bench_up_stop
done

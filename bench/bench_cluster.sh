#!/usr/bin/env bash
# bench_cluster.sh — `make bench-cluster`: what KV page transfer buys a whole cluster (issues 14
# and 31, docs/transfer.md), through `kvmesh up` clusters of WORKERS workers routed kv-aware:
#  1. bench-router's shared-prefix workload (TENANTS tenants, each with a PREFIX_TOKENS-token
#     system prompt, PER_TENANT short questions, CONCURRENCY in flight), page transfer off
#     (--no-peer) and on (the default; the router may then tell a worker to pull a prefix
#     another holds), routed as by default and weighted for load: hit ratio and TTFT p50/p90;
#  2. a level-3 restart (SIGTERM: the drain; `kvmesh up` restarts it) of the worker holding the
#     most pages, under the skewed workload of phase 4 run without a pause: the cluster's hit
#     ratio in the RESTART_WINDOW seconds (60) after it against as many before;
#  3. scale-out: a cluster of WORKERS/2 workers under the skewed workload, then `kvmesh scale
#     --workers WORKERS`: the time from each new worker's readiness to its first prefix hit;
#  4. the skewed workload: tenant t of SKEW_TENANTS gets a share of SKEW_REQUESTS proportional to
#     1/(t+1)^SKEW, each with a ~SKEW_PREFIX_TOKENS-token system text (about 0.8 words a token),
#     short questions, SKEW_CONCURRENCY in flight; default flags against sticky kv-aware routing
#     without transfer and load-weighted routing without transfer: hit ratio, its ceiling (each
#     tenant's text computed once), TTFT p50/p90 and requests per worker.
# Every size is an environment variable. Prints figures with the CPU and the load average;
# asserts nothing about time. Each phase starts fresh clusters (empty caches).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin
BENCH=${BENCH_ROUTER:-build/bench/bench_router}
export KVMESH_MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export UCX_TLS=${UCX_TLS:-tcp}
WORKERS=${WORKERS:-4}
TENANTS=${TENANTS:-16}
PER_TENANT=${PER_TENANT:-8}
PREFIX_TOKENS=${PREFIX_TOKENS:-1000}
CONCURRENCY=${CONCURRENCY:-8}
MAX_TOKENS=${MAX_TOKENS:-8}
THREADS=${THREADS:-1}
PHASES=${PHASES:-"1 2 3 4"}
SKEW=${SKEW:-1.2}
SKEW_TENANTS=${SKEW_TENANTS:-8}
SKEW_REQUESTS=${SKEW_REQUESTS:-192}
SKEW_PREFIX_TOKENS=${SKEW_PREFIX_TOKENS:-875}
SKEW_CONCURRENCY=${SKEW_CONCURRENCY:-8}
RESTART_WINDOW=${RESTART_WINDOW:-60}
# P1_CONFIGS: phase 1's clusters, among "off on balanced-off balanced-on" (all by default)
LOGS=build/bench-cluster-logs
PEER="" # transfer nodes are on by default
NOPEER="--no-peer"
mkdir -p "$LOGS"
BENCH_NAME=bench-cluster
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh

EXTRA=()
stop_up() {
    for p in "${EXTRA[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${EXTRA[@]}"; do wait "$p" 2>/dev/null || true; done
    EXTRA=()
    bench_up_stop
}
trap stop_up EXIT

RQ='' HTTP='' # the router's endpoints in the current cluster (its cluster.env)
status() { [ -n "$HTTP" ] && "$BIN/kvmesh" status --http "$HTTP" --json 2>/dev/null; }
ups() { status | grep -o '"up":true' | wc -l || true; }

# start_up NAME N WORKER_ARGS: a kv-aware cluster of N workers; waits until the router sees every
# one up
start_up() {
    rm -rf "${LOGS:?}/$1"
    RQ='' HTTP=''
    bench_up_start "$LOGS/$1" --workers "$2" --threads "$THREADS" --mode kv --worker-args "$3" \
        --router-args "--max-queue=100000 ${RARGS:-}"
    RQ=$BENCH_RQ HTTP=$BENCH_HTTP
    for _ in $(seq 1 600); do
        [ "$(ups)" -ge "$2" ] && return 0
        sleep 0.2
    done
    bench_die "the router did not see $2 workers up (see $LOGS/$1)"
}

workload() { # LABEL
    "$BENCH" workload --router "$RQ" --tenants "$TENANTS" --per-tenant "$PER_TENANT" \
        --prefix-tokens "$PREFIX_TOKENS" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
        --label "$1" | tee -a "$LOGS/results.txt"
}

# SKEW_EXEC=exec in a background call: the job's pid ($!) is then bench_router's own
skewed() { # LABEL REQUESTS [ARGS...]: the skewed workload of phase 4
    local label=$1 n=$2
    shift 2
    ${SKEW_EXEC:-} "$BENCH" workload --router "$RQ" --tenants "$SKEW_TENANTS" --skew "$SKEW" \
        --requests "$n" --prefix-tokens "$SKEW_PREFIX_TOKENS" \
        --concurrency "$SKEW_CONCURRENCY" --max-tokens "$MAX_TOKENS" --label "$label" "$@"
}

# the router's counter (name and labels exactly), 0 when absent
router_metric() { bench_metric "$HTTP" "$1"; }

# "UP MEMBER_STATE" of worker ID in the router's status
member() {
    status | python3 -c 'import json,sys; w=[x for x in json.load(sys.stdin)["workers"] if x["id"]==sys.argv[1]]; print(w[0]["up"], w[0]["member_state"]) if w else print("-")' "$1" || true
}

# the id of the worker with the most pages in the router's index
fullest() {
    status | python3 -c 'import json,sys; w=json.load(sys.stdin)["workers"]; print(max(w, key=lambda x: sum(x["kv_pages"].values()))["id"])'
}


bench_header "cluster benchmark"
echo "   $MAX_TOKENS tokens a request, $THREADS thread(s) per worker"
: >"$LOGS/results.txt"

pulls() {
    echo "   router pulls: pull $(router_metric 'kvmesh_router_pulls_total{decision="pull"}')," \
        "recompute $(router_metric 'kvmesh_router_pulls_total{decision="recompute"}');" \
        "hints ok $(router_metric 'kvmesh_router_pull_hints_total{outcome="ok"}')," \
        "failed $(router_metric 'kvmesh_router_pull_hints_total{outcome="failed"}')"
}

if [[ " $PHASES " == *" 1 "* ]]; then
    echo
    echo "-- 1. $TENANTS tenants x $PER_TENANT requests, ~$PREFIX_TOKENS-token system prompts, $CONCURRENCY in flight"
    echo "   page transfer off and on, $WORKERS workers: kv-aware routing as by default (prefix"
    echo "   affinity first), then weighted for load (--w-prefill 0.01: tenants spread over the"
    echo "   workers, so a prefix is either computed again or pulled)"
    for t in ${P1_CONFIGS:-off on balanced-off balanced-on}; do
        RARGS=$([[ $t == balanced-* ]] && echo "--w-prefill=0.01" || echo "")
        start_up "p1-$t" "$WORKERS" "$([[ $t == *on ]] && echo "$PEER" || echo "$NOPEER")"
        workload "transfer-$t"
        pulls
        stop_up
    done
    RARGS=
fi

if [[ " $PHASES " == *" 4 "* ]]; then
    echo
    echo "-- 4. skewed: $SKEW_TENANTS tenants, tenant t's share ~ 1/(t+1)^$SKEW, $SKEW_REQUESTS requests," \
        "~$SKEW_PREFIX_TOKENS-token system texts, $SKEW_CONCURRENCY in flight, $WORKERS workers"
    : >"$LOGS/p4.txt"
    # default flags; sticky kv-aware without transfer; weighted for load without transfer
    for t in ${P4_CONFIGS:-default sticky-nopeer balanced-nopeer}; do
        RARGS=$([[ $t == balanced-* ]] && echo "--w-prefill=0.01" || echo "")
        start_up "p4-$t" "$WORKERS" "$([[ $t == *-nopeer ]] && echo "$NOPEER" || echo "$PEER")"
        skewed "$t" "$SKEW_REQUESTS" --workers "$WORKERS" --trace "$LOGS/p4-$t/trace" | tee -a "$LOGS/results.txt" "$LOGS/p4.txt"
        pulls
        stop_up
    done
    RARGS=
    # the targets, from the figures above (hit ratio >= 95% of the ceiling, no worker above
    # 1.25x the mean, TTFT p90 below both other configurations)
    python3 - "$LOGS/p4.txt" <<'PY'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if not f: continue
    r = rows.setdefault(f[0], {})
    m = re.search(r"hit ratio +([\d.]+)%.*p90 +([\d.]+) ms", line)
    if m: r["hit"], r["p90"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"ceiling +([\d.]+)%.*most/mean ([\d.]+)", line)
    if m: r["ceil"], r["most"] = float(m.group(1)), float(m.group(2))
d = rows.get("default", {})
ceil = max((r.get("ceil", 0) for r in rows.values()), default=0)
if d and ceil:
    others = [r["p90"] for k, r in rows.items() if k != "default" and "p90" in r]
    print("   default flags: hit ratio %.1f%% = %.1f%% of the ceiling %.1f%% (target >= 95%%): %s"
          % (d["hit"], 100 * d["hit"] / ceil, ceil, "met" if d["hit"] >= 0.95 * ceil else "missed"))
    print("   busiest worker %.2fx the mean (target <= 1.25): %s"
          % (d["most"], "met" if d["most"] <= 1.25 else "missed"))
    print("   TTFT p90 %.0f ms against %s ms (target: below both): %s"
          % (d["p90"], " and ".join("%.0f" % x for x in others),
             "met" if others and d["p90"] < min(others) else "missed"))
PY
fi

if [[ " $PHASES " == *" 2 "* ]]; then
    echo
    echo "-- 2. a level-3 restart of the fullest worker under the skewed workload, $WORKERS workers,"
    echo "   kvmesh up defaults: hit ratio in the ${RESTART_WINDOW} s before and after the SIGTERM"
    start_up p2 "$WORKERS" "$PEER"
    run="$LOGS/p2/run"
    skewed warm $((SKEW_REQUESTS / 4)) >/dev/null # every tenant's text computed once
    SKEW_EXEC='exec' skewed bg 20000 --trace "$LOGS/p2/trace" >/dev/null 2>"$LOGS/p2/load.err" &
    LOAD=$!
    EXTRA+=("$LOAD")
    sleep "$RESTART_WINDOW" # the window before
    victim=$(fullest)
    pid=$(bench_field "$run" "$victim" pid)
    t0=$(date +%s.%N)
    kill -TERM "$pid"
    back=""
    while [ "$(echo "$(date +%s.%N) - $t0 < $RESTART_WINDOW" | bc)" = 1 ]; do
        if [ -z "$back" ]; then
            npid=$(bench_field "$run" "$victim" pid || true)
            [ "$npid" != "$pid" ] && [ "$(member "$victim")" = "True ready" ] &&
                back=$(echo "$(date +%s.%N) - $t0" | bc | cut -c1-5)
        fi
        sleep 0.2
    done
    kill -TERM "$LOAD" 2>/dev/null || true
    wait "$LOAD" 2>/dev/null || true
    EXTRA=()
    echo "   $victim (pid $pid) SIGTERMed; up and ready again after ${back:-more than $RESTART_WINDOW} s"
    python3 - "$LOGS/p2/trace" "$t0" "$RESTART_WINDOW" <<'PY' | tee -a "$LOGS/results.txt"
import sys
t0, win = float(sys.argv[2]) * 1e3, float(sys.argv[3]) * 1e3
w = {"before": [0, 0, 0], "after": [0, 0, 0]}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 3: continue
    t, p, c = float(f[0]), int(f[1]), int(f[2])
    k = "before" if t0 - win <= t < t0 else "after" if t0 <= t < t0 + win else None
    if k: w[k][0] += 1; w[k][1] += p; w[k][2] += c
for k, (n, p, c) in w.items():
    print("   %-6s %4d requests, prompt tokens %7d, hit ratio %5.1f%%" % (k, n, p, 100.0 * c / p if p else 0))
b, a = (w[k][2] / w[k][1] if w[k][1] else 0 for k in ("before", "after"))
print("   after / before: %.1f%% (target >= 90%%): %s" % (100 * a / b if b else 0, "met" if b and a >= 0.9 * b else "missed"))
PY
    stop_up
fi

if [[ " $PHASES " == *" 3 "* ]]; then
    echo
    half=$((WORKERS / 2))
    echo "-- 3. scale-out from $half to $WORKERS workers under the skewed workload (kvmesh scale):"
    echo "   time from a new worker's readiness to its first prefix hit"
    start_up p3 "$half" "$PEER"
    run="$LOGS/p3/run"
    skewed base $((SKEW_REQUESTS / 4)) >/dev/null
    SKEW_EXEC='exec' skewed bg 20000 >/dev/null 2>&1 &
    EXTRA+=("$!")
    t0=$(date +%s.%N)
    "$BIN/kvmesh" scale --workers "$WORKERS" --run-dir "$run" >"$LOGS/p3/scale.log" 2>&1 &
    EXTRA+=("$!")
    # every new worker watched at once: when its /readyz answers 200, when its first prefix hit
    # shows (kvmesh_worker_prefix_hit_ratio > 0); 120 s at most
    declare -A ready=() hit=()
    while :; do
        for i in $(seq "$half" $((WORKERS - 1))); do
            [ -n "${hit[$i]:-}" ] && continue
            a=$(bench_field "$run" "w$i" admin 2>/dev/null || true)
            [ -z "$a" ] && continue
            now=$(echo "$(date +%s.%N) - $t0" | bc)
            if [ -z "${ready[$i]:-}" ]; then
                [ "$(curl -s -o /dev/null -w '%{http_code}' "$a/readyz" || true)" = 200 ] &&
                    ready[$i]=$now
                continue
            fi
            v=$(curl -s "$a/metrics" |
                awk '$1 == "kvmesh_worker_prefix_hit_ratio" {print ($2 > 0)}' || true)
            [ "${v:-0}" = 1 ] && hit[$i]=$now
        done
        [ "${#hit[@]}" -ge $((WORKERS - half)) ] && break
        [ "$(echo "$(date +%s.%N) - $t0 > 120" | bc)" = 1 ] && break
        sleep 0.1
    done
    for i in $(seq "$half" $((WORKERS - 1))); do
        printf "   w%d: ready %.1f s after kvmesh scale, " "$i" "${ready[$i]:--1}"
        if [ -n "${hit[$i]:-}" ]; then
            d=$(echo "${hit[$i]} - ${ready[$i]}" | bc)
            printf "first prefix hit %.1f s after it was ready (target <= 5 s: %s)\n" "$d" \
                "$([ "$(echo "$d <= 5" | bc)" = 1 ] && echo met || echo missed)"
        else
            printf "no prefix hit within 120 s (target <= 5 s: missed)\n"
        fi
    done
    unset ready hit
    stop_up
fi
echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); logs in $LOGS/"

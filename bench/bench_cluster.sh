#!/usr/bin/env bash
# bench_cluster.sh — `make bench-cluster`: what KV page transfer buys a whole cluster (issue 14,
# docs/transfer.md), on bench-router's shared-prefix workload (TENANTS tenants, each with a
# PREFIX_TOKENS-token system prompt, PER_TENANT short questions, CONCURRENCY in flight) against
# WORKERS workers routed kv-aware:
#  1. page transfer off (--no-peer) and on (the default; the router may then tell a worker to
#     pull a prefix another holds): cluster hit ratio and TTFT p50/p90;
#  2. a restart of the worker holding the most pages (SIGTERM: the drain of recovery level 3;
#     `kvmesh up` restarts it) between two passes of the workload: the second pass's hit ratio
#     with the drain handoff and warm-up (--peer-view, as `kvmesh up` passes it) and without
#     (--peer-view= empty: page transfer on, no handoff);
#  3. scale-out: a cluster of WORKERS/2 workers serves the workload, then WORKERS/2 more are
#     started by hand next to it (they join through the controller's view); the time until each
#     new worker's first prefix hit, with warm-up and without.
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
PHASES=${PHASES:-"1 2 3"}
# P1_CONFIGS: phase 1's clusters, among "off on balanced-off balanced-on" (all by default)
LOGS=build/bench-cluster-logs
PEER="" # transfer nodes are on by default
NOPEER="--no-peer"
mkdir -p "$LOGS"

UP=
EXTRA=()
stop_up() {
    for p in "${EXTRA[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${EXTRA[@]}"; do wait "$p" 2>/dev/null || true; done
    EXTRA=()
    [ -n "$UP" ] && { kill -INT "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }
    UP=
}
trap stop_up EXIT

RQ= HTTP= # the router's endpoints in the current cluster (its cluster.env)
status() { [ -n "$HTTP" ] && "$BIN/kvmesh" status --http "$HTTP" --json 2>/dev/null; }
ups() { status | grep -o '"up":true' | wc -l || true; }

field() { # RUN ID KEY: a field of cluster.env
    grep "id=$2 " "$1/cluster.env" | tr ' ' '\n' | awk -F= -v k="$3" '$1 == k {print substr($0, length(k) + 2)}'
}

# start_up NAME N WORKER_ARGS: a kv-aware cluster of N workers; waits until every one is up
start_up() {
    rm -rf "$LOGS/$1"
    mkdir -p "$LOGS/$1"
    "$BIN/kvmesh" up --insecure --workers "$2" --threads "$THREADS" --mode kv \
        --base-port 0 --log-dir "$LOGS/$1" \
        --run-dir "$LOGS/$1/run" --worker-args "$3" \
        --router-args "--max-queue=100000 ${RARGS:-}" 2>>"$LOGS/up.log" &
    UP=$!
    RQ= HTTP=
    for _ in $(seq 1 600); do
        if [ -z "$HTTP" ] && [ -s "$LOGS/$1/run/cluster.env" ]; then
            RQ=$(field "$LOGS/$1/run" router requests)
            HTTP=$(field "$LOGS/$1/run" router http)
        fi
        [ "$(ups)" -ge "$2" ] && return 0
        sleep 0.2
    done
    echo "bench-cluster: the cluster did not come up (see $LOGS/$1)" >&2
    exit 1
}

workload() { # LABEL
    "$BENCH" workload --router "$RQ" --tenants "$TENANTS" --per-tenant "$PER_TENANT" \
        --prefix-tokens "$PREFIX_TOKENS" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
        --label "$1" | tee -a "$LOGS/results.txt"
}

# the router's counter (name and labels exactly), 0 when absent
router_metric() {
    curl -s "$HTTP/metrics" | awk -v s="$1" '$1 == s {print $2; f=1} END {if (!f) print 0}'
}

# "UP MEMBER_STATE" of worker ID in the router's status
member() {
    status | python3 -c 'import json,sys; w=[x for x in json.load(sys.stdin)["workers"] if x["id"]==sys.argv[1]]; print(w[0]["up"], w[0]["member_state"]) if w else print("-")' "$1" || true
}

# the id of the worker with the most pages in the router's index
fullest() {
    status | python3 -c 'import json,sys; w=json.load(sys.stdin)["workers"]; print(max(w, key=lambda x: sum(x["kv_pages"].values()))["id"])'
}


CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')
echo "== kvmesh cluster benchmark ($CPU, $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), load $(cut -d' ' -f1-3 /proc/loadavg))"
echo "   $TENANTS tenants x $PER_TENANT requests, ~$PREFIX_TOKENS-token system prompts, $CONCURRENCY in flight, $MAX_TOKENS tokens each, $THREADS thread(s) per worker"
: >"$LOGS/results.txt"

if [[ " $PHASES " == *" 1 "* ]]; then
    echo
    echo "-- 1. page transfer off and on, $WORKERS workers: kv-aware routing as by default (prefix"
    echo "   affinity first), then weighted for load (--w-prefill 0.01: tenants spread over the"
    echo "   workers, so a prefix is either computed again or pulled)"
    for t in ${P1_CONFIGS:-off on balanced-off balanced-on}; do
        RARGS=$([[ $t == balanced-* ]] && echo "--w-prefill=0.01" || echo "")
        start_up "p1-$t" "$WORKERS" "$([[ $t == *on ]] && echo "$PEER" || echo "$NOPEER")"
        workload "transfer-$t"
        echo "   router pulls: pull $(router_metric 'kvmesh_router_pulls_total{decision="pull"}')," \
            "recompute $(router_metric 'kvmesh_router_pulls_total{decision="recompute"}');" \
            "hints ok $(router_metric 'kvmesh_router_pull_hints_total{outcome="ok"}')," \
            "failed $(router_metric 'kvmesh_router_pull_hints_total{outcome="failed"}')"
        stop_up
    done
    RARGS=
fi

if [[ " $PHASES " == *" 2 "* ]]; then
    echo
    echo "-- 2. a restart of the fullest worker between two passes, $WORKERS workers"
    for h in handoff none; do
        start_up "p2-$h" "$WORKERS" "$PEER$([ $h = none ] && echo " --peer-view=" || echo "")"
        workload "before-$h" >/dev/null
        run="$LOGS/p2-$h/run"
        victim=$(fullest)
        pid=$(field "$run" "$victim" pid)
        t0=$(date +%s.%N)
        kill -TERM "$pid"
        # until kvmesh up has restarted it and the router has it up and ready in the view again
        for _ in $(seq 1 600); do
            npid=$(field "$run" "$victim" pid || true)
            [ "$npid" != "$pid" ] && [ "$(member "$victim")" = "True ready" ] && break
            sleep 0.2
        done
        echo "   $victim (pid $pid) SIGTERMed; back after $(echo "$(date +%s.%N) - $t0" | bc | cut -c1-5) s"
        workload "after-$h"
        stop_up
    done
fi

if [[ " $PHASES " == *" 3 "* ]]; then
    echo
    half=$((WORKERS / 2))
    echo "-- 3. scale-out from $half to $WORKERS workers: time from a new worker's start to its first prefix hit"
    for h in warm cold; do
        start_up "p3-$h" "$half" "$PEER"
        workload "base-$h" >/dev/null
        run="$LOGS/p3-$h/run"
        ctl=$(field "$run" controller listen)
        view=$(field "$run" controller view)
        "$BENCH" workload --router "$RQ" --tenants "$TENANTS" --per-tenant 1000 \
            --prefix-tokens "$PREFIX_TOKENS" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
            --label bg >/dev/null 2>&1 &
        LOAD=$!
        EXTRA+=("$LOAD")
        t0=$(date +%s.%N)
        for i in $(seq "$half" $((WORKERS - 1))); do
            mkdir -p "$LOGS/p3-$h/w$i"
            "$BIN/kvmesh-worker" --insecure --worker-id "w$i" --controller "$ctl" --peer-view "$view" \
                --listen "tcp://127.0.0.1:*" --events "tcp://127.0.0.1:*" --admin-port 0 \
                --ports-file "$LOGS/p3-$h/w$i/ports" --threads "$THREADS" $PEER \
                $([ $h = cold ] && echo "--peer-warm-pages 0") 2>"$LOGS/p3-$h/w$i/worker.log" &
            EXTRA+=("$!")
        done
        # every new worker watched at once: when it is ready (its ports file), when its first
        # prefix hit shows (kvmesh_worker_prefix_hit_ratio > 0); 120 s at most
        declare -A ready=() hit=()
        while :; do
            for i in $(seq "$half" $((WORKERS - 1))); do
                [ -n "${hit[$i]:-}" ] && continue
                a=$(grep '^admin=' "$LOGS/p3-$h/w$i/ports" 2>/dev/null | sed 's/.*://' || true)
                [ -z "$a" ] && continue
                now=$(echo "$(date +%s.%N) - $t0" | bc)
                [ -z "${ready[$i]:-}" ] && ready[$i]=$now
                v=$(curl -s "http://127.0.0.1:$a/metrics" |
                    awk '$1 == "kvmesh_worker_prefix_hit_ratio" {print ($2 > 0)}' || true)
                [ "${v:-0}" = 1 ] && hit[$i]=$now
            done
            [ "${#hit[@]}" -ge $((WORKERS - half)) ] && break
            [ "$(echo "$(date +%s.%N) - $t0 > 120" | bc)" = 1 ] && break
            sleep 0.1
        done
        for i in $(seq "$half" $((WORKERS - 1))); do
            printf "   w%d (%s): ready after %.1f s, " "$i" "$h" "${ready[$i]:--1}"
            if [ -n "${hit[$i]:-}" ]; then
                printf "first prefix hit %.1f s after it was ready\n" "$(echo "${hit[$i]} - ${ready[$i]}" | bc)"
            else
                printf "no prefix hit within 120 s\n"
            fi
        done
        unset ready hit
        stop_up
    done
fi
echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); logs in $LOGS/"

#!/usr/bin/env bash
# bench_router.sh — `make bench-router`: the router's figures (docs/router.md).
#  1. routing decisions per second, in process (bench_router micro);
#  2. the latency the router adds: one cached one-token request, worker directly vs through the
#     router (a 1-worker `kvmesh up` cluster);
#  3. a shared-prefix workload (TENANTS tenants, each with a PREFIX_TOKENS-token system prompt of
#     its own, PER_TENANT short questions each, CONCURRENCY in flight) against WORKERS workers,
#     once per routing mode — kv-aware, round-robin, random — each on a fresh cluster (empty
#     caches): prefix hit ratio and TTFT p50/p90. Targets: hit ratio >= 85% and TTFT p90 at least
#     3x better than round-robin for kv-aware.
# Every size is an environment variable; the defaults are the issue's workload. Prints figures,
# asserts nothing about time.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin
BENCH=${BENCH_ROUTER:-build/bench/bench_router}
export KVMESH_MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
WORKERS=${WORKERS:-4}
TENANTS=${TENANTS:-16}
PER_TENANT=${PER_TENANT:-16}
PREFIX_TOKENS=${PREFIX_TOKENS:-1000}
CONCURRENCY=${CONCURRENCY:-8}
MAX_TOKENS=${MAX_TOKENS:-8}
THREADS=${THREADS:-$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))}
MODES=${MODES:-"kv round-robin random"}
LAT_N=${LAT_N:-200}
PORT=${BENCH_PORT:-7400}
LOGS=build/bench-router-logs
mkdir -p "$LOGS"

UP=
stop_up() { [ -n "$UP" ] && { kill -INT "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }; UP=; }
trap stop_up EXIT

# start_up N MODE: a cluster of N workers routed by MODE; waits until every worker is up
start_up() {
    rm -rf "$LOGS/$2"
    # insecure on purpose: this measures routing, and the load generator speaks plain ZeroMQ
    "$BIN/kvmesh" up --insecure --workers "$1" --threads "$THREADS" --mode "$2" --base-port $((PORT + 100)) \
        --front-port "$PORT" --http-port $((PORT + 1)) --log-dir "$LOGS/$2" \
        --router-args "--max-queue=100000" 2>>"$LOGS/up.log" &
    UP=$!
    for _ in $(seq 1 600); do
        n=$("$BIN/kvmesh" status --http "http://127.0.0.1:$((PORT + 1))" --json 2>/dev/null |
            grep -o '"up":true' | wc -l || true)
        [ "$n" -ge "$1" ] && return 0
        sleep 0.2
    done
    echo "bench-router: the cluster did not come up (see $LOGS/)" >&2
    exit 1
}

echo "== kvmesh router benchmark ($(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ))"
echo
echo "-- 1. routing decisions"
"$BENCH" micro
echo
echo "-- 2. latency added by the router"
echo "  a instant worker that answers at once (the router's own cost: decode, tokenize, hash, route,"
echo "  relay, two extra hops on loopback):"
"$BENCH" instant --listen "tcp://127.0.0.1:$((PORT + 90))" &
INSTANT=$!
"$BIN/kvmesh-router" --workers "instant=tcp://127.0.0.1:$((PORT + 90))" --front "tcp://127.0.0.1:$((PORT + 91))" \
    --insecure --http-port -1 --log-level error 2>>"$LOGS/instant-router.log" &
SROUTER=$!
sleep 1
"$BENCH" latency --router "tcp://127.0.0.1:$((PORT + 91))" --worker "tcp://127.0.0.1:$((PORT + 90))" \
    -n "$((LAT_N * 10))"
kill "$SROUTER" "$INSTANT" 2>/dev/null || true
wait "$SROUTER" "$INSTANT" 2>/dev/null || true
echo
echo "-- 2b. the cost of CURVE (docs/security.md): a plain and a CURVE pair (instant worker + router)"
echo "  side by side, requests alternating between them; CPU seconds of each router from /proc"
KEYS="$LOGS/curve-keys"
rm -rf "$KEYS"
"$BIN/kvmesh" keys init "$KEYS" --workers instant >/dev/null
"$BENCH" instant --listen "tcp://127.0.0.1:$((PORT + 92))" 2>>"$LOGS/instant.log" &
I1=$!
"$BENCH" instant --listen "tcp://127.0.0.1:$((PORT + 93))" --keydir "$KEYS" 2>>"$LOGS/instant.log" &
I2=$!
"$BIN/kvmesh-router" --workers "instant=tcp://127.0.0.1:$((PORT + 92))" --front "tcp://127.0.0.1:$((PORT + 94))" \
    --insecure --http-port -1 --log-level error 2>>"$LOGS/instant-router.log" &
R1=$!
"$BIN/kvmesh-router" --workers "instant=tcp://127.0.0.1:$((PORT + 93))" --front "tcp://127.0.0.1:$((PORT + 95))" \
    --keydir "$KEYS" --http-port -1 --log-level error 2>>"$LOGS/instant-router.log" &
R2=$!
sleep 1
cpu() { awk '{printf "%.2f", ($14 + $15) / '"$(getconf CLK_TCK)"'}' "/proc/$1/stat"; }
C1=$(cpu $R1); C2=$(cpu $R2)
"$BENCH" curve --router "tcp://127.0.0.1:$((PORT + 94))" --worker "tcp://127.0.0.1:$((PORT + 92))" \
    --curve-router "tcp://127.0.0.1:$((PORT + 95))" --curve-worker "tcp://127.0.0.1:$((PORT + 93))" \
    --keydir "$KEYS" -n "$((LAT_N * 10))"
echo "  router CPU during the run: plain $(echo "$(cpu $R1) - $C1" | bc) s, CURVE $(echo "$(cpu $R2) - $C2" | bc) s"
kill "$R1" "$R2" "$I1" "$I2" 2>/dev/null || true
wait "$R1" "$R2" "$I1" "$I2" 2>/dev/null || true
echo "  a real worker (a cached prompt, one token):"
start_up 1 kv
"$BENCH" latency --router "tcp://127.0.0.1:$PORT" --worker "tcp://127.0.0.1:$((PORT + 100))" -n "$LAT_N"
stop_up
echo
echo "-- 3. shared-prefix workload: $TENANTS tenants x $PER_TENANT requests, ~$PREFIX_TOKENS-token" \
     "system prompts, $WORKERS workers x $THREADS threads, $CONCURRENCY in flight, $MAX_TOKENS tokens each"
for mode in $MODES; do
    start_up "$WORKERS" "$mode"
    "$BENCH" workload --router "tcp://127.0.0.1:$PORT" --tenants "$TENANTS" --per-tenant "$PER_TENANT" \
        --prefix-tokens "$PREFIX_TOKENS" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
        --label "$mode" | tee -a "$LOGS/workload.txt"
    stop_up
done

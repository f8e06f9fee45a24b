#!/usr/bin/env bash
# bench_worker_ab.sh BIN_A BIN_B [ROUNDS] — two kvmesh-worker binaries (a commit before and after a
# change, copied aside) compared on a short batch-8 decode, alternated A B A B ... then B A B A
# ... (ROUNDS pairs each way, default 3), one worker at a time: each run warms up, then
# `bench_worker load --concurrency 8` (16 requests of 64 greedy tokens after ~90-token prompts).
# Prints per run the load average, the worker's CPU time (user + system, ms) over the measured
# load, and bench_worker's result line (tok_s, TTFT and ITL percentiles). Build the load generator
# with `make build/bench/bench_worker`. Nothing here asserts anything about time.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_NAME=bench_worker_ab.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh
[ $# -ge 2 ] || bench_die "usage: bench/bench_worker_ab.sh BIN_A BIN_B [ROUNDS]"
A=$1 B=$2 ROUNDS=${3:-3}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
BENCH=${BENCH_WORKER:-build/bench/bench_worker}
OUT=${BENCH_OUT:-build/bench-worker-ab/$(date -u +%Y%m%dT%H%M%SZ)}
for bin in "$A" "$B"; do [ -x "$bin" ] || bench_die "$bin is not an executable"; done
[ -x "$BENCH" ] || bench_die "$BENCH not built (make $BENCH)"
mkdir -p "$OUT"
trap bench_stop_worker EXIT
tck=$(getconf CLK_TCK)
cpu_ms() { awk -v t="$tck" '{print ($14 + $15) * 1000 / t}' "/proc/$1/stat"; }
echo "cpu=\"$(bench_cpu)\" threads=$THREADS"
one() { # bin round
    WORKER_BIN=$1 bench_start_worker 0 "$OUT/worker.log" "$OUT/worker.ports"
    "$BENCH" load --kvmesh "$WORKER_REQ" --label warmup --concurrency 4 --requests-per-client 1 \
        --min-requests 4 --max-tokens 16 --prompt-words 16 >/dev/null
    local c0 line
    c0=$(cpu_ms "$WORKER_PID")
    line=$("$BENCH" load --kvmesh "$WORKER_REQ" --label "$1" --concurrency 8 \
        --requests-per-client 2 --min-requests 16 --max-tokens 64 --prompt-words 48)
    echo "round=$2 load=\"$(bench_load)\" cpu_ms=$(awk -v a="$c0" -v b="$(cpu_ms "$WORKER_PID")" 'BEGIN{print b - a}') $line"
    bench_stop_worker
}
for r in $(seq 1 "$ROUNDS"); do one "$A" "$r"; one "$B" "$r"; done
for r in $(seq 1 "$ROUNDS"); do one "$B" "$r"; one "$A" "$r"; done

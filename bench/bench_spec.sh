#!/usr/bin/env bash
# bench_spec.sh — `make bench-spec`: speculative decoding on and off on one kvmesh-worker, the
# same prompts, one phase after the other (bench/bench_spec.c), for two workloads:
#   repetitive  bench/spec_repetitive.txt: copy a passage, repeat an earlier answer, repeat a
#               record — what suffix drafts are for;
#   open        tests/fixtures/llamacpp/prompts.txt: the greedy fixtures' open-ended prompts,
#               where drafts rarely match and must not cost anything.
# Prints the CPU, the load average and one line per workload and concurrency with tokens/s off
# and on, their ratio, drafted/accepted tokens and how many outputs were identical (all must be:
# speculation is exact; a mismatch makes the run fail). No llama.cpp column: llama.cpp's server has
# no draft-model-free speculation to compare with.
#
# The worker runs --insecure: this measures decoding, and bench_spec speaks plain ZeroMQ.
# Environment: THREADS (2), MODEL, CONCURRENCY ("1,8"), MAX_TOKENS (128), BENCH_PORT (7670),
#   WORKER_ARGS (extra worker flags), BENCH_OUT (build/bench-spec/<time>).
#   Nothing here asserts anything about time.
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=${THREADS:-2}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CONCURRENCY=${CONCURRENCY:-1,8}
MAX_TOKENS=${MAX_TOKENS:-128}
PORT=${BENCH_PORT:-7670}
BENCH=${BENCH_SPEC:-build/bench/bench_spec}
WORKER=build/bin/kvmesh-worker
OUT=${BENCH_OUT:-build/bench-spec/$(date -u +%Y%m%dT%H%M%SZ)}

die() {
    echo "bench_spec.sh: error: $*" >&2
    exit 1
}
[ -f "$MODEL" ] || die "model $MODEL not found (run 'make deps')"
[ -x "$WORKER" ] || die "$WORKER not built (make build)"
[ -x "$BENCH" ] || die "$BENCH not built (make $BENCH)"
mkdir -p "$OUT"

PID=
stop() {
    if [ -n "$PID" ]; then
        kill "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
    fi
    PID=
}
trap stop EXIT

# shellcheck disable=SC2086 # WORKER_ARGS is a list of flags
"$WORKER" --model "$MODEL" --threads "$THREADS" --listen "tcp://127.0.0.1:$PORT" --events "" \
    --admin-port -1 --ports-file "$OUT/worker.ports" --log-level warn --insecure ${WORKER_ARGS:-} \
    >>"$OUT/worker.log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do
    [ -s "$OUT/worker.ports" ] && break
    kill -0 "$PID" 2>/dev/null || die "kvmesh-worker exited (see $OUT/worker.log)"
    sleep 0.1
done
[ -s "$OUT/worker.ports" ] || die "kvmesh-worker did not come up (see $OUT/worker.log)"

echo "## speculative decoding off vs auto ($(date -u +%Y-%m-%dT%H:%MZ))"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), threads=$THREADS," \
    "max_tokens=$MAX_TOKENS, load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
rc=0
for w in "repetitive bench/spec_repetitive.txt" "open tests/fixtures/llamacpp/prompts.txt"; do
    set -- $w
    "$BENCH" --kvmesh "tcp://127.0.0.1:$PORT" --prompts "$2" --label "$1" \
        --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" | tee -a "$OUT/results.txt" || rc=1
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg); results in $OUT/results.txt"
exit $rc

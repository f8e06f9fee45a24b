#!/usr/bin/env bash
# bench_spec.sh — `make bench-spec`: speculative decoding on and off on one kvmesh-worker, the
# same prompts, one phase after the other (bench/bench_spec.c), for two workloads:
#   repetitive  bench/spec_repetitive.txt: copy a passage, repeat an earlier answer, repeat a
#               record — what suffix drafts are for;
#   open        tests/fixtures/llamacpp/prompts.txt: the greedy fixtures' open-ended prompts,
#               where drafts rarely match and must not cost anything;
#   long        two prompts of ~4,500 tokens (the first LONG_CHARS characters of docs/kvshard.md,
#               then "copy its first section" / "what is it about"), one client (LONG_CONCURRENCY):
#               speculation where attention over a long context weighs on every step. The worker
#               runs --max-ctx=8192 for it (the model's training context). Then the same with
#               self-speculation (QuantSpec: the model drafts over a 4-bit copy of the KV,
#               "speculate": "self"; the worker runs --speculate self for it, which changes
#               nothing for requests that say "auto" or "off"), unless SELF=0.
# Prints the CPU, the load average and one line per workload and concurrency with tokens/s off
# and on, their ratio, drafted/accepted tokens and how many outputs were identical (all must be:
# speculation is exact; a mismatch makes the run fail), and the same ratio over decode time alone
# (decode_ratio: without the prefill, which dominates the long workload's wall time).
#
# Then the llama.cpp column, at one client (bench/spec_llama.py against llama-server, same
# prompts, greedy, same threads): its draft-model-free speculation (`--spec-type`, default
# "ngram-simple ngram-mod": n-gram lookups over the request's own context, what our suffix drafts
# compare with) against `none`, with the same ratio, drafted/accepted and identical counts.
# Skipped with a line saying so when llama-server is not built (bench/build_llamacpp.sh).
#
# The worker runs --insecure: this measures decoding, and bench_spec speaks plain ZeroMQ.
# Environment: THREADS (2), MODEL, CONCURRENCY ("1,8"), MAX_TOKENS (128), BENCH_PORT (7670),
#   WORKER_ARGS (extra worker flags), LONG (1; 0 = no long workload), LONG_CHARS (17000),
#   SELF (1; 0 = no self-speculation run of the long workload),
#   LONG_CONCURRENCY (1), BENCH_OUT (build/bench-spec/<time>), LLAMA (1; 0 = no
#   llama.cpp column), LLAMA_SPECS ("ngram-simple ngram-mod"), LLBIN
#   (third_party/llama.cpp/build/bin), LLAMA_REPACK (auto|0|1: llama.cpp's weight repacking, off
#   when a probe run crashes, as its AMX path does on some machines; bench_lib.sh).
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
stop() { bench_stop_pid PID; }
trap stop EXIT

BENCH_NAME=bench_spec.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh
SELF_ARGS=()
[ "${SELF:-1}" != 1 ] || SELF_ARGS=(--speculate=self)
# shellcheck disable=SC2086 # WORKER_ARGS is a list of flags
bench_start_worker "$PORT" "$OUT/worker.log" "$OUT/worker.ports" --max-ctx=8192 "${SELF_ARGS[@]}" ${WORKER_ARGS:-}
PID=$WORKER_PID

echo "## speculative decoding off vs auto ($(date -u +%Y-%m-%dT%H:%MZ))"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), threads=$THREADS," \
    "max_tokens=$MAX_TOKENS, load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
rc=0
for w in "repetitive bench/spec_repetitive.txt" "open tests/fixtures/llamacpp/prompts.txt"; do
    set -- $w
    "$BENCH" --kvmesh "tcp://127.0.0.1:$PORT" --prompts "$2" --label "$1" \
        --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" | tee -a "$OUT/results.txt" || rc=1
done
if [ "${LONG:-1}" = 1 ]; then
    # the prompts file's escapes: one prompt per line, "\n" for a newline (and none may start
    # with '#', a comment there: the document does)
    python3 - "${LONG_CHARS:-17000}" "$OUT/long.txt" <<'EOF2'
import sys
n, out = int(sys.argv[1]), sys.argv[2]
doc = open("docs/kvshard.md", encoding="utf-8").read()[:n]
doc = doc[: doc.rfind("\n\n")]  # whole paragraphs
esc = doc.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
with open(out, "w", encoding="utf-8") as f:
    f.write("Here is a document.\\n\\n" + esc + "\\n\\nCopy the document's first section word for word.\n")
    f.write("Read this.\\n\\n" + esc + "\\n\\nIn a few sentences, what is this document about?\n")
EOF2
    "$BENCH" --kvmesh "tcp://127.0.0.1:$PORT" --prompts "$OUT/long.txt" --label long \
        --max-tokens "$MAX_TOKENS" --concurrency "${LONG_CONCURRENCY:-1}" |
        tee -a "$OUT/results.txt" || rc=1
    if [ "${SELF:-1}" = 1 ]; then
        "$BENCH" --kvmesh "tcp://127.0.0.1:$PORT" --prompts "$OUT/long.txt" --label long \
            --mode self --max-tokens "$MAX_TOKENS" --concurrency "${LONG_CONCURRENCY:-1}" |
            tee -a "$OUT/results.txt" || rc=1
    fi
fi
stop

# ------------------------------------------------------------------ llama.cpp, one client
LLBIN=${LLBIN:-third_party/llama.cpp/build/bin}
LLAMA_SPECS=${LLAMA_SPECS:-ngram-simple ngram-mod}
LPORT=$((PORT + 1))
start_llama() { # log [--spec-type TYPE]
    local log=$1
    shift
    local nr=()
    [ "$REPACK" = 1 ] || nr=(-nr)
    "$LLBIN/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np 1 -c 8192 \
        --host 127.0.0.1 --port "$LPORT" --no-webui "${nr[@]}" "$@" >>"$log" 2>&1 &
    PID=$!
    for _ in $(seq 1 1200); do
        curl -sf "http://127.0.0.1:$LPORT/health" >/dev/null 2>&1 && return 0
        kill -0 "$PID" 2>/dev/null || die "llama-server exited (see $log)"
        sleep 0.1
    done
    die "llama-server did not come up (see $log)"
}
if [ "${LLAMA:-1}" != 1 ]; then
    echo "llama.cpp column: off (LLAMA=0)"
elif [ ! -x "$LLBIN/llama-server" ] || ! command -v curl >/dev/null; then
    echo "llama.cpp column: skipped ($LLBIN/llama-server not built: bench/build_llamacpp.sh; or no curl)"
else
    # llama.cpp's AMX path dies on some machines (bench_lib.sh): without repacking there
    REPACK="$(bench_llama_repack "${LLAMA_REPACK:-auto}" "$MODEL" "$THREADS" "$OUT")"
    echo "## llama.cpp's llama-server, one client: --spec-type none vs $LLAMA_SPECS" \
        "(weight repacking $([ "$REPACK" = 1 ] && echo on || echo 'off: -nr'))"
    field() { sed "s/.* $1=\([0-9.]*\).*/\1/"; } # a number after " NAME=" in a result line
    works=("repetitive bench/spec_repetitive.txt" "open tests/fixtures/llamacpp/prompts.txt")
    [ "${LONG:-1}" != 1 ] || works+=("long $OUT/long.txt")
    for w in "${works[@]}"; do
        set -- $w
        for spec in none $LLAMA_SPECS; do
            args=()
            [ "$spec" = none ] || args=(--spec-type "$spec")
            start_llama "$OUT/llama-$spec.log" "${args[@]}"
            python3 bench/spec_llama.py --url "http://127.0.0.1:$LPORT" --prompts "$2" --label "$1" \
                --spec "$spec" --max-tokens "$MAX_TOKENS" --texts "$OUT/llama-$1-$spec.txt" |
                tee -a "$OUT/results.txt"
            stop
        done
        base=$(grep "^llama label=$1 spec=none " "$OUT/results.txt" | tail -1 | field tok_s)
        dbase=$(grep "^llama label=$1 spec=none " "$OUT/results.txt" | tail -1 | field decode_tok_s)
        for spec in $LLAMA_SPECS; do
            line=$(grep "^llama label=$1 spec=$spec " "$OUT/results.txt" | tail -1)
            tok=$(echo "$line" | field tok_s)
            dtok=$(echo "$line" | field decode_tok_s)
            same=$(paste -d'\t' "$OUT/llama-$1-none.txt" "$OUT/llama-$1-$spec.txt" |
                awk -F'\t' '{n++; if ($1 == $2) k++} END {printf "%d/%d", k, n}')
            echo "llama-result label=$1 spec=$spec ratio=$(awk -v a="$tok" -v b="$base" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}')" \
                "decode_ratio=$(awk -v a="$dtok" -v b="$dbase" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}') identical=$same" |
                tee -a "$OUT/results.txt"
        done
    done
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg); results in $OUT/results.txt"
exit $rc

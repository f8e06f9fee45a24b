#!/usr/bin/env bash
# bench_worker.sh — `make bench-worker`: one kvmesh-worker beside llama.cpp's llama-server, same
# model, same thread count, same prompts and completion lengths, same machine, one server at a
# time (never both at once). Prints a markdown table (docs/benchmarks.md) with, at each
# concurrency (default 1, 8, 32 clients, closed loop): output tokens/s, TTFT p50/p99 and ITL
# p50/p99 as the client sees them; then the cached-prefix figure: TTFT of a prompt whose first
# 90% is already cached against the same-length cold prompt, for each prompt size.
#
# The load itself is bench/bench_worker.c (one thread per client; ZeroMQ + libkvmesh to the
# worker, HTTP/1.1 + SSE to llama-server's /completion). Greedy on both; kvmesh's protocol has no
# ignore-EOS switch, so neither side ignores EOS and the tokens actually streamed are counted (the
# prompts are story openings, which run to max_tokens). llama-server runs with as many slots as
# the highest concurrency, continuous batching, one unified KV pool of LLAMA_CTX tokens (every slot
# can hold a long prompt), its prompt cache on, and weight repacking off: its AMX repack path dies
# with SIGSEGV on the machines kvmesh is developed on (LLAMA_REPACK=1 turns it back on).
#
# Environment: THREADS (2), MODEL, CONCURRENCY ("1,8,32"), MAX_TOKENS (64), PROMPT_WORDS (48,
#   ~90-token prompts), REQUESTS_PER_CLIENT (2), MIN_REQUESTS (8, per level), PREFIX_WORDS
#   ("800 1600": ~1000- and ~1900-token prompts), PREFIX_REPS (5), ROUNDS (1; figures are medians
#   over rounds, each round runs both servers), SERVERS ("kvmesh llama-server"), LLAMA_CTX
#   (16384, the worker's default KV budget), LLAMA_REPACK (0), BENCH_PORT (7660), BENCH_OUT
#   (build/bench-worker/<time>), WORKER_ARGS / LLAMA_ARGS (extra flags for either server).
#   Nothing here asserts anything about time.
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=${THREADS:-2}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CONCURRENCY=${CONCURRENCY:-1,8,32}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_WORDS=${PROMPT_WORDS:-48}
REQUESTS_PER_CLIENT=${REQUESTS_PER_CLIENT:-2}
MIN_REQUESTS=${MIN_REQUESTS:-8}
PREFIX_WORDS=${PREFIX_WORDS:-"800 1600"}
PREFIX_REPS=${PREFIX_REPS:-5}
ROUNDS=${ROUNDS:-1}
SERVERS=${SERVERS:-"kvmesh llama-server"}
LLAMA_CTX=${LLAMA_CTX:-16384}
LLAMA_REPACK=${LLAMA_REPACK:-0}
PORT=${BENCH_PORT:-7660}
BENCH=${BENCH_WORKER:-build/bench/bench_worker}
WORKER=build/bin/kvmesh-worker
LLBIN=third_party/llama.cpp/build/bin
OUT=${BENCH_OUT:-build/bench-worker/$(date -u +%Y%m%dT%H%M%SZ)}
RESULTS="$OUT/results.txt"

die() {
    echo "bench_worker.sh: error: $*" >&2
    exit 1
}
say() { echo "bench_worker.sh: $*" >&2; }
BENCH_NAME=bench_worker.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh

[ -f "$MODEL" ] || die "model $MODEL not found (run 'make deps')"
[ -x "$WORKER" ] || die "$WORKER not built (make build)"
[ -x "$BENCH" ] || die "$BENCH not built (make $BENCH)"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"
command -v curl >/dev/null || die "curl is needed to wait for llama-server"
if [[ " $SERVERS " == *" llama-server "* ]] && [ ! -x "$LLBIN/llama-server" ]; then
    say "llama-server is not built; running bench/build_llamacpp.sh"
    bash bench/build_llamacpp.sh || die "bench/build_llamacpp.sh failed"
fi
mkdir -p "$OUT"
: >"$RESULTS"

# llama-server's slots: one per client of the highest concurrency level.
SLOTS=$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)
# The no-repack flag as this build's --help spells it.
NR=()
if [ "$LLAMA_REPACK" != 1 ] && [[ " $SERVERS " == *" llama-server "* ]]; then
    help=$("$LLBIN/llama-server" --help 2>&1 || true)
    if grep -q -- '--no-repack' <<<"$help"; then
        NR=(--no-repack)
    elif grep -qE -- '(^|[ ,])-nr([ ,]|$)' <<<"$help"; then
        NR=(-nr)
    else
        say "warning: this llama-server has no no-repack option; running it with its default"
    fi
fi

SERVER_PID=
stop_server() { bench_stop_pid SERVER_PID; }
trap stop_server EXIT

start_kvmesh() { # log
    # shellcheck disable=SC2086 # WORKER_ARGS is a list of flags
    bench_start_worker "$PORT" "$1" "$OUT/worker.ports" ${WORKER_ARGS:-}
    SERVER_PID=$WORKER_PID
}

start_llama() { # log
    # shellcheck disable=SC2086 # LLAMA_ARGS is a list of flags
    "$LLBIN/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c "$LLAMA_CTX" -kvu \
        -cb "${NR[@]}" --host 127.0.0.1 --port "$((PORT + 1))" --no-webui ${LLAMA_ARGS:-} >>"$1" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 1200); do
        curl -sf "http://127.0.0.1:$((PORT + 1))/health" >/dev/null 2>&1 && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || die "llama-server exited (see $1)"
        sleep 0.1
    done
    die "llama-server did not come up (see $1)"
}

run_server() { # name round
    local name=$1 round=$2 target log="$OUT/$1.$2.log"
    if [ "$name" = kvmesh ]; then
        start_kvmesh "$log"
        target=(--kvmesh "tcp://127.0.0.1:$PORT")
    else
        start_llama "$log"
        target=(--http "127.0.0.1:$((PORT + 1))")
    fi
    say "round $round: $name up (load $(cut -d' ' -f1-3 /proc/loadavg)); warming up"
    "$BENCH" load "${target[@]}" --label warmup --concurrency 4 --requests-per-client 1 \
        --min-requests 4 --max-tokens 16 --prompt-words 16 >/dev/null
    echo "load server=$name round=$round at=start loadavg=\"$(cut -d' ' -f1-3 /proc/loadavg)\"" >>"$RESULTS"
    "$BENCH" load "${target[@]}" --label "$name" --concurrency "$CONCURRENCY" \
        --requests-per-client "$REQUESTS_PER_CLIENT" --min-requests "$MIN_REQUESTS" \
        --max-tokens "$MAX_TOKENS" --prompt-words "$PROMPT_WORDS" | tee -a "$RESULTS" >&2
    for w in $PREFIX_WORDS; do
        "$BENCH" prefix "${target[@]}" --label "$name" --prompt-words "$w" --reps "$PREFIX_REPS" |
            sed "s/^prefix /prefix words=$w /" | tee -a "$RESULTS" >&2
    done
    echo "load server=$name round=$round at=end loadavg=\"$(cut -d' ' -f1-3 /proc/loadavg)\"" >>"$RESULTS"
    stop_server
}

START_LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
    for s in $SERVERS; do run_server "$s" "$r"; done
done
END_LOAD=$(cut -d' ' -f1-3 /proc/loadavg)

# ------------------------------------------------------------------ the table (medians over rounds)
echo "## kvmesh-worker vs llama-server ($(date -u +%Y-%m-%dT%H:%MZ))"
echo
echo "model $(basename "$MODEL"), $THREADS threads each, $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo |
    cut -d: -f2 | sed 's/^ //')); $MAX_TOKENS-token completions (greedy), ~$PROMPT_WORDS-word prompts,"
echo "closed loop ($REQUESTS_PER_CLIENT requests per client, at least $MIN_REQUESTS per level); llama-server:" \
    "-np $SLOTS -c $LLAMA_CTX -kvu -cb ${NR[*]:-}; $ROUNDS round(s), medians; load average $START_LOAD at" \
    "start, $END_LOAD at end."
echo
awk -v servers="$SERVERS" '
function med(key,   n, i, j, t, a) {
    n = cnt[key]; if (!n) return "";
    for (i = 1; i <= n; i++) a[i] = val[key, i];
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2;
}
function put(key, v) { val[key, ++cnt[key]] = v }
function ratio(a, b) { return (a != "" && b != "" && b > 0) ? sprintf("%.2f", a / b) : "–" }
function show(v, fmt) { return v == "" ? "–" : sprintf(fmt, v) }
{
    delete f
    for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
    if ($1 == "result") {
        s = f["server"]; c = f["conc"]; if (!(c in seen)) { seen[c] = 1; order[++nc] = c }
        put(s SUBSEP c SUBSEP "tok_s", f["tok_s"]); put(s SUBSEP c SUBSEP "ttft_p50", f["ttft_p50"])
        put(s SUBSEP c SUBSEP "ttft_p99", f["ttft_p99"]); put(s SUBSEP c SUBSEP "itl_p50", f["itl_p50"])
        put(s SUBSEP c SUBSEP "itl_p99", f["itl_p99"]); put(s SUBSEP c SUBSEP "tpr", f["tokens_per_req"])
        if (f["failed"] > 0) failed[s] += f["failed"]
    } else if ($1 == "prefix") {
        s = f["server"]; w = f["words"]; if (!(w in pseen)) { pseen[w] = 1; porder[++np] = w }
        put(s SUBSEP w SUBSEP "cold", f["cold_ttft_ms"]); put(s SUBSEP w SUBSEP "warm", f["cached_ttft_ms"])
        put(s SUBSEP w SUBSEP "ptok", f["prompt_tokens"]); put(s SUBSEP w SUBSEP "ctok", f["cached_tokens"])
    }
}
END {
    K = "kvmesh"; L = "llama-server"
    print "| clients | metric | kvmesh | llama-server | kvmesh / llama-server |"
    print "|---:|---|---:|---:|---:|"
    split("tok_s ttft_p50 ttft_p99 itl_p50 itl_p99", ms, " ")
    split("output tok/s|TTFT p50 ms|TTFT p99 ms|ITL p50 ms|ITL p99 ms", names, "|")
    for (i = 1; i <= nc; i++) {
        c = order[i]
        for (m = 1; m <= 5; m++) {
            a = med(K SUBSEP c SUBSEP ms[m]); b = med(L SUBSEP c SUBSEP ms[m])
            printf "| %s | %s | %s | %s | %s |\n", c, names[m], show(a, "%.1f"), show(b, "%.1f"), ratio(a, b)
        }
        a = med(K SUBSEP c SUBSEP "tpr"); b = med(L SUBSEP c SUBSEP "tpr")
        printf "| %s | tokens per request | %s | %s | |\n", c, show(a, "%.1f"), show(b, "%.1f")
    }
    print ""
    print "| prompt tokens | cached | server | cold TTFT ms | 90%-cached TTFT ms | cold / cached |"
    print "|---:|---:|---|---:|---:|---:|"
    for (i = 1; i <= np; i++) {
        w = porder[i]
        for (k = 1; k <= 2; k++) {
            s = k == 1 ? K : L
            co = med(s SUBSEP w SUBSEP "cold"); wa = med(s SUBSEP w SUBSEP "warm")
            if (co == "") continue
            printf "| %d | %d | %s | %.1f | %.1f | %s |\n", med(s SUBSEP w SUBSEP "ptok"),
                med(s SUBSEP w SUBSEP "ctok"), s, co, wa, ratio(co, wa)
        }
    }
    print ""
    top = order[nc]
    a = med(K SUBSEP top SUBSEP "tok_s"); b = med(L SUBSEP top SUBSEP "tok_s")
    ia = med(K SUBSEP top SUBSEP "itl_p99"); ib = med(L SUBSEP top SUBSEP "itl_p99")
    if (a != "" && b != "")
        printf "target: throughput at %s clients >= 1.0x llama-server: %sx (%s); ITL p99 no worse: %.1f vs %.1f ms (%s)\n",
            top, ratio(a, b), (a >= b ? "met" : "NOT met"), ia, ib, (ia <= ib ? "met" : "NOT met")
    for (i = 1; i <= np; i++) {
        w = porder[i]; co = med(K SUBSEP w SUBSEP "cold"); wa = med(K SUBSEP w SUBSEP "warm")
        if (co != "")
            printf "target: kvmesh 90%%-cached TTFT >= 5x lower than cold (%d tokens): %sx (%s)\n",
                med(K SUBSEP w SUBSEP "ptok"), ratio(co, wa), ((wa > 0 && co / wa >= 5) ? "met" : "NOT met")
    }
    for (s in failed) printf "warning: %s: %d requests failed\n", s, failed[s]
}' "$RESULTS"
echo
echo "raw results: $RESULTS"

#!/usr/bin/env bash
# bench_pd.sh — prefill/decode disaggregation against colocated workers (issue 32 point 4,
# docs/disaggregation.md "Figures"): the same mixed workload (bench/bench_pd.c: STREAMS clients
# streaming short prompts back to back, plus a fresh prompt of LONG_MIN..LONG_MAX tokens every
# LONG_EVERY_MS) through `kvmesh up` clusters of single-threaded workers (insecure, transfer
# nodes on as shipped), one cluster per configuration, the configurations interleaved REPEAT
# times so they meet the same machine load. Per run: the streams' ITL p50/p99, TTFT p50/p90 of
# short and of long requests, generated tokens/s, how many long prompts the router
# disaggregated, and how many of their full pages reached the decode worker while the prefill
# still ran ("overlap": kvmesh_worker_pd_pages_imported_total{when="during_prefill"} over the
# pages of the decode worker's pd_done lines; the rest it computed itself). Then the medians
# over the runs and their ratios (colocated / disaggregated ITL p99, disaggregated / colocated
# tokens/s). CONFIGS: "NAME:KVMESH UP FLAGS" separated by ';', the first the baseline (a 2+2
# cluster: "pd-2+2:--prefill-workers=2 --decode-workers=2", against "--workers=4").
# Prints figures, asserts nothing about time.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin
BENCH=build/bench/bench_pd
export KVMESH_MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
SECONDS_RUN=${SECONDS_RUN:-40}
STREAMS=${STREAMS:-4}
STREAM_TOKENS=${STREAM_TOKENS:-48}
LONG_EVERY_MS=${LONG_EVERY_MS:-10000}
LONG_MIN=${LONG_MIN:-2000}
LONG_MAX=${LONG_MAX:-4000}
LONG_TOKENS=${LONG_TOKENS:-8}
REPEAT=${REPEAT:-2}
WORKER_ARGS=${WORKER_ARGS:-"--max-ctx=4608 --kv-bytes=256M"}
CONFIGS=${CONFIGS:-"colocated:--workers=2;pd-1+1:--prefill-workers=1 --decode-workers=1"}
LOGS=build/bench-pd-logs
BENCH_NAME=bench-pd
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh
rm -rf "$LOGS"
mkdir -p "$LOGS"
trap bench_up_stop EXIT

bench_header "prefill/decode benchmark"
echo "   $STREAMS streams of $STREAM_TOKENS tokens (short prompts), a $LONG_MIN..$LONG_MAX-token prompt every $LONG_EVERY_MS ms ($LONG_TOKENS tokens), ${SECONDS_RUN} s a run, 1 thread per worker"
RES="$LOGS/results.txt"
: >"$RES"
bench_runs "$CONFIGS" "$REPEAT"
for i in "${!BENCH_RUNS[@]}"; do
    c=${BENCH_RUNS[$i]}
    rep=$((i / BENCH_CONFIGS + 1))
    name=${c%%:*}
    flags=${c#*:}
    dir="$LOGS/$name-$rep"
    # shellcheck disable=SC2086 # flags are up's arguments
    bench_up_start "$dir" --threads 1 --worker-args "$WORKER_ARGS" $flags
    rq=$BENCH_RQ
    http=$BENCH_HTTP
    sleep 2 # the router's view: roles and transfer addresses (one heartbeat)
    line=$("$BENCH" --router "$rq" --seconds "$SECONDS_RUN" --streams "$STREAMS" \
        --stream-tokens "$STREAM_TOKENS" --long-every-ms "$LONG_EVERY_MS" --long-min "$LONG_MIN" \
        --long-max "$LONG_MAX" --long-tokens "$LONG_TOKENS" --seed "$rep" --label "$name" | tr '\n' ' ' || true)
    dis=$(bench_metric "$http" 'kvmesh_router_pd_total{decision="disaggregated"}')
    during=0 after=0 rounds=""
    for w in $(grep -o 'id=w[0-9]*' "$dir/run/cluster.env" | cut -d= -f2); do
        adm=$(bench_field "$dir/run" "$w" admin)
        d=$(bench_metric "$adm" 'kvmesh_worker_pd_pages_imported_total{when="during_prefill"}')
        a=$(bench_metric "$adm" 'kvmesh_worker_pd_pages_imported_total{when="after_prefill"}')
        during=$(awk -v x="$during" -v y="$d" 'BEGIN {print x + y}')
        after=$(awk -v x="$after" -v y="$a" 'BEGIN {print x + y}')
    done
    # per prompt: the decode worker's pd_done lines (pages imported during the prefill / the
    # prompt's full pages, and the outcome: partial when the rest was computed there)
    rounds=$(cat "$dir"/logs/w*.log 2>/dev/null | grep -o 'event=pd_done.*' |
        sed -n 's/.* pages=\([0-9]*\).* during_prefill=\([0-9]*\).* outcome=\([a-z]*\).*/\2\/\1:\3/p' | tr '\n' ' ' || true)
    total=$(echo "$rounds" | tr ' ' '\n' | awk -F'[/:]' 'NF >= 2 {t += $2} END {print t + 0}')
    echo "$line disaggregated=$dis pages_during=$during pages_after=$after pages_total=$total per_prompt=[${rounds% }]" | tee -a "$RES"
    bench_up_stop
done

echo
echo "== medians over $REPEAT run(s) of each configuration"
awk '
function med(a, n,   i, j, t) {
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
/^result/ {
    delete f
    for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
    l = f["label"]; if (!(l in n)) order[++no] = l
    k = ++n[l]
    for (m in f) v[l, m, k] = f[m]
}
END {
    split("itl_p50 itl_p99 ttft_short_p50 ttft_short_p90 ttft_long_p50 ttft_long_p90 tok_s pages_during pages_total", ms, " ")
    printf "%-14s %8s %8s %10s %10s %10s %10s %7s %8s\n", "config", "ITL p50", "ITL p99", "TTFTs p50", "TTFTs p90", "TTFTl p50", "TTFTl p90", "tok/s", "overlap"
    for (o = 1; o <= no; o++) {
        l = order[o]
        for (x = 1; x <= 9; x++) { delete a; for (k = 1; k <= n[l]; k++) a[k] = v[l, ms[x], k]; r[l, ms[x]] = med(a, n[l]) }
        tot = r[l, "pages_total"]
        ov = tot > 0 ? sprintf("%.0f%%", 100 * r[l, "pages_during"] / tot) : "-"
        printf "%-14s %8.1f %8.1f %10.0f %10.0f %10.0f %10.0f %7.1f %8s\n", l, r[l, "itl_p50"], r[l, "itl_p99"], r[l, "ttft_short_p50"], r[l, "ttft_short_p90"], r[l, "ttft_long_p50"], r[l, "ttft_long_p90"], r[l, "tok_s"], ov
    }
    base = order[1]
    for (o = 2; o <= no; o++) {
        l = order[o]
        itl = r[l, "itl_p99"] > 0 ? r[base, "itl_p99"] / r[l, "itl_p99"] : 0
        tps = r[base, "tok_s"] > 0 ? r[l, "tok_s"] / r[base, "tok_s"] : 0
        printf "%s vs %s: ITL p99 %.1fx lower (target >= 3x), tokens/s %.2fx (target >= 0.9x)\n", l, base, itl, tps
    }
}' "$RES"

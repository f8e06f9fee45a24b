#!/bin/sh
# bench_long.sh — long contexts, dense vs sparse attention (docs/sparse.md): perplexity of a long
# text at several context lengths and sparse budgets, and the decode step time at a long context.
# One thread by default, so that the CPU time per step (step_cpu_ms) stays meaningful on a shared
# machine. Knobs (environment): BIN, TEXT (default: /usr/share/common-licenses/* concatenated),
# CTXS, BUDGETS, DEPTHS, CHUNKS (chunks scored per context), THREADS, PART (ppl|step|all).
set -eu
BIN=${BIN:-build/bin/kvmesh}
TEXT=${TEXT:-${TMPDIR:-/tmp}/kvmesh-long.txt}
CTXS=${CTXS:-"2048 4096 8192"}
BUDGETS=${BUDGETS:-"256 512 1024"}
DEPTHS=${DEPTHS:-8192}
CHUNKS=${CHUNKS:-1}
THREADS=${THREADS:-1}
PART=${PART:-all}
[ -s "$TEXT" ] || cat /usr/share/common-licenses/* >"$TEXT"
echo "cpu: $(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -1), threads $THREADS"
if [ "$PART" != step ]; then
    for ctx in $CTXS; do
        for b in 0 $BUDGETS; do
            ppl=$("$BIN" perplexity -f "$TEXT" -c "$ctx" -b 512 --chunks "$CHUNKS" -t "$THREADS" \
                --sparse-attn "$b" 2>/dev/null | sed -n 's/^Final estimate: PPL = \([0-9.]*\).*/\1/p')
            echo "ppl ctx=$ctx sparse=$b ppl=$ppl"
        done
    done
fi
if [ "$PART" != ppl ]; then
    for d in $DEPTHS; do
        for b in 0 $BUDGETS; do
            "$BIN" bench --prompt 16 --gen 32 --batch 1 --reps 1 --depth "$d" -t "$THREADS" \
                --sparse-attn "$b" 2>/dev/null | sed -n "s/^bench decode /step sparse=$b /p"
        done
    done
fi

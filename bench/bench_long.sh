#!/bin/sh
# bench_long.sh — long contexts, dense vs sparse attention (docs/sparse.md): perplexity of a long
# text at several context lengths and sparse budgets; passkey retrieval (a number hidden at
# PK_DEPTHS evenly spread depths of a filler text, asked for at its end, greedy) and the decode
# step time at a long context, split into attention and the rest, at batch 1 and a serving batch
# (bench/bench_long_dec.c); and (PART=mem, bench/bench_long_mem.c) many long sequences served
# inside a hot KV budget a quarter of their KV, against the same run all hot.
# One thread by default, so that the CPU time per step (step_cpu_ms) stays meaningful on a shared
# machine. Knobs (environment): BIN, TEXT (default: /usr/share/common-licenses/* concatenated),
# CTXS, BUDGETS, DEPTHS, CHUNKS (chunks scored per context), THREADS, PK_CTXS, PK_DEPTHS,
# PART (ppl|passkey|step|mem|all), SPARSE_FLAGS (more flags for the perplexity's sparse runs,
# e.g. "--sparse-dense-layers 8 --sparse-shallow-attn 2048"), DENSE (empty: no dense runs);
# step: STEP_BATCH (batch sizes, comma-separated), STEP_GEN, STEP_ROUNDS; passkey and step:
# DEC_FLAGS (bench_long_dec's, e.g. "--dense-layers 8 --shallow 2048"); SHARES (a budget-shares
# file from `kvmesh sparse-calibrate`: every sparse run's budgets per (layer, kv head));
# mem: MEM_SEQS, MEM_CTX, MEM_GEN, MEM_BUDGET, MEM_ROUNDS, MEM_THREADS (its runs are
# interleaved, MEM_ROUNDS times each).
set -eu
BIN=${BIN:-build/bin/kvmesh}
TEXT=${TEXT:-${TMPDIR:-/tmp}/kvmesh-long.txt}
CTXS=${CTXS:-"2048 4096 8192"}
BUDGETS=${BUDGETS:-"256 512 1024"}
DEPTHS=${DEPTHS:-8192}
CHUNKS=${CHUNKS:-1}
THREADS=${THREADS:-1}
PK_CTXS=${PK_CTXS:-$CTXS}
PK_DEPTHS=${PK_DEPTHS:-20}
PART=${PART:-all}
SPARSE_FLAGS=${SPARSE_FLAGS:-}
BENCH_LONG_MEM=${BENCH_LONG_MEM:-build/bench/bench_long_mem}
MEM_SEQS=${MEM_SEQS:-8}
MEM_CTX=${MEM_CTX:-1024}
MEM_GEN=${MEM_GEN:-32}
MEM_BUDGET=${MEM_BUDGET:-256}
MEM_ROUNDS=${MEM_ROUNDS:-2}
MEM_THREADS=${MEM_THREADS:-2}
BENCH_LONG_DEC=${BENCH_LONG_DEC:-build/bench/bench_long_dec}
STEP_BATCH=${STEP_BATCH:-1,8}
STEP_GEN=${STEP_GEN:-16}
STEP_ROUNDS=${STEP_ROUNDS:-2}
DEC_FLAGS=${DEC_FLAGS:-}
SHARES=${SHARES:-}
if [ -n "$SHARES" ]; then
    SPARSE_FLAGS="$SPARSE_FLAGS --sparse-budgets $SHARES"
    DEC_FLAGS="$DEC_FLAGS --shares $SHARES"
fi
[ -s "$TEXT" ] || cat /usr/share/common-licenses/* >"$TEXT"
echo "cpu: $(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -1), threads $THREADS"
if [ "$PART" = all ] || [ "$PART" = ppl ]; then
    for ctx in $CTXS; do
        for b in ${DENSE-0} $BUDGETS; do
            ppl=$("$BIN" perplexity -f "$TEXT" -c "$ctx" -b 512 --chunks "$CHUNKS" -t "$THREADS" \
                --sparse-attn "$b" $SPARSE_FLAGS 2>/dev/null |
                sed -n 's/^Final estimate: PPL = \([0-9.]*\).*/\1/p')
            echo "ppl ctx=$ctx sparse=$b ppl=$ppl"
        done
    done
fi
# passkey and step: bench/bench_long_dec.c, the prompt prefilled once (densely), then every mode
# decodes from the same KV.
# shellcheck disable=SC2086
modes=$(echo ${DENSE-0} $BUDGETS | tr " " ",")
if [ "$PART" = all ] || [ "$PART" = passkey ]; then
    for ctx in $PK_CTXS; do
        # shellcheck disable=SC2086
        "$BENCH_LONG_DEC" --part passkey --ctx "$ctx" --depths "$PK_DEPTHS" --budgets "$modes" \
            --threads "$THREADS" $DEC_FLAGS 2>/dev/null | grep '^passkey ctx=[0-9]* sparse='
    done
fi
if [ "$PART" = all ] || [ "$PART" = step ]; then
    for d in $DEPTHS; do
        # shellcheck disable=SC2086
        "$BENCH_LONG_DEC" --part step --text "$TEXT" --depth "$d" --batch "$STEP_BATCH" \
            --gen "$STEP_GEN" --rounds "$STEP_ROUNDS" --budgets "$modes" --threads "$THREADS" \
            $DEC_FLAGS 2>/dev/null | grep '^step depth='
    done
fi
if [ "$PART" = all ] || [ "$PART" = mem ]; then
    r=0
    while [ $r -lt "$MEM_ROUNDS" ]; do
        # hot a quarter (host a quarter, disk the rest), layer slices then whole pages; hot a
        # quarter, host the rest; all hot; all hot and dense (the first of a repeated flag counts)
        for mode in "--hot 0.25 --host 0.25" "--hot 0.25 --host 0.25 --slices -1" \
            "--hot 0.25 --host 1" "--hot 1" "--hot 1 --budget 0"; do
            # shellcheck disable=SC2086
            "$BENCH_LONG_MEM" $mode --seqs "$MEM_SEQS" --ctx "$MEM_CTX" --gen "$MEM_GEN" \
                --budget "$MEM_BUDGET" --threads "$MEM_THREADS" 2>/dev/null
        done
        r=$((r + 1))
    done
fi

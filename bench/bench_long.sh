#!/bin/sh
# bench_long.sh — long contexts, dense vs sparse attention (docs/sparse.md): perplexity of a long
# text at several context lengths and sparse budgets, passkey retrieval (a number hidden at
# PK_DEPTHS evenly spread depths of a filler text, asked for at its end, greedy), and the decode
# step time at a long context, and (PART=mem, bench/bench_long_mem.c) many long sequences served
# inside a hot KV budget a quarter of their KV, against the same run all hot.
# One thread by default, so that the CPU time per step (step_cpu_ms) stays meaningful on a shared
# machine. Knobs (environment): BIN, TEXT (default: /usr/share/common-licenses/* concatenated),
# CTXS, BUDGETS, DEPTHS, CHUNKS (chunks scored per context), THREADS, PK_CTXS, PK_DEPTHS,
# PART (ppl|passkey|step|mem|all), SPARSE_FLAGS (more flags for the sparse runs, e.g.
# "--sparse-dense-layers 8 --sparse-shallow-attn 2048"), DENSE (empty: no dense runs);
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
PK_FILL="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

# passkey_prompt TOKENS PERMILLE KEY: the filler (about 25 tokens a sentence group) with the key
# at PERMILLE/1000 of its length, and the question.
passkey_prompt() {
    reps=$(($1 / 25)) at=$(($1 / 25 * $2 / 1000)) i=0
    printf 'There is an important info hidden inside a lot of irrelevant text. Find it and '
    printf 'memorize it. I will quiz you about the important information there.\n'
    while [ $i -lt $reps ]; do
        [ $i -eq $at ] && printf 'The pass key is %s. Remember it. %s is the pass key. ' "$3" "$3"
        printf '%s' "$PK_FILL"
        i=$((i + 1))
    done
    printf '\nWhat is the pass key? The pass key is'
}
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
if [ "$PART" = all ] || [ "$PART" = passkey ]; then
    pk=${TMPDIR:-/tmp}/kvmesh-passkey.$$.txt
    for ctx in $PK_CTXS; do
        for b in ${DENSE-0} $BUDGETS; do
            ok=0 j=0
            while [ $j -lt "$PK_DEPTHS" ]; do
                key=$(((j * 7919 + 10007) % 90000 + 10000))
                passkey_prompt "$ctx" $(((2 * j + 1) * 500 / PK_DEPTHS)) "$key" >"$pk"
                if "$BIN" run -f "$pk" -n 8 --temperature 0 -t "$THREADS" --sparse-attn "$b" \
                    2>/dev/null | grep -q "pass key? The pass key is $key"; then
                    ok=$((ok + 1))
                fi
                j=$((j + 1))
            done
            echo "passkey ctx=$ctx sparse=$b correct=$ok/$PK_DEPTHS"
        done
    done
    rm -f "$pk"
fi
if [ "$PART" = all ] || [ "$PART" = step ]; then
    for d in $DEPTHS; do
        for b in ${DENSE-0} $BUDGETS; do
            "$BIN" bench --prompt 16 --gen 32 --batch 1 --reps 1 --depth "$d" -t "$THREADS" \
                --sparse-attn "$b" 2>/dev/null | sed -n "s/^bench decode /step sparse=$b /p"
        done
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

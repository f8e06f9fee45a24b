#!/usr/bin/env bash
# bench_quality.sh — `make bench-quality`: perplexity of the default model per KV format on two
# texts shipped with every Debian (llama.cpp's method, ctx 512), next to llama.cpp's committed
# figures (tests/fixtures/llamacpp/perplexity.txt). The figures in docs/benchmarks.md and
# docs/engine.md come from this. Every format, f16 included, runs with batch 16 (BATCH=): a KV
# page (16 tokens) is complete, and so sealed to its format, before a later step attends to it,
# as in decoding. At the default batch (= ctx, 512) a chunk's pages would seal only after the
# step that attends to them, so int4 gave exactly the f16 figure (issue 12). Prints a markdown
# table; asserts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin/kvmesh
MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
TEXTS=(${TEXTS:-/usr/share/common-licenses/GPL-3 /usr/share/common-licenses/MPL-2.0})
BATCH=${BATCH:-16}
[ -x "$BIN" ] || { echo "bench_quality.sh: build first (make build)" >&2; exit 1; }
ppl() { "$BIN" perplexity -m "$MODEL" -t "$THREADS" --ctx 512 -b "$BATCH" "$@" 2>/dev/null |
        sed -n 's/^Final estimate: PPL = \([0-9.]*\).*/\1/p'; }
echo "perplexity, ctx 512, batch $BATCH: every 16-token KV page is sealed to its format before"
echo "a later step attends to it, as in decoding; $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'),"
isa=$("$BIN" run -m "$MODEL" -t 1 -n 1 -p x 2>&1 >/dev/null | grep -o 'isa=[a-z0-9]*' | head -1)
echo "${isa:-isa=?} (KVMESH_ISA=${KVMESH_ISA:-auto}), $THREADS threads, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| text | format | PPL | vs f16 |"
echo "|---|---|---|---|"
for t in "${TEXTS[@]}"; do
    [ -f "$t" ] || { echo "bench_quality.sh: $t missing, skipped" >&2; continue; }
    base=$(ppl -f "$t" --kv-format f16)
    echo "| $(basename "$t") | f16 | $base | – |"
    for f in bf16 fp8 int8 int4; do
        v=$(ppl -f "$t" --kv-format "$f")
        echo "| $(basename "$t") | $f | $v | $(python3 -c "print(f'{($v/$base-1)*100:+.2f}%')") |"
    done
done
echo
echo "llama.cpp (tests/fixtures/llamacpp/perplexity.txt, f16 KV):"
grep -o 'text=[^	]*\|ppl=[0-9.]*' tests/fixtures/llamacpp/perplexity.txt | paste - - | sort -u

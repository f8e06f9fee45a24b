#!/usr/bin/env bash
# bench_quality.sh — `make bench-quality`: perplexity of the default model per KV format on two
# texts shipped with every Debian (llama.cpp's method, ctx 512), next to llama.cpp's committed
# figures (tests/fixtures/llamacpp/perplexity.txt). The figures in docs/benchmarks.md and
# docs/engine.md come from this. int4 runs with -b 16 (pages are sealed to int4 when complete;
# see docs/kvshard.md). Prints a markdown table; asserts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin/kvmesh
MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-$(nproc)}
TEXTS=(${TEXTS:-/usr/share/common-licenses/GPL-3 /usr/share/common-licenses/MPL-2.0})
[ -x "$BIN" ] || { echo "bench_quality.sh: build first (make build)" >&2; exit 1; }
ppl() { "$BIN" perplexity -m "$MODEL" -t "$THREADS" --ctx 512 "$@" 2>/dev/null |
        sed -n 's/^Final estimate: PPL = \([0-9.]*\).*/\1/p'; }
echo "| text | format | PPL | vs f16 |"
echo "|---|---|---|---|"
for t in "${TEXTS[@]}"; do
    [ -f "$t" ] || { echo "bench_quality.sh: $t missing, skipped" >&2; continue; }
    base=$(ppl -f "$t" --kv-format f16)
    echo "| $(basename "$t") | f16 | $base | – |"
    for f in bf16 fp8 int8 int4; do
        extra=(); [ "$f" = int4 ] && extra=(-b 16)
        v=$(ppl -f "$t" --kv-format "$f" "${extra[@]}")
        echo "| $(basename "$t") | $f | $v | $(python3 -c "print(f'{($v/$base-1)*100:+.2f}%')") |"
    done
done
echo
echo "llama.cpp (tests/fixtures/llamacpp/perplexity.txt, f16 KV):"
grep -o 'text=[^	]*\|ppl=[0-9.]*' tests/fixtures/llamacpp/perplexity.txt | paste - - | sort -u

#!/usr/bin/env bash
# demo.sh — `make demo`: the default model answering real prompts with the local engine.
# (The multi-process cluster demo — router, workers, controller — arrives with `kvmesh up`.)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin/kvmesh
MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
echo "== kvmesh demo: $MODEL"
run() {
    echo
    echo "-- prompt: $1"
    "$BIN" run -m "$MODEL" --chat -p "$1" -n 96 --temperature 0 2>&1
}
run "What is the capital of France?"
run "Write a haiku about caches."
run "Explain in two sentences why a KV cache speeds up text generation."
echo
echo "-- raw completion, sampled (temperature 0.7, seed 7)"
"$BIN" run -m "$MODEL" -p "Once upon a time, in a data center far away," -n 64 --temperature 0.7 --seed 7 2>&1

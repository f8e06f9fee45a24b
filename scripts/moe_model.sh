#!/usr/bin/env bash
# moe_model.sh — `make moe-model` (called by `make deps`): the MoE test models, made from the
# default dense model by scripts/moe_from_dense.py (docs/moe.md):
#   models/SmolLM2-135M-Instruct-MoE1-top1.Q4_1.gguf  1 expert (the whole FFN), router trivial: the
#                                                     dense model's arithmetic, bit for bit
#   models/SmolLM2-135M-Instruct-MoE8-top8.Q4_1.gguf  8 experts, all used, uniform router: computes
#                                                     the dense FFN (the engine's exactness test)
#   models/SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf  8 experts, top 4, router from the experts'
#                                                     gate rows: a sparse MoE
#   models/SmolLM2-135M-Instruct-MoE8-top4-mirror.Q4_1.gguf  8 experts, top 4: 4 slices of the FFN
#                                                     written twice, router rows +r/-r (the
#                                                     --router mirror of moe_from_dense.py): sparse
#                                                     routing that rounding cannot derail
#   models/SmolLM2-135M-Instruct-Qwen2MoE8-top8.Q4_1.gguf  qwen2moe: a shared expert of 512
#                                                     neurons and 8 routed ones of 128, all used
#                                                     (the dense FFN up to float order)
#   models/SmolLM2-135M-Instruct-GraniteMoE8-top8.Q4_1.gguf granitemoe: MoE8-top8 with Granite's
#                                                     four multipliers, compensated exactly
#   models/SmolLM2-135M-Instruct-OLMoE8-top8.Q4_1.gguf  olmoe: 8 experts, all used, plus q/k RMS
#                                                     norms of weight 1.5 (not the dense model)
#   models/SmolLM2-135M-Instruct-Qwen2MoE8-top4-mirror.Q4_1.gguf qwen2moe, shared 512, the mirror
#                                                     router over 4 slices of 256: weights not
#                                                     renormalized where that changes the output
# Idempotent: a model is rebuilt only when it is missing, its recorded sha256 (models/X.sha256)
# does not match, or its recipe (this script's arguments, the converter's and the source's
# hashes, models/X.recipe) changed. The converter runs in build/moe-venv with the `gguf` package
# from PyPI (pinned), installed on first use; nothing is fetched when the models are up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=models/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_PY=gguf==0.19.0
VENV=build/moe-venv
say() { echo "moe-model: $*"; }
die() { echo "moe-model: error: $*" >&2; exit 1; }

[ -f "$SRC" ] || die "$SRC missing: run \`make deps\` first"
conv_sha=$(sha256sum scripts/moe_from_dense.py | cut -d' ' -f1)
src_sha=$(sha256sum "$SRC" | cut -d' ' -f1)

python_ready() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import gguf, numpy' 2>/dev/null && return
    say "installing $GGUF_PY into $VENV (PyPI)"
    rm -rf "$VENV"
    python3 -m venv "$VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$GGUF_PY" ||
        die "pip install $GGUF_PY failed: is PyPI reachable?"
}

build() { # build NAME ARGS...
    local out="models/$1" ; shift
    local recipe="args=$* converter=$conv_sha source=$src_sha gguf=$GGUF_PY"
    if [ -f "$out" ] && [ -f "$out.sha256" ] && [ "$(cat "$out.recipe" 2>/dev/null)" = "$recipe" ] &&
        (cd models && sha256sum -c --status "$(basename "$out").sha256"); then
        say "present: $out"
        return
    fi
    python_ready
    say "building $out ($*)"
    "$VENV/bin/python" scripts/moe_from_dense.py "$SRC" "$out.tmp" "$@" || die "conversion failed"
    mv "$out.tmp" "$out"
    (cd models && sha256sum "$(basename "$out")" > "$(basename "$out").sha256")
    echo "$recipe" > "$out.recipe"
    say "ready: $out sha256 $(cut -d' ' -f1 "$out.sha256")"
}

build SmolLM2-135M-Instruct-MoE1-top1.Q4_1.gguf --experts 1 --used 1 --router uniform
build SmolLM2-135M-Instruct-MoE8-top8.Q4_1.gguf --experts 8 --used 8 --router uniform
build SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf --experts 8 --used 4 --router gate-mean
build SmolLM2-135M-Instruct-MoE8-top4-mirror.Q4_1.gguf --experts 8 --used 4 --router mirror
build SmolLM2-135M-Instruct-Qwen2MoE8-top8.Q4_1.gguf --arch qwen2moe --shared 512 --experts 8 \
    --used 8 --router uniform
build SmolLM2-135M-Instruct-GraniteMoE8-top8.Q4_1.gguf --arch granitemoe --experts 8 --used 8 \
    --router uniform
build SmolLM2-135M-Instruct-OLMoE8-top8.Q4_1.gguf --arch olmoe --experts 8 --used 8 \
    --router uniform --qk-norm-weight 1.5
build SmolLM2-135M-Instruct-Qwen2MoE8-top4-mirror.Q4_1.gguf --arch qwen2moe --shared 512 \
    --experts 8 --used 4 --router mirror

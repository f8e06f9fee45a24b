#!/usr/bin/env bash
# Engine speed, kvmesh beside llama.cpp, on the same model and thread count. `make bench-engine`
# runs it. Prints a markdown table (metric | kvmesh | llama.cpp | ratio) and the machine it ran on.
#
# What is measured (same shapes on both sides):
#   prefill tok/s   512-token prompt, one sequence      llama-bench -p 512          (pp512)
#   decode tok/s    128 tokens, one sequence            llama-bench -n 128          (tg128)
#   decode tok/s    B sequences decoding together,      llama-batched-bench -npp 128 -ntg 128
#   at batch B      aggregate over all B (B = 1, 8, 32)  -npl 1,8,32                 (its S_TG column)
#   kvmesh: build/bin/kvmesh bench -m M --threads T --prompt 512 --gen 128 --batch 1,8,32, which
#   prints lines "bench prefill tokens=512 tok_s=X" and "bench decode batch=B tok_s=X".
#
# The machine is shared and noisy, so the runs are interleaved (kvmesh, llama.cpp, kvmesh,
# llama.cpp, ...; ROUNDS of each) and each figure is the median over the rounds. Every raw
# figure is printed too, with the load average. Nothing here asserts anything about time.
# Beware: ggml's threads meet at spinning barriers many times per token, so when other processes
# compete for the cores (load average above the core count) llama.cpp's multi-threaded figures
# collapse by up to 10x and vary wildly between rounds; compare only on a quiet machine, or look
# at THREADS=1 as well.
#
# The physical limit of batch-1 decode is the memory bandwidth over the weight bytes a token
# reads: each round also measures the machine's read bandwidth with THREADS threads
# (bench_kernels -b), and the table gives every decode figure as a fraction of
# B x bandwidth / (weight bytes per token) — at batch B one pass over the weights serves B tokens
# (the KV cache reads, ~1.5 MB per token at tg128's average context, are left out).
#
# Environment: THREADS (default nproc), MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf),
#   ROUNDS (default 2), LLAMA_REPACK (auto|0|1, default auto: llama.cpp's weight repacking is
#   used unless a probe run crashes, which the AMX path does on some machines; see
#   tests/README.md), BENCH_OUT (directory for the raw outputs; default build/bench/<time>),
#   KVMESH_BASE (another build's kvmesh binary, e.g. of an older commit: it runs in every round
#   too and the table gets a "before" column with the ratio after/before).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

THREADS="${THREADS:-$(nproc)}"
MODEL="${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
ROUNDS="${ROUNDS:-2}"
LLAMA_REPACK="${LLAMA_REPACK:-auto}"
LLBIN=third_party/llama.cpp/build/bin
KVMESH=build/bin/kvmesh
KVMESH_BASE="${KVMESH_BASE:-}"
BENCH_KERNELS="${BENCH_KERNELS:-build/bench/bench_kernels}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="${BENCH_OUT:-build/bench/$STAMP}"

BENCH_NAME=bench_engine.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh
die() { bench_die "$@"; }
say() { bench_say "$@"; }

[ -f "$MODEL" ] || die "model $MODEL not found (run 'make deps')"
[[ "$THREADS" =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive integer (got '$THREADS')"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer (got '$ROUNDS')"
command -v python3 >/dev/null || die "python3 is needed to read llama.cpp's JSON output"
if [ ! -x "$LLBIN/llama-bench" ] || [ ! -x "$LLBIN/llama-batched-bench" ]; then
    say "llama.cpp is not built; running bench/build_llamacpp.sh"
    bash bench/build_llamacpp.sh || die "bench/build_llamacpp.sh failed"
fi
[ -x "$BENCH_KERNELS" ] || die "$BENCH_KERNELS is not built (make bench-kernels builds it)"
mkdir -p "$OUT"
"$BENCH_KERNELS" -w "$MODEL" >"$OUT/weights.txt" || die "bench_kernels -w $MODEL failed"
LOAD_START="$(cut -d' ' -f1-3 /proc/loadavg)"

# ------------------------------------------------------------------ llama.cpp weight repacking
REPACK="$(bench_llama_repack "$LLAMA_REPACK" "$MODEL" "$THREADS" "$OUT")"
if [ "$REPACK" = 1 ]; then NR=(); else NR=(-nr); fi

# ------------------------------------------------------------------ one round of each side
run_llamacpp() { # round
    local r="$1"
    say "round $r: llama-bench"
    "$LLBIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 3 --repack "$REPACK" -o json \
        >"$OUT/llama-bench.$r.json" 2>"$OUT/llama-bench.$r.log" || {
        tail -20 "$OUT/llama-bench.$r.log" >&2
        die "llama-bench failed (log: $OUT/llama-bench.$r.log)"
    }
    say "round $r: llama-batched-bench"
    "$LLBIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c 8192 -b 2048 -ub 512 -npp 128 -ntg 128 \
        -npl 1,8,32 "${NR[@]}" --output-format jsonl >"$OUT/batched-bench.$r.jsonl" \
        2>"$OUT/batched-bench.$r.log" || {
        tail -20 "$OUT/batched-bench.$r.log" >&2
        die "llama-batched-bench failed (log: $OUT/batched-bench.$r.log)"
    }
}

KVMESH_STATUS=""
run_kvmesh() { # round
    local r="$1"
    if [ ! -x "$KVMESH" ]; then
        KVMESH_STATUS="kvmesh bench not built ($KVMESH missing; run 'make build')"
        return 0
    fi
    say "round $r: kvmesh bench"
    if "$KVMESH" bench -m "$MODEL" --threads "$THREADS" --prompt 512 --gen 128 --batch 1,8,32 \
        >"$OUT/kvmesh.$r.txt" 2>"$OUT/kvmesh.$r.log" && grep -q '^bench ' "$OUT/kvmesh.$r.txt"; then
        return 0
    fi
    if grep -q '^bench ' "$OUT/kvmesh.$r.txt" 2>/dev/null; then
        KVMESH_STATUS="kvmesh bench failed (log: $OUT/kvmesh.$r.log)"
    else
        KVMESH_STATUS="kvmesh bench not built ('$KVMESH bench' printed no 'bench' lines; log: $OUT/kvmesh.$r.log)"
    fi
    rm -f "$OUT/kvmesh.$r.txt"
    return 0
}

run_membw() { # round
    say "round $1: memory read bandwidth, $THREADS threads"
    "$BENCH_KERNELS" -b "$THREADS" >"$OUT/membw.$1.txt" || die "bench_kernels -b failed"
}

run_base() { # round
    [ -n "$KVMESH_BASE" ] || return 0
    say "round $1: kvmesh bench ($KVMESH_BASE)"
    "$KVMESH_BASE" bench -m "$MODEL" --threads "$THREADS" --prompt 512 --gen 128 --batch 1,8,32 \
        >"$OUT/base.$1.txt" 2>"$OUT/base.$1.log" || die "$KVMESH_BASE bench failed (log: $OUT/base.$1.log)"
}

for r in $(seq 1 "$ROUNDS"); do
    run_membw "$r"
    [ -n "$KVMESH_STATUS" ] || run_kvmesh "$r"
    run_base "$r"
    run_llamacpp "$r"
done
[ -z "$KVMESH_STATUS" ] || say "$KVMESH_STATUS"

# ------------------------------------------------------------------ table
LLVER="$(bash bench/build_llamacpp.sh --version)"
CPU="$(bench_cpu)"
ISA="$(grep -h -o 'isa=[a-z0-9]*' "$OUT"/kvmesh.*.log 2>/dev/null | head -1 | cut -d= -f2)"
MODEL_SHA="$(sha256sum "$MODEL" | cut -d' ' -f1)"

python3 - "$OUT" "$ROUNDS" "$KVMESH_STATUS" <<'PY'
import glob, json, os, re, statistics, sys

out, rounds, kv_status = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def median(xs):
    return statistics.median(xs) if xs else None

# llama.cpp figures, one list per metric (one entry per round)
ll = {}
for r in range(1, rounds + 1):
    with open(f"{out}/llama-bench.{r}.json") as f:
        for t in json.load(f):
            if t["n_prompt"] == 512 and t["n_gen"] == 0:
                ll.setdefault("prefill", []).append(t["avg_ts"])
            elif t["n_prompt"] == 0 and t["n_gen"] == 128:
                ll.setdefault("tg128", []).append(t["avg_ts"])
    with open(f"{out}/batched-bench.{r}.jsonl") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            t = json.loads(line)
            ll.setdefault(f"batch{t['pl']}", []).append(t["speed_tg"])

def read_kvmesh(prefix):
    got = {}
    for r in range(1, rounds + 1):
        p = f"{out}/{prefix}.{r}.txt"
        if not os.path.exists(p):
            continue
        for line in open(p):
            m = re.match(r"bench prefill tokens=512 tok_s=([0-9.eE+-]+)", line)
            if m:
                got.setdefault("prefill", []).append(float(m.group(1)))
            m = re.match(r"bench decode batch=(\d+) tok_s=([0-9.eE+-]+)", line)
            if m:
                got.setdefault(f"batch{m.group(1)}", []).append(float(m.group(2)))
    if "batch1" in got:
        got["tg128"] = got["batch1"]
    return got

kv, base = read_kvmesh("kvmesh"), read_kvmesh("base")

bw = []
for r in range(1, rounds + 1):
    for line in open(f"{out}/membw.{r}.txt"):
        m = re.match(r"membw threads=\d+ read_gb_s=([0-9.]+)", line)
        if m:
            bw.append(float(m.group(1)))
wbytes = None
for line in open(f"{out}/weights.txt"):
    m = re.match(r"model weight_bytes_per_token=(\d+)", line)
    if m:
        wbytes = int(m.group(1))
isa = "?"
for r in range(1, rounds + 1):
    p = f"{out}/kvmesh.{r}.log"
    if os.path.exists(p):
        for line in open(p):
            m = re.search(r"isa=(\S+)", line)
            if m:
                isa = m.group(1)
bw_med = median(bw)
limit1 = bw_med * 1e9 / wbytes if bw_med and wbytes else None

rows = [  # (name, key, llama.cpp source, batch size for the bandwidth limit or 0)
    ("prefill tok/s (512-token prompt)", "prefill", "llama-bench pp512", 0),
    ("decode tok/s, batch 1 (128 tokens)", "tg128", "llama-bench tg128", 1),
    ("decode tok/s, batch 1 (aggregate)", "batch1", "batched-bench S_TG, npl 1", 1),
    ("decode tok/s, batch 8 (aggregate)", "batch8", "batched-bench S_TG, npl 8", 8),
    ("decode tok/s, batch 32 (aggregate)", "batch32", "batched-bench S_TG, npl 32", 32),
]

def fmt(x):
    return "—" if x is None else f"{x:.1f}"

def frac(x, B):
    return f"{100 * x / (B * limit1):.0f}%" if x is not None and B and limit1 else "—"

bh = " kvmesh before | after / before |" if base else ""
print(f"| metric | kvmesh | llama.cpp | ratio (kvmesh/llama.cpp) | kvmesh / llama.cpp of the bandwidth limit |{bh} llama.cpp source |")
print("|---|---:|---:|---:|---:|" + ("---:|---:|" if base else "") + "---|")
for name, key, src, B in rows:
    a, b = median(kv.get(key, [])), median(ll.get(key, []))
    kcell = fmt(a) if a is not None else ("not built" if kv_status else "—")
    ratio = f"{a / b:.2f}" if a is not None and b else "—"
    lim = f"{frac(a, B)} / {frac(b, B)}" if B else "—"
    bc = ""
    if base:
        z = median(base.get(key, []))
        bc = f" {fmt(z)} | {a / z:.2f} |" if a is not None and z else " — | — |"
    print(f"| {name} | {kcell} | {fmt(b)} | {ratio} | {lim} |{bc} {src} |")
print()
if limit1:
    print(f"Bandwidth limit: {bw_med:.2f} GB/s measured read bandwidth (median over rounds, "
          f"{[round(x, 2) for x in bw]}) / {wbytes / 1e6:.1f} MB of weights per token = "
          f"**{limit1:.1f} tok/s at batch 1** (B times that at batch B). kvmesh ISA path: {isa}.")
print()
print(f"Medians over {rounds} interleaved round(s). Raw figures per round:")
for name, key, _, _ in rows:
    extra = f", kvmesh before {[round(x, 1) for x in base.get(key, [])]}" if base else ""
    print(f"- {key}: kvmesh {[round(x, 1) for x in kv.get(key, [])]}, llama.cpp {[round(x, 1) for x in ll.get(key, [])]}{extra}")
PY

echo
echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "- machine: $CPU, $(nproc) cores visible, threads = $THREADS; kvmesh kernels: ${ISA:-?}; load average $LOAD_START at start, $(cut -d' ' -f1-3 /proc/loadavg) at end"
echo "- model: $MODEL (sha256 $MODEL_SHA)"
echo "- llama.cpp: $LLVER; weight repacking $([ "$REPACK" = 1 ] && echo on || echo 'off (--repack 0 / -nr)'); flash attention auto; KV f16"
[ -z "$KVMESH_STATUS" ] || echo "- kvmesh: $KVMESH_STATUS"
[ -z "$KVMESH_BASE" ] || echo "- kvmesh before: $KVMESH_BASE"
echo "- raw outputs: $OUT"

#!/usr/bin/env bash
# bench_moe.sh — `make bench-moe` (issue 16 point 4; docs/moe.md, docs/benchmarks.md): what the
# MoE test model costs and what expert-aware KV shards do, measured, in two parts (PARTS):
#
# speed   prefill and decode tok/s of the MoE model (default the top-4 one) and of the dense model
#         it was made from, kvmesh next to llama.cpp, same threads, interleaved: each round runs,
#         for each model, `kvmesh bench --prompt 512 --gen 128 --batch 1` then
#         `llama-bench -p 512 -n 128` (pp512, tg128); figures are medians over ROUNDS, every raw
#         figure is printed, with the CPU and the load average before and after.
# shards  the hit ratio of one kvmesh-worker (4 KV shards, one request at a time) on a mixed
#         workload (bench/bench_moe_workload.py: code (llama.cpp's pinned C sources), English
#         prose, German and French (Debian's own files), 3 documents each, every document asked about many times with Zipf popularity, after a
#         warm-up that sends each document once, kind by kind), per configuration:
#           key hash; key expert with T=1 (--kv-tok-groups 1: the expert alone picks the shard);
#           key expert with T=4 (PiKV's page-index term spreads an expert's pages);
#         each with a budget the workload fits in (FIT_BYTES: placement and balance only) and
#         with one it does not (KV_BYTES: memory pressure, each shard a quarter of it with its
#         own LRU). Expert groups are 8 (--kv-expert-groups 8: one per expert, so the tables show
#         each expert; shard = ((page mod T) xor expert) mod 4, the same shards as 4 groups).
#         Each configuration gets a fresh worker and the same request sequence; the hit ratio is
#         cached over prompt tokens as the worker reports them (done.usage); `kvmesh status
#         --worker` prints its shards (pages, hits, evictions, max/mean hot pages: PiKV's balance)
#         and expert groups; the warm-up of the T=1 run says where each kind of text is routed.
#
# Environment: THREADS (nproc), MOE (models/SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf), DENSE
#   (models/SmolLM2-135M-Instruct.Q4_1.gguf), PARTS ("speed shards"), ROUNDS (2), LLAMA_REPACK
#   (auto|0|1; bench_lib.sh), SHARDS (4), KV_BYTES (48M), FIT_BYTES (512M), REQUESTS (60),
#   PER_KIND (3), DOC_BYTES (1600), SEED (1), ZIPF (1.0), CONFIGS (all six:
#   "fit-hash fit-t1 fit-t4 hash t1 t4"), BENCH_OUT (build/bench-moe/<time>).
# Prints figures; asserts nothing about time.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_NAME=bench_moe.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh

THREADS=${THREADS:-$(nproc)}
MOE=${MOE:-models/SmolLM2-135M-Instruct-MoE8-top4.Q4_1.gguf}
DENSE=${DENSE:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PARTS=${PARTS:-"speed shards"}
ROUNDS=${ROUNDS:-2}
LLAMA_REPACK=${LLAMA_REPACK:-auto}
SHARDS=${SHARDS:-4}
KV_BYTES=${KV_BYTES:-48M}
FIT_BYTES=${FIT_BYTES:-512M}
REQUESTS=${REQUESTS:-60}
PER_KIND=${PER_KIND:-3}
DOC_BYTES=${DOC_BYTES:-1600}
SEED=${SEED:-1}
ZIPF=${ZIPF:-1.0}
CONFIGS=${CONFIGS:-"fit-hash fit-t1 fit-t4 hash t1 t4"}
OUT=${BENCH_OUT:-build/bench-moe/$(date -u +%Y%m%dT%H%M%SZ)}
LLBIN=third_party/llama.cpp/build/bin
KVMESH=build/bin/kvmesh

for m in "$MOE" "$DENSE"; do [ -f "$m" ] || bench_die "model $m not found (run 'make deps')"; done
for b in "$KVMESH" build/bin/kvmesh-worker; do [ -x "$b" ] || bench_die "$b missing (make build)"; done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || bench_die "ROUNDS must be a positive integer"
command -v python3 >/dev/null || bench_die "python3 is needed (the workload and the tables)"
mkdir -p "$OUT"

echo "## MoE: engine speed and expert-aware KV shards ($(date -u +%Y-%m-%dT%H:%MZ))"
echo
echo "- machine: $(bench_cpu), $(nproc) cores visible, threads = $THREADS; load average $(bench_load) at start"
echo "- MoE model: $MOE (sha256 $(sha256sum "$MOE" | cut -c1-16)…); dense: $DENSE"

# llama.cpp: its llama-bench for the speed part, its pinned sources for the workload's code.
need_llamacpp() {
    if [ ! -x "$LLBIN/llama-bench" ] || [ ! -d third_party/llama.cpp/ggml/src ]; then
        bench_say "llama.cpp is not built; running bench/build_llamacpp.sh"
        bash bench/build_llamacpp.sh >&2 || bench_die "bench/build_llamacpp.sh failed"
    fi
}

# ------------------------------------------------------------------ speed
speed() {
    need_llamacpp
    local repack r m i
    repack=$(bench_llama_repack "$LLAMA_REPACK" "$MOE" "$THREADS" "$OUT")
    for r in $(seq 1 "$ROUNDS"); do
        i=0
        for m in "$DENSE" "$MOE"; do
            i=$((i + 1))
            bench_say "round $r: kvmesh bench $(basename "$m") (load $(bench_load))"
            "$KVMESH" bench -m "$m" --threads "$THREADS" --prompt 512 --gen 128 --batch 1 --reps 2 \
                >"$OUT/kvmesh.$i.$r.txt" 2>"$OUT/kvmesh.$i.$r.log" ||
                bench_die "kvmesh bench failed (log: $OUT/kvmesh.$i.$r.log)"
            bench_say "round $r: llama-bench $(basename "$m")"
            "$LLBIN/llama-bench" -m "$m" -t "$THREADS" -p 512 -n 128 -r 2 --repack "$repack" -o json \
                >"$OUT/llama.$i.$r.json" 2>"$OUT/llama.$i.$r.log" ||
                bench_die "llama-bench failed (log: $OUT/llama.$i.$r.log)"
        done
    done
    echo
    echo "### Engine speed, kvmesh next to llama.cpp ($THREADS threads, $ROUNDS interleaved rounds, medians)"
    echo
    python3 - "$OUT" "$ROUNDS" "$(basename "$DENSE")" "$(basename "$MOE")" <<'PY'
import json, re, statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
fig = {}  # (model index, metric, engine) -> [per round]
for i in (1, 2):
    for r in range(1, rounds + 1):
        for line in open(f"{out}/kvmesh.{i}.{r}.txt"):
            m = re.match(r"bench (prefill) tokens=512 tok_s=(\S+)|bench (decode) batch=1 tok_s=(\S+)", line)
            if m:
                key = m.group(1) or m.group(3)
                fig.setdefault((i, key, "kvmesh"), []).append(float(m.group(2) or m.group(4)))
        for t in json.load(open(f"{out}/llama.{i}.{r}.json")):
            key = "prefill" if t["n_gen"] == 0 else "decode"
            fig.setdefault((i, key, "llama"), []).append(t["avg_ts"])
med = {k: statistics.median(v) for k, v in fig.items()}
print("| model | metric | kvmesh tok/s | llama.cpp tok/s | kvmesh / llama.cpp |")
print("|---|---|---:|---:|---:|")
for i in (1, 2):
    for key, what in (("prefill", "prefill (512-token prompt)"), ("decode", "decode (128 tokens, batch 1)")):
        a, b = med[(i, key, "kvmesh")], med[(i, key, "llama")]
        print(f"| {names[i - 1]} | {what} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
print()
for key in ("prefill", "decode"):
    print(f"- MoE / dense, {key}: kvmesh {med[(2, key, 'kvmesh')] / med[(1, key, 'kvmesh')]:.2f}, "
          f"llama.cpp {med[(2, key, 'llama')] / med[(1, key, 'llama')]:.2f}")
print("- raw figures per round: " + "; ".join(
    f"{names[i - 1]} {key} {eng} {[round(x, 1) for x in fig[(i, key, eng)]]}"
    for i in (1, 2) for key in ("prefill", "decode") for eng in ("kvmesh", "llama")))
PY
    echo "- llama.cpp: $(bash bench/build_llamacpp.sh --version); weight repacking $([ "$repack" = 1 ] && echo on || echo off); load average $(bench_load) after this part"
}

# ------------------------------------------------------------------ shards
shard_run() { # CONFIG
    local c=$1 bytes=$KV_BYTES key=expert t=1 log="$OUT/shards.$1"
    case "$c" in fit-*) bytes=$FIT_BYTES ;; esac
    case "${c#fit-}" in
        hash) key="hash" ;;
        t1) t=1 ;;
        t4) t=4 ;;
        *) bench_die "unknown configuration $c (CONFIGS: fit-hash fit-t1 fit-t4 hash t1 t4)" ;;
    esac
    local args=(--kv-shards "$SHARDS" --kv-bytes "$bytes" --kv-shard-key "$key" --admin-port 0)
    local admin=()
    [ "$key" = hash ] || args+=(--kv-tok-groups "$t" --kv-expert-groups 8)
    MODEL=$MOE bench_start_worker 0 "$log.worker.log" "$log.ports" "${args[@]}"
    [ "$key" = hash ] || admin=(--admin "$WORKER_ADMIN") # where each kind is routed
    bench_say "$c: ${args[*]} (load $(bench_load))"
    python3 bench/bench_moe_workload.py run --kvmesh "$WORKER_REQ" --docs "$OUT/docs" \
        --requests "$REQUESTS" --seed "$SEED" --zipf "$ZIPF" --label "$c" \
        "${admin[@]}" | tee -a "$OUT/shards.txt" >"$log.txt"
    sleep 0.6 # the worker refreshes its series every 250 ms
    "$KVMESH" status --worker "$WORKER_ADMIN" >"$log.status"
    curl -s "$WORKER_ADMIN/metrics" >"$log.metrics"
    bench_stop_worker
    echo "balance label=$c $(sed -n 's/^hot pages max\/mean over the shards: /max_mean=/p' "$log.status")" \
        "resident=$(awk '/^kvmesh_worker_kv_pages/ && /tier="hot"/ {s += $2} END {print s + 0}' "$log.metrics")" \
        "evictions=$(awk '/^kvmesh_kv_shard_events_total/ && /event="eviction"/ {s += $2} END {print s + 0}' "$log.metrics")" \
        "moved=$(awk '/^kvmesh_kv_placements_total/ && /result="moved"/ {s += $2} END {print s + 0}' "$log.metrics")" \
        "stayed=$(awk '/^kvmesh_kv_placements_total/ && /result="stayed"/ {s += $2} END {print s + 0}' "$log.metrics")" \
        "bytes=$bytes" >>"$OUT/shards.txt"
}

shards() {
    need_llamacpp
    python3 bench/bench_moe_workload.py docs "$OUT/docs" --per-kind "$PER_KIND" --bytes "$DOC_BYTES"
    : >"$OUT/shards.txt"
    local c
    trap bench_stop_worker EXIT
    for c in $CONFIGS; do shard_run "$c"; done
    echo
    echo "### Expert-aware KV shards: hit ratio and balance ($SHARDS shards, $REQUESTS requests after a warm-up)"
    echo
    echo "Workload: $PER_KIND documents of ~$DOC_BYTES bytes per kind ($(for f in "$OUT"/docs/*; do
        printf '%s %s tokens, ' "$(basename "$f" .txt)" "$("$KVMESH" tokenize -m "$MOE" -f "$f" 2>/dev/null | wc -w)"; done | sed 's/, $//')),"
    echo "Zipf $ZIPF popularity, seed $SEED, one request at a time, 1 completion token; budgets: fit-* $FIT_BYTES, the others $KV_BYTES."
    echo
    python3 - "$OUT/shards.txt" <<'PY'
import sys
rows, route = {}, []
for line in open(sys.argv[1]):
    w = line.split()
    f = dict(x.split("=", 1) for x in w[1:])
    if w[0] == "hits":
        rows.setdefault(f["label"], {})[f["kind"]] = f
    elif w[0] == "balance":
        rows.setdefault(f["label"], {})["balance"] = f
    elif w[0] == "pages":
        rows.setdefault(f["label"], {})["pages"] = f
    elif w[0] == "route":
        route.append(f)
kinds = ["all", "code", "english", "german", "french"]
print("| configuration | KV budget | hit ratio | " + " | ".join(kinds[1:]) +
      " | hot pages max/mean | pages computed | evicted | resident | freed unindexed | placed: moved / stayed |")
print("|---|---|---:|" + "---:|" * (len(kinds) - 1) + "---:|---:|---:|---:|---:|---|")
for label, r in rows.items():
    b = r.get("balance", {})
    cells = [f"{float(r[k]['hit_ratio']):.3f}" if k in r and r[k]["requests"] != "0" else "—"
             for k in kinds]
    place = f"{b['moved']} / {b['stayed']}" if int(b.get("moved", 0)) + int(b.get("stayed", 0)) else "—"
    comp, ev, res = int(r["pages"]["computed"]), int(b["evictions"]), int(b["resident"])
    print(f"| {label} | {b['bytes']} | " + " | ".join(cells) +
          f" | {b.get('max_mean') or '—'} | {comp} | {ev} | {res} | {comp - ev - res} | {place} |")
print()
print("Hit ratio: cached / prompt tokens of the requests after the warm-up (done.usage). Pages: full "
      "pages computed (warm-up included), evicted (every shard's LRU), hot at the end; freed "
      "unindexed = computed - evicted - resident: pages computed again while an identical page was "
      "still cached behind an evicted one (a prefix hit ends at the first missing page, and the "
      "older copy stays indexed while the new one is freed with its request).")
print()
print("Where the warm-up's pages went, by kind of text (pages placed per expert = group, "
      "configuration fit-t1):")
print()
for f in route:
    if f["label"] == "fit-t1":
        gs = sorted((k for k in f if k.startswith("g")), key=lambda k: int(k[1:]))
        tot = sum(int(f[g]) for g in gs) or 1
        print(f"- {f['kind']}: " + ", ".join(f"e{g[1:]} {int(f[g])}" for g in gs) +
              f"  (top expert {max(int(f[g]) for g in gs) / tot:.0%} of {tot})")
PY
    echo
    echo "Per configuration (\`kvmesh status --worker\` at the end of its run):"
    for c in $CONFIGS; do
        echo
        echo "#### $c"
        echo '```'
        cat "$OUT/shards.$c.status"
        echo '```'
    done
}

for p in $PARTS; do
    case "$p" in
        speed) speed ;;
        shards) shards ;;
        *) bench_die "unknown part $p (PARTS: speed shards)" ;;
    esac
done
echo
echo "- load average $(bench_load) at the end; raw outputs: $OUT"

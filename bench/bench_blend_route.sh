#!/usr/bin/env bash
# bench_blend_route.sh — chunk-aware routing on a 4-worker cluster (issue 33, 4; docs/blend.md
# "Serving"): the share of chunk tokens reused when the router credits workers for the chunk
# pages they hold (--chunk-credit, router/chunks.c) and when it does not (--chunk-credit=0).
#
# A `kvmesh up` cluster of WORKERS workers; DOCS documents cut from the texts of
# /usr/share/common-licenses (DOC_BYTES bytes each, at line ends); REQUESTS completions one after
# another (PAUSE_S apart: a client's think time, in which a worker stores the chunks of the request
# it just served), each a lead line of its own (so no prefix is shared and the prefix index alone
# spreads them), PER documents drawn from the pool (seeded) in a shuffled order, each marked as a
# chunk (kvmesh.chunks, byte spans), and a question; max_tokens 1. Per run: the chunk tokens the
# workers reused (usage.prompt_tokens_details.chunk_tokens) over those they could have (each
# document's whole pages, /tokenize), over all chunks and over chunks of documents seen before
# (the first sight of a document can never be a hit); the requests each worker served; TTFT
# p50/p90 of the whole requests; the router's chunk pull decisions (mesh on: a worker pulls the
# chunk pages another holds, router/chunks.c). CONFIGS: per run, router flags, optionally then
# '|' and worker flags (--no-peer: mesh off), ';'-separated, REPEAT times in turn. Prints
# figures, asserts nothing about time.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin
export KVMESH_MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
WORKERS=${WORKERS:-4}
DOCS=${DOCS:-8}
DOC_BYTES=${DOC_BYTES:-900}
PER=${PER:-3}
REQUESTS=${REQUESTS:-24}
PAUSE_S=${PAUSE_S:-1}
THREADS=${THREADS:-1}
REPEAT=${REPEAT:-1}
CONFIGS=${CONFIGS:-"--chunk-credit=0;--chunk-credit=0.05|--no-peer;--chunk-credit=0.05;--chunk-credit=0.5|--no-peer;--chunk-credit=0.5"}
PORT=${BENCH_PORT:-7700}
LOGS=build/bench-blend-route-logs
BENCH_NAME=bench_blend_route.sh
# shellcheck source=bench/bench_lib.sh
. bench/bench_lib.sh
rm -rf "$LOGS"
mkdir -p "$LOGS"

UP=
stop_up() { [ -n "$UP" ] && { kill -INT "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }; UP=; }
trap stop_up EXIT

# start_up ROUTER_FLAGS [WORKER_FLAGS]: the cluster with those flags; waits until every worker is
# ready
start_up() {
    local wargs=()
    [ -n "${2:-}" ] && wargs=(--worker-args "$2")
    "$BIN/kvmesh" up --insecure --workers "$WORKERS" --threads "$THREADS" \
        --base-port $((PORT + 100)) --front-port "$PORT" --http-port $((PORT + 1)) \
        --log-dir "$LOGS/up-$RUN" --router-args "$1" "${wargs[@]}" 2>>"$LOGS/up.log" &
    UP=$!
    for _ in $(seq 1 900); do
        curl -sf "http://127.0.0.1:$((PORT + 1))/readyz" >/dev/null 2>&1 && break
        sleep 0.2
    done
    curl -sf "http://127.0.0.1:$((PORT + 1))/readyz" >/dev/null || bench_die "the cluster did not come up (see $LOGS/)"
    sleep 2 # every worker connected at the router, not only the first
}

echo "== kvmesh chunk-aware routing benchmark ($(date -u +%Y-%m-%dT%H:%MZ))"
echo "   CPU: $(bench_cpu); load before: $(bench_load)"
echo "   $WORKERS workers x $THREADS thread(s); $DOCS documents of ~$DOC_BYTES bytes, $PER per"
echo "   prompt, $REQUESTS requests ${PAUSE_S}s apart"
RUN=0
IFS=';' read -r -a ONE <<<"$CONFIGS"
RUNS=()
for _ in $(seq 1 "$REPEAT"); do RUNS+=("${ONE[@]}"); done
for config in "${RUNS[@]}"; do
RUN=$((RUN + 1))
rflags=${config%%|*}
wflags=
[[ "$config" == *"|"* ]] && wflags=${config#*|}
start_up "$rflags" "$wflags"
echo
echo "-- run $RUN: router flags: $rflags; worker flags: ${wflags:-none}"
python3 - "$((PORT + 1))" "$DOCS" "$DOC_BYTES" "$PER" "$REQUESTS" "$PAUSE_S" <<'PY'
import http.client, json, os, random, sys, time

port, ndocs, doc_bytes, per, nreq = (int(a) for a in sys.argv[1:6])
pause = float(sys.argv[6])

def call(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        raise SystemExit("%s: %d %s" % (path, r.status, data[:300]))
    return json.loads(data)

# documents: DOC_BYTES of each licence text in name order, cut at a line end
docs = []
root = "/usr/share/common-licenses"
for name in sorted(os.listdir(root)):
    p = os.path.join(root, name)
    if len(docs) == ndocs or not os.path.isfile(p):
        continue
    text = open(p, encoding="utf-8", errors="replace").read()
    if len(text) < doc_bytes:
        continue
    cut = text[:doc_bytes]
    cut = cut[: cut.rfind("\n") + 1] or cut
    if cut.strip():
        docs.append(cut)
if len(docs) < ndocs:
    raise SystemExit("only %d documents in %s" % (len(docs), root))
# whole pages of each document alone: what a worker can reuse of it
pages = []
for d in docs:
    n = len(call("/tokenize", {"prompt": d, "add_special_tokens": False})["tokens"])
    pages.append(n // 16 * 16)

rng = random.Random(33)
seen = set()
reused = possible = reused_seen = possible_seen = 0
by_worker, ttft = {}, []
for i in range(nreq):
    pick = rng.sample(range(ndocs), per)
    lead = "Request %d. The documents below were retrieved for the question after them.\n" % i
    text, chunks = lead, []
    for k in pick:
        chunks.append([len(text.encode()), len(docs[k].encode())])
        text += docs[k]
    text += "Question: which of these documents mentions a warranty?"
    t0 = time.monotonic()
    o = call("/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0,
                                 "kvmesh": {"chunks": chunks}})
    ttft.append(time.monotonic() - t0)
    got = o["usage"].get("prompt_tokens_details", {}).get("chunk_tokens", 0)
    w = o.get("kvmesh", {}).get("worker", "?")
    by_worker[w] = by_worker.get(w, 0) + 1
    can = sum(pages[k] for k in pick)
    can_seen = sum(pages[k] for k in pick if k in seen)
    reused += got
    possible += can
    reused_seen += got
    possible_seen += can_seen
    seen.update(pick)
    time.sleep(pause)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]

print("  chunk tokens reused: %d of %d (%.1f%%); of documents seen before: %d of %d (%.1f%%)" %
      (reused, possible, 100.0 * reused / max(possible, 1), reused_seen, possible_seen,
       100.0 * reused_seen / max(possible_seen, 1)))
print("  requests per worker: " + ", ".join("%s %d" % kv for kv in sorted(by_worker.items())))
print("  request time p50 %.2f s, p90 %.2f s" % (pct(ttft, .5), pct(ttft, .9)))
c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
c.request("GET", "/metrics")
pulls = {}
for line in c.getresponse().read().decode().splitlines():
    if line.startswith("kvmesh_router_chunk_pulls_total{"):
        pulls[line.split('"')[1]] = int(float(line.split()[-1]))
print("  chunk pulls (router decisions): " +
      ", ".join("%s %d" % kv for kv in sorted(pulls.items())))
PY
stop_up
done

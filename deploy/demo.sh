#!/usr/bin/env bash
# demo.sh — `make demo`: a whole kvmesh cluster on this machine (`kvmesh up`: a router and two
# workers on 127.0.0.1) answering real prompts with the default model. Shows which worker served
# each request, how much of each prompt came from cached KV (requests of one tenant share a
# system prompt, and the router sends them to the worker that holds it), TTFT and tokens/s, the
# OpenAI-compatible API streaming, the cluster status, a recovery level forced through the
# controller on the worker holding tenant acme's prompt (its KV to fp8, then drained and restarted
# by `kvmesh up`: its drain hands its cached pages to the other worker over the KV mesh, which is
# on by default, so acme's next request is a hit there), then stops everything as Ctrl-C would.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin
export KVMESH_MODEL=${KVMESH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
WORKERS=${KVMESH_DEMO_WORKERS:-2}
FRONT_PORT=${KVMESH_DEMO_FRONT_PORT:-7000}
HTTP_PORT=${KVMESH_DEMO_HTTP_PORT:-8080}
BASE_PORT=${KVMESH_DEMO_BASE_PORT:-7100}
CTL_PORT=${KVMESH_DEMO_CONTROLLER_PORT:-7200}
CONTROLLER=tcp://127.0.0.1:$CTL_PORT
LOGS=build/demo-logs
ROUTER=tcp://127.0.0.1:$FRONT_PORT
HTTP=http://127.0.0.1:$HTTP_PORT
THREADS=$(( $(nproc) / WORKERS )); [ "$THREADS" -ge 1 ] || THREADS=1

echo "== kvmesh demo: $KVMESH_MODEL, $WORKERS workers x $THREADS threads (logs in $LOGS/)"
rm -rf "$LOGS"
# `kvmesh up` makes the cluster's keys in RUN/keys (docs/security.md): the demo's chat uses the
# client key, recover and status --controller the operator key
RUN=$(mktemp -d /tmp/kvmesh-demo-XXXXXX)
CLIENT_CERT=$RUN/keys/private/client.key
ADMIN_CERT=$RUN/keys/private/admin.key
# and HTTP API keys for the OpenAI front: the client's for completions, the operator's for status
api_key() { cat "$RUN/keys/private/api_key.$1" 2>/dev/null || true; }
"$BIN/kvmesh" up --workers "$WORKERS" --threads "$THREADS" --front-port "$FRONT_PORT" \
    --http-port "$HTTP_PORT" --base-port "$BASE_PORT" --controller-port "$CTL_PORT" --log-dir "$LOGS" \
    --run-dir "$RUN" &
UP=$!
cleanup() { kill -INT "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }
trap cleanup EXIT

# ready when the router answers and every worker is up behind it
for _ in $(seq 1 300); do
    n=$("$BIN/kvmesh" status --http "$HTTP" --api-key "$(api_key admin)" --json 2>/dev/null |
        grep -o '"up":true' | wc -l || true)
    [ "$n" -ge "$WORKERS" ] && break
    sleep 0.2
done
[ "$n" -ge "$WORKERS" ] || { echo "demo: the cluster did not come up (see $LOGS/)"; exit 1; }

LAST=$RUN/last-answer
ask() { # tenant system-prompt question; the stats line ("[worker ID | ...") also lands in $LAST
    echo
    echo "-- [$1] $3"
    echo "$3" | "$BIN/kvmesh" chat --router "$ROUTER" --cert "$CLIENT_CERT" --cache-salt "$1" --system "$2" \
        --max-tokens 48 --temperature 0 2> >(tee "$LAST" >&2)
    sleep 0.1 # the stats line's tee
}
served_by() { sed -n 's/^\[worker \([^ ]*\) .*/\1/p' "$LAST" | tail -1; }
SYS_A="You are the support assistant of Acme Rockets. Acme sells model rockets, launch pads and \
engines. Be concise and friendly. Never promise delivery dates. Answer in one or two sentences. \
Refunds are possible within 30 days. Engines must be shipped by ground. Our office is in Tucson."
SYS_B="You are a geography tutor for school children. Explain simply, give one fact per answer, \
and end with a short question that checks understanding. Use metric units."
ask acme "$SYS_A" "Can I get a refund for a broken launch pad?"
ask school "$SYS_B" "What is the capital of France?"
ask acme "$SYS_A" "How are rocket engines shipped?"
ask school "$SYS_B" "Which river flows through Paris?"
ask acme "$SYS_A" "Where is your office?"

echo
echo "-- the same cluster through the OpenAI-compatible API (streamed, SSE):"
curl -sN "$HTTP/v1/chat/completions" -H 'Content-Type: application/json' \
    -H "Authorization: Bearer $(api_key client)" -d '{
  "messages":[{"role":"user","content":"Write a haiku about caches."}],
  "max_tokens":32,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}' |
    sed -n 's/^data: //p' | head -c 100000 | python3 -c '
import json, sys
text, usage = "", None
for line in sys.stdin:
    line = line.strip()
    if not line or line == "[DONE]": continue
    o = json.loads(line)
    for c in o.get("choices", []):
        text += c.get("delta", {}).get("content") or ""
    usage = o.get("usage") or usage
print(text.strip())
print("usage:", json.dumps(usage))' 2>/dev/null || echo "(python3 not found: skipped)"

echo
echo "-- kvmesh status"
"$BIN/kvmesh" status --http "$HTTP" --api-key "$(api_key admin)"

echo
HOLDER=$(served_by) # acme's worker ("Where is your office?" was the last question asked)
HOLDER=${HOLDER:-w1}
echo "-- recovery, forced by hand on $HOLDER (it holds acme's prompt): level 2 (its KV to fp8 in"
echo "   place), then level 3 (drain, its cached pages handed to its peer, restart)"
"$BIN/kvmesh" recover --controller "$CONTROLLER" --cert "$ADMIN_CERT" --worker "$HOLDER" --level 2 || true
ask acme "$SYS_A" "Do you ship to Europe?"
"$BIN/kvmesh" recover --controller "$CONTROLLER" --cert "$ADMIN_CERT" --worker "$HOLDER" --level 3 || true
for _ in $(seq 1 150); do # until the controller's view has it back: restarted and ready
    "$BIN/kvmesh" status --controller "$CONTROLLER" --cert "$ADMIN_CERT" --json 2>/dev/null |
        grep -q '"restarted"' && break
    sleep 0.2
done
echo
echo "-- acme again, after $HOLDER's restart: served by its peer from the pages $HOLDER handed over"
ask acme "$SYS_A" "Can I pay by card?"
echo "   (acme's prompt was last computed on $HOLDER; this request ran on $(served_by))"
echo
echo "-- kvmesh status --controller (member states, recovery levels and history)"
"$BIN/kvmesh" status --controller "$CONTROLLER" --cert "$ADMIN_CERT"
echo
echo "-- stopping the cluster (what Ctrl-C on kvmesh up does)"
cleanup
trap - EXIT
echo "demo: done"

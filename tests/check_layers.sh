#!/usr/bin/env bash
# check_layers.sh COMPONENT LIB — a component's files are layers and calls go one way: a file may
# call the functions of the files on the lines below its own, never those on its line or above
# (docs/kvshard.md "Layers", docs/architecture.md for worker/ and router/). Read from the compiled
# library (nm), so a call that goes back up fails `make check-layers` (part of `make test`)
# whatever the sources look like. The layers of every checked component are listed here, top
# first.
set -euo pipefail
comp=${1:?usage: check_layers.sh COMPONENT LIB}
lib=${2:?usage: check_layers.sh COMPONENT LIB}
case $comp in
kvshard)
    layers=(
        "store"              # top: create/destroy
        "xfer"               # page transfer support: exports, imports (on sequences and attach)
        "tier convert check" # attach, persist; level 2; kv_store_check
        "seq"                # sequences: page tables, reserve, publish, hot path
        "evict"              # pages no sequence holds: victims, demotion, room-making allocation
        "disk"               # the disk tier's page files
        "index"              # the prefix index
        "promote"            # the promoter thread
        "format"             # encodings, conversion, sealing
        "xsum"               # the transfer checksum, a page's transfer description
        "page"               # page memory and accounting
        "arena"              # the page-memory arena page.c cuts buffers from
        "events diskfmt"     # leaves
    )
    ;;
worker)
    layers=(
        "service"           # top: create/destroy, the loop, frames in, drain
        "gate"              # the thread that owns the requests ROUTER
        "service_admin"     # admin commands; the gate's answers during a step
        "service_heartbeat" # gauges, the heartbeat snapshot, the pulse thread
        "service_peer"      # the transfer node, requests held for a pull
        "service_pd"        # disaggregated requests: a prefill worker's pages pulled as sealed
        "service_serve"     # kv_pull served as a holder
        "service_handoff"   # the controller's view, drain handoff, warm-up
        "links"             # links to holders, pulls started over them
        "service_requests"  # requests in flight, the scheduler's callbacks
        "events"            # KV events, replay, snapshots
        "frames metrics"    # frames out and refusals counted; the series
        "state"             # the state, shared names and KV facts
    )
    ;;
router)
    layers=(
        "router"   # top: create/destroy, the loop that drains every socket
        "front"    # the HTTP front (OpenAI API, status)
        "clients"  # the ZeroMQ front: req, cancel, client connections
        "view"     # the controller's view, which workers exist and get requests
        "workers"  # one link per worker: its frames, liveness, KV event stream
        "relay"    # a worker's tok/done/err back to the client; migration
        "prompt"   # text to tokens, then the request starts
        "dispatch" # choosing a worker, the router queue's pump, parking
        "requests" # the request table and queue, the end of a request, replies
        "metrics"  # the Prometheus series
        "pull pd"  # pull or recompute (prefixes and chunks); disaggregation
        "chunks"   # chunk chains and credit
        "evstream index policy openai fair tenants" # leaves
        "openai_tools openai_chunks" # structured outputs (response_format), chunks; under openai
        "state"    # the clock and the loop's hooks
    )
    ;;
*)
    echo "check-layers: no layers listed for '$comp' in $0" >&2
    exit 1
    ;;
esac
declare -A rank owner
for r in "${!layers[@]}"; do
    for f in ${layers[$r]}; do rank[$f]=$r; done
done
# "libkvshard.a:page.o:0000000000000000 T kv_buf_get" / "libkvshard.a:page.o:                 U free"
while read -r loc kind sym; do
    f=${loc#*:} f=${f%%.o:*}
    [[ -n ${rank[$f]:-} ]] || { echo "check-layers: $comp/$f.c has no layer in $0" >&2; exit 1; }
    [[ $kind == [TDBR] ]] && owner[$sym]=$f
done < <(nm -A --defined-only -g "$lib")
bad=0
while read -r loc kind sym; do
    f=${loc#*:} f=${f%%.o:*} g=${owner[$sym]:-}
    [[ -n $g && $g != "$f" ]] || continue
    if (( ${rank[$g]} <= ${rank[$f]} )); then
        echo "check-layers: $comp/$f.c calls $sym of $comp/$g.c, which is not below it" >&2
        bad=1
    fi
done < <(nm -A -u "$lib")
exit $bad

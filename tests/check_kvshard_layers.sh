#!/usr/bin/env bash
# check_kvshard_layers.sh [LIBKVSHARD] — kvshard's files are layers and calls go one way
# (docs/kvshard.md, "Layers"): a file may call the functions of the files on the lines below its
# own, never those on its line or above. Read from the compiled objects (nm), so a call that
# goes back up fails `make check-layers` (part of `make test`) whatever the sources look like.
set -euo pipefail
lib=${1:-build/lib/libkvshard.a}
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
declare -A rank owner
for r in "${!layers[@]}"; do
    for f in ${layers[$r]}; do rank[$f]=$r; done
done
# "libkvshard.a:page.o:0000000000000000 T kv_buf_get" / "libkvshard.a:page.o:                 U free"
while read -r loc kind sym; do
    f=${loc#*:} f=${f%%.o:*}
    [[ -n ${rank[$f]:-} ]] || { echo "check-layers: kvshard/$f.c has no layer in $0" >&2; exit 1; }
    [[ $kind == [TDBR] ]] && owner[$sym]=$f
done < <(nm -A --defined-only -g "$lib")
bad=0
while read -r loc kind sym; do
    f=${loc#*:} f=${f%%.o:*} g=${owner[$sym]:-}
    [[ -n $g && $g != "$f" ]] || continue
    if (( ${rank[$g]} <= ${rank[$f]} )); then
        echo "check-layers: kvshard/$f.c calls $sym of kvshard/$g.c, which is not below it" >&2
        bad=1
    fi
done < <(nm -A -u "$lib")
exit $bad

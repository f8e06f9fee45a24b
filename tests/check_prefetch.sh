#!/usr/bin/env bash
# check_prefetch.sh [OBJDIR] — every kernel object whose sources ask for a software prefetch
# (_mm_prefetch in the .c or a header it includes, read from the compiler's .d file) carries
# prefetch instructions. GCC deletes the calls of a static function whose only effect is a
# prefetch (it finds the function has none): the SIMD attention ran without its prefetches from
# ace3e47 to 2026-11-28 while every test passed, since a prefetch changes no result. Part of
# `make test` (check-prefetch).
set -euo pipefail
dir=${1:-build/obj/kernels/cpu}
n=0
for d in "$dir"/*.d; do
    o=${d%.d}.o
    [[ -f $o ]] || continue
    # the .d file: "obj: src hdr ... \" lines, then "hdr:" lines; the first rule lists them all
    srcs=$(sed -n '1,/[^\\]$/p' "$d" | tr -d '\\' | cut -d: -f2-)
    # shellcheck disable=SC2086
    grep -l '_mm_prefetch' $srcs >/dev/null 2>&1 || continue
    count=$(objdump -d "$o" | grep -c 'prefetch' || true)
    if [[ $count -eq 0 ]]; then
        echo "check-prefetch: $o has no prefetch instruction although its sources ask for one" \
             "(a prefetch inside a static function that is not always inlined is deleted)" >&2
        exit 1
    fi
    n=$((n + 1))
done
[[ $n -gt 0 ]] || { echo "check-prefetch: no kernel object with prefetches under $dir" >&2; exit 1; }
echo "check-prefetch: $n kernel objects carry their prefetches"

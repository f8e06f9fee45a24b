#!/usr/bin/env bash
# Obtains and builds llama.cpp, kvmesh's correctness and speed reference, into
# third_party/llama.cpp (git-ignored). Idempotent: when every tool kvmesh uses is already in
# third_party/llama.cpp/build/bin it does nothing.
#
# Where the source comes from: the PyPI sdist of llama-cpp-python, pinned by version and sha256,
# which vendors llama.cpp's full source under vendor/llama.cpp (only PyPI and Debian are
# reachable from the machines kvmesh is built on). Which llama.cpp commit that is: the sdist's
# CHANGELOG.md ("update llama.cpp to ggml-org/llama.cpp@<commit>"), pinned below as well.
#
# Usage:
#   bench/build_llamacpp.sh            obtain + build if needed
#   bench/build_llamacpp.sh --version  print the pinned version line and exit
# Environment: JOBS (default 2), FORCE=1 (re-run the cmake build even if the tools exist),
#              LLAMA_CPP_DIR (default third_party/llama.cpp).
#
# Needs: python3 with pip, cmake, a C/C++ compiler (Debian: cmake g++ python3-pip).
set -euo pipefail

LLAMACPP_PY_VERSION="0.3.36"
LLAMACPP_SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMACPP_COMMIT="0c1e57098" # ggml-org/llama.cpp, from the sdist's CHANGELOG.md

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA="${LLAMA_CPP_DIR:-$ROOT/third_party/llama.cpp}"
BUILD="$LLAMA/build"
JOBS="${JOBS:-2}"
TOOLS=(llama-tokenize llama-perplexity llama-bench llama-batched-bench llama-simple llama-cli llama-completion
    llama-server)

die() {
    echo "build_llamacpp.sh: error: $*" >&2
    exit 1
}
say() { echo "build_llamacpp.sh: $*" >&2; }

if [ "${1:-}" = "--version" ]; then
    echo "llama-cpp-python ${LLAMACPP_PY_VERSION} sdist (sha256 ${LLAMACPP_SDIST_SHA256}) vendoring ggml-org/llama.cpp@${LLAMACPP_COMMIT}"
    exit 0
fi
[ $# -eq 0 ] || die "unknown argument '$1' (usage: build_llamacpp.sh [--version])"

missing_tools() {
    local t out=()
    for t in "${TOOLS[@]}"; do
        [ -x "$BUILD/bin/$t" ] || out+=("$t")
    done
    echo "${out[*]:-}"
}

if [ "${FORCE:-0}" != 1 ] && [ -z "$(missing_tools)" ]; then
    say "llama.cpp already built in $BUILD/bin (FORCE=1 to rebuild)"
    exit 0
fi

# One build at a time: a second caller waits for the first.
mkdir -p "$(dirname "$LLAMA")"
exec 9>"$(dirname "$LLAMA")/.build_llamacpp.lock"
if ! flock -n 9; then
    say "another build_llamacpp.sh is running; waiting for it"
    flock 9
    if [ "${FORCE:-0}" != 1 ] && [ -z "$(missing_tools)" ]; then
        say "llama.cpp was built by the other run"
        exit 0
    fi
fi

command -v cmake >/dev/null || die "cmake not found (Debian: apt-get install cmake g++)"
command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler found (Debian: apt-get install g++)"

# ------------------------------------------------------------------ source
if [ ! -f "$LLAMA/CMakeLists.txt" ] || [ ! -f "$LLAMA/include/llama.h" ]; then
    command -v python3 >/dev/null || die "python3 not found (Debian: apt-get install python3-pip)"
    python3 -m pip --version >/dev/null 2>&1 || die "pip not found (Debian: apt-get install python3-pip)"
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    say "downloading the llama-cpp-python ${LLAMACPP_PY_VERSION} sdist from PyPI"
    # The file straight from PyPI's simple index (seconds); `pip download --no-binary :all:` builds
    # the sdist's build dependencies from source just to read its metadata (~6 minutes on 2
    # cores), so it is only the fallback. Either way the sha256 below is checked.
    python3 - "$LLAMACPP_PY_VERSION" "$TMP" >"$TMP/fetch.log" 2>&1 <<'PY' ||
import re, sys, urllib.request
ver, dst = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{ver}.tar.gz"
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/", headers={"Accept": "text/html"})
page = urllib.request.urlopen(req, timeout=60).read().decode()
urls = [u for u in re.findall(r'href="([^"]+)"', page) if u.split("#")[0].endswith("/" + name)]
if not urls:
    sys.exit(f"{name} is not on the simple index")
with urllib.request.urlopen(urls[0].split("#")[0], timeout=300) as r, open(f"{dst}/{name}", "wb") as f:
    f.write(r.read())
PY
        {
            say "direct download failed ($(tail -1 "$TMP/fetch.log")); trying pip download"
            python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==${LLAMACPP_PY_VERSION}" -d "$TMP" \
                >"$TMP/pip.log" 2>&1 || {
                cat "$TMP/pip.log" >&2
                die "pip download of llama-cpp-python==${LLAMACPP_PY_VERSION} failed (is PyPI reachable?)"
            }
        }
    SDIST="$TMP/llama_cpp_python-${LLAMACPP_PY_VERSION}.tar.gz"
    [ -f "$SDIST" ] || die "pip did not produce $SDIST (got: $(ls "$TMP"))"
    got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
    [ "$got" = "$LLAMACPP_SDIST_SHA256" ] ||
        die "sha256 mismatch for $(basename "$SDIST"): got $got, want $LLAMACPP_SDIST_SHA256"
    say "unpacking vendor/llama.cpp into $LLAMA"
    top="llama_cpp_python-${LLAMACPP_PY_VERSION}"
    tar -xzf "$SDIST" -C "$TMP" "$top/vendor/llama.cpp" "$top/CHANGELOG.md" ||
        die "unpacking $SDIST failed"
    grep -q "llama.cpp@${LLAMACPP_COMMIT}" "$TMP/$top/CHANGELOG.md" ||
        say "warning: CHANGELOG.md of the sdist does not name llama.cpp@${LLAMACPP_COMMIT}"
    if [ -e "$LLAMA" ]; then
        [ -z "$(ls -A "$LLAMA")" ] ||
            die "$LLAMA exists but is not a llama.cpp source tree (no CMakeLists.txt/include/llama.h); remove it and re-run"
        rmdir "$LLAMA"
    fi
    mv "$TMP/$top/vendor/llama.cpp" "$LLAMA"
    # The sdist carries a .git file pointing into llama-cpp-python's submodule store, which does
    # not exist here; git commands inside the tree would fail confusingly.
    rm -f "$LLAMA/.git"
    cat >"$LLAMA/KVMESH_SOURCE" <<EOF
llama-cpp-python ${LLAMACPP_PY_VERSION} sdist from PyPI, sha256 ${LLAMACPP_SDIST_SHA256}
llama.cpp commit ggml-org/llama.cpp@${LLAMACPP_COMMIT} (from the sdist's CHANGELOG.md)
unpacked $(date -u +%Y-%m-%dT%H:%M:%SZ) by bench/build_llamacpp.sh
EOF
fi

# ------------------------------------------------------------------ build
say "configuring $BUILD"
(
    cd "$LLAMA"
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
) >"$BUILD.cmake.log" 2>&1 || {
    tail -40 "$BUILD.cmake.log" >&2
    die "cmake configure failed (full log: $BUILD.cmake.log)"
}
say "building ${TOOLS[*]} with -j$JOBS (log: $BUILD.build.log; this takes a while on few cores)"
(
    cd "$LLAMA"
    nice cmake --build build -j"$JOBS" --target "${TOOLS[@]}"
) >"$BUILD.build.log" 2>&1 || {
    grep -E 'error|Error' "$BUILD.build.log" | head -40 >&2 || true
    tail -20 "$BUILD.build.log" >&2
    die "cmake build failed (full log: $BUILD.build.log)"
}

left="$(missing_tools)"
[ -z "$left" ] || die "build finished but these tools are missing from $BUILD/bin: $left"
say "llama.cpp built: $BUILD/bin ($(bash "$0" --version))"

#!/usr/bin/env bash
# gpu_check.sh — `make gpu-check`: everything kvmesh checks on a GPU, in one call that fits a lent
# GPU machine's lease (docs/gpu.md, "gpu-check"). Builds what it needs from this tree with nvcc and
# a C compiler only (no package installs, no model: kvmesh-gguf-gen writes the ones it uses), runs
# every GPU test program (tests/gpu/test_*.c: this issue's and the KV cache's) and PyTorch's
# figures for the same shapes (bench/gpu_torch_ref.py), and prints the table of errors and speeds
# last.
#
# Without nvcc it says so and exits 0; with nvcc but no GPU (a CI or build machine) it builds
# everything (a compile check), the tests say SKIP, and it exits 0. A failing check exits 1.
# Logs and the table also go to $GPU_CHECK_OUT (default: $OUT where the device tool sets it, else
# build/gpu-check). Each test runs under a time limit (GPU_CHECK_TEST_TIMEOUT, 300 s).
# GPU_CHECK_NO_MAKE=1 takes the path of a machine without make (the build by hand below).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
out=${GPU_CHECK_OUT:-${OUT:-build/gpu-check}}
mkdir -p "$out"
log="$out/gpu_check.log"
table="$out/gpu_table.txt"
: >"$log"
: >"$table"
say() { echo "gpu-check: $*" | tee -a "$log"; }

nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -z "$nvcc" ]; then
    say "no nvcc on this machine: nothing built, nothing run (CUDA is optional; docs/gpu.md)"
    exit 0
fi
gpu=$(nvidia-smi -L 2>/dev/null | head -1 || true)
say "nvcc: $("$nvcc" --version | tail -1)"
say "GPU: ${gpu:-none found (nvidia-smi -L); building only, the tests will say SKIP}"
[ -n "$gpu" ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
    --format=csv,noheader 2>&1 | sed 's/^/gpu-check: /' | tee -a "$log"

# The build: make where it exists (the same rules as everywhere), else the same commands by hand.
jobs=$(nproc 2>/dev/null || echo 2)
[ -n "$gpu" ] || jobs=2
if [ -z "${GPU_CHECK_NO_MAKE:-}" ] && command -v make >/dev/null; then
    make -j"$jobs" --no-print-directory CUDA=1 NVCC="$nvcc" gpu-programs >>"$log" 2>&1 || {
        tail -30 "$log"
        say "build failed (log: $log)"
        exit 1
    }
    gpubin=build/gpu
    gen=build/bin/kvmesh-gguf-gen
else
    say "no make here: building with nvcc and cc directly into build/gpu-direct"
    d=build/gpu-direct
    mkdir -p "$d"
    cc=${CC:-$(command -v gcc || command -v cc)}
    gencode="-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80"
    trap 'say "build by hand failed (log: $log)"; tail -20 "$log"' ERR
    set -e
    cuda_home=$(dirname "$(dirname "$nvcc")")
    objs=()
    for f in kernels/cuda/*.cu; do
        "$nvcc" -O3 -std=c++17 -I. $gencode -c "$f" -o "$d/${f//\//_}.o" >>"$log" 2>&1
        objs+=("$d/${f//\//_}.o")
    done
    for f in kernels/cpu/ops_ref.c kernels/cpu/quant_ref.c kernels/cpu/attn_kv_ref.c model/types.c \
        model/gguf_gen.c common/err.c tools/gguf_gen.c; do
        "$cc" -std=gnu11 -O2 -I. -c "$f" -o "$d/${f//\//_}.o" >>"$log" 2>&1
    done
    refs=("$d"/kernels_cpu_ops_ref.c.o "$d"/kernels_cpu_quant_ref.c.o "$d"/kernels_cpu_attn_kv_ref.c.o
        "$d"/model_types.c.o)
    for t in tests/gpu/test_*.c; do
        n=$(basename "$t" .c)
        "$cc" -std=gnu11 -O2 -I. -isystem "$cuda_home/include" -c "$t" -o "$d/$n.o" >>"$log" 2>&1
        "$cc" -o "$d/$n" "$d/$n.o" "${objs[@]}" "${refs[@]}" -L"$cuda_home/lib64" -lcudart_static \
            -ldl -lrt -lpthread -lstdc++ -lm >>"$log" 2>&1
    done
    "$cc" -o "$d/kvmesh-gguf-gen" "$d"/tools_gguf_gen.c.o "$d"/model_gguf_gen.c.o \
        "$d"/model_types.c.o "$d"/common_err.c.o -lm >>"$log" 2>&1
    set +e
    trap - ERR
    gpubin=$d
    gen=$d/kvmesh-gguf-gen
fi
say "built in $(($(date +%s) - t0)) s"

# Generated models: how long the shapes the engine benchmarks will use take to write here.
models=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-gpu-check.XXXXXX")
trap 'rm -rf "$models"' EXIT
failed=0
specs=("tiny Q8_0")
[ -n "$gpu" ] && specs+=("1b Q4_K")
for spec in "${specs[@]}"; do
    set -- $spec
    s=$(date +%s%N)
    if "$gen" --shape "$1" --type "$2" --seed 1 -o "$models/$1-$2.gguf" >>"$log" 2>&1; then
        say "kvmesh-gguf-gen --shape $1 --type $2: $(du -h "$models/$1-$2.gguf" | cut -f1) in" \
            "$((($(date +%s%N) - s) / 1000000)) ms"
    else
        say "kvmesh-gguf-gen --shape $1 --type $2 FAILED (log: $log)"
        failed=1
    fi
    rm -f "$models/$1-$2.gguf"
done

for t in "$gpubin"/test_*; do
    [ -x "$t" ] || continue
    n=$(basename "$t")
    say "== $n"
    KVMESH_GPU_TABLE="$table" timeout "${GPU_CHECK_TEST_TIMEOUT:-300}" "$t" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        say "$n FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ': time limit'))"
        failed=1
    fi
done

# The ceilings (copy bandwidth, bf16 matrix rate) and PyTorch's matvec on the same shape, where
# the machine has PyTorch (the GPU image does); a reference only, so its failure fails nothing.
if [ -n "$gpu" ] && command -v python3 >/dev/null; then
    say "== bench/gpu_torch_ref.py"
    KVMESH_GPU_TABLE="$table" PYTHONUNBUFFERED=1 timeout 180 python3 bench/gpu_torch_ref.py 2>&1 |
        tee -a "$log" || say "bench/gpu_torch_ref.py did not finish (a reference only; log: $log)"
fi

say "done in $(($(date +%s) - t0)) s; log $log"
if [ -s "$table" ]; then
    echo
    cat "$table"
fi
if [ "$failed" -ne 0 ]; then
    say "SOME GPU CHECKS FAILED"
elif [ -z "$gpu" ]; then
    say "no GPU here: built and compile-checked only, no GPU test ran"
else
    say "all GPU checks passed on $gpu"
fi
exit "$failed"

# shellcheck shell=bash
# bench_lib.sh — what the bench scripts share (sourced, not run): the machine's description that
# goes next to every figure, llama.cpp's weight-repacking probe, one kvmesh-worker started in the
# background and waited for, and `kvmesh up` clusters: started, waited for, read (cluster.env,
# /metrics) and stopped, configurations repeated in turn. Each script sets BENCH_NAME (its own
# name, for messages) first.

bench_die() {
    echo "${BENCH_NAME:-bench}: error: $*" >&2
    exit 1
}
bench_say() { echo "${BENCH_NAME:-bench}: $*" >&2; }

# The 1-, 5- and 15-minute load averages.
bench_load() { cut -d' ' -f1-3 /proc/loadavg; }

# The CPU: model name, family and model numbers, and the ISA flags the kernels choose between.
bench_cpu() {
    local name
    name="$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
    echo "$name (family $(grep -m1 'cpu family' /proc/cpuinfo | sed 's/.*: //'), model $(grep -m1 '^model[[:space:]]' /proc/cpuinfo | sed 's/.*: //'); $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx2|fma|f16c|avx512f|avx512_vnni|amx_int8' | tr '\n' ' ' | sed 's/ $//'))"
}

# llama.cpp's weight repacking, auto|0|1 ($1) for model $2 with $3 threads, probe output under
# directory $4: prints 1 or 0. By default llama.cpp puts weights in "extra" buffers (AMX tiles
# where the CPU reports AMX, repacked AVX layouts otherwise); on some machines the AMX path dies
# with SIGSEGV/#GP, and then the fair comparison is llama.cpp without it (--repack 0 / -nr).
bench_llama_repack() {
    local rc=0
    case "$1" in
        auto)
            third_party/llama.cpp/build/bin/llama-bench -m "$2" -t "$3" -p 8 -n 1 -r 1 --repack 1 -o json \
                >"$4/probe.json" 2>"$4/probe.log" || rc=$?
            if [ "$rc" = 0 ]; then
                echo 1
            else
                bench_say "llama.cpp failed with weight repacking on (exit $rc, see $4/probe.log); using --repack 0"
                echo 0
            fi
            ;;
        0 | 1) echo "$1" ;;
        *) bench_die "LLAMA_REPACK must be auto, 0 or 1" ;;
    esac
}

# Starts build/bin/kvmesh-worker (or WORKER_BIN) in the background with MODEL, THREADS, a requests endpoint on
# 127.0.0.1 (port $1; 0 picks a free one), KV events off, logs appended to $2, its ports file at
# $3, --insecure (the benches speak plain ZeroMQ), then the remaining arguments; waits up to 60 s
# for the ports file. Sets WORKER_PID; WORKER_REQ and WORKER_ADMIN come from the ports file (the
# admin endpoint is off unless the arguments give --admin-port).
bench_start_worker() {
    local port="$1" log="$2" ports="$3"
    shift 3
    rm -f "$ports"
    "${WORKER_BIN:-build/bin/kvmesh-worker}" --model "$MODEL" --threads "$THREADS" --listen "tcp://127.0.0.1:$port" \
        --events "" --admin-port -1 --ports-file "$ports" --log-level warn --insecure "$@" >>"$log" 2>&1 &
    WORKER_PID=$!
    for _ in $(seq 1 600); do
        if [ -s "$ports" ]; then
            # shellcheck disable=SC2034 # read by the scripts that source this
            WORKER_REQ=$(sed -n 's/^requests=//p' "$ports")
            # shellcheck disable=SC2034
            WORKER_ADMIN=$(sed -n 's/^admin=//p' "$ports")
            return 0
        fi
        kill -0 "$WORKER_PID" 2>/dev/null || bench_die "kvmesh-worker exited (see $log)"
        sleep 0.1
    done
    bench_die "kvmesh-worker did not come up (see $log)"
}

# Stops the background process whose pid the variable named $1 holds (signal $2, TERM by default;
# its own pid only), waits for it and empties the variable; nothing when it is empty.
bench_stop_pid() {
    local pid=${!1:-}
    if [ -n "$pid" ]; then
        kill -"${2:-TERM}" "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    printf -v "$1" '%s' ''
}

# Stops the worker bench_start_worker started.
bench_stop_worker() { bench_stop_pid WORKER_PID; }

# The first line of a bench's output: "== kvmesh TITLE (the CPU, cores, date, load average)".
bench_header() {
    echo "== kvmesh $1 ($(bench_cpu), $(nproc) cores, $(date -u +%Y-%m-%dT%H:%MZ), load $(bench_load))"
}

# BENCH_RUNS: the ';'-separated configurations $1, all of them $2 times in turn, so that the
# configurations compared meet the same machine load; BENCH_CONFIGS: how many there are (run i,
# from 0, is repetition i / BENCH_CONFIGS + 1).
bench_runs() {
    local one
    IFS=';' read -r -a one <<<"$1"
    # shellcheck disable=SC2034 # read by the scripts that source this
    BENCH_CONFIGS=${#one[@]}
    BENCH_RUNS=()
    for _ in $(seq 1 "$2"); do BENCH_RUNS+=("${one[@]}"); done
}

# Field $3 of the process with id $2 in run dir $1's cluster.env (kvmesh up's).
bench_field() {
    grep "id=$2 " "$1/cluster.env" | tr ' ' '\n' | awk -F= -v k="$3" '$1 == k {print substr($0, length(k) + 2)}'
}

# The value of the series $2 (name and labels exactly) in $1/metrics, 0 when absent.
bench_metric() {
    curl -s "$1/metrics" | awk -v s="$2" '$1 == s {print $2; f=1} END {if (!f) print 0}'
}

# Starts `kvmesh up --insecure --base-port 0` in the background (UP: its pid) with the daemons'
# logs in $1/logs, its run dir $1/run and its own output in $1/up.log, then the remaining
# arguments; waits up to 180 s for "cluster ready:" (every worker and router answers /readyz).
# BENCH_RQ and BENCH_HTTP: the router's requests endpoint and HTTP base URL. Insecure on purpose:
# the benches measure serving, not CURVE.
bench_up_start() {
    local dir=$1
    shift
    mkdir -p "$dir"
    "${BIN:-build/bin}/kvmesh" up --insecure --base-port 0 --log-dir "$dir/logs" --run-dir "$dir/run" \
        "$@" >"$dir/up.log" 2>&1 &
    UP=$!
    for _ in $(seq 1 900); do
        if grep -q "cluster ready:" "$dir/up.log" 2>/dev/null; then
            # shellcheck disable=SC2034 # read by the scripts that source this
            BENCH_RQ=$(bench_field "$dir/run" router requests)
            # shellcheck disable=SC2034
            BENCH_HTTP=$(bench_field "$dir/run" router http)
            return 0
        fi
        kill -0 "$UP" 2>/dev/null || break
        sleep 0.2
    done
    bench_die "the cluster did not come up (see $dir)"
}

# Stops the cluster bench_up_start started: SIGINT to kvmesh up (it stops its daemons), waited for.
bench_up_stop() { bench_stop_pid UP INT; }

# podman-env.sh — sourced by the image scripts: finds podman and fits it to this host.
# Sets PODMAN (the command with any flags) and CONTAINERS_CONF, and says what it changed:
#  - the hard open-files limit below podman's default for root (nofile=1048576): runc cannot
#    raise it (EPERM), so containers get the host's own limits instead (default_ulimits = []);
#  - a cgroup v1 or hybrid hierarchy: crun refuses it, runc works, so runtime = "runc";
#  - no systemd as PID 1: no systemd cgroup manager, so cgroup_manager = "cgroupfs".
# Returns 1 (with the reason on stderr) when podman is missing or cannot run a container.
# shellcheck shell=bash

km_podman_setup() {
    local conf_dir=$1 notes=() runtime="" cgm="" ulim=""
    if ! command -v podman >/dev/null; then
        echo "podman not found (deploy/image-deps.sh image installs it)" >&2
        return 1
    fi
    mkdir -p "$conf_dir"
    if [ "$(ulimit -Hn)" != unlimited ] && [ "$(ulimit -Hn)" -lt 1048576 ]; then
        ulim=1
        notes+=("hard nofile limit $(ulimit -Hn) < 1048576: default_ulimits = [] (containers inherit the host's limits)")
    fi
    if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ]; then
        command -v runc >/dev/null || { echo "cgroup v1/hybrid host needs runc, which is missing" >&2; return 1; }
        runtime=runc
        notes+=("cgroup v1/hybrid hierarchy: runtime = runc (crun refuses it)")
    fi
    if [ ! -d /run/systemd/system ]; then
        cgm=cgroupfs
        notes+=("no systemd as PID 1: cgroup_manager = cgroupfs")
    fi
    {
        echo "# written by deploy/image/podman-env.sh for this host"
        echo "[containers]"
        [ -z "$ulim" ] || echo "default_ulimits = []"
        echo "[engine]"
        [ -z "$runtime" ] || echo "runtime = \"$runtime\""
        [ -z "$cgm" ] || echo "cgroup_manager = \"$cgm\""
        echo 'events_logger = "file"'
    } >"$conf_dir/containers.conf"
    export CONTAINERS_CONF=$conf_dir/containers.conf
    PODMAN=podman
    local n
    for n in "${notes[@]}"; do echo "podman: $n"; done
    echo "podman: CONTAINERS_CONF=$CONTAINERS_CONF"
}

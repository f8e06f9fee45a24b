# apt.sh — sourced by deploy/deps.sh and deploy/image-deps.sh: km_apt_install PKG... installs
# the Debian packages that are missing (none: says so), through sudo when not root. The caller
# defines say and die.
# shellcheck shell=bash
km_apt_install() {
    local missing=() p SUDO=""
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]} == 0)); then
        say "Debian packages present"
        return 0
    fi
    say "installing Debian packages: ${missing[*]}"
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "not root and no sudo: install ${missing[*]} by hand"
        SUDO=sudo
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq || die "apt-get update failed: check the network or /etc/apt/sources.list"
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        die "apt-get install failed for: ${missing[*]}"
}

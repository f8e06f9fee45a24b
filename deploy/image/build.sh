#!/usr/bin/env bash
# build.sh — `make image`: an OCI image of kvmesh made without any registry.
#
#  1. The runtime packages are read off the binaries: each NEEDED library of build/bin/* is
#     mapped to the Debian package that owns it on this (bookworm) host, so the image carries the
#     runtime half of what deploy/deps.sh installed (libzmq5, libczmq4, ...) and nothing else.
#  2. mmdebstrap makes a bookworm root file system (variant essential: no apt, no compiler) from
#     the host's own Debian sources, so the libraries are the versions the binaries linked against;
#     docs, man pages and locales are left out. It is cached by package list in build/image/.
#  3. podman imports it as localhost/kvmesh-base:HASH; buildah adds the four binaries and the
#     settings (non-root user kvmesh, uid 10001) and commits localhost/kvmesh:REV (REV = git
#     revision, -dirty when the tree has changes), which reads the model from a volume at
#     /opt/kvmesh/models, and localhost/kvmesh:REV-model, the same plus the default model.
#  4. podman save writes build/kvmesh-image.tar (REV) and build/kvmesh-image-model.tar (REV-model).
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "image: $*"; }
die() { echo "image: error: $*" >&2; exit 1; }

BINS=(kvmesh kvmesh-worker kvmesh-router kvmesh-controller)
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
WORK=build/image
mkdir -p "$WORK"
for b in "${BINS[@]}"; do [ -x "build/bin/$b" ] || die "build/bin/$b missing: run make build"; done
[ -f "models/$MODEL_FILE" ] || die "models/$MODEL_FILE missing: run make deps"
for t in mmdebstrap buildah podman; do
    command -v $t >/dev/null || die "$t not found: bash deploy/image-deps.sh image installs it"
done
# shellcheck source=podman-env.sh
. deploy/image/podman-env.sh
km_podman_setup "$PWD/$WORK" || die "podman cannot run here"

# -- 1. runtime packages from the binaries' NEEDED entries
pkg_of() { # the Debian package owning a library path, with or without the /usr merge
    local p q
    for p in "$1" "$(readlink -f "$1")"; do
        for q in "$p" "/usr${p#/usr}" "${p#/usr}"; do
            dpkg -S "$q" 2>/dev/null | head -1 | cut -d: -f1 && return 0
        done
    done
    return 1
}
declare -A pkgs=()
for b in "${BINS[@]}"; do
    while read -r lib; do
        path=$(ldd "build/bin/$b" | awk -v l="$lib" '$1 == l { print $3 } $1 ~ "/" l "$" { print $1 }')
        [ -n "$path" ] || die "$lib (needed by $b) is not found on this host"
        # UCX from third_party/ucx (deploy/ucx.sh) travels into the image itself (below)
        # (third_party/ may be a link, as in a git worktree)
        case "$(readlink -f "$path")" in "$(readlink -f third_party)"/ucx/lib/*) continue ;; esac
        p=$(pkg_of "$path") || die "no Debian package owns $path (needed by $b)"
        pkgs[$p]=1
    done < <(objdump -p "build/bin/$b" | awk '/NEEDED/ { print $2 }')
done
PKGS=$(printf '%s\n' "${!pkgs[@]}" | sort | paste -sd, -)
say "runtime packages: $PKGS"

# -- 2. the root file system (cached: same packages and sources, same tarball)
SOURCES=""
for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    [ -s "$f" ] && { SOURCES=$f; break; }
done
HASH=$(printf '%s\n' "$PKGS" "$(cat "$SOURCES" 2>/dev/null)" v1 | sha256sum | cut -c1-12)
BASE_TAR=$WORK/base-$HASH.tar
BASE_IMG=localhost/kvmesh-base:$HASH
if [ ! -s "$BASE_TAR" ]; then
    say "mmdebstrap bookworm (essential + runtime packages) from ${SOURCES:-deb.debian.org}"
    t0=$SECONDS
    mmdebstrap --quiet --format=tar --variant=essential --include="$PKGS" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='echo "kvmesh:x:10001:10001:kvmesh:/var/lib/kvmesh:/usr/sbin/nologin" >>"$1/etc/passwd"' \
        --customize-hook='echo "kvmesh:x:10001:" >>"$1/etc/group"' \
        --customize-hook='mkdir -p "$1/var/lib/kvmesh" "$1/opt/kvmesh/models" && chown 10001:10001 "$1/var/lib/kvmesh" && chmod 0700 "$1/var/lib/kvmesh"' \
        --customize-hook='rm -rf "$1/var/cache/debconf"/*-old "$1/var/log"/*.log' \
        bookworm "$BASE_TAR.tmp" ${SOURCES:+"$SOURCES"} || die "mmdebstrap failed (is the Debian mirror reachable?)"
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    say "root file system in $((SECONDS - t0)) s: $BASE_TAR"
fi
if ! podman image exists "$BASE_IMG"; then
    podman import --quiet "$BASE_TAR" "$BASE_IMG" >/dev/null
fi

# -- 3. the kvmesh layer and the model layer
REV=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- 2>/dev/null || REV=$REV-dirty
IMG=localhost/kvmesh:$REV
# what these tags name now: left untagged by this build, removed at its end
old_ids=$(podman image inspect --format '{{.Id}}' "$IMG" "$IMG-model" localhost/kvmesh:latest \
    localhost/kvmesh:latest-model 2>/dev/null | sort -u || true)
ctr=$(buildah from --quiet "$BASE_IMG")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
for b in "${BINS[@]}"; do buildah copy --quiet --chmod 0755 "$ctr" "build/bin/$b" /usr/local/bin/ >/dev/null; done
# the binaries' rpath names $ORIGIN/../lib/kvmesh/ucx for the UCX of third_party/ucx (its
# modules in ucx/ beside libucs, which finds them there). Not grep -q: it stops reading at the
# first match, and under pipefail ldd's SIGPIPE would then read as no match.
if ldd build/bin/kvmesh-worker | grep "$PWD/third_party/ucx/lib" >/dev/null; then
    buildah copy --quiet "$ctr" third_party/ucx/lib /usr/local/lib/kvmesh/ucx >/dev/null
fi
buildah config --user 10001:10001 --workingdir /opt/kvmesh \
    --env KVMESH_MODEL=/opt/kvmesh/models/$MODEL_FILE --env KVMESH_LOG_FORMAT=json \
    --volume /opt/kvmesh/models --volume /var/lib/kvmesh \
    --entrypoint '["/usr/local/bin/kvmesh"]' --cmd '["--help"]' \
    --label org.opencontainers.image.title=kvmesh \
    --label org.opencontainers.image.revision="$(git rev-parse HEAD)" \
    --label org.opencontainers.image.source=kvmesh "$ctr"
buildah commit --quiet --rm "$ctr" "$IMG" >/dev/null
ctr=$(buildah from --quiet "$IMG")
buildah copy --quiet --chmod 0644 "$ctr" "models/$MODEL_FILE" /opt/kvmesh/models/ >/dev/null
# the model is inside: no volume over it
buildah config --volume /opt/kvmesh/models- "$ctr"
buildah commit --quiet --rm "$ctr" "$IMG-model" >/dev/null
trap - EXIT
podman tag "$IMG" localhost/kvmesh:latest
podman tag "$IMG-model" localhost/kvmesh:latest-model
for id in $old_ids; do # only if nothing tags or uses it any more
    [ -n "$(podman image inspect --format '{{.RepoTags}}' "$id" 2>/dev/null | tr -d '[]')" ] ||
        podman rmi "$id" >/dev/null 2>&1 || true
done

# every library the binaries need resolves inside the image
missing=$(podman run --rm --entrypoint /bin/sh "$IMG" -c 'ldd /usr/local/bin/kvmesh*' | grep 'not found' || true)
[ -z "$missing" ] || die "libraries missing in the image: $missing"

# -- 4. the archives
rm -f build/kvmesh-image.tar build/kvmesh-image-model.tar
podman save --quiet --format docker-archive -o build/kvmesh-image.tar "$IMG"
podman save --quiet --format docker-archive -o build/kvmesh-image-model.tar "$IMG-model"
echo "$REV" >build/kvmesh-image.rev
mb() { echo $(( ($1 + 524288) / 1048576 )); }
size=$(podman image inspect --format '{{.Size}}' "$IMG")
msize=$(podman image inspect --format '{{.Size}}' "$IMG-model")
say "$IMG: $(mb "$size") MiB (model from a volume at /opt/kvmesh/models)"
say "$IMG-model: $(mb "$msize") MiB (the default model inside)"
say "build/kvmesh-image.tar: $(mb "$(stat -c %s build/kvmesh-image.tar)") MiB; build/kvmesh-image-model.tar: $(mb "$(stat -c %s build/kvmesh-image-model.tar)") MiB"
say "load with: podman load -i build/kvmesh-image.tar (or docker load -i ...)"

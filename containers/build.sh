#!/usr/bin/env bash
# Build the kit's container image for one CPU architecture and convert it to an Enroot .sqsh.
#
#   containers/build.sh [--arch amd64|arm64] [--tool docker|podman] [--out DIR] [--base IMAGE]
#
# --arch   amd64 (H100/H200/B200 hosts) or arm64 (GB200 Grace hosts); x86_64/aarch64 also
#          accepted; default: this machine's. The NVIDIA JAX base image is multi-arch; building
#          for the other arch needs QEMU binfmt handlers (docker buildx / podman on the host).
# --tool   docker or podman; default: docker if on PATH, else podman.
# --out    directory for the .sqsh (default: runs/containers, which git ignores).
# --base   override the Dockerfile's pinned BASE_IMAGE (a registry reference).
#
# Tags the image moe-train:<commit>[-dirty] and moe-train:<commit>[-dirty]-<arch>, then runs
# `enroot import -o DIR/moe-train-<commit>[-dirty]-<arch>.sqsh dockerd://...` (podman://...).
# Exit codes: 0 built, 2 bad arguments, 3 a needed tool (docker/podman, its daemon, enroot)
# is missing, other: the build or the import failed (their own output says why).
set -euo pipefail

src="${BASH_SOURCE[0]}"
[[ "$src" == */* ]] || src="./$src"
HERE="$(cd "${src%/*}" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=containers/lib.sh
source "$HERE/lib.sh"

usage() {
    printf 'usage: containers/build.sh [--arch amd64|arm64] [--tool docker|podman] [--out DIR] [--base IMAGE]\n'
}

arch=""
tool=""
out="$ROOT/runs/containers"
base=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --arch) [[ $# -ge 2 ]] || die 2 "build.sh: --arch needs a value (amd64 or arm64)"; arch="$2"; shift 2 ;;
        --tool) [[ $# -ge 2 ]] || die 2 "build.sh: --tool needs a value (docker or podman)"; tool="$2"; shift 2 ;;
        --out) [[ $# -ge 2 ]] || die 2 "build.sh: --out needs a directory"; out="$2"; shift 2 ;;
        --base) [[ $# -ge 2 ]] || die 2 "build.sh: --base needs an image"; base="$2"; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die 2 "build.sh: unknown argument '$1'" ;;
    esac
done

if [[ -z "$arch" ]]; then
    arch="$(host_arch)" || die 2 "build.sh: cannot build for this machine's architecture '$(uname -m)'; pass --arch amd64 or --arch arm64"
fi
norm="$(norm_arch "$arch")" || die 2 "build.sh: --arch must be amd64 or arm64 (or x86_64/aarch64), got '$arch'"
arch="$norm"
if [[ -n "$base" ]]; then
    validate_image "$base" || die 2 "build.sh: --base '$base' is not a plain image reference (registry/name:tag)"
fi

# The container tool: present, and (docker) its daemon reachable.
INSTALL_HINT="install Docker Engine (https://docs.docker.com/engine/install/) or Podman (https://podman.io/docs/installation), or run 'make container-import IMAGE=...' where enroot is installed"
if [[ -z "$tool" ]]; then
    if command -v docker >/dev/null 2>&1; then
        tool=docker
    elif command -v podman >/dev/null 2>&1; then
        tool=podman
    else
        die 3 "build.sh: no container tool: neither docker nor podman is on PATH; $INSTALL_HINT"
    fi
fi
case "$tool" in
    docker | podman) ;;
    *) die 2 "build.sh: --tool must be docker or podman, got '$tool'" ;;
esac
command -v "$tool" >/dev/null 2>&1 || die 3 "build.sh: $tool is not on PATH; $INSTALL_HINT"
if ! "$tool" info >/dev/null 2>&1; then
    if [[ "$tool" == docker ]]; then
        die 3 "build.sh: docker is installed but its daemon is unreachable ('docker info' failed): start it (sudo systemctl start docker), join the docker group, or use --tool podman"
    fi
    die 3 "build.sh: podman is installed but not usable ('podman info' failed): check 'podman info' (rootless setup: subuid/subgid, storage)"
fi

rev="$(git_rev "$ROOT")" || die 2 "build.sh: $ROOT is not a git checkout; image tags carry the git commit"
full_rev="$(git_full_rev "$ROOT")"
tag="moe-train:${rev}"
arch_tag="moe-train:${rev}-${arch}"
sqsh="$out/moe-train-${rev}-${arch}.sqsh"

build_args=(--platform "linux/${arch}" -f "$HERE/Dockerfile"
            --build-arg "GIT_COMMIT=${full_rev}" -t "$tag" -t "$arch_tag")
if [[ -n "$base" ]]; then
    build_args+=(--build-arg "BASE_IMAGE=${base}")
fi
printf 'build.sh: building %s for linux/%s with %s\n' "$arch_tag" "$arch" "$tool" >&2
if [[ "$tool" == docker ]]; then
    # BuildKit reads containers/Dockerfile.dockerignore (the ignore file next to the Dockerfile).
    DOCKER_BUILDKIT=1 docker build "${build_args[@]}" "$ROOT"
    scheme=dockerd
else
    podman build --ignorefile "$HERE/Dockerfile.dockerignore" "${build_args[@]}" "$ROOT"
    scheme=podman
fi

if ! command -v enroot >/dev/null 2>&1; then
    die 3 "build.sh: built image $arch_tag; converting it to $sqsh needs enroot, which is not on PATH: install enroot (https://github.com/NVIDIA/enroot) or run there: enroot import --arch $(enroot_arch "$arch") -o $sqsh ${scheme}://${arch_tag}"
fi
mkdir -p "$out"
if [[ -e "$sqsh" ]]; then
    printf 'build.sh: replacing %s\n' "$sqsh" >&2
    rm -f "$sqsh"
fi
enroot import --arch "$(enroot_arch "$arch")" -o "$sqsh" "${scheme}://${arch_tag}"
printf 'build.sh: wrote %s (image %s)\n' "$sqsh" "$arch_tag"

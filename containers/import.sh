#!/usr/bin/env bash
# Make an Enroot .sqsh straight from a registry image, no container daemon needed.
#
#   containers/import.sh IMAGE [--out DIR] [--arch amd64|arm64]
#
# IMAGE is a Docker-style reference such as ghcr.io/nvidia/jax:jax-2026-06-27 (the form the
# topology presets' [container] tables use) or enroot's own ghcr.io#nvidia/jax:TAG. It becomes
#   enroot import [--arch ARCH] -o DIR/<registry+path+tag>.sqsh docker://ghcr.io#nvidia/jax:TAG
# --out defaults to runs/containers (git ignores runs/); --arch defaults to this machine's
# (pass --arch arm64 on an x86 login node to import the image GB200 nodes run).
# Registry credentials, if any, live in enroot's own $ENROOT_CONFIG_PATH/.credentials.
# Exit codes: 0 imported, 2 bad arguments or the file exists, 3 enroot missing, other: enroot's.
set -euo pipefail

src="${BASH_SOURCE[0]}"
[[ "$src" == */* ]] || src="./$src"
HERE="$(cd "${src%/*}" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=containers/lib.sh
source "$HERE/lib.sh"

usage() {
    printf 'usage: containers/import.sh IMAGE [--out DIR] [--arch amd64|arm64]\n'
}

image=""
out="$ROOT/runs/containers"
arch=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) [[ $# -ge 2 ]] || die 2 "import.sh: --out needs a directory"; out="$2"; shift 2 ;;
        --arch) [[ $# -ge 2 ]] || die 2 "import.sh: --arch needs a value (amd64 or arm64)"; arch="$2"; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        -*) usage >&2; die 2 "import.sh: unknown option '$1'" ;;
        *)
            [[ -z "$image" ]] || die 2 "import.sh: one IMAGE only (got '$image' and '$1')"
            image="$1"; shift ;;
    esac
done

[[ -n "$image" ]] || { usage >&2; die 2 "import.sh: IMAGE is required, e.g. ghcr.io/nvidia/jax:jax-2026-06-27"; }
if [[ "$image" == *@* ]]; then
    die 2 "import.sh: '$image' names a digest; enroot's docker:// URI takes a tag (registry/name:tag)"
fi
validate_image "$image" || die 2 "import.sh: '$image' is not a plain image reference (registry/name:tag; lowercase path, no spaces or shell characters)"
uri="$(enroot_uri "$image")"
sqsh="$out/$(sqsh_name "$image")"
arch_args=()
if [[ -n "$arch" ]]; then
    norm="$(enroot_arch "$arch")" || die 2 "import.sh: --arch must be amd64 or arm64 (or x86_64/aarch64), got '$arch'"
    arch_args=(--arch "$norm")
fi

command -v enroot >/dev/null 2>&1 || die 3 "import.sh: enroot is not on PATH; install it (https://github.com/NVIDIA/enroot) or run this on a login/compute node that has it: enroot import -o $sqsh $uri"
[[ ! -e "$sqsh" ]] || die 2 "import.sh: $sqsh already exists; remove it first (enroot will not overwrite it)"
mkdir -p "$out"
enroot import "${arch_args[@]}" -o "$sqsh" "$uri"
printf 'import.sh: wrote %s\n' "$sqsh"

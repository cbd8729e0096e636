# shellcheck shell=bash
# Shared helpers for containers/build.sh and containers/import.sh (source it; bash only).
#
# Every function prints its result on stdout and returns non-zero on bad input; none of them
# runs a command built from its arguments, so user input is never evaluated by a shell.

# die CODE MESSAGE: one line on stderr, then exit CODE.
die() {
    local code="$1"
    shift
    printf '%s\n' "$*" >&2
    exit "$code"
}

# norm_arch ARCH: amd64|x86_64 -> amd64, arm64|aarch64 -> arm64 (Docker's platform names).
norm_arch() {
    case "$1" in
        amd64 | x86_64) printf 'amd64\n' ;;
        arm64 | aarch64) printf 'arm64\n' ;;
        *) return 1 ;;
    esac
}

# enroot_arch ARCH: the uname-style name `enroot import --arch` expects (x86_64, aarch64).
enroot_arch() {
    case "$(norm_arch "$1")" in
        amd64) printf 'x86_64\n' ;;
        arm64) printf 'aarch64\n' ;;
        *) return 1 ;;
    esac
}

# host_arch: this machine's architecture in Docker's naming.
host_arch() {
    norm_arch "$(uname -m)"
}

# A registry image reference: [host[:port]/]path[:tag], or enroot's host#path[:tag] form.
# Lowercase repository path as Docker and enroot require; no digest (enroot's docker:// URI
# takes a tag), no whitespace, no shell metacharacters.
IMAGE_RE='^([A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]+)?[/#])?[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$'

# validate_image IMAGE: succeeds only for a plain image reference (see IMAGE_RE).
validate_image() {
    local image="$1"
    [[ "$image" =~ $IMAGE_RE ]] || return 1
    # At most one '#', and only as the registry separator.
    local hashes="${image//[^#]/}"
    [[ ${#hashes} -le 1 ]]
}

# enroot_uri IMAGE: Docker-style reference -> enroot's docker://[REGISTRY#]IMAGE[:TAG].
#   ghcr.io/nvidia/jax:TAG   -> docker://ghcr.io#nvidia/jax:TAG
#   nvcr.io/nvidia/jax:TAG   -> docker://nvcr.io#nvidia/jax:TAG
#   docker.io/library/x:TAG  -> docker://library/x:TAG   (enroot's default registry)
#   nvidia/cuda:TAG          -> docker://nvidia/cuda:TAG (Docker Hub)
#   ghcr.io#nvidia/jax:TAG   -> docker://ghcr.io#nvidia/jax:TAG (already enroot form)
enroot_uri() {
    local image="$1" first rest
    validate_image "$image" || return 1
    if [[ "$image" == *'#'* ]]; then
        printf 'docker://%s\n' "$image"
        return 0
    fi
    first="${image%%/*}"
    rest="${image#*/}"
    if [[ "$image" != */* ]]; then
        printf 'docker://%s\n' "$image"
    elif [[ "$first" == docker.io || "$first" == index.docker.io ]]; then
        printf 'docker://%s\n' "$rest"
    elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then
        printf 'docker://%s#%s\n' "$first" "$rest"
    else
        printf 'docker://%s\n' "$image"
    fi
}

# sqsh_name IMAGE: a file name for the image's squashfs (/, :, # become +).
#   ghcr.io/nvidia/jax:jax-2026-06-27 -> ghcr.io+nvidia+jax+jax-2026-06-27.sqsh
sqsh_name() {
    local image="$1"
    validate_image "$image" || return 1
    local name="${image//[\/:#]/+}"
    printf '%s.sqsh\n' "$name"
}

# git_rev ROOT: "<short commit>" or "<short commit>-dirty" when the work tree differs from
# HEAD (tracked changes or untracked, not ignored, files: both end up in the image).
git_rev() {
    local root="$1" rev
    rev="$(git -C "$root" rev-parse --short HEAD 2>/dev/null)" || return 1
    if [[ -n "$(git -C "$root" status --porcelain 2>/dev/null)" ]]; then
        rev="${rev}-dirty"
    fi
    printf '%s\n' "$rev"
}

# git_full_rev ROOT: the full commit hash, with -dirty as in git_rev (for the image label).
git_full_rev() {
    local root="$1" rev
    rev="$(git -C "$root" rev-parse HEAD 2>/dev/null)" || return 1
    if [[ -n "$(git -C "$root" status --porcelain 2>/dev/null)" ]]; then
        rev="${rev}-dirty"
    fi
    printf '%s\n' "$rev"
}

#!/usr/bin/env bash
# Make the Debian bookworm base image, hydrafl-base:bookworm, from a Debian mirror instead of a registry
# (a hospital's build host often reaches an apt mirror but no image registry). Needs root and debootstrap;
# about a minute. Does nothing when the image already exists.
#   docker/base-image.sh [IMAGE] [MIRROR]
# The Dockerfiles take any Debian/Ubuntu base with Python >= 3.11 instead: --build-arg BASE=debian:bookworm-slim.
set -euo pipefail
image=${1:-hydrafl-base:bookworm}
mirror=${2:-${DEBIAN_MIRROR:-http://deb.debian.org/debian}}

if "${DOCKER:-docker}" image inspect "$image" >/dev/null 2>&1; then
  echo "$image exists"
  exit 0
fi
rootfs=$(mktemp -d /tmp/hydrafl-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
# apt's lists are fetched again by each build; leaving them out saves ~80 MB.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | "${DOCKER:-docker}" import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "$image made from $mirror"

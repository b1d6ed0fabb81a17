#!/usr/bin/env bash
# Build hydrafl's three images with BuildKit: hydrafl-coordinator, hydrafl-site and hydrafl-postgres (:latest).
#   docker/build.sh [extra `docker build` options, e.g. --build-arg PIP_SOURCE=index]
# Environment: HYDRAFL_BUILD_CA=proxy-ca.pem passes a TLS-inspecting proxy's CA as the BuildKit secret `ca`
# (never stored in an image); HYDRAFL_BASE=image picks the base (default hydrafl-base:bookworm, made by
# docker/base-image.sh when missing); DOCKER names the docker client (one with BuildKit: docker 20.10+, or
# buildx for docker 23+).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
docker=${DOCKER:-docker}
base=${HYDRAFL_BASE:-hydrafl-base:bookworm}
tag=${HYDRAFL_TAG:-latest}
export DOCKER_BUILDKIT=1

if [ "$base" = hydrafl-base:bookworm ]; then
  DOCKER="$docker" "$here/base-image.sh" "$base"
fi
if ! ls "$here"/dist/hydrafl-*.whl >/dev/null 2>&1; then
  echo "no hydrafl wheel in $here/dist: run docker/wheelhouse.sh (--own-only with PIP_SOURCE=index)" >&2
  exit 2
fi
mkdir -p "$here/wheelhouse"
secret=()
if [ -n "${HYDRAFL_BUILD_CA:-}" ]; then
  secret=(--secret "id=ca,src=$HYDRAFL_BUILD_CA")
fi
for target in coordinator site; do
  "$docker" build --build-arg "BASE=$base" "${secret[@]}" "$@" --target "$target" -t "hydrafl-$target:$tag" "$here"
done
"$docker" build --build-arg "BASE=$base" -f "$here/postgres.Dockerfile" -t "hydrafl-postgres:$tag" "$here"

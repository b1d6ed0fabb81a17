#!/usr/bin/env bash
# Fill the folders the image build installs from, on a machine that reaches a package index:
#   docker/wheelhouse.sh             docker/dist: hydrafl's wheel; docker/wheelhouse: every dependency (CPU torch),
#                                    for an air-gapped build (PIP_SOURCE=wheelhouse, the default)
#   docker/wheelhouse.sh --own-only  docker/dist alone, for a build with PIP_SOURCE=index
# TORCH_INDEX (default https://download.pytorch.org/whl/cpu; empty: none) picks torch's build, e.g.
# https://download.pytorch.org/whl/cu126; PIP_* settings (index, proxy, cert) apply as for any pip; WHEELHOUSE
# and DIST move the two folders. The wheels must match the image's Python and platform (CPython 3.11, Linux
# x86_64 on the default bookworm base): run this on such a machine. Then copy docker/ to the build host and run
# docker/build.sh there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wheelhouse=${WHEELHOUSE:-$here/wheelhouse}
dist=${DIST:-$here/dist}
python=${PYTHON:-python3}
torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
mkdir -p "$wheelhouse" "$dist"
# Fixed timestamps: the same source gives the same wheel, so an unchanged hydrafl keeps the image cache.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800}

rm -f "$dist"/hydrafl-*.whl
"$python" -m pip wheel --no-deps --wheel-dir "$dist" "$here/.."
[ "${1:-}" = "--own-only" ] && exit 0

# torch's +cpu (or +cuXYZ) build from TORCH_INDEX outranks the same release on PyPI.
extra=()
[ -n "$torch_index" ] && extra=(--extra-index-url "$torch_index")
"$python" -m pip wheel "${extra[@]}" --find-links "$dist" --wheel-dir "$wheelhouse" "$(ls "$dist"/hydrafl-*.whl)[postgres]"
rm -f "$wheelhouse"/hydrafl-*.whl
echo "$(ls "$wheelhouse" | wc -l) wheels in $wheelhouse, hydrafl's in $dist"

#!/usr/bin/env bash
# Make the Horovod 0.28.1 sdist build against PyTorch >= 2.1, whose headers require C++17.
# Horovod pins C++14 in two CMake files and gloo pins -std=c++11; gloo must move too, or the link fails with
# "multiple definition of gloo::rendezvous::Store::kDefaultTimeout" (C++17 makes static constexpr members inline).
# Usage: patch_horovod.sh UNPACKED_SDIST_DIR. Idempotent; fails loudly when a pattern is not found, so a newer
# sdist that already carries the fix is noticed (then drop this script).
set -euo pipefail
SRC="$1"
edit() {  # file, from, to
  local f="$SRC/$1"
  if grep -qF -- "$3" "$f" && ! grep -qF -- "$2" "$f"; then return 0; fi
  grep -qF -- "$2" "$f" || { echo "patch_horovod: '$2' not found in $1" >&2; exit 1; }
  sed -i "s/$(printf '%s' "$2" | sed 's/[][\.*^$/]/\\&/g')/$3/" "$f"
}
edit CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
edit horovod/torch/CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
edit third_party/gloo/CMakeLists.txt '-std=c++11' '-std=c++17'
echo "patch_horovod: C++17 edits applied to $SRC"

#!/usr/bin/env bash
# Patch the Horovod 0.28.1 sdist: (1) build against PyTorch >= 2.1, whose headers require C++17;
# (2) fix Gloo process sets on hosts whose own name resolves to loopback; (3) elastic host-change notifications
# stamped in whole seconds (see below).
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

# (2) GlooContext::InitializeForProcessSet builds its transport device from its own gloo_iface_, which is still
# empty for a new process-set context, instead of the global context's interface. Gloo then binds to whatever the
# hostname resolves to; where that is loopback (Debian/Ubuntu: "127.0.1.1 <hostname>" in /etc/hosts) every
# cross-host connection of hvd.init() fails with "gloo::IoException ... connect [127.0.0.1]:PORT: Connection
# refused". The fix: take the interface of the global context (the one --network-interface chose).
GC=horovod/common/gloo/gloo_context.cc
FIXED='gloo_iface_ = global_context.gloo_iface_;  // horovod_adtopk patch'
if ! grep -qF -- "$FIXED" "$SRC/$GC"; then
  grep -q 'void GlooContext::InitializeForProcessSet' "$SRC/$GC" \
    || { echo "patch_horovod: InitializeForProcessSet not found in $GC" >&2; exit 1; }
  sed -i "/^void GlooContext::InitializeForProcessSet/,/CreateDevice(device_attr)/ s|^\( *\)device_attr.iface = gloo_iface_;|\1$FIXED\n\1device_attr.iface = gloo_iface_;|" "$SRC/$GC"
  [ "$(grep -cF -- "$FIXED" "$SRC/$GC")" = 1 ] || { echo "patch_horovod: the process-set interface fix did not apply to $GC" >&2; exit 1; }
fi

# (3) The elastic driver stamps each host-change notification with int(time.time()), and a worker acts on a
# notification only when its stamp is greater than the last one it acted on. A change discovered in the same
# whole second as the previous one (a host removed, the job shrunk in under a second, the host listed again) is
# then dropped by every rank for good: the job never grows back. The fix: stamps in fractional seconds.
DRV=horovod/runner/elastic/driver.py
edit "$DRV" '    return int(time.time())' '    return time.time()  # horovod_adtopk patch: fractional seconds'
echo "patch_horovod: C++17 edits, the Gloo process-set interface fix and the elastic notification stamps applied to $SRC"

#!/usr/bin/env bash
# The Python client as a wheel that installs on any x86-64 Linux with glibc
# 2.17 or later and Python 3.11 or later (manylinux2014, abi3): built with
# maturin against glibc 2.17's symbols through zig (no build container),
# then checked with auditwheel: it may need nothing of the build host's but
# glibc. The client links no RocksDB, etcd client or daemon.
#
#   tools/release-wheel.sh            the wheel, in dist/
#   tools/release-wheel.sh --check    and installs it in a clean Debian 12
#                                     root (python3 and its venv only: no
#                                     Rust, no compiler, no index), where a
#                                     put and a get go through a store
#                                     started on this host (needs root)
#
# The build tools are pinned and kept in ~/.cache/mooncake-release-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
case "${1:-}" in
    "") ;;
    --check) check=1 ;;
    *) echo "usage: tools/release-wheel.sh [--check]" >&2; exit 2 ;;
esac
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
TOOLS="${MOONCAKE_RELEASE_VENV:-$HOME/.cache/mooncake-release-venv}"
PLATFORM=manylinux_2_17_x86_64

[ -x "$TOOLS/bin/python" ] || python3 -m venv "$TOOLS"
"$TOOLS/bin/pip" install -q --disable-pip-version-check \
    "maturin==1.16.0" "ziglang==0.17.1" "auditwheel==6.8.2"

rm -rf dist && mkdir dist
# maturin finds zig (the ziglang package) through the python on PATH.
PATH="$TOOLS/bin:$PATH" maturin build --release --strip --zig --compatibility manylinux2014 \
    -m client/python/Cargo.toml -o dist 2>&1 | grep -vE '^\s+(Compiling|Checking)' || true
wheel=$(ls dist/*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "no wheel was built" >&2; exit 1; }

# What the wheel needs of the machine it lands on.
shown=$("$TOOLS/bin/auditwheel" show "$wheel")
if ! grep -q "\"$PLATFORM\"" <<<"$shown" || grep -q "external shared libraries are required" <<<"$shown"; then
    echo "$shown" >&2
    echo "$wheel: not a self-contained $PLATFORM wheel" >&2
    exit 1
fi
echo "$wheel: $PLATFORM, abi3, $(du -h "$wheel" | cut -f1); auditwheel: it needs only glibc's libraries"
[ "$check" = 1 ] || exit 0

# --check: a clean Debian 12 root that shares this host's network (so it
# reaches a store on loopback) and nothing else.
[[ $(id -u) -eq 0 ]] || { echo "--check needs root (chroot, mounts)" >&2; exit 2; }
. tools/clean-root.sh
. tools/store-for-script.sh
base=$(clean_root_tarball)
cargo build --release -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/release/mooncake-store"
start_store 256MiB
root=$(mktemp -d /var/tmp/mooncake-wheel.XXXXXX)
chmod 755 "$root"   # mktemp's 0700 would shut out apt's _apt user
cleanup_root() {
    umount "$root/proc" "$root/dev" 2>/dev/null || true
    rm -rf --one-file-system "$root"
}
trap 'cleanup_root; stop_store' EXIT
tar -C "$root" -xf "$base"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
mkdir -p "$root/wheel" && cp "$wheel" "$root/wheel/"
echo "== a clean Debian 12 root: python3 and python3-venv from Debian, then the wheel alone"
chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive META="$META" bash -c '
    set -euo pipefail
    apt-get update -qq && apt-get install -y -qq python3 python3-venv >/dev/null
    python3 -m venv /venv
    /venv/bin/pip install -q --no-index --disable-pip-version-check /wheel/*.whl
    for tool in cargo rustc cc gcc; do
        if command -v "$tool" >/dev/null; then echo "$tool is here: not a clean root"; exit 1; fi
    done
    /venv/bin/python - <<PY
import os, platform
import mooncake_store
from mooncake.store import MooncakeDistributedStore
client = mooncake_store.Client(os.environ["META"], namespace="wheel-check")
client.put("k", b"from a wheel" * 1000)
assert client.get("k") == b"from a wheel" * 1000, "get did not return what put stored"
print(f"put and get through the wheel: ok (Python {platform.python_version()}, {platform.libc_ver()[0]} {platform.libc_ver()[1]})")
PY
'

#!/usr/bin/env bash
# Proves the README's two commands on a machine where nothing was installed
# by hand: each runs in its own clean Debian 12 root (debootstrap, minbase,
# entered with pivot_root in a private mount namespace),
# from a clone of this checkout's HEAD, with the host's Rust toolchain
# mounted read-only (nothing else of the host's is visible), and the script
# prints which packages each command installed and how long it took.
#
#   tools/fresh-machine.sh [up|test]...    default: up test
#
#   up     tools/up.sh builds and starts the store; a put and a get go
#          through it, then SIGTERM must stop it cleanly.
#   test   tools/test.sh, the README's test command, must pass.
#
# Run as root (debootstrap, chroot, mounts), before each release and
# whenever set-up changes. The clean root is made once and kept as a tarball
# in ~/.cache/mooncake-fresh; each run unpacks a new copy under /var/tmp and
# removes it afterwards (MOONCAKE_FRESH_KEEP=1 keeps it for a look).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=("$@")
((${#steps[@]})) || steps=(up test)
for s in "${steps[@]}"; do
    [[ $s == up || $s == test ]] || { echo "usage: tools/fresh-machine.sh [up|test]..." >&2; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { echo "tools/fresh-machine.sh needs root (debootstrap, chroot, mounts)" >&2; exit 2; }
. tools/clean-root.sh

toolchain=$(dirname "$(dirname "$(rustup which cargo 2>/dev/null || command -v cargo)")")
[[ -x $toolchain/bin/cargo && -x $toolchain/bin/rustc ]] || { echo "no Rust toolchain found beside cargo ($toolchain)" >&2; exit 2; }
base=$(clean_root_tarball)

# The command run inside the root, as a new user would: a clone, no cache,
# only the toolchain on PATH.
inside_up='
set -euo pipefail
cd /src
tools/up.sh >/tmp/up.log 2>&1 &
up=$!
# However this ends, nothing it started outlives it.
stop_all() { set +e; pkill -P $up; kill $up; } 2>/dev/null
trap stop_all EXIT
bin=/src/target/release/mooncake-store
for _ in $(seq 1 1800); do
    # Up once its daemon has registered (the meta service answers first).
    [[ -x $bin ]] && "$bin" stat --json 2>/dev/null | grep -q "\"alive\":true" && break
    kill -0 $up 2>/dev/null || { echo "tools/up.sh exited early:"; tail -20 /tmp/up.log; exit 1; }
    sleep 1
done
echo "fresh machine check" | "$bin" put fresh-key
[[ $("$bin" get fresh-key) == "fresh machine check" ]] || { echo "get did not return what put stored"; exit 1; }
"$bin" stat
kill -TERM $up
for _ in $(seq 1 30); do kill -0 $up 2>/dev/null || break; sleep 1; done
if kill -0 $up 2>/dev/null; then echo "up did not stop within 30 s of SIGTERM"; exit 1; fi
wait $up || { echo "up exited with $? after SIGTERM"; tail -20 /tmp/up.log; exit 1; }
tail -5 /tmp/up.log
'
inside_test='
set -euo pipefail
cd /src
tools/test.sh
'

run_step() {
    local step=$1 root
    root=$(mktemp -d /var/tmp/mooncake-fresh.XXXXXX)
    echo "== $step: clean root $root"
    chmod 755 "$root"   # mktemp's 0700 would shut out apt's _apt user
    tar -C "$root" -xf "$base"
    git clone -q --no-hardlinks "file://$PWD" "$root/src"
    git -C "$root/src" checkout -q "$(git rev-parse HEAD)"
    mkdir -p "$root/opt/rust"
    # The network is the host's: its resolver, and the certificate
    # authorities of a proxy this network may put between it and the
    # package registries (installed by ca-certificates' own hook when
    # setup installs that package). Nothing else of the host's goes in.
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        mkdir -p "$root/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    fi
    mount --bind "$toolchain" "$root/opt/rust" && mount -o remount,bind,ro "$root/opt/rust"
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"
    mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"
    local cleanup="umount -R $root/dev; umount -R $root/sys; umount $root/proc; umount $root/opt/rust"
    [[ ${MOONCAKE_FRESH_KEEP:-} == 1 ]] || cleanup+="; rm -rf --one-file-system $root"
    # shellcheck disable=SC2064
    trap "$cleanup" RETURN
    chroot "$root" dpkg-query -W -f='${Package}\n' | sort >"$root/tmp/before"
    local script=$inside_up start=$SECONDS rc
    [[ $step == test ]] && script=$inside_test
    local net=() var
    for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY SSL_CERT_FILE SSL_CERT_DIR \
        CURL_CA_BUNDLE REQUESTS_CA_BUNDLE PIP_CERT; do
        [[ -n ${!var:-} ]] && net+=("$var=${!var}")
    done
    set +e
    # Entered with pivot_root in a private mount namespace, not chroot: the
    # kernel refuses user namespaces (`unshare -r`, which the disk-full
    # tests use) to a chrooted process, and a real machine has no chroot.
    env -i HOME=/root TERM=dumb LANG=C.UTF-8 PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${net[@]}" \
        unshare --mount --propagation private -- /bin/bash -c '
            set -e; root=$1; shift
            mount --rbind "$root" "$root"; cd "$root"
            mkdir -p .old-root; pivot_root . .old-root; cd /
            umount -l /.old-root; rmdir /.old-root
            exec "$@"' _ "$root" bash -c "$script" 2>&1 | sed "s/^/[$step] /"
    rc=${PIPESTATUS[0]}
    set -e
    chroot "$root" dpkg-query -W -f='${Package}\n' | sort >"$root/tmp/after"
    local added
    added=$(comm -13 "$root/tmp/before" "$root/tmp/after" | wc -l)
    echo "== $step: exit $rc after $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
    echo "== $step: setup installed $added packages; those named by tools/setup.sh and the Python venv:"
    comm -13 "$root/tmp/before" "$root/tmp/after" \
        | grep -xE 'build-essential|ca-certificates|protobuf-compiler|libprotobuf-dev|librocksdb-dev|libclang-dev|cmake|libibverbs-dev|python3|python3-venv|etcd-server|prometheus|util-linux' \
        | tr '\n' ' '
    echo
    [[ -x $root/root/.cache/mooncake-venv/bin/pip ]] && echo "== $step: venv: $(chroot "$root" /root/.cache/mooncake-venv/bin/pip list --format=freeze 2>/dev/null | grep -iE '^(kubernetes-validate|pyyaml|maturin|pytest|numpy|pyzmq|msgspec|mooncake)' | tr '\n' ' ')"
    return "$rc"
}

failed=0
for s in "${steps[@]}"; do run_step "$s" || failed=1; done
exit $failed

# Sourced by scripts that prove something on a machine where nothing was
# installed by hand (tools/fresh-machine.sh, tools/release-wheel.sh):
# `clean_root_tarball` makes a clean Debian 12 root (debootstrap, minbase)
# once, keeps it as a tarball in ~/.cache/mooncake-fresh, and prints its
# path. Needs root.

clean_root_tarball() {
    local cache="$HOME/.cache/mooncake-fresh"
    local base="$cache/bookworm-minbase.tar"
    if [[ ! -s $base ]]; then
        command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
        echo "== making a clean Debian 12 root (debootstrap --variant=minbase bookworm)" >&2
        mkdir -p "$cache"
        local tmp
        tmp=$(mktemp -d /var/tmp/mooncake-debootstrap.XXXXXX)
        debootstrap --variant=minbase bookworm "$tmp" http://deb.debian.org/debian >"$cache/debootstrap.log" 2>&1 \
            || { echo "debootstrap failed; see $cache/debootstrap.log" >&2; return 1; }
        tar -C "$tmp" -cf "$base.part" . && mv "$base.part" "$base"
        rm -rf "$tmp"
    fi
    echo "$base"
}

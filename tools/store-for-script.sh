# Sourced by scripts that need a store of their own (benchmarks, the
# engines' tests): `release_and_python` builds the release binary (BIN) and
# installs this repository's Python package into $VENV; `start_store DRAM
# [ARGS...]` runs `$BIN up` on free loopback ports (with ARGS), sets META to
# its meta service's address once its daemon has registered, and stops it
# when the script exits. SCRATCH is a folder for what the script writes
# (configs, traces, sockets, logs), removed when it exits, after the store
# stops; a script that sets a trap of its own calls `stop_store` in it.

SCRATCH=$(mktemp -d)
stop_store() {
    [ -z "${STORE_PID:-}" ] || kill "$STORE_PID" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$SCRATCH"
}
trap stop_store EXIT

release_and_python() {
    cargo build --release -q --bin mooncake-store
    BIN="$CARGO_TARGET_DIR/release/mooncake-store"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q maturin numpy
    "$VENV/bin/pip" install -q ./client/python
}

# A loopback port free for TCP and UDP, at random below the kernel's
# ephemeral range (as the tests pick them: tools/tests/common/mod.rs).
free_port() {
    python3 -c '
import random, socket
while True:
    port = random.randrange(20000, 32000)
    try:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", port))
            udp.bind(("127.0.0.1", port))
    except OSError:
        continue
    print(port)
    break'
}

start_store() {
    META="127.0.0.1:$(free_port)"
    "$BIN" up --meta-listen "$META" --listen "127.0.0.1:$(free_port)" --admin "" --dram "$1" \
        "${@:2}" >/dev/null 2>&1 &
    STORE_PID=$!
    # Up once its daemon registered (filling a large pool takes seconds).
    for _ in $(seq 300); do
        "$BIN" stat --meta "$META" 2>/dev/null | grep -qE '^daemons +[1-9][0-9]* alive' && return
        sleep 0.1
    done
    echo "the store did not come up in 30 s: $BIN up --dram $1 ${*:2}" >&2
    return 1
}

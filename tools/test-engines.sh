#!/usr/bin/env bash
# Serving engines' own Mooncake backends, unchanged, against this store,
# and vLLM's own KV-event classes reading the store's events.
#
# Installs, into a virtual environment of its own (~6 GiB, kept in
# ~/.cache; torch is the bulk), SGLang from PyPI without its GPU-only
# dependencies, plus what its Mooncake backend imports, and this
# repository's Python package; starts `mooncake-store up`; and runs the
# drivers in client/python/engines/, which drive the engines' classes as
# the engines do: SGLang HiCache's `MooncakeStore` and the native SGLang
# backend, SGLang's own test of its Mooncake backend (shipped in its
# wheel), SGLang's multimodal embedding store, SGLang's direct linker
# (unified cache, layer-wise loads), vLLM's v1 scheduler with
# vLLM's own MooncakeStoreConnector (one rank, and tensor-parallel ranks
# in worker processes of their own) and with the native vLLM connector,
# vLLM's encoder-cache store, LMCache's remote
# backend with its `mooncakestore` connector and the native one, and
# vLLM's KV-event classes. Separate from tools/test.sh: the first run
# also downloads about 3 GiB and installs 6.8 GiB; a later run took 2 min
# 59 s here, the drivers included.
#
# Usage: tools/test-engines.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
VENV="${MOONCAKE_ENGINES_VENV:-$HOME/.cache/mooncake-engines-venv}"

tools/setup.sh --engines
# The debug build tools/test.sh made: these drivers check behaviour, not speed.
cargo build -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/debug/mooncake-store"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# The engine itself without its dependencies (most need a GPU), then the
# ones its Mooncake backend imports on a CPU-only host, at the versions
# this was last run with.
"$VENV/bin/pip" install -q --disable-pip-version-check \
    torch==2.15.0 numpy==2.4.6
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps sglang==0.5.23
"$VENV/bin/pip" install -q --disable-pip-version-check \
    aiohttp==3.14.5 apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.1 dill==0.4.1 \
    gguf==0.19.0 ipython==9.18.1 msgspec==0.23.0 ninja==1.13.2 orjson==3.13.0 packaging==26.4 \
    pillow==13.0.0 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4 pyzmq==27.3.0 \
    requests==2.34.2 sentencepiece==0.2.3 starlette==1.10.0 torchvision==0.29.2 \
    tqdm==4.70.1 transformers==5.24.0 2>&1 | grep -v "requires\|incompatible\|resolver" || true
# vLLM's own KV-event classes (vllm.distributed.kv_events) read the store's
# events: vLLM without its dependencies, plus what that module imports.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps vllm==0.34.0
"$VENV/bin/pip" install -q --disable-pip-version-check \
    cbor2==6.3.0 cloudpickle==3.1.3 fastapi==0.165.0 llguidance==1.9.1 openai==3.57.0 \
    openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 prometheus-client==0.26.0 \
    py-cpuinfo==9.0.0 uvloop==0.23.0 xgrammar==0.2.9 \
    cachetools==8.0.2 einops==0.8.2 2>&1 | grep -v "requires\|incompatible\|resolver" || true
# LMCache's own mooncakestore connector: LMCache without its dependencies
# (its CPU path needs no CUDA extension), plus what that path imports.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps lmcache==0.5.6 \
    aiofile==3.12.3 caio==0.12.10 cffi==2.1.1 cryptography==50.0.2 llvmlite==0.50.0 \
    numba==0.68.1 pycparser==3.12 sortedcontainers==2.4.0
"$VENV/bin/pip" install -q --disable-pip-version-check ./client/python

. tools/store-for-script.sh
EVENTS="127.0.0.1:$(free_port)"
REPLAY="127.0.0.1:$(free_port)"
# Block hashes in the store's events as vLLM publishes its own by default
# (64-bit integers), so that the drivers match them with vLLM's.
printf '[meta]\nevents_int_hashes = true\n' >"$SCRATCH/store.toml"
start_store 1GiB --events "$EVENTS" --events-replay "$REPLAY" --config "$SCRATCH/store.toml"
# What the drivers and the engines write to temporary files (the engines'
# sockets, compiled kernels, the drivers' own stores) goes with SCRATCH.
export TMPDIR="$SCRATCH"

echo "== client/python/engines/sglang_hicache.py"
# MOONCAKE_BIN: a small store of its own, filled between a lookup and a read.
MOONCAKE_BIN="$BIN" "$VENV/bin/python" -W ignore client/python/engines/sglang_hicache.py "$META"
echo "== SGLang's own test of its Mooncake backend (sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store)"
# As SGLang's docs run it: set up from MOONCAKE_* variables, each store
# contributing a segment (here a daemon of this package beside it).
MOONCAKE_BIN="$BIN" MOONCAKE_MASTER="$META" MOONCAKE_PROTOCOL=tcp \
    MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE MOONCAKE_GLOBAL_SEGMENT_SIZE=67108864 \
    "$VENV/bin/python" -W ignore -m sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store 2>&1 \
    | grep -E "passed|Traceback|[A-Za-z]Error: "
echo "== client/python/engines/sglang_embedding.py"
"$VENV/bin/python" -W ignore client/python/engines/sglang_embedding.py "$META"
echo "== client/python/engines/sglang_direct_linker.py"
# SGLang builds its page-hash extension at first use with ninja (from the
# venv's bin) and c++; triton's bindings print leak reports at exit.
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -W ignore client/python/engines/sglang_direct_linker.py "$META" 2>&1 \
    | grep -v "nanobind\|leaked\|skipped remainder"
echo "== client/python/engines/vllm_connector.py"
# MOONCAKE_BIN: the driver also kills and restarts a store of its own.
MOONCAKE_BIN="$BIN" "$VENV/bin/python" -W ignore client/python/engines/vllm_connector.py "$META" "$EVENTS" "$REPLAY"
echo "== client/python/engines/lmcache_remote.py"
LMCACHE_LOG_LEVEL=ERROR "$VENV/bin/python" -W ignore client/python/engines/lmcache_remote.py "$META"
echo "== client/python/engines/vllm_store_connector.py"
# MOONCAKE_BIN: vLLM's `embedded` mode starts a daemon beside each worker.
MOONCAKE_BIN="$BIN" "$VENV/bin/python" -W ignore client/python/engines/vllm_store_connector.py "$META"
echo "== client/python/engines/vllm_ec_store.py"
"$VENV/bin/python" -W ignore client/python/engines/vllm_ec_store.py "$META"
echo "== client/python/engines/vllm_warmup_cache.py"
"$VENV/bin/python" -W ignore client/python/engines/vllm_warmup_cache.py "$META"
echo "== client/python/engines/vllm_kv_events.py"
"$VENV/bin/python" -W ignore client/python/engines/vllm_kv_events.py "$META" "$EVENTS" "$REPLAY"
echo "== client/python/engines/lmcache_replay.py, sglang_replay.py (300 requests of a conversation trace)"
TRACE="$SCRATCH/trace.jsonl"
"$BIN" gen-trace chat --requests 300 --out "$TRACE" >/dev/null
LMCACHE_LOG_LEVEL=ERROR "$VENV/bin/python" -W ignore client/python/engines/lmcache_replay.py "$META" "$TRACE"
LMCACHE_LOG_LEVEL=ERROR "$VENV/bin/python" -W ignore client/python/engines/lmcache_replay.py "$META" "$TRACE" --native
"$VENV/bin/python" -W ignore client/python/engines/sglang_replay.py "$META" "$TRACE"

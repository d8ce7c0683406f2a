"""A storage daemon beside this client: what Mooncake's ``global_segment_size``
means here.

Mooncake clients contribute a memory segment to the cluster. This package is
a client only (it links no pool, no NVMe tier, no etcd), so a client asked to
contribute memory starts ``mooncake-store daemon`` of that size as a child
process, registered with the same meta service. The child stops with its
parent, however the parent ends: it watches its standard input, which only
the parent holds open.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from typing import List, Optional

#: How long starting a daemon waits for it to register.
REGISTER_WITHIN = 15.0
#: How long stopping a daemon waits for it to leave the meta service.
STOP_WITHIN = 15.0


def tls_flags() -> List[str]:
    """The daemon's TLS flags on a TLS cluster, from the environment that
    the engines' Mooncake backends already set for their clients
    (``MOONCAKE_TLS_CA``, and ``MOONCAKE_TLS_CERT`` for mutual TLS), plus
    the daemon's own server certificate (``MOONCAKE_DAEMON_TLS_CERT`` and
    ``MOONCAKE_DAEMON_TLS_KEY``: it must name the address clients reach it
    at). None without ``MOONCAKE_TLS_CA``."""
    ca = os.environ.get("MOONCAKE_TLS_CA")
    if not ca:
        return []
    cert = os.environ.get("MOONCAKE_DAEMON_TLS_CERT")
    key = os.environ.get("MOONCAKE_DAEMON_TLS_KEY")
    if not (cert and key):
        raise RuntimeError(
            "the store speaks TLS (MOONCAKE_TLS_CA is set), and the storage daemon "
            "this client starts (global_segment_size > 0) needs a server certificate "
            "of its own: set MOONCAKE_DAEMON_TLS_CERT and MOONCAKE_DAEMON_TLS_KEY, "
            "or pass global_segment_size=0"
        )
    flags = ["--tls", "--tls-cert", cert, "--tls-key", key, "--peer-ca", ca]
    if os.environ.get("MOONCAKE_TLS_CERT"):
        # Mutual TLS: the daemon admits only clients the CA signed.
        flags += ["--tls-client-ca", ca]
    return flags


def find_binary() -> str:
    """The ``mooncake-store`` executable: ``$MOONCAKE_BIN``, else on ``PATH``."""
    exe = os.environ.get("MOONCAKE_BIN") or shutil.which("mooncake-store")
    if not exe:
        raise RuntimeError(
            "global_segment_size > 0 starts a storage daemon beside this client, "
            "and `mooncake-store` is not on PATH: install it, set MOONCAKE_BIN to it, "
            "or pass global_segment_size=0 to use the store's daemons only"
        )
    return exe


class DaemonProcess:
    """``mooncake-store daemon`` with ``dram`` bytes of pool, serving on
    ``host`` (a free port), registered with the meta service at ``meta``,
    speaking TLS on a TLS cluster (``tls_flags``). The constructor returns
    once the daemon is registered: puts can be placed on it."""

    def __init__(self, meta: str, dram: int, host: str = "127.0.0.1") -> None:
        exe = find_binary()
        tls = tls_flags()
        self._log = tempfile.NamedTemporaryFile(
            prefix="mooncake-daemon-", suffix=".log", delete=False
        )
        self.log_path = self._log.name
        self._proc = subprocess.Popen(
            [
                exe, "daemon",
                "--meta", meta,
                "--listen", f"{host}:0",
                "--dram", str(int(dram)),
                "--admin", "",
                "--until-stdin-closes",
                *tls,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.addr: Optional[str] = None
        self._registered = False
        self._said = threading.Event()
        self._reader = threading.Thread(
            target=self._read, name="mooncake-daemon-stdout", daemon=True
        )
        self._reader.start()
        self._said.wait(REGISTER_WITHIN)
        if not self._registered:
            why = self._why()
            self.stop()
            raise RuntimeError(
                f"the daemon did not register with the meta service at {meta} "
                f"within {REGISTER_WITHIN:.0f} s: {why}"
            )

    def _read(self) -> None:
        """Reads the daemon's stdout to its end (so it never blocks on a full
        pipe), noting its address and its registration."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith("daemon on ") and self.addr is None:
                self.addr = line.split()[2]
            elif line.startswith("daemon registered"):
                self._registered = True
                self._said.set()
        # Ended (the daemon exited): wake a constructor still waiting.
        self._said.set()

    def _why(self) -> str:
        code = self._proc.poll()
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                last = [l.strip() for l in f if l.strip()][-1:]
        except OSError:
            last = []
        said = last[0] if last else "it said nothing"
        if code is None:
            return f"still not registered ({said}; log: {self.log_path})"
        return f"it exited with status {code} ({said}; log: {self.log_path})"

    @property
    def running(self) -> bool:
        return self._proc.poll() is None and self.addr is not None

    def stop(self) -> None:
        """Stops the daemon and waits until it has: it leaves the meta service
        first, so its blocks leave the index and no put goes to it."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(STOP_WITHIN)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._reader.join(timeout=1.0)
        self._log.close()
        if self._proc.returncode == 0:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

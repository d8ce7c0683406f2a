#!/usr/bin/env bash
# Validates deploy/ offline: Kubernetes manifests against the API schemas
# (kubernetes-validate), the Prometheus config and alert rules (promtool),
# every shipped store config through the real binary (`config print`), and
# the Grafana dashboard's JSON. The dashboard's queries and the scrape config
# also run against a real Prometheus in tools/tests/prometheus.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mooncake-target}"
# kubernetes-validate and PyYAML live in the virtual environment that
# tools/setup.sh makes.
VENV="${MOONCAKE_VENV:-$HOME/.cache/mooncake-venv}"
PATH="$VENV/bin:$PATH"
cargo build -q --bin mooncake-store
BIN="$CARGO_TARGET_DIR/debug/mooncake-store"
fail=0
check() { local what=$1; shift; if "$@" >/tmp/mooncake-check.log 2>&1; then echo "ok    $what"; else echo "FAIL  $what"; cat /tmp/mooncake-check.log; fail=1; fi; }

core=(deploy/k8s/namespace.yaml deploy/k8s/etcd.yaml deploy/k8s/config.yaml deploy/k8s/meta.yaml deploy/k8s/daemon.yaml)
check "kubernetes manifests (strict schema)" kubernetes-validate --strict --quiet "${core[@]}"
check "PodMonitor (Prometheus Operator CRD)" python3 - <<'PY'
import yaml
doc = yaml.safe_load(open("deploy/k8s/podmonitor.yaml"))
assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PodMonitor"
ep = doc["spec"]["podMetricsEndpoints"][0]
assert ep["port"] == "admin" and ep["path"] == "/metrics"
names = doc["spec"]["selector"]["matchExpressions"][0]["values"]
assert set(names) == {"mooncake-meta", "mooncake-daemon"}
PY
check "prometheus scrape config" promtool check config deploy/prometheus/prometheus.yml
check "prometheus alert rules" promtool check rules deploy/prometheus/alerts.yml
check "grafana dashboard JSON" python3 -c 'import json,sys; d=json.load(open("deploy/grafana/mooncake-store.json")); assert d["panels"] and all(t["expr"] for p in d["panels"] for t in p["targets"])'
for f in deploy/systemd/daemon.toml deploy/systemd/meta.toml; do
    check "store config $f" "$BIN" config print --config "$f"
done
python3 - <<'PY' >/tmp/mooncake-k8s.toml
import yaml
print(yaml.safe_load(open("deploy/k8s/config.yaml"))["data"]["mooncake.toml"])
PY
check "store config in deploy/k8s/config.yaml" "$BIN" config print --config /tmp/mooncake-k8s.toml
for unit in deploy/systemd/*.service; do
    check "systemd unit $unit" python3 - "$unit" <<'PY'
import configparser, sys
c = configparser.ConfigParser(strict=True, interpolation=None)
c.optionxform = str
c.read(sys.argv[1])
assert {"Unit", "Service", "Install"} <= set(c.sections())
exec_start = c["Service"]["ExecStart"].split()
assert exec_start[0] == "/usr/local/bin/mooncake-store" and exec_start[1] in {"daemon", "meta"}
assert c["Service"]["KillSignal"] == "SIGTERM"
PY
done
check "compose file (addresses, roles, the image)" python3 - <<'PY'
import yaml
doc = yaml.safe_load(open("deploy/compose/compose.yaml"))
subnet = doc["networks"]["mooncake"]["ipam"]["config"][0]["subnet"]
prefix = subnet.rsplit(".", 1)[0] + "."
roles = {}
for name, svc in doc["services"].items():
    ip = svc["networks"]["mooncake"]["ipv4_address"]
    assert ip.startswith(prefix), (name, ip, subnet)
    cmd = svc["command"]
    if name == "etcd":
        assert any(a == f"--advertise-client-urls=http://{ip}:2379" for a in cmd), name
        continue
    assert svc["image"].endswith("mooncake-store:0.1.0}"), (name, svc["image"])
    roles[cmd[0]] = roles.get(cmd[0], 0) + 1
    # Each server advertises its own fixed address, and finds etcd at its.
    assert any(a.startswith(f"--advertise={ip}:") for a in cmd), (name, cmd)
    etcd_ip = doc["services"]["etcd"]["networks"]["mooncake"]["ipv4_address"]
    assert f"--etcd=http://{etcd_ip}:2379" in cmd, (name, cmd)
assert roles == {"meta": 2, "daemon": 2}, roles
PY
exit $fail

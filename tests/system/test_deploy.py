"""The deploy/ files: the example config is the defaults and serves, the systemd unit verifies and
promises only what the daemon does, and the container and Kubernetes files say what they must.

No YAML parser is a dependency of kvd, so the YAML files get structural checks on their
uncommented lines.
"""
from __future__ import annotations

import configparser
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvd
from kvd.cli import build_parser
from kvd.daemon.config import FIELD_NAMES, Config, load_config
from kvd.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLE = DEPLOY / "kvd.example.toml"
UNIT = DEPLOY / "kvd.service"
CONTAINERFILE = DEPLOY / "Containerfile"
POD = DEPLOY / "k8s" / "pod-sidecar.yaml"
SERVICE = DEPLOY / "k8s" / "service.yaml"
PROMETHEUS = DEPLOY / "prometheus.yml"


def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                     comment_prefixes=("#", ";"))
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    return unit


def active_lines(path: Path) -> list[str]:
    """The lines of a YAML file without comments and blank lines."""
    lines = []
    for line in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.strip():
            lines.append(line)
    return lines


def yaml_list(lines: list[str], key: str) -> list[str]:
    """Items of the block list under the first `key:` (one level, `- item` lines)."""
    for i, line in enumerate(lines):
        if line.strip() == f"{key}:":
            indent = len(line) - len(line.lstrip())
            items = []
            for item in lines[i + 1:]:
                if len(item) - len(item.lstrip()) <= indent and not item.lstrip().startswith("- "):
                    break
                items.append(item.strip()[2:].strip().strip('"'))
            return items
    raise AssertionError(f"no {key}: list")


def parse_serve(argv: list[str]):
    """Parse `kvd serve` arguments as the real CLI does; argparse exits on an unknown flag."""
    try:
        return build_parser().parse_args(["serve", *argv])
    except SystemExit as exc:
        raise AssertionError(f"not valid `kvd serve` arguments: {argv}") from exc


# --- (a) the example configuration -----------------------------------------------------------------

def test_example_config_is_exactly_the_defaults():
    loaded = load_config(config_file=str(EXAMPLE), env={})
    defaults = Config()
    assert dataclasses.replace(loaded, node_id=defaults.node_id) == defaults
    assert loaded.metrics_port == 9470 and loaded.metrics_host == "127.0.0.1"


def test_example_config_documents_every_option():
    text = EXAMPLE.read_text()
    for name in FIELD_NAMES:
        if name in ("peers", "labels"):
            assert re.search(rf"^#\s*\[{name}\]\s*$", text, re.M), f"no commented [{name}] example"
        else:
            assert re.search(rf"^#?\s*{name}\s*=", text, re.M), f"{name} is not in {EXAMPLE.name}"


def test_example_peers_table_is_valid_once_uncommented(tmp_path):
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index("# [peers]")
    table = ["[peers]"] + [line[2:] for line in lines[start + 1:] if re.match(r'# \S+ = "tcp://', line)]
    assert len(table) >= 2
    config = tmp_path / "peers.toml"
    config.write_text(EXAMPLE.read_text() + "\n".join(table) + "\n")
    peers = load_config(config_file=str(config), env={}).peers
    assert len(peers) == len(table) - 1 and all(e.startswith("tcp://") for e in peers.values())


def _notifications(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages += sock.recv(4096).decode(errors="replace").split("\n")
        except BlockingIOError:
            return messages


def _wait_for_notification(sock: socket.socket, seen: list[str], wanted: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while wanted not in seen and time.monotonic() < deadline:
        seen += _notifications(sock)
        time.sleep(0.05)
    return wanted in seen


def test_daemon_serves_with_the_example_config(tmp_path):
    sock_path = tmp_path / "k.sock"
    endpoint = f"unix://{sock_path}"
    # what a service manager would hand a Type=notify service with WatchdogSec
    notify_path = tmp_path / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.setblocking(False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    env.update(NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="1000000")
    args = [sys.executable, "-m", "kvd", "serve", "--config", str(EXAMPLE), "--socket", endpoint,
            "--listen", f"tcp://127.0.0.1:{free_port()}", "--pool-size", "64MiB", "--metrics-port", "0"]
    log_path = tmp_path / "kvd.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 20
        while not (re.search(r"\bready\b", log_path.read_text()) and sock_path.exists()):
            assert proc.poll() is None, f"kvd exited with {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"kvd not ready after 20 s:\n{log_path.read_text()}"
            time.sleep(0.05)

        kv = {"layer.0.k": torch.arange(24, dtype=torch.float16).reshape(2, 3, 4),
              "layer.0.v": torch.tensor([1.5, -0.0, float("inf")], dtype=torch.bfloat16)}
        with kvd.Client(endpoint) as client:
            client.put("deploy-1", kv)
            got = client.get("deploy-1", timeout=5)
        assert got.keys() == kv.keys()
        for name, tensor in kv.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

        # the unit may promise systemd only what this daemon does
        service = read_unit()["Service"]
        seen = _notifications(notify)
        if service.get("Type") == "notify":
            assert _wait_for_notification(notify, seen, "READY=1", 3), (
                "kvd.service says Type=notify but the daemon sent no READY=1 to $NOTIFY_SOCKET: "
                "systemd would kill it after TimeoutStartSec")
        if "WatchdogSec" in service:
            assert _wait_for_notification(notify, seen, "WATCHDOG=1", 3), (
                "kvd.service sets WatchdogSec but the daemon sends no WATCHDOG=1: "
                "systemd would kill it every WatchdogSec")
        if "HUP" in service.get("ExecReload", ""):
            proc.send_signal(signal.SIGHUP)
            time.sleep(1)
            assert proc.poll() is None, "kvd.service reloads with SIGHUP, which killed the daemon"
            with kvd.Client(endpoint) as client:
                client.stats()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log_path.read_text()
        assert not sock_path.exists(), "the client socket was left behind"
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- (b) the systemd unit --------------------------------------------------------------------------

def test_unit_file_settings():
    unit = read_unit()
    assert unit.has_section("Unit") and unit["Install"]["WantedBy"] == "multi-user.target"
    service = unit["Service"]
    expected = {
        "User": "kvd", "Group": "kvd",
        "ExecStart": "/usr/local/bin/kvd serve --config /etc/kvd/kvd.toml",
        "RuntimeDirectory": "kvd", "RuntimeDirectoryMode": "0700",
        "Environment": "KVD_RUNTIME_DIR=/run/kvd",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "Restart": "on-failure", "RestartSec": "2", "TimeoutStopSec": "45",
        "LimitNOFILE": "65536", "LimitMEMLOCK": "infinity",
    }
    for key, value in expected.items():
        assert service.get(key) == value, f"{key}={service.get(key)!r}, expected {value!r}"
    assert "kvd serve" in service["ExecStart"]
    parse_serve(shlex.split(service["ExecStart"])[2:])
    assert set(service["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # the daemon speaks sd_notify (checked for real in test_daemon_serves_with_the_example_config)
    assert service["Type"] == "notify"
    assert service["WatchdogSec"] == "30"
    assert "HUP" in service["ExecReload"]
    assert service.get("DynamicUser", "no") == "no"  # clients must be able to run as the daemon's user
    assert "MemoryDenyWriteExecute" not in service
    for comment in ("MemoryMax=", "DeviceAllow=", "MemoryDenyWriteExecute", "DynamicUser"):
        assert comment in UNIT.read_text(), f"the unit should explain {comment}"


def test_unit_runtime_dir_gives_the_socket_clients_use(monkeypatch):
    """KVD_RUNTIME_DIR=/run/kvd in the unit + the example config = the socket the pod/README name."""
    monkeypatch.delenv("KVD_SOCKET", raising=False)
    monkeypatch.setenv("KVD_RUNTIME_DIR", read_unit()["Service"]["Environment"].split("=", 1)[1])
    assert load_config(config_file=str(EXAMPLE), env={}).socket == "unix:///run/kvd/kvd.sock"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    unit = tmp_path / "kvd.service"
    # verify insists that ExecStart's binary exists: point it at this interpreter
    unit.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/kvd serve",
                                             f"ExecStart={sys.executable} -m kvd serve"))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    output = result.stdout + result.stderr
    # an unknown key or bad value is only a warning (exit 0), so read what it said about our unit
    complaints = [line for line in output.splitlines() if "kvd.service" in line]
    assert not complaints, output
    if result.returncode != 0:
        pytest.skip(f"systemd-analyze verify cannot run here: {output.strip()}")


# --- (c) Kubernetes and Prometheus -----------------------------------------------------------------

def test_pod_sidecar_manifest():
    text = POD.read_text()
    lines = active_lines(POD)
    body = "\n".join(lines)
    assert "\t" not in text
    assert re.search(r"^apiVersion: v1$", body, re.M) and re.search(r"^kind: Pod$", body, re.M)
    assert re.search(r"^\s+shareProcessNamespace: true$", body, re.M)
    # one uid for both containers, set once for the pod
    assert re.findall(r"^\s+runAsUser: (\d+)$", body, re.M) == ["10001"]
    assert re.search(r'^\s+command: \["kvd", "serve"\]$', body, re.M)
    serve = parse_serve(yaml_list(lines, "args"))
    assert serve.listen == "tcp://0.0.0.0:7470" and serve.metrics_host == "0.0.0.0"
    # the client socket: one emptyDir, mounted at /run/kvd in kvd and in the worker
    assert re.search(r"^\s+emptyDir: \{\}$", body, re.M)
    assert len(re.findall(r"^\s+mountPath: /run/kvd$", body, re.M)) == 2
    assert re.search(r"name: KVD_SOCKET\n\s+value: unix:///run/kvd/kvd\.sock$", body, re.M)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert re.search(rf"^\s+{probe}:$", body, re.M), probe
    assert "path: /readyz" in text and "path: /healthz" in text
    assert len(re.findall(r"^\s+limits:$", body, re.M)) == 2 and "memory: 4608Mi" in body
    assert 'prometheus.io/scrape: "true"' in body and 'prometheus.io/port: "9470"' in body
    assert "containerPort: 7470" in body and "containerPort: 9470" in body


def test_pod_worker_turns_on_the_vllm_connector_with_valid_options():
    from kvd.integrations.handshake import ConnectorSettings

    flags = [line.strip()[2:] for line in active_lines(POD) if "--kv-transfer-config=" in line]
    assert len(flags) == 1
    config = json.loads(flags[0].split("=", 1)[1])
    assert config["kv_connector"] == "KVDConnector"
    assert config["kv_connector_module_path"] == "kvd.integrations.vllm"
    settings = ConnectorSettings.from_extra(config["kv_connector_extra_config"])  # raises on a bad option
    assert settings.socket == "unix:///run/kvd/kvd.sock"
    assert settings.endpoint and settings.endpoint.endswith(".kvd-peers.default.svc.cluster.local:7470")


def test_headless_service_matches_the_pod():
    body = "\n".join(active_lines(SERVICE))
    pod = "\n".join(active_lines(POD))
    assert re.search(r"^kind: Service$", body, re.M) and re.search(r"^\s+clusterIP: None$", body, re.M)
    assert re.search(r"^\s+port: 7470$", body, re.M)
    name = re.search(r"^  name: (\S+)$", body, re.M).group(1)
    assert re.search(rf"^\s+subdomain: {name}$", pod, re.M)  # pods get <hostname>.<service> names
    selector = re.search(r"selector:\n\s+(\S+: \S+)", body).group(1)
    assert selector in pod
    assert re.search(rf"tcp://\S+\.{name}\.\S+:7470", pod)  # the peer example uses those names


def test_prometheus_scrape_config():
    body = "\n".join(active_lines(PROMETHEUS))
    assert "\t" not in PROMETHEUS.read_text()
    jobs = re.findall(r"^\s*- job_name: (\S+)$", body, re.M)
    assert "kvd" in jobs and len(jobs) == len(set(jobs))  # Prometheus refuses duplicate job names
    assert re.search(r"^  scrape_interval: 15s$", body, re.M)
    assert re.search(r'- "[^"]+:9470"', body)  # static example
    assert re.search(r"- role: pod$", body, re.M)
    assert "__meta_kubernetes_pod_annotation_prometheus_io_scrape" in body
    assert "__meta_kubernetes_pod_annotation_prometheus_io_port" in body
    assert not re.search(r"\\\\[1-9]", body), "Prometheus regexes (RE2) have no backreferences"


# --- (d) the container image -----------------------------------------------------------------------

def containerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_containerfile():
    instructions = containerfile_instructions()

    def values(key: str) -> list[str]:
        return [rest for keyword, rest in instructions if keyword == key]

    assert values("FROM") == ["python:3.11-slim"]
    assert json.loads(values("ENTRYPOINT")[-1]) == ["kvd", "serve"]
    serve = parse_serve(json.loads(values("CMD")[-1]))
    assert serve.listen == "tcp://0.0.0.0:7470" and serve.metrics_host == "0.0.0.0"
    user = values("USER")[-1].split(":")[0]
    assert user not in ("root", "0", ""), "the image must not run as root"
    assert set(" ".join(values("EXPOSE")).split()) == {"7470", "9470"}
    health = values("HEALTHCHECK")[-1]
    assert re.search(r'CMD \["kvd", "status", "--json"\]$', health)
    runs = " ".join(values("RUN"))
    # the daemon alone: its own requirements, then kvd without the client's torch
    assert "pip install -r /tmp/kvd-src/requirements/daemon.txt" in runs and "--no-deps" in runs
    assert "torch" not in runs
    daemon_requirements = (ROOT / "requirements" / "daemon.txt").read_text()
    assert "torch" not in [line.split(">")[0].strip() for line in daemon_requirements.splitlines()]
    # everything COPY takes from the build context (the repository root) exists
    for rest in values("COPY"):
        for source in rest.split()[:-1]:
            if not source.startswith("--"):
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_the_registry_manifest_and_its_kvd_flags():
    registry = DEPLOY / "k8s" / "registry.yaml"
    text = registry.read_text()
    assert "\t" not in text and "kind: StatefulSet" in text and "kind: Service" in text
    assert "--auto-compaction-retention=1h" in text and "containerPort: 2379" in text
    # the kvd args it tells you to add, with the pod's values filled in, make a valid configuration
    flags = [line.split("- ", 1)[1].split("#")[0].strip() for line in text.splitlines()
             if line.startswith("#     - --")]
    flags = [f.replace("$(POD_NAME)", "prefill-0").replace("$(POD_IP)", "10.1.2.3").replace("$(NODE_ZONE)", "a")
             for f in flags]
    from kvd.daemon.config import parse_labels

    args = {k: v for k, v in vars(parse_serve(flags)).items() if k not in ("command", "config")}
    args["labels"] = parse_labels(args["labels"])
    config = load_config(args, env={})  # raises on anything invalid (a wildcard listen needs advertise)
    assert config.registry == "etcd://kvd-registry.default.svc.cluster.local:2379"
    assert config.advertised == "tcp://10.1.2.3:7470" and config.role == "prefill" and config.labels == {"zone": "a"}

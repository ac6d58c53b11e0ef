"""The GPU pool: CUDA IPC handoff from workers and the pinned bounce path to the network.

Skipped without a CUDA GPU (and cupy). Run on a GPU machine with `./dev test -m cuda`.
"""
from __future__ import annotations

import pytest
import torch

from kvd.client.tensors import TORCH_DTYPES
from kvd.testing.daemons import free_port, wait_ready

pytestmark = pytest.mark.cuda


def gpu_daemon(daemons, node_id="G", **kwargs):
    return daemons.start(node_id, pool_size="256MiB", extra=["--device", "cuda:0", *kwargs.pop("extra", [])],
                         **kwargs)


@pytest.mark.parametrize("dtype_name", list(TORCH_DTYPES))
def test_gpu_pool_round_trips_every_dtype(daemons, dtype_name):
    d = gpu_daemon(daemons)
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randint(0, 256, (4096 * 8,), dtype=torch.uint8, device="cuda", generator=g)
    tensor = raw.view(TORCH_DTYPES[dtype_name])[:4096].reshape(64, 64)
    with d.client() as c:
        assert c.info.device == "cuda:0" and c.info.pool_handle
        c.put("gpu-1", {"x": tensor})
        out = torch.empty_like(tensor)
        got = c.get("gpu-1", out={"x": out})["x"]
        assert got.device.type == "cuda"
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


def test_gpu_to_gpu_and_gpu_to_host_daemons(daemons):
    from kvd.testing.daemons import free_port

    port_g, port_h, port_g2 = free_port(), free_port(), free_port()
    peers = {"H": f"tcp://127.0.0.1:{port_h}", "G2": f"tcp://127.0.0.1:{port_g2}"}
    g = gpu_daemon(daemons, "G", port=port_g, peers=peers)
    h = daemons.start("H", port=port_h, pool_size="256MiB")
    g2 = gpu_daemon(daemons, "G2", port=port_g2)
    data = torch.randint(0, 256, (96 << 20,), dtype=torch.uint8, device="cuda")
    with g.client() as cg, h.client() as ch, g2.client() as cg2:
        cg.put("to-host", {"x": data}, dest="H")
        assert torch.equal(ch.get("to-host")["x"], data.cpu())
        cg.put("to-gpu", {"x": data}, dest="G2")
        out = torch.empty_like(data)
        assert torch.equal(cg2.get("to-gpu", out={"x": out})["x"], data)


def test_paged_blocks_on_the_gpu(daemons):
    d = gpu_daemon(daemons)
    cache = torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    target = torch.zeros_like(cache)
    with d.client() as c:
        c.put_blocks("gpu-paged", {"k": cache}, [5, 9, 33])
        c.get_blocks("gpu-paged", {"k": target}, [0, 1, 2])
    assert torch.equal(target[:3].view(torch.int16), cache[[5, 9, 33]].view(torch.int16))


def test_two_gpu_pool_daemons_push_and_pull_over_the_nixl_plane(daemons):
    """Both pools registered as VRAM: UCX moves the bytes GPU to GPU (cuda_ipc on one node, GPUDirect
    RDMA between nodes); the digests are taken through the host. Bit-exact, and the plane did it."""
    from kvd.daemon.plane.nixl import available

    if not available():
        pytest.skip("NIXL is not installed (pip install '.[nixl]')")
    port_a, port_b = free_port(), free_port()
    flags = ["--device", "cuda:0", "--data-plane", "nixl"]
    a = daemons.start("A", port=port_a, pool_size="256MiB", extra=flags, wait=False,
                      peers={"B": f"tcp://127.0.0.1:{port_b}"})
    b = daemons.start("B", port=port_b, pool_size="256MiB", extra=flags, peers={"A": f"tcp://127.0.0.1:{port_a}"})
    wait_ready(a)
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    with a.client() as ca, b.client() as cb:
        ca.put("vram-push", {"x": data}, dest="B")
        assert torch.equal(cb.get("vram-push", timeout=20)["x"].to(data.device), data)
        ca.put("vram-pull", {"x": data})
        assert torch.equal(cb.get("vram-pull", source="A", timeout=20)["x"].to(data.device), data)
        assert ca.stats()["plane"]["memory"] == "VRAM" and ca.stats()["plane"]["done"] >= 1
        assert cb.stats()["plane"]["done"] >= 1 and cb.stats()["plane"]["failed"] == 0

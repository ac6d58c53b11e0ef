"""kvd's cases, against real daemons: local handoff, push, pull, small-message latency, concurrency."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

import torch

from kvd.testing.daemons import DaemonProc

from .measure import Sample, busy_between, repeat, rss_beyond_shared, system_cpu


def _tensor(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def local_put_get(daemon: DaemonProc, nbytes: int, repeats: int) -> tuple[Sample, Sample]:
    """put of one nbytes tensor; get(out=...) into a preallocated, touched tensor."""
    data, out = _tensor(nbytes), torch.ones(nbytes, dtype=torch.uint8)
    with daemon.client() as c:
        put = repeat(lambda: c.put("bench", {"x": data}), repeats, pids=(daemon.pid,),
                     setup=lambda: c.delete("bench"))
        get = repeat(lambda: c.get("bench", out={"x": out}, keep=True), repeats, pids=(daemon.pid,))
        c.delete("bench")
    assert torch.equal(out, data), "local get returned different bytes"
    return put, get


def local_round_trip(daemon: DaemonProc, nbytes: int, repeats: int) -> float:
    data, out = _tensor(nbytes), torch.ones(nbytes, dtype=torch.uint8)
    with daemon.client() as c:
        def once() -> None:
            c.put("rt", {"x": data})
            c.get("rt", out={"x": out})
        sample = repeat(once, repeats, warmup=20)
    assert torch.equal(out, data)
    return sample.median


def push(a: DaemonProc, b: DaemonProc, nbytes: int, repeats: int) -> Sample:
    """put(dest=B) on A, until B has verified and published it (the call's return)."""
    data = _tensor(nbytes, 1)
    with a.client() as ca, b.client() as cb:
        sample = repeat(lambda: ca.put("push", {"x": data}, dest="B"), repeats, pids=(a.pid, b.pid),
                        setup=lambda: cb.delete("push"))
        out = cb.get("push", timeout=10)["x"]
    assert torch.equal(out, data), "push delivered different bytes"
    return sample


def pull(a: DaemonProc, b: DaemonProc, nbytes: int, repeats: int) -> Sample:
    """get(source=A, out=...) on B: B's daemon pulls from A, then the client copies out."""
    data, out = _tensor(nbytes, 2), torch.ones(nbytes, dtype=torch.uint8)

    def fresh_entry() -> None:
        # A drops its copy when B's done reaches it, which can be just after B's get returned
        ca.delete("pull")
        ca.put("pull", {"x": data})

    with a.client() as ca, b.client() as cb:
        sample = repeat(lambda: cb.get("pull", source="A", out={"x": out}), repeats, pids=(a.pid, b.pid),
                        setup=fresh_entry)
    assert torch.equal(out, data), "pull delivered different bytes"
    return sample


def _concurrent_pusher(socket: str, worker: int, count: int, nbytes: int, ready, start, results, finish) -> None:
    import kvd

    async def main() -> None:
        data = torch.full((nbytes,), worker, dtype=torch.uint8)
        async with kvd.AsyncClient(socket) as c:
            ready.put(worker)
            start.wait()
            t0 = time.time()
            await asyncio.gather(*(c.put(f"c{worker}-{i}", {"x": data}, dest="B") for i in range(count)))
            results.put((t0, time.time()))
            # stay connected and alive until every worker is done: closing unmaps the pool (tens
            # of ms of kernel time for a 1 GiB mapping) and the interpreter's teardown (torch's
            # included) is CPU too, taken from the transfers of the workers still being timed
            finish.wait(300)

    asyncio.run(main())


def concurrent_pushes(a: DaemonProc, b: DaemonProc, processes: int, per_process: int,
                      nbytes: int) -> tuple[float, float]:
    """Aggregate bytes/second of processes x per_process concurrent pushes of nbytes, and the
    fraction of the machine's CPU that was busy meanwhile (1.0: every core, all the time)."""
    ctx = mp.get_context("spawn")
    ready, start, results, finish = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_concurrent_pusher,
                         args=(a.socket, w, per_process, nbytes, ready, start, results, finish))
             for w in range(processes)]
    for proc in procs:
        proc.start()
    for _ in procs:  # every worker has imported torch and connected
        ready.get(timeout=120)
    before = system_cpu()
    start.set()
    spans = [results.get(timeout=300) for _ in procs]
    busy = busy_between(before, system_cpu())
    finish.set()
    for proc in procs:
        proc.join(30)
    with b.client() as cb:
        for w in range(processes):
            for i in range(per_process):
                cb.delete(f"c{w}-{i}")
    elapsed = max(end for _, end in spans) - min(begin for begin, _ in spans)
    return processes * per_process * nbytes / elapsed, busy


@dataclass
class StreamRun:
    """One layer-streamed handoff: when each layer was written on A and arrived on B."""

    written: list[float]  # perf_counter at the end of each write (the producer's clock)
    arrived: list[float]  # perf_counter when the consumer had each layer (same process, same clock)

    @property
    def tail(self) -> float:
        """How long after the producer's last write the consumer had the last layer."""
        return max(self.arrived) - max(self.written)


def layer_streaming(a: DaemonProc, b: DaemonProc, layers: int, layer_bytes: int, pace: float,
                    request_id: str = "stream-bench") -> StreamRun:
    """A producer on A writes `layers` tensors into put_stream(dest=B), one every `pace` seconds
    (standing in for prefill computing layer i+1 while layer i is sent); a consumer on B
    iterates get_stream in another thread, into preallocated tensors as an engine's KV cache
    would be (fresh ones would time the page faults of touching new memory), and notes when
    each layer arrives. Bytes verified."""
    data = [_tensor(layer_bytes, seed) for seed in range(layers)]
    names = [f"layer.{i}" for i in range(layers)]
    out = {name: torch.ones(layer_bytes, dtype=torch.uint8) for name in names}
    arrived: dict[str, float] = {}
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            with b.client() as cb:
                for group in cb.get_stream(request_id, timeout=30, out=out):
                    now = time.perf_counter()
                    for name in group:
                        arrived[name] = now
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    written: list[float] = []
    with a.client() as ca, ca.put_stream(request_id, dict(zip(names, data)), dest="B") as stream:
        due = time.perf_counter()
        for name, tensor in zip(names, data):
            due += pace
            time.sleep(max(0.0, due - time.perf_counter()))  # "computing" this layer
            stream.write({name: tensor})
            written.append(time.perf_counter())
    consumer.join(60)
    if errors:
        raise errors[0]
    assert all(torch.equal(out[n], t) for n, t in zip(names, data)), "a streamed layer differs"
    return StreamRun(written, [arrived[n] for n in names])


def daemon_rss(*daemons: DaemonProc) -> int:
    return max(rss_beyond_shared(d.pid) for d in daemons)


def pushes_in_flight(a: DaemonProc, b: DaemonProc, nbytes: int, inflight: int, count: int) -> float:
    """Seconds per push when `inflight` pushes of nbytes run at once from one AsyncClient (the
    shape of layer streaming or of a worker handing off several requests), count in all."""
    data = _tensor(nbytes, 3)

    async def run() -> float:
        async with a.async_client() as ca:
            await ca.put("inflight-warm", {"x": data}, dest="B")
            gate = asyncio.Semaphore(inflight)

            async def one(i: int) -> None:
                async with gate:
                    await ca.put(f"inflight-{i}", {"x": data}, dest="B")

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(count)))
            return time.perf_counter() - t0

    elapsed = asyncio.run(run())
    with b.client() as cb:
        assert torch.equal(cb.get("inflight-warm")["x"], data), "a push in flight delivered different bytes"
        for i in range(count):
            cb.delete(f"inflight-{i}")
    return elapsed / count


@dataclass
class FirstGets:
    first: list[float]  # B's get(out=) right after each push returned
    repeated: list[float]  # the same get again, at once

    @property
    def ratios(self) -> list[float]:
        return [f / r for f, r in zip(self.first, self.repeated)]


def first_get_after_push(a: DaemonProc, b: DaemonProc, nbytes: int, repeats: int) -> FirstGets:
    """Whether the receiver's first read of a pushed entry pays for anything the push left
    behind (its daemon still busy, pages not yet mapped): against the same read repeated."""
    data, out = _tensor(nbytes, 4), torch.ones(nbytes, dtype=torch.uint8)
    first, repeated = [], []
    with a.client() as ca, b.client() as cb:
        for _ in range(repeats):
            ca.put("first-get", {"x": data}, dest="B")
            t0 = time.perf_counter()
            cb.get("first-get", out={"x": out}, keep=True)
            t1 = time.perf_counter()
            cb.get("first-get", out={"x": out}, keep=True)
            t2 = time.perf_counter()
            cb.delete("first-get")
            first.append(t1 - t0)
            repeated.append(t2 - t1)
    assert torch.equal(out, data), "the first get returned different bytes"
    return FirstGets(first, repeated)


def fresh_client_faults(daemon: DaemonProc, nbytes: int) -> tuple[int, int]:
    """Page faults (minor, in this process) of a fresh client's first put and first get of
    nbytes: what its new mapping of the pool costs on the first transfer's path (source and
    destination tensors are touched beforehand, so only the pool's pages can fault)."""
    import resource

    data, out = _tensor(nbytes, 5), torch.ones(nbytes, dtype=torch.uint8)
    with daemon.client() as c:
        c.stats()  # connected: the pool is mapped
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c.put("fresh-faults", {"x": data})
        after_put = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c.get("fresh-faults", out={"x": out})
        after_get = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert torch.equal(out, data)
    return after_put - before, after_get - after_put

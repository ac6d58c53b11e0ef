"""Model-based test: random sequences of operations on two real daemons, checked against a model.

Hypothesis drives put / push / get / pull / delete / expiry (and, in the second test, restarts of
the peer) on daemons A and B, started once per test. A pure-Python model says which request ids
each daemon holds and with which bytes; after every step each daemon must list exactly those
entries (right byte sizes, all ready), its pool must hold exactly the blocks they need, and every
get must return the model's bytes bit for bit. At the end of each run, deleting everything
returns both pools to 0 bytes.

The three tests at the end are regression tests: the smallest reproductions of bugs these tests
and bench/soak.py found (a pushed entry whose ttl ran out, streams aborted after their last
write or right after opening), kept as plain tests since the fixes.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import kvd
from kvd.testing.daemons import DaemonFactory, free_port, wait_ready

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
ALIGNMENT = 256  # each tensor starts on this boundary inside an entry (PROTOCOL.md, "entry layout")
BLOCK = 64 << 10  # the daemons' default --block-size
IDS = [f"req-{i}" for i in range(5)]  # a small pool, so ids collide and AlreadyExists happens
NODES = ("A", "B")
SETTLE = 3.0  # seconds a step's effects may take to show (pull releases, deferred frees, expiry)
EXPIRE_TTL, EXPIRE_WAIT = 0.3, 0.5

KV = dict[str, torch.Tensor]


def entry_bytes(kv: KV) -> int:
    cursor = 0
    for t in kv.values():
        cursor = -(-cursor // ALIGNMENT) * ALIGNMENT + t.numel() * t.element_size()
    return cursor


def pool_bytes(kv: KV) -> int:
    return -(-entry_bytes(kv) // BLOCK) * BLOCK


def make_kv(specs: list[tuple[str, list[int]]], seed: int) -> KV:
    """Random bytes (NaN payloads, -0.0, anything) reinterpreted as each tensor's dtype."""
    g = torch.Generator().manual_seed(seed)
    kv = {}
    for i, (dtype_name, shape) in enumerate(specs):
        dtype = DTYPES[dtype_name]
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        kv[f"t{i}"] = raw.view(dtype).reshape(shape)
    return kv


kvs = st.builds(
    make_kv,
    st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 300), min_size=1, max_size=2)),
             min_size=1, max_size=3),
    st.integers(0, 2**31 - 1),
)
ids = st.sampled_from(IDS)
nodes = st.sampled_from(NODES)


def assert_same(got: KV, expected: KV) -> None:
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype and tuple(have.shape) == tuple(want.shape), (name, have, want)
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


class Pair:
    """Daemons A and B (each the other's peer), a client for each, and a way to restart B in place."""

    def __init__(self, factory: DaemonFactory, extra: list[str]) -> None:
        self.factory, self.extra = factory, extra
        self.port_a, self.port_b = free_port(), free_port()
        self.a = factory.start("A", port=self.port_a, peers={"B": f"tcp://127.0.0.1:{self.port_b}"},
                               extra=extra, wait=False)
        self.b = factory.start("B", port=self.port_b, peers={"A": f"tcp://127.0.0.1:{self.port_a}"},
                               extra=extra, wait=False)
        wait_ready(self.a)
        wait_ready(self.b)
        self.b_socket = self.b.socket
        self.clients = {"A": self.a.client().connect(), "B": self.b.client().connect()}
        self.restarts = 0

    def restart_b(self) -> None:
        """SIGTERM B, then start a new B on the same peer port and the same client socket path."""
        self.clients["B"].close()
        assert self.b.stop() == 0, self.b.log()[-3000:]
        self.b = self.factory.start("B", port=self.port_b, peers={"A": f"tcp://127.0.0.1:{self.port_a}"},
                                    extra=[*self.extra, "--socket", self.b_socket], wait=False)
        self.b.socket = self.b_socket  # the last --socket wins
        wait_ready(self.b)
        self.clients["B"] = self.b.client().connect()
        self.restarts += 1

    def clear(self) -> None:
        """Delete whatever either daemon holds and wait for both pools to be empty."""
        for node, c in self.clients.items():
            for entry in c.list():
                c.delete(entry["request_id"])
            wait_until(lambda: c.stats()["pool"]["used_bytes"] == 0, f"{node}'s pool did not empty")

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def wait_until(check, message: str, timeout: float = SETTLE) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.02)


class KvdMachine(RuleBasedStateMachine):
    pair: Pair  # set by the test that runs the machine
    restarts_enabled = False

    def __init__(self) -> None:
        super().__init__()
        self.pair.clear()
        self.model: dict[str, dict[str, KV]] = {"A": {}, "B": {}}

    def c(self, node: str) -> kvd.Client:
        return self.pair.clients[node]

    # --- rules -------------------------------------------------------------------------------------

    @rule(node=nodes, rid=ids, kv=kvs)
    def put(self, node, rid, kv):
        held = self.model[node]
        if rid in held:
            with pytest.raises(kvd.AlreadyExists):
                self.c(node).put(rid, kv)
        else:
            self.c(node).put(rid, kv)
            held[rid] = kv

    @rule(rid=ids, kv=kvs)
    def push(self, rid, kv):
        a, b = self.model["A"], self.model["B"]
        if rid in a:
            with pytest.raises(kvd.AlreadyExists) as info:
                self.c("A").put(rid, kv, dest="B")
            assert info.value.remote in (None, "A"), info.value
        elif rid in b:
            with pytest.raises(kvd.AlreadyExists) as info:
                self.c("A").put(rid, kv, dest="B")
            assert info.value.remote == "B", info.value
        else:
            self.c("A").put(rid, kv, dest="B")  # A's copy is gone once B confirmed
            b[rid] = kv

    @rule(node=nodes, rid=ids, keep=st.booleans())
    def get(self, node, rid, keep):
        held = self.model[node]
        if rid not in held:
            with pytest.raises(kvd.NotFound):
                self.c(node).get(rid, timeout=0, keep=keep)
            return
        assert_same(self.c(node).get(rid, timeout=0, keep=keep), held[rid])
        if not keep:
            del held[rid]

    @rule(rid=ids, keep=st.booleans())
    def pull(self, rid, keep):
        """get(source="A") on B: served from B's own copy if it has one, else pulled from A."""
        a, b = self.model["A"], self.model["B"]
        cb = self.c("B")
        if rid in b:
            assert_same(cb.get(rid, source="A", timeout=0, keep=keep), b[rid])
            if not keep:
                del b[rid]
        elif rid in a:
            assert_same(cb.get(rid, source="A", timeout=0, keep=keep), a[rid])
            if keep:
                b[rid] = a[rid]  # A keeps its copy, and B keeps the one it pulled
            else:
                del a[rid]  # A drops its copy once B has it; B's reader consumed it
                # ... when B's `done` reaches A, which can be just after B's get returned
                ca = self.c("A")
                wait_until(lambda: all(e["request_id"] != rid for e in ca.list()),
                           f"A still holds {rid!r} after B pulled it")
        else:
            with pytest.raises(kvd.NotFound) as info:
                cb.get(rid, source="A", timeout=0, keep=keep)
            assert info.value.remote == "A", info.value

    @rule(node=nodes, rid=ids)
    def delete(self, node, rid):
        assert self.c(node).delete(rid) is (rid in self.model[node])
        self.model[node].pop(rid, None)

    @rule(node=nodes, rid=ids, kv=kvs, via_push=st.booleans())
    def expire(self, node, rid, kv, via_push):
        """put with a short ttl (locally, or pushed from A to B); after the ttl it is gone."""
        if via_push:
            node = "B"
            exists = rid in self.model["A"] or rid in self.model["B"]
            put = lambda: self.c("A").put(rid, kv, dest="B", ttl=EXPIRE_TTL)  # noqa: E731
        else:
            exists = rid in self.model[node]
            put = lambda: self.c(node).put(rid, kv, ttl=EXPIRE_TTL)  # noqa: E731
        if exists:
            with pytest.raises(kvd.AlreadyExists):
                put()
            return
        put()
        time.sleep(EXPIRE_WAIT)
        c = self.c(node)
        wait_until(lambda: rid not in {e["request_id"] for e in c.list()},
                   f"{rid} (ttl {EXPIRE_TTL}s, via_push={via_push}) still on {node} after "
                   f"{EXPIRE_WAIT + SETTLE}s: {c.list()}")
        with pytest.raises(kvd.NotFound):
            c.get(rid, timeout=0)

    @precondition(lambda self: self.restarts_enabled)
    @rule()
    def restart_peer(self):
        """B restarts (SIGTERM, new process on the same port and socket): its entries are gone, and A
        can push to the new B again, at the latest once its heartbeat timeout has passed."""
        self.pair.restart_b()
        self.model["B"].clear()
        probe = {"x": torch.arange(1000, dtype=torch.int32)}
        deadline = time.monotonic() + 5 + 2  # default --heartbeat-timeout, and a margin
        failures = []
        while True:
            try:
                self.c("A").put("restart-probe", probe, dest="B")
                break
            except kvd.KvdError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"A cannot push to B after B restarted ({len(failures)} tries over 7 s): "
                        f"{failures[0]} ... {failures[-1]}") from exc
                time.sleep(0.5)
        assert_same(self.c("B").get("restart-probe", timeout=5), probe)

    # --- invariants --------------------------------------------------------------------------------

    @invariant()
    def daemons_hold_what_the_model_says(self):
        for node in NODES:
            c = self.c(node)
            want = {rid: (entry_bytes(kv), "ready") for rid, kv in self.model[node].items()}
            want_used = sum(pool_bytes(kv) for kv in self.model[node].values())
            deadline = time.monotonic() + SETTLE
            while True:
                listed = {e["request_id"]: (e["bytes"], e["state"]) for e in c.list()}
                pool = c.stats()["pool"]
                used = pool["used_bytes"]
                if (listed == want and used == want_used) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert listed == want, f"{node} lists {listed}, the model says {want}"
            assert used == want_used, f"{node} uses {used} pool bytes, the model's entries need {want_used}"
            # blocks lent for one-round-trip puts stay within their bound (PROTOCOL.md §2.1)
            assert pool["scratch_bytes"] <= pool["capacity_bytes"] // 16
            assert pool["free_blocks"] * BLOCK == pool["capacity_bytes"] - used - pool["scratch_bytes"]

    def teardown(self):
        for node in NODES:
            c = self.c(node)
            for rid in list(self.model[node]):
                assert c.delete(rid), f"{rid} was not on {node}"
            wait_until(lambda: c.stats()["pool"]["used_bytes"] == 0 and c.stats()["entries"] == 0,
                       f"{node}: pool not empty after deleting everything: {c.stats()['pool']}, {c.list()}")


def run_machine(pair: Pair, restarts: bool, **overrides) -> None:
    class Machine(KvdMachine):
        pass

    Machine.pair = pair
    Machine.restarts_enabled = restarts
    config = dict(max_examples=12, stateful_step_count=25, deadline=None, database=None,
                  report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    config.update(overrides)
    run_state_machine_as_test(Machine, settings=settings(**config))


def test_operations_match_the_model(daemons):
    pair = Pair(daemons, extra=[])
    try:
        run_machine(pair, restarts=False)
    finally:
        pair.close()


@pytest.mark.slow  # ~30 s of restarts on 2 cores; the model test above runs by default
def test_operations_match_the_model_across_peer_restarts(daemons):
    pair = Pair(daemons, extra=[])
    try:
        # a failure is reported as found (no shrinking): each restart costs a second or more
        run_machine(pair, restarts=True, max_examples=6, stateful_step_count=15,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])
    finally:
        pair.close()


def test_pushed_entry_whose_ttl_ran_out_still_expires(daemons):
    a, b = daemons.pair(extra=["--default-ttl", "1s"])
    with a.client() as ca, b.client() as cb:
        ca.put("short-lived", {"x": torch.ones(4)}, dest="B", ttl=1e-6)
        wait_until(lambda: not cb.list(), f"still on B after {SETTLE + 1}s: {cb.list()}", timeout=SETTLE + 1)


def test_stream_aborted_after_its_last_write_is_not_delivered(daemons):
    a, b = daemons.pair()
    layout = {"layer.0": ((1000,), torch.float32)}
    with a.client() as ca, b.client() as cb:
        with (
            pytest.raises(RuntimeError, match="prefill failed"),
            ca.put_stream("abandoned", layout, dest="B") as stream,
        ):
            stream.write({"layer.0": torch.ones(1000)})
            # B has every byte, only the commit is missing (else there is nothing to not deliver)
            wait_until(lambda: cb.stats()["counters"]["received_bytes"] == 4000, "B never had the bytes")
            raise RuntimeError("prefill failed")
        wait_until(lambda: cb.stats()["counters"]["failures"] == 1, "B never took the abort")
        with pytest.raises(kvd.NotFound):
            cb.get("abandoned", timeout=0)
        assert cb.stats()["pool"]["used_bytes"] == 0


def test_streams_aborted_right_after_opening_leave_nothing_behind(daemons):
    a, b = daemons.pair(extra=["--drain-timeout", "1s"])  # a stuck transfer also holds up SIGTERM's drain
    layout = {"layer.0": ((20000,), torch.float32), "layer.1": ((20000,), torch.float32)}
    with a.client() as ca, b.client() as cb:
        for i in range(20):
            with pytest.raises(RuntimeError), ca.put_stream(f"abandoned-{i}", layout, dest="B") as stream:
                stream.write({"layer.0": torch.ones(20000)})
                raise RuntimeError("prefill failed")
        wait_until(lambda: not cb.list() and cb.stats()["pool"]["used_bytes"] == 0,
                   f"B still holds {[(e['request_id'], e['state']) for e in cb.list()]}")
        wait_until(lambda: ca.stats()["pool"]["used_bytes"] == 0, f"A still uses {ca.stats()['pool']}")

"""kvd.daemon.local.ledger: what each client connection holds, without sockets (a real Store)."""
from __future__ import annotations

from kvd.daemon.local.ledger import Holds
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import Store

BLOCK = 4096


def make() -> tuple[Holds, Store]:
    store = Store(BlockAllocator(64), BLOCK, None)
    return Holds(store), store


def test_a_connection_holds_several_loans_each_used_once():
    holds, store = make()
    tokens = [store.lend_scratch(2)[0] for _ in range(3)]
    for token in tokens:
        holds.lend(b"c1", token, 2)
    assert holds.loans(b"c1") == {t: 2 for t in tokens} and store.scratch_blocks == 6
    assert holds.take_loan(b"c1", tokens[1])
    assert not holds.take_loan(b"c1", tokens[1])  # used up: a second use finds nothing
    assert set(holds.loans(b"c1")) == {tokens[0], tokens[2]}


def test_a_loan_is_only_its_connections():
    holds, store = make()
    token, _ = store.lend_scratch(1)
    holds.lend(b"c1", token, 1)
    assert not holds.take_loan(b"c2", token)
    assert not holds.take_loan(b"c1", None) and not holds.take_loan(b"c1", 424242)
    assert holds.loans(b"c1") == {token: 1} and holds.loans(b"c2") == {}


def test_a_departed_connection_gives_back_every_loan():
    holds, store = make()
    tokens = [store.lend_scratch(1)[0] for _ in range(4)]
    for token in tokens:
        holds.lend(b"c1", token, 1)
    other, _ = store.lend_scratch(1)
    holds.lend(b"c2", other, 1)
    loans, held = holds.gone(b"c1")
    assert sorted(loans) == sorted(tokens) and held == []
    for token in loans:
        store.return_scratch(token)
    assert store.scratch_blocks == 1 and holds.loans(b"c1") == {} and holds.loans(b"c2") == {other: 1}
    assert holds.gone(b"c1") == ([], [])  # twice is harmless

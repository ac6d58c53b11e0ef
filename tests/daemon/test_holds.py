"""kvd.daemon.local.ledger: loans of scratch blocks, each its connection's, without sockets (a real Store)."""
from __future__ import annotations

import pytest

from kvd.daemon.local import events as ev
from kvd.daemon.local.ledger import LocalLedger
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import Store
from kvd.errors import NotFound

BLOCK = 4096


def make() -> tuple[LocalLedger, Store]:
    store = Store(BlockAllocator(64), BLOCK, None)
    return LocalLedger(store, None, 30.0), store


def lend(ledger: LocalLedger, store: Store, conn: bytes, blocks: int) -> int:
    token, _ = store.lend_scratch(blocks)
    ledger.handle(ev.Lent(conn, token, blocks))
    return token


def test_a_connection_holds_several_loans_each_used_once():
    ledger, store = make()
    tokens = [lend(ledger, store, b"c1", 2) for _ in range(3)]
    assert ledger.loans(b"c1") == {t: 2 for t in tokens} and store.scratch_blocks == 6
    ledger.validate()
    ledger.handle(ev.LoanUsed(b"c1", tokens[1]))
    with pytest.raises(NotFound):  # used up: a second use finds nothing
        ledger.handle(ev.LoanUsed(b"c1", tokens[1]))
    assert set(ledger.loans(b"c1")) == {tokens[0], tokens[2]}
    store.return_scratch(tokens[1])  # (the shell turns a used loan into an entry; here it goes back)
    ledger.validate()


def test_a_loan_is_only_its_connections():
    ledger, store = make()
    token = lend(ledger, store, b"c1", 1)
    with pytest.raises(NotFound):
        ledger.handle(ev.LoanUsed(b"c2", token))
    ledger.handle(ev.LoanReturned(b"c2", token))  # (another's give_back is ignored)
    ledger.handle(ev.LoanReturned(b"c1", None))
    ledger.handle(ev.LoanReturned(b"c1", 424242))
    assert ledger.loans(b"c1") == {token: 1} and ledger.loans(b"c2") == {} and store.scratch_blocks == 1
    ledger.handle(ev.LoanReturned(b"c1", token))  # its own give_back: the blocks go back
    assert ledger.loans(b"c1") == {} and store.scratch_blocks == 0 and not ledger.holds_any(b"c1")
    ledger.validate()


def test_a_departed_connection_gives_back_every_loan():
    ledger, store = make()
    for _ in range(4):
        lend(ledger, store, b"c1", 1)
    other = lend(ledger, store, b"c2", 1)
    assert ledger.handle(ev.ConnectionLost(b"c1")) == []  # (loans: nothing to tell anyone)
    assert store.scratch_blocks == 1 and ledger.loans(b"c1") == {} and ledger.loans(b"c2") == {other: 1}
    assert ledger.handle(ev.ConnectionLost(b"c1")) == []  # twice is harmless
    ledger.validate()

"""The client's operations as I/O-free generators (kvd/client/core.py, streaming.py): driven here
with hand-written replies, over a pool that is a plain tensor; no daemon, no socket."""
from __future__ import annotations

import pytest
import torch

from kvd.client.core import ConnectionLost, _ClientCore
from kvd.client.ops import NO_REPLY, Emit, Receive
from kvd.client.streaming import StreamState, abort_stream, commit_stream, open_stream, read_stream, write_stream
from kvd.client.tensors import DTYPE_NAMES
from kvd.errors import BadRequest, KvdError, NotFound, ProtocolError
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, physical_segments

BLOCK, BLOCKS = 4096, 32
DTYPES = list(DTYPE_NAMES)  # every dtype the wire carries


def core() -> _ClientCore:
    """A client core as it is after hello: its pool a tensor here instead of the daemon's mapping."""
    c = _ClientCore("unix:///nonexistent/kvd.sock", reply_timeout=1.0)
    c.info = p.HelloOk(req=1, node_id="A", incarnation=1, pool_path="", pool_size=BLOCK * BLOCKS,
                       block_size=BLOCK, device="cpu", pool_handle=None)
    c._pool = torch.zeros(BLOCK * BLOCKS, dtype=torch.uint8)
    c._generation = 1
    return c


def sample(dtype: torch.dtype, n: int = 1000, seed: int = 0) -> torch.Tensor:
    """Every bit pattern matters: random bytes viewed as dtype (NaNs and all)."""
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def slots_for(msg: p.PutAlloc, first_block: int = 3) -> p.PutSlots:
    """The daemon's answer: each tensor placed back to back from first_block, one extent."""
    specs = [TensorSpec.from_wire(t) for t in msg.tensors]
    segments, offset = [], 0
    for spec in specs:
        segments.append(physical_segments([(first_block, BLOCKS - first_block)], BLOCK, offset, spec.nbytes))
        offset += spec.nbytes
    return p.PutSlots(req=msg.req, token=41, segments=segments)


def put_then_get(c: _ClientCore, kv: dict) -> dict:
    op = c._put("r", kv, None, None, None)
    alloc, wait = next(op)
    assert isinstance(alloc, p.PutAlloc) and wait == 0.0 and [t[0] for t in alloc.tensors] == list(kv)
    slots = slots_for(alloc)
    commit, _ = op.send(slots)
    assert isinstance(commit, p.PutCommit) and commit.token == 41 and commit.lend
    with pytest.raises(StopIteration):
        op.send(p.PutOk(req=commit.req))
    get = c._get("r", None, 0.0, None, keep=False)
    msg, _ = next(get)
    assert isinstance(msg, p.Get) and msg.request_id == "r" and not msg.keep
    done, wait = get.send(p.GetSlots(req=msg.req, token=9, tensors=alloc.tensors, segments=slots.segments))
    assert isinstance(done, p.GetDone) and done.consume and done.token == 9 and wait is NO_REPLY
    with pytest.raises(StopIteration) as stop:
        get.send(None)
    return stop.value.value if hasattr(stop.value, "value") else stop.value


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_what_a_put_writes_a_get_reads_back_bit_for_bit(dtype):
    c = core()
    kv = {"k": sample(dtype, 700, 1), "v": sample(dtype, 300, 2).reshape(10, 30)}
    got = put_then_get(c, kv)
    assert set(got) == {"k", "v"} and all(same_bits(got[name], kv[name]) for name in kv)


def test_a_small_put_goes_into_blocks_lent_with_the_last_reply():
    c = core()
    op = c._put("first", {"x": sample(torch.uint8, 100)}, None, None, None)
    alloc, _ = next(op)
    commit, _ = op.send(slots_for(alloc))
    with pytest.raises(StopIteration):
        op.send(p.PutOk(req=commit.req, scratch=77, extents=[[20, 2]]))
    assert c._scratch == [(77, [(20, 2)], 2)]
    data = sample(torch.float32, 1024, 3)  # 4 KiB: fits the two lent blocks
    op = c._put("second", {"x": data}, None, None, None)
    put, _ = next(op)
    assert isinstance(put, p.Put) and put.scratch == 77 and c._scratch == []  # one round trip
    assert same_bits(c._pool[20 * BLOCK:20 * BLOCK + 4096].view(torch.float32), data)
    with pytest.raises(StopIteration):
        op.send(p.PutOk(req=put.req))


@pytest.mark.parametrize("extents", [[[30, 5]], [[-1, 1]], [[0, 0]], [["x", 1]], "nonsense"])
def test_lent_blocks_outside_the_pool_are_not_believed(extents):
    c = core()
    c._keep_scratch(p.PutOk(req=1, scratch=5, extents=extents))
    assert c._scratch == []


def test_a_put_whose_copy_fails_gives_its_reservation_back_at_once():
    c = core()
    c._pool = None  # (the connection went away mid-operation)
    op = c._put("r", {"x": sample(torch.uint8, 10)}, None, None, None)
    alloc, _ = next(op)
    delete, wait = op.send(slots_for(alloc))
    assert isinstance(delete, p.Delete) and delete.token == 41 and delete.request_id == "r" and wait is NO_REPLY
    with pytest.raises(ConnectionLost):
        op.send(None)


def test_a_get_into_a_wrong_out_tensor_hands_the_entry_back_unconsumed():
    c = core()
    spec = TensorSpec("x", "float32", (10,))
    op = c._get("r", None, 1.0, {"x": torch.empty(11)}, keep=False)
    msg, wait = next(op)
    assert wait == 1.0
    done, _ = op.send(p.GetSlots(req=msg.req, token=3, tensors=[spec.to_wire()],
                                 segments=[physical_segments([(0, 1)], BLOCK, 0, 40)]))
    assert isinstance(done, p.GetDone) and not done.consume
    with pytest.raises(BadRequest):
        op.send(None)


def test_an_error_reply_thrown_into_a_put_unwinds_it_cleanly():
    c = core()
    sent = []
    c._send_nowait = sent.append
    op = c._put("r", {"x": sample(torch.uint8, 10)}, None, None, None)
    alloc, _ = next(op)
    with pytest.raises(NotFound):
        c._unwind(op, NotFound("the reservation expired"), reraise=True)
    assert sent == []  # nothing reserved yet: nothing to give back
    op = c._put("r", {"x": sample(torch.uint8, 10)}, None, None, None)
    alloc, _ = next(op)
    op.send(slots_for(alloc))  # written: the commit is next
    with pytest.raises(KvdError, match="interrupted"):  # not swallowed, even when not re-raised
        c._unwind(op, KvdError("interrupted"), reraise=False)
    assert sent == []


def test_late_replies_to_abandoned_requests_give_back_what_they_hold():
    c = core()
    get = p.Get(req=5, request_id="r", timeout=1.0)
    alloc = p.PutAlloc(req=6, request_id="w", tensors=[["x", "uint8", [10]]])
    c._abandon(get)
    c._abandon(alloc)
    back = c._late_reply(p.GetSlots(req=5, token=11, tensors=[], segments=[]))
    assert isinstance(back, p.GetDone) and back.token == 11 and not back.consume and not back.reply
    back = c._late_reply(p.PutSlots(req=6, token=12, segments=[]))
    assert isinstance(back, p.Delete) and back.token == 12 and back.request_id == "w"
    assert c._late_reply(p.GetSlots(req=5, token=11, tensors=[], segments=[])) is None  # once only
    assert c._late_reply(p.PutOk(req=99, scratch=8, extents=[[1, 1]])) is None
    assert c._scratch == [(8, [(1, 1)], 1)]  # a late put_ok's loan is still ours to use


def test_hello_refuses_a_reply_that_is_not_hello_ok():
    c = _ClientCore("unix:///nonexistent/kvd.sock", reply_timeout=1.0)
    op = c._hello()
    msg, _ = next(op)
    assert isinstance(msg, p.Hello)
    with pytest.raises(ProtocolError, match="expected hello_ok"):
        op.send(p.Ok(req=msg.req))


def test_listing_asks_page_after_page_until_one_comes_back_short():
    c = core()
    op = c._list()
    first, _ = next(op)
    assert first.after is None and first.limit == p.LIST_PAGE
    page = [{"request_id": f"r{i:05d}"} for i in range(p.LIST_PAGE)]
    second, _ = op.send(p.Ok(req=first.req, value=page))
    assert second.after == page[-1]["request_id"]
    with pytest.raises(StopIteration) as stop:
        op.send(p.Ok(req=second.req, value=[{"request_id": "zz"}]))
    assert len(stop.value.value) == p.LIST_PAGE + 1


def test_bad_request_ids_are_refused_before_anything_is_sent():
    c = core()
    for bad in ("", 5, None, b"bytes"):  # (the daemon checks the rest, such as the length)
        with pytest.raises(BadRequest):
            next(c._get(bad, None, 0.0, None, keep=False))


def test_a_stream_written_in_parts_then_committed():
    c = core()
    layer0, layer1 = sample(torch.bfloat16, 500, 4), sample(torch.bfloat16, 500, 5)
    specs = [TensorSpec("l0", "bfloat16", (500,)), TensorSpec("l1", "bfloat16", (500,))]
    state = StreamState("s", specs, dest=None)
    op = open_stream(c, state, None, None)
    alloc, _ = next(op)
    assert alloc.stream and alloc.req not in c._writes
    with pytest.raises(StopIteration):
        op.send(slots_for(alloc))
    assert c._writes[alloc.req] is state  # open: an error on its put_alloc's req is this stream's
    part, wait = next(write_stream(c, state, {"l1": layer1}))
    assert isinstance(part, p.PutPart) and part.tensors == [1] and wait is NO_REPLY
    with pytest.raises(BadRequest, match="already written"):
        next(write_stream(c, state, {"l1": layer1}))
    with pytest.raises(BadRequest, match="declared"):
        next(write_stream(c, state, {"l0": layer0.float()}))
    next(write_stream(c, state, {"l0": layer0}))
    commit, _ = next(commit_stream(c, state))
    assert isinstance(commit, p.PutCommit) and commit.token == 41 and alloc.req not in c._writes
    assert list(abort_stream(c, state)) == []  # committed: nothing to abort
    got = put_free_read(c, state, alloc)
    assert same_bits(got["l0"], layer0) and same_bits(got["l1"], layer1)


def put_free_read(c: _ClientCore, state: StreamState, alloc: p.PutAlloc) -> dict:
    """Read the stream back: slots, then two TensorsReady, as the daemon sends them."""
    slots = slots_for(alloc)
    op = read_stream(c, "s", 5.0, None, keep=False)
    msg, _ = next(op)
    assert isinstance(msg, p.GetStream)
    step = op.send(p.GetSlots(req=msg.req, token=13, tensors=alloc.tensors, segments=slots.segments))
    assert isinstance(step, Receive) and step.req == msg.req
    got = {}
    for ready in (p.TensorsReady(req=msg.req, tensors=[1], complete=False),
                  p.TensorsReady(req=msg.req, tensors=[0], complete=True)):
        emitted = op.send(ready)
        assert isinstance(emitted, Emit)
        got.update(emitted.value)
        step = op.send(None)
    done, wait = step
    assert isinstance(done, p.GetDone) and done.consume and wait is NO_REPLY
    return got


def test_a_stream_the_daemon_ended_gives_up_at_its_next_write():
    c = core()
    state = StreamState("s", [TensorSpec("l0", "uint8", (10,))], dest=None)
    op = open_stream(c, state, None, None)
    alloc, _ = next(op)
    with pytest.raises(StopIteration):
        op.send(slots_for(alloc))
    assert c._stream_notice(p.Error(req=alloc.req, code=NotFound.code, message="deleted", origin="A"))
    op = write_stream(c, state, {"l0": torch.ones(10, dtype=torch.uint8)})
    delete, wait = next(op)  # it lets go of the parked blocks first
    assert isinstance(delete, p.Delete) and delete.token == 41 and wait is NO_REPLY
    with pytest.raises(NotFound, match="deleted"):
        op.send(None)
    assert state.closed and alloc.req not in c._writes

"""The disk level's page header (kvd.daemon.tier.disk.disk_format), pure: every field round-trips, and a
header that is damaged, of another version, or of another page is refused, never misread."""
from __future__ import annotations

import struct

import pytest

from kvd.daemon.tier.disk.disk_format import (
    HEADER_SIZE,
    VERSION,
    BadPage,
    Header,
    check_is,
    decode,
    disk_bytes,
    encode,
    namespace_dir,
    page_path,
)
from kvd.wire.dtypes import DTYPE_ITEMSIZE


def header(**changes) -> Header:
    fields = dict(namespace="model=m;tp=0/2", key="a" * 64, dtype="bfloat16", shape=(2, 3, 4), nbytes=48,
                  digest=0x1234_5678_9ABC_DEF0, block_size=65536)
    fields.update(changes)
    return Header(**fields)


@pytest.mark.parametrize("dtype", list(DTYPE_ITEMSIZE))
def test_every_field_round_trips(dtype):
    shape = (1, 2, 3, 4, 5, 6, 7, 8)
    h = header(dtype=dtype, shape=shape, nbytes=40320 * DTYPE_ITEMSIZE[dtype], namespace="", key="k")
    raw = encode(h)
    assert len(raw) == HEADER_SIZE and decode(raw) == h


def test_a_flipped_byte_anywhere_in_the_header_is_refused():
    raw = encode(header())
    for at in [*list(range(0, 200)), 1000, HEADER_SIZE - 1]:
        damaged = bytearray(raw)
        damaged[at] ^= 0x04
        with pytest.raises(BadPage):
            decode(damaged)


def test_another_format_version_is_stale_and_never_read():
    old = encode(header(version=VERSION - 1))
    with pytest.raises(BadPage) as caught:
        decode(old)
    assert caught.value.stale and f"this kvd reads {VERSION}" in caught.value.reason
    with pytest.raises(BadPage, match="no magic"):
        decode(b"\0" * HEADER_SIZE)
    with pytest.raises(BadPage, match="shorter"):
        decode(encode(header())[:100])


def test_a_size_that_does_not_match_dtype_and_shape_is_refused():
    raw = bytearray(encode(header()))
    struct.pack_into("<Q", raw, 16, 49)  # nbytes, with the header's digest made good again
    import xxhash
    struct.pack_into("<Q", raw, 32, 0)
    struct.pack_into("<Q", raw, 32, xxhash.xxh3_64_intdigest(bytes(raw)))
    with pytest.raises(BadPage, match="49 bytes for a bfloat16 page"):
        decode(raw)


def test_a_header_of_another_page_is_not_the_page_asked_for():
    h = decode(encode(header()))
    check_is(h, "model=m;tp=0/2", "a" * 64, 48)
    with pytest.raises(BadPage, match="namespace"):
        check_is(h, "model=m;tp=1/2", "a" * 64)
    with pytest.raises(BadPage, match="key"):
        check_is(h, "model=m;tp=0/2", "b" * 64)
    with pytest.raises(BadPage, match="48 bytes"):
        check_is(h, "model=m;tp=0/2", "a" * 64, 64)


def test_names_part_namespaces_and_keys_and_the_budget_counts_whole_blocks():
    assert page_path("a", "k") != page_path("b", "k") != page_path("a", "l")
    assert page_path("a", "k").startswith(f"pages/{namespace_dir('a')}/")
    assert page_path("a\x00b", "k") != page_path("a", "b\x00k")  # (NUL never appears in either)
    assert disk_bytes(0) == 4096 and disk_bytes(1) == 8192 and disk_bytes(4096) == 8192 and disk_bytes(4097) == 12288

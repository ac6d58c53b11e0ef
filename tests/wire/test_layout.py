"""kvd.wire.layout: tensor specs, tensor offsets, logical-to-pool mapping, chunking."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import BadRequest
from kvd.wire.layout import (
    ALIGNMENT,
    MAX_DIMS,
    MAX_NAME_LEN,
    MAX_TENSORS,
    TensorSpec,
    blocks_needed,
    chunk_ranges,
    physical_segments,
    split_extents,
    tensor_offsets,
    validate_specs,
)

# ---- TensorSpec --------------------------------------------------------------------------


def test_spec_nbytes_and_wire_round_trip():
    spec = TensorSpec("layer.0.k", "bfloat16", (8, 16, 64))
    assert spec.nbytes == 8 * 16 * 64 * 2
    assert spec.to_wire() == ["layer.0.k", "bfloat16", [8, 16, 64]]
    assert TensorSpec.from_wire(spec.to_wire()) == spec
    assert TensorSpec.from_wire(("x", "int64", (3,))) == TensorSpec("x", "int64", (3,))


def test_spec_scalar_and_empty_shapes():
    assert TensorSpec.from_wire(["s", "float32", []]).nbytes == 4  # a 0-d tensor holds one element
    assert TensorSpec.from_wire(["e", "float32", [0, 5]]).nbytes == 0
    assert TensorSpec.from_wire(["m", "uint8", [1] * MAX_DIMS]).shape == (1,) * MAX_DIMS


@pytest.mark.parametrize("raw", [
    None, "x", 5, [], ["x", "float32"], ["x", "float32", [1], "extra"], {"name": "x"},
])
def test_from_wire_rejects_malformed_specs(raw):
    with pytest.raises(BadRequest, match=r"\[name, dtype, shape\]"):
        TensorSpec.from_wire(raw)


@pytest.mark.parametrize("name", ["", None, 5, b"bytes", "n" * (MAX_NAME_LEN + 1)])
def test_from_wire_rejects_bad_names(name):
    with pytest.raises(BadRequest, match="name"):
        TensorSpec.from_wire([name, "float32", [1]])


def test_from_wire_accepts_name_at_limit():
    assert TensorSpec.from_wire(["n" * MAX_NAME_LEN, "float32", [1]]).name == "n" * MAX_NAME_LEN


@pytest.mark.parametrize("dtype", ["float64", "bool", "torch.float32", "", "Float32", None, 4])
def test_from_wire_rejects_bad_dtypes(dtype):
    with pytest.raises(BadRequest, match="dtype"):
        TensorSpec.from_wire(["x", dtype, [1]])


@pytest.mark.parametrize("shape", [
    [True, 2], [2, False], [-1], [3, -2], [1.0], ["4"], [None], [2**40], [[2]],
])
def test_from_wire_rejects_bad_dims(shape):
    with pytest.raises(BadRequest, match="dims"):
        TensorSpec.from_wire(["x", "float32", shape])


@pytest.mark.parametrize("shape", [[1] * (MAX_DIMS + 1), "12", 12, None, {"a": 1}])
def test_from_wire_rejects_bad_shapes(shape):
    with pytest.raises(BadRequest, match="shape"):
        TensorSpec.from_wire(["x", "float32", shape])


def test_validate_specs():
    validate_specs([])
    validate_specs([TensorSpec("a", "int8", (1,)), TensorSpec("b", "int8", (1,))])
    with pytest.raises(BadRequest, match="unique"):
        validate_specs([TensorSpec("a", "int8", (1,)), TensorSpec("a", "int8", (2,))])
    many = [TensorSpec(f"t{i}", "int8", (1,)) for i in range(MAX_TENSORS + 1)]
    with pytest.raises(BadRequest, match="too many"):
        validate_specs(many)
    validate_specs(many[:-1])


# ---- tensor_offsets ---------------------------------------------------------------------


def test_tensor_offsets_align_each_tensor():
    specs = [
        TensorSpec("a", "uint8", (1,)),        # 1 byte
        TensorSpec("b", "float32", (64,)),     # 256 bytes
        TensorSpec("c", "float16", (3,)),      # 6 bytes
        TensorSpec("d", "int64", (0,)),        # 0 bytes
        TensorSpec("e", "int8", (300,)),       # 300 bytes
    ]
    offsets, total = tensor_offsets(specs)
    assert offsets == [0, 256, 512, 768, 768]
    assert total == 768 + 300
    for offset in offsets:
        assert offset % ALIGNMENT == 0


def test_tensor_offsets_empty():
    assert tensor_offsets([]) == ([], 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["uint8", "float16", "float32", "int64"]),
                          st.lists(st.integers(0, 40), max_size=3)), max_size=12))
def test_tensor_offsets_properties(raw):
    specs = [TensorSpec(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(raw)]
    offsets, total = tensor_offsets(specs)
    assert len(offsets) == len(specs)
    end = 0
    for spec, offset in zip(specs, offsets):
        assert offset % ALIGNMENT == 0
        assert offset >= end  # no overlap with the previous tensor
        assert offset - end < ALIGNMENT  # and no more padding than needed
        end = offset + spec.nbytes
    assert total == end


def test_blocks_needed():
    assert blocks_needed(0, 4096) == 0
    assert blocks_needed(1, 4096) == 1
    assert blocks_needed(4096, 4096) == 1
    assert blocks_needed(4097, 4096) == 2


# ---- physical_segments --------------------------------------------------------------------


def brute_force_segments(extents, block_size, offset, length):
    """Byte-by-byte logical -> pool map, then merge consecutive pool bytes."""
    byte_map = [block * block_size + i
                for first, count in extents
                for block in range(first, first + count)
                for i in range(block_size)]
    segments = []
    for pos in byte_map[offset:offset + length]:
        if segments and segments[-1][0] + segments[-1][1] == pos:
            segments[-1][1] += 1
        else:
            segments.append([pos, 1])
    return [tuple(s) for s in segments]


def test_physical_segments_single_extent():
    assert physical_segments([(3, 2)], 16, 0, 32) == [(48, 32)]
    assert physical_segments([(3, 2)], 16, 5, 10) == [(53, 10)]


def test_physical_segments_merges_adjacent_extents():
    # (0,2) and (2,3) are contiguous in the pool: one segment
    assert physical_segments([(0, 2), (2, 3)], 16, 0, 80) == [(0, 80)]
    assert physical_segments([(4, 1), (5, 1), (6, 1)], 8, 3, 18) == [(35, 18)]


def test_physical_segments_splits_across_gaps():
    extents = [(5, 2), (0, 1), (9, 3)]
    # logical bytes: [0,32) -> pool [80,112); [32,48) -> [0,16); [48,96) -> [144,192)
    assert physical_segments(extents, 16, 0, 96) == [(80, 32), (0, 16), (144, 48)]
    assert physical_segments(extents, 16, 30, 20) == [(110, 2), (0, 16), (144, 2)]
    assert physical_segments(extents, 16, 32, 16) == [(0, 16)]
    assert physical_segments(extents, 16, 95, 1) == [(191, 1)]


def test_physical_segments_zero_length_is_empty():
    assert physical_segments([(0, 1)], 16, 0, 0) == []
    assert physical_segments([], 16, 0, 0) == []


@pytest.mark.parametrize("offset, length", [(0, 49), (48, 1), (40, 10), (100, 5), (-1, 2), (-8, 8)])
def test_physical_segments_out_of_range(offset, length):
    with pytest.raises(BadRequest, match="outside"):
        physical_segments([(0, 1), (4, 2)], 16, offset, length)


def test_physical_segments_no_extents():
    with pytest.raises(BadRequest):
        physical_segments([], 16, 0, 1)


@st.composite
def extent_layouts(draw):
    """Disjoint extents in shuffled order, a block size, and a range inside them."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    gaps = draw(st.lists(st.integers(0, 2), min_size=len(sizes), max_size=len(sizes)))
    extents = []
    cursor = 0
    for size, gap in zip(sizes, gaps):
        cursor += gap
        extents.append((cursor, size))
        cursor += size
    order = draw(st.permutations(range(len(extents))))
    extents = [extents[i] for i in order]
    capacity = sum(sizes) * block_size
    offset = draw(st.integers(0, capacity))
    length = draw(st.integers(0, capacity - offset))
    return extents, block_size, offset, length


@settings(max_examples=300, deadline=None)
@given(extent_layouts())
def test_physical_segments_matches_brute_force(layout):
    extents, block_size, offset, length = layout
    got = physical_segments(extents, block_size, offset, length)
    assert got == brute_force_segments(extents, block_size, offset, length)
    assert sum(n for _, n in got) == length
    assert all(n > 0 for _, n in got)


@settings(max_examples=100, deadline=None)
@given(extent_layouts(), st.integers(1, 10))
def test_physical_segments_rejects_ranges_past_the_end(layout, overshoot):
    extents, block_size, offset, _ = layout
    capacity = sum(n for _, n in extents) * block_size
    with pytest.raises(BadRequest):
        physical_segments(extents, block_size, offset, capacity - offset + overshoot)


# ---- chunk_ranges ---------------------------------------------------------------------------


def test_chunk_ranges_examples():
    assert chunk_ranges(0, 4) == []
    assert chunk_ranges(4, 4) == [(0, 4)]
    assert chunk_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_ranges(3, 100) == [(0, 3)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4096))
def test_chunk_ranges_cover_total_exactly(total, chunk):
    ranges = chunk_ranges(total, chunk)
    assert sum(n for _, n in ranges) == total
    cursor = 0
    for offset, length in ranges:
        assert offset == cursor
        assert 0 < length <= chunk
        cursor += length
    assert cursor == total
    assert len(ranges) == -(-total // chunk)
    # only the last chunk may be short
    assert all(length == chunk for _, length in ranges[:-1])


@pytest.mark.parametrize("blocks, head, tail", [
    (0, [], [(3, 2), (10, 3)]),
    (1, [(3, 1)], [(4, 1), (10, 3)]),
    (2, [(3, 2)], [(10, 3)]),
    (4, [(3, 2), (10, 2)], [(12, 1)]),
    (5, [(3, 2), (10, 3)], []),
])
def test_split_extents_keeps_the_order_blocks_are_used_in(blocks, head, tail):
    assert split_extents([(3, 2), (10, 3)], blocks) == (head, tail)

"""A paged KV cache's blocks in kvd's KV tier, by content (engine worker and scheduler processes;
pure: no I/O, no engine import): which page holds what, under which namespace and key.

Prefix reuse stores each full block of a computed prompt once, under the engine's own block hash
(which chains the block's parent, its tokens and the extra keys: LoRA, multimodal inputs, a
request's cache salt), so any engine of the same model and layout that meets the same prefix
finds it. A page is one block of one KV cache group on one saving rank: that block of every
layer of the group the rank holds, laid end to end (`kvd.Parts`), so a page is one copy each way
and all of a block's layers come and go together.

- namespace (`namespace`): everything that changes a page's bytes or the meaning of its key
  and is the same on every rank of a deployment: the model (its signature), the KV dtype, the
  quantization mode and the cache layout, the block size, the KV cache groups, the TP and PP
  sizes (and layer partition), the block hash algorithm, and the tenant salt (`kvd_salt`);
  two deployments that differ in any of them never read each other's pages;
- key (`page_key`): the block hash, the group, and the rank that holds the page's heads and
  layers (the first holder of its KV heads: replicas, and every rank of an MLA latent, read the
  one page their primary rank saved), so one lookup of a block asks for all of its pages in one
  namespace, in one request.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...parallel.kv_layout import KVLayout, shard_layouts
from ...parallel.readers import primary_shards
from .groups import FULL, MAMBA, KVGroup
from .plans import layer_index

PREFIX = "kvd-prefix/1"  # bump when the page format or the naming changes: older pages then miss
MAX_NAMESPACE_LEN = 256  # the daemon's bound (kvd.daemon.store.page_names.MAX_NAMESPACE_LEN)
_UNSAFE = re.compile(r"[^A-Za-z0-9._/:@+=,-]")
_KEY = re.compile(r"([0-9a-f]{2,200})\.g(\d+)\.t(\d+)\.p(\d+)")

Rank = tuple[int, int]  # (tp rank, pp rank) of the rank that saves a page


def _digest(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def namespace(engine: str, model: str, fields: dict[str, object], salt: str | None = None) -> str:
    """The namespace of a deployment's pages: equal exactly when their bytes may be shared.
    `model` shows (cut, with a hash, when long or unusual); `fields` are spelled out when short and
    all hashed into `sig`; the salt only hashed (the namespace shows in `kvd status`)."""
    name = _UNSAFE.sub("_", model)[:48]
    shown = ";".join(f"{k}={_UNSAFE.sub('_', str(v))}" for k, v in fields.items() if len(str(v)) <= 24)
    parts = [PREFIX, f"e={engine}", f"m={name}", shown, f"sig={_digest(repr((model, sorted(fields.items()))))}"]
    if salt:
        parts.append(f"salt={_digest('salt:' + salt)}")
    text = ";".join(p for p in parts if p)
    return text if len(text) <= MAX_NAMESPACE_LEN else f"{PREFIX};h={_digest(text, 64)}"


def unusable(groups: Sequence[KVGroup]) -> str | None:
    """Why a model's KV cache cannot be reused by prefix through the tier, or None."""
    if not groups:
        return "no KV cache groups"
    if any(g.kind == MAMBA for g in groups):
        return "a Mamba state exists only at the end of each computed chunk, not at every block"
    if len({g.block_size for g in groups}) > 1:
        return f"KV cache groups of different block sizes ({sorted({g.block_size for g in groups})})"
    return None


def page_key(block_hash: bytes | str, group: int, rank: Rank) -> str:
    """The key of one saving rank's page of one group's block."""
    hexed = block_hash if isinstance(block_hash, str) else block_hash.hex()
    return f"{hexed}.g{group}.t{rank[0]}.p{rank[1]}"


def parse_key(key: str) -> tuple[str, int, Rank] | None:
    """(block hash hex, group, rank) of a page key, or None for a key that is not one."""
    found = _KEY.fullmatch(key)
    if found is None:
        return None
    return found.group(1), int(found.group(2)), (int(found.group(3)), int(found.group(4)))


def saving_rank(kv: KVLayout) -> Rank:
    """The rank whose page this rank reads and, if it is that rank, writes: the first holder of its heads."""
    return kv.tp_rank - kv.tp_rank % kv.head_replicas, kv.pp_rank


@dataclass(frozen=True)
class TierLayout:
    """Which pages a block of a deployment has: per group, the saving ranks holding its layers."""

    groups: tuple[KVGroup, ...]
    ranks: tuple[tuple[Rank, ...], ...]  # per group: the saving ranks with layers of it

    @classmethod
    def of(cls, model: KVLayout, groups: Sequence[KVGroup]) -> TierLayout:
        """From the model's layout (its TP and PP sizes and partition) and every group's layers."""
        shards = primary_shards(shard_layouts(model, model.tp_size, model.pp_size, model.pp_partition))
        ranks = []
        for group in groups:
            indices = {layer_index(name) for name in group.layers}
            ranks.append(tuple(saving_rank(s) for s in shards if not indices or any(
                s.layer_range()[0] <= i < s.layer_range()[1] for i in indices)))
        return cls(tuple(groups), tuple(ranks))

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    def needed(self, num_blocks: int) -> list[list[int]]:
        """Per block of a hit of num_blocks blocks, the groups whose pages it needs: full attention
        every block; a window only the blocks it keeps for the hit's next token."""
        tokens = num_blocks * self.block_size
        firsts = [g.kept_blocks(tokens)[0] if g.kind != FULL else 0 for g in self.groups]
        return [[g for g, first in enumerate(firsts) if i >= first] for i in range(num_blocks)]

    def lookup_keys(self, hashes: Sequence[str], first: int) -> tuple[list[str], list[int]]:
        """The keys that a hit of blocks [first, len(hashes)) needs, block by block in order, and
        how many keys each block has (a leading count of keys held -> leading blocks held)."""
        keys: list[str] = []
        per_block: list[int] = []
        for i, groups in enumerate(self.needed(len(hashes))[first:], start=first):
            block = [page_key(hashes[i], g, rank) for g in groups for rank in self.ranks[g]]
            keys += block
            per_block.append(len(block))
        return keys, per_block


def leading_blocks(held_keys: int, per_block: Iterable[int]) -> int:
    """How many blocks, from the first asked, have every page held, given the leading keys held."""
    blocks = 0
    for count in per_block:
        if held_keys < count:
            break
        held_keys -= count
        blocks += 1
    return blocks


@dataclass
class TierSave:
    """Pages to store once this step's forward is over: (block hash hex, group, block id) each."""

    pages: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class TierLoad:
    """A request's hit: fill these blocks from the tier, (block hash hex, group, block id) each."""

    req_id: str
    pages: list[tuple[str, int, int]]
    num_tokens: int  # the tokens computed once loaded (the hit's end)

    def block_ids(self) -> set[int]:
        return {block for _, _, block in self.pages}

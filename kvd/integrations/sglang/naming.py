"""Which KV tier namespace an SGLang rank's pages live in (SGLang's scheduler process; pure, no SGLang import).

SGLang's L3 keys are chained SHA-256 hashes of token ids only: they carry no model, no rank and
no tenant (sgl-project/sglang#37160). Two ranks, two models or two tenants with the same prompt
make the same key, so everything that changes the bytes of a page goes into the namespace:
- the model, and the shard of it this rank holds: TP rank and size for MHA (each rank holds its
  heads); none for MLA, whose latent KV is the same on every TP rank (one writer, all read);
  the pipeline stage (its layers) and the context-parallel and DCP shards when there are several;
- the page format: the host pool's layout, dtype and page shape (a page_first page and a
  layer_first page of the same tokens hold the same numbers in another order);
- the tenant salt (`kvd_salt`), hashed: the namespace shows in `kvd status`, the salt must not.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import torch

PREFIX = "sglang/1"  # bump when the page format or this naming changes: old pages then miss
MAX_NAMESPACE_LEN = 256  # the daemon's bound (kvd.daemon.store.page_names.MAX_NAMESPACE_LEN)
MAX_MODEL_LEN = 96  # longer model names keep their head and a hash, so the namespace stays bounded
_UNSAFE = re.compile(r"[^A-Za-z0-9._/:@+-]")  # what may stand in a namespace field as it is


@dataclass(frozen=True)
class RankIdentity:
    """The fields of SGLang's HiCacheStorageConfig that say which shard of which model a rank holds."""

    model_name: str | None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    logical_page_size: int | None = None
    is_mla_model: bool = False

    @classmethod
    def of(cls, storage_config: Any) -> RankIdentity:
        """From an SGLang HiCacheStorageConfig (read by name: this module does not import SGLang)."""
        def get(name: str, default: Any) -> Any:
            return getattr(storage_config, name, default)

        return cls(model_name=get("model_name", None), tp_rank=int(get("tp_rank", 0)), tp_size=int(get("tp_size", 1)),
                   pp_rank=int(get("pp_rank", 0)), pp_size=int(get("pp_size", 1)),
                   attn_cp_rank=int(get("attn_cp_rank", 0)), attn_cp_size=int(get("attn_cp_size", 1)),
                   dcp_rank=int(get("dcp_rank", 0)), dcp_size=int(get("dcp_size", 1)),
                   logical_page_size=get("logical_page_size", None), is_mla_model=bool(get("is_mla_model", False)))


def _digest(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def model_field(model_name: str | None) -> str:
    """The model name as a namespace field: safe characters kept, the rest '_'; a changed or
    over-long name gets a hash of the original, so two names never end up as one field."""
    name = model_name or ""
    safe = _UNSAFE.sub("_", name)
    if safe != name or len(safe) > MAX_MODEL_LEN:
        safe = f"{safe[:MAX_MODEL_LEN - 17]}~{_digest(name)}"
    return safe


def page_format(layout: str, dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """The bytes' format of one page: layout, dtype and the page's shape in that layout."""
    return f"{_UNSAFE.sub('_', str(layout))},{str(dtype).removeprefix('torch.')},{'x'.join(map(str, shape))}"


def namespace(rank: RankIdentity, fmt: str, salt: str | None = None) -> str:
    """The namespace of a rank's pages: equal exactly when the pages' bytes may be shared."""
    parts = [PREFIX, f"m={model_field(rank.model_name)}"]
    # MLA: the latent KV is replicated over TP (SGLang writes it from one rank); MHA: sharded by head
    parts.append("mla" if rank.is_mla_model else f"tp={rank.tp_rank}/{rank.tp_size}")
    if rank.pp_size > 1:
        parts.append(f"pp={rank.pp_rank}/{rank.pp_size}")
    if rank.attn_cp_size > 1:
        parts.append(f"cp={rank.attn_cp_rank}/{rank.attn_cp_size}")
    if rank.dcp_size > 1:
        parts.append(f"dcp={rank.dcp_rank}/{rank.dcp_size},lp={rank.logical_page_size}")
    parts.append(f"fmt={fmt}")
    if salt:
        parts.append(f"salt={_digest(salt)}")
    text = ";".join(parts)
    if len(text) > MAX_NAMESPACE_LEN:  # (only an extreme page shape gets here: the model field is bounded)
        text = f"{PREFIX};h={_digest(text, 64)}"
    return text

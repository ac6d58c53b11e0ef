"""The KV layout of a vLLM instance, read from its config (vLLM's scheduler and worker processes).

- `model_signature`: what must match between producer and consumer beyond the cache shapes.
- `deployment`: this instance's TP/PP sizes and layer partition (vLLM's own `get_pp_indices`,
  so VLLM_PP_LAYER_PARTITION is honoured), as the handshake carries it to the consumer.
- `model_kv_layout`: the model's KV geometry and one rank's shard of it as a `KVLayout`. An MLA
  cache (one latent every TP rank holds) is modelled as one KV head: each rank then holds the
  same "head", only rank 0 saves it and every consumer rank reads that one shard.
- `kv_groups`: the KV cache groups vLLM moves (its transfer groups) as `KVGroup`s, by kind: full
  attention (MLA too, and a sliding-window layer with the hybrid manager off: its blocks are
  all kept), sliding window, chunked local attention, Mamba / linear-attention state. Any other
  kind is refused at start (a ValueError naming it).
- `tier_namespace`: the KV tier namespace of this deployment's prefix pages (the same on the
  scheduler and on every worker).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...parallel.kv_layout import KVLayout
from ..paged.groups import CHUNKED, FULL, MAMBA, SLIDING, KVGroup
from ..paged.plans import SourceDeployment
from ..paged.tier_pages import namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


def model_signature(vllm_config: VllmConfig) -> str:
    """What must match between producer and consumer beyond the cache shapes."""
    model_config = vllm_config.model_config
    hf = getattr(model_config, "hf_config", None)
    arch = ",".join(getattr(hf, "architectures", None) or [type(hf).__name__])
    parts = [arch]
    for attr in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "head_dim", "vocab_size"):
        value = getattr(hf, attr, None)
        if value is not None:
            parts.append(f"{attr}={value}")
    parts.append(f"kv_dtype={vllm_config.cache_config.cache_dtype}")
    return ":".join(parts)


def deployment(vllm_config: VllmConfig) -> SourceDeployment:
    """This instance's TP size, PP size and layer partition."""
    from vllm.distributed.utils import get_pp_indices

    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    partition = None
    if pp > 1:
        partition = ",".join(str(b - a) for a, b in (get_pp_indices(layers, r, pp) for r in range(pp)))
    return SourceDeployment(tp, pp, partition)


def model_kv_layout(vllm_config: VllmConfig, dtype: str, tp_rank: int = 0, pp_rank: int = 0) -> KVLayout:
    """The model's KV geometry and the shard of rank (tp_rank, pp_rank) of this instance."""
    model_config = vllm_config.model_config
    where = deployment(vllm_config)
    heads = 1 if model_config.use_mla else model_config.get_total_num_kv_heads()
    return KVLayout(num_layers=model_config.get_total_num_hidden_layers(), num_kv_heads=heads,
                    head_dim=model_config.get_head_size(), dtype=dtype, tp_rank=tp_rank, tp_size=where.tp_size,
                    pp_rank=pp_rank, pp_size=where.pp_size, pp_partition=where.pp_partition)


def worker_ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker process; (0, 0) without parallel state."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, RuntimeError):  # no parallel state (a single process)
        return 0, 0


def kv_groups(kv_cache_config: KVCacheConfig | None) -> tuple[tuple[int, ...], tuple[KVGroup, ...]]:
    """(vLLM's ids of the groups kvd moves, each as a KVGroup). Without a config (a bare worker),
    one full-attention group of every layer: (0,), () (layers unknown)."""
    if kv_cache_config is None:
        return (0,), ()
    ids = tuple(kv_cache_config.transfer_group_ids)
    return ids, tuple(_group(kv_cache_config.kv_cache_groups[i].kv_cache_spec, i,
                             tuple(kv_cache_config.kv_cache_groups[i].layer_names)) for i in ids)


def _group(spec: KVCacheSpec, index: int, layers: tuple[str, ...]) -> KVGroup:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):  # layers of one kind whose shapes differ
        kinds = {_group(s, index, layers) for s in spec.kv_cache_specs.values()}
        if len(kinds) == 1:
            return kinds.pop()
        raise ValueError(f"kvd: KV cache group {index} mixes kinds of cache ({sorted(g.label for g in kinds)})")
    kind = type(spec)
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        return KVGroup(FULL, spec.block_size, layers)
    if kind in (SlidingWindowSpec, SlidingWindowMLASpec) and not getattr(spec, "bounded_replay", False):
        # blocks are kept for `extra_retained_tokens` past the window too (vLLM's skipped-token rule)
        return KVGroup(SLIDING, spec.block_size, layers, spec.sliding_window + spec.extra_retained_tokens)
    if kind is ChunkedLocalAttentionSpec:
        return KVGroup(CHUNKED, spec.block_size, layers, spec.attention_chunk_size)
    if kind is MambaSpec and spec.mamba_cache_mode != "align" and not spec.num_speculative_blocks:
        return KVGroup(MAMBA, spec.block_size, layers)
    raise ValueError(f"kvd: the KVDConnector cannot move KV cache group {index} ({kind.__name__}"
                     f"{', mamba_cache_mode ' + spec.mamba_cache_mode if kind is MambaSpec else ''}): run this model "
                     "without --kv-transfer-config, or with --disable-hybrid-kv-cache-manager where it allows")


def quant_mode(kv_cache_config: KVCacheConfig | None) -> str:
    """The KV quantization modes of the cache's groups ("NONE" unquantized)."""
    groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
    modes = {getattr(getattr(g.kv_cache_spec, "kv_quant_mode", None), "name", "NONE") for g in groups}
    return ",".join(sorted(modes)) or "NONE"


def cache_layout(kv_cache_config: KVCacheConfig | None) -> str | None:
    """The physical layout of the paged caches ("NHD", "HND", ...), where vLLM says."""
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    return str(layout) if layout is not None else None


def tier_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, salt: str | None) -> str:
    """The KV tier namespace of this deployment's prefix pages: the model (its served name, else
    its path or id: engines that share pages name it alike), its dtype and KV cache dtype,
    quantization and cache layout, the block size, the KV cache groups (kinds, windows, layers),
    the TP and PP sizes and layer partition, the block hash algorithm, and the salt."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    where = deployment(vllm_config)
    _, groups = kv_groups(kv_cache_config)
    fields: dict[str, object] = {
        "dt": str(model_config.dtype).removeprefix("torch."), "kv": cache_config.cache_dtype,
        "bs": groups[0].block_size if groups else cache_config.block_size, "tp": where.tp_size, "pp": where.pp_size,
        "part": where.pp_partition or "", "mla": bool(model_config.use_mla), "q": quant_mode(kv_cache_config),
        "layout": cache_layout(kv_cache_config) or "", "sig": model_signature(vllm_config),
        "groups": [(g.kind, g.block_size, g.window, g.layers) for g in groups],
        "hash": getattr(cache_config, "prefix_caching_hash_algo", "sha256")}
    served = model_config.served_model_name
    name = (served[0] if isinstance(served, (list, tuple)) and served else served) or model_config.model
    return namespace("vllm", str(name), fields, salt)

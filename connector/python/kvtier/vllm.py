"""kvtier as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {...}}'

kv_role: "kv_both" (loads and saves), "kv_consumer" (only loads: an engine that must not write
the shared cache, e.g. a benchmark or a canary), "kv_producer" (only saves).

Extra config keys:
  mode: "sidecar" (kvtierd on this node) or "embedded" (the store lives in the engine process;
        only with distributed_executor_backend="uni"; vLLM's CPU build also needs
        VLLM_ENABLE_V1_MULTIPROCESSING=0)
  socket: kvtierd's engine socket (sidecar mode)
  host_bytes, disk_dir, disk_bytes, admission, write_through: the embedded store
  async_load: true (default): loads run on the worker's transfer thread while other requests
        compute (the request waits in WAITING_FOR_REMOTE_KVS); false: loads finish in
        ``start_load_kv`` before the forward pass
  lease_ms: lease TTL for sidecar loads (default 30000)
  tenant_secret: the secret of this engine's tenant when kvtierd runs with
        server.isolation = "tenant" (default: placed by the process's uid/gid)
  copy_threads: threads a large save or load is split across (default 0: the cores available
        to the process less one in 8, at most 16; 1: the calling thread only)
  preload: true (default): when a request arrives (``on_new_request``) its blocks found only
        on disk are promoted into host memory while it waits in the queue (and held there for
        it until it is served or finishes, at least 30 s)
  load_policy: what ``get_num_new_matched_tokens`` does while a request's preloads are still
        arriving: "timeout" (default: the request waits in the queue while its preloads move
        into host memory, at most ``load_deadline_ms`` since its arrival; then, while preloads
        are landing (a hint found more of its blocks in host memory than before, within the
        last deadline), it loads them all, reading those still on disk itself, else (a stalled
        disk) it loads what is in host memory and computes the rest; when none of its blocks
        is being preloaded (no preload room) it does not wait: it loads them all at once),
        "wait_complete" (waits until all have arrived, at most 60 s),
        "best_effort" (never waits: loads what is in host memory now)
  load_deadline_ms: see load_policy (default 2000)
  layerwise: saves and (with ``async_load`` false) loads move layer by layer (default false:
        whole requests). Saves: the step's slots are reserved when vLLM binds its metadata
        (before the forward pass), each layer is copied into them by the transfer thread as
        soon as ``save_kv_layer`` reports it computed, and the blocks are committed after the
        last one (never with a layer missing). Loads: a step's loads run on a thread of their
        own while the forward pass starts: every block is pinned and checksum-verified first,
        then each layer is copied in order and ``wait_for_layer_load`` waits only for its own
        layer. Models with several KV-cache groups move whole requests.
  prefill_tokens_per_s: the engine's prefill rate; break-even admission loads a block from
        disk only if that beats recomputing it (each tier priced by its measured read bandwidth
        and latency). 0 (default): measured from the engine's own steps on a CPU engine (the
        tokens each step of at least 64 tokens computed over its forward pass's time, load
        waits taken out, as workers report it through ``build_connector_worker_meta``;
        exponentially weighted); until a step was measured, and on GPU engines (whose forward
        pass the host does not wait for), every hit loads. "off": never price, load every hit

Per-request hints (``kv_transfer_params``, e.g. the OpenAI server's ``"kv_transfer_params"``
field, or ``SamplingParams(extra_args={"kv_transfer_params": ...})``)::

    {"kvtier": {"session": "chat-42", "retain_s": 600, "priority": 3}}
    {"kvtier": {"session": "chat-42", "demote": true}}

``retain_s`` > 0: once the request finished and its saves are written, its prompt's blocks
are retained (kept out of eviction's reach in whatever tier holds them) for that long, under
``session`` (each turn adds to it; without one, an anonymous retention) at ``priority``
(0..255: a retain past kvtierd's bound ends lower-priority retentions first). ``demote``: the
session is done for now: its retention ends and its blocks leave host memory for disk at once
(without a session, the request's own blocks). Bounds: ``preload.max_retained_bytes`` and
``preload.max_retain_ms`` (kvtierd). A malformed hint is logged, naming the field, and
ignored: the request is served as without it.

kvtierd may restart under a running engine (a rolling upgrade): while it is away every lookup,
load and save is a miss (logged once, counted), and the connection is made again with backoff
(100 ms doubling to 2 s); hits resume by themselves.

Keys are vLLM's own ``request.block_hashes`` (one kvtier block per vLLM block) mixed with a
namespace fingerprint (model, KV dtype, layout, block size, TP rank), so engines only share
blocks they can use. Hashes agree across processes only with a fixed PYTHONHASHSEED (use
``--prefix-caching-hash-algo sha256_cbor``); :func:`prompt_keys` computes them outside an engine.

Hybrid models (several KV-cache groups: full attention and sliding window) keep vLLM's hybrid
allocator (``SupportsHMA``): each group is keyed in a namespace of its own and copied through
its own layers; a hit needs the full-attention prefix and each sliding-window group's window
before its end; loads are asynchronous and a failed one fails its request (recomputed).

Saves of newly computed full prompt blocks are queued after each step's forward pass (with
``layerwise``, copied layer by layer during it and committed after it) and written by the
transfer thread; a finished request's blocks stay allocated (``delay_free``)
until its saves are written, and a preempted request's saves finish before its blocks can be
reused (``handle_preemptions``). A block that fails to load (missing, failed checksum, lapsed
lease) is reported through ``get_block_ids_with_load_errors``, so vLLM's
``kv_load_failure_policy`` ("fail" or "recompute") applies; it is never used.
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

# The connector's two sides, and what they share (re-exported: the names this module had).
from .vllm_common import (  # noqa: F401
    HINT_FIELDS,
    MIN_TIMED_TOKENS,
    KvtierMetadata,
    KvtierWorkerMetadata,
    _event_group,
    _Group,
    _groups_of,
    _PrefillRate,
    _Transfer,
    namespace,
    prompt_keys,
    session_hints,
)
from .vllm_scheduler import KvtierScheduler  # noqa: F401
from .vllm_worker import _LEAKED, KvtierWorker, _LayerLoads, _Mover, _StepSave  # noqa: F401


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module documentation. ``SupportsHMA``: a model with several KV-cache groups
    (full attention and sliding window) keeps vLLM's hybrid allocator; each group's blocks are
    keyed in a namespace of its own and copied through that group's layers only. As vLLM's own
    connectors, one class per role does the work: ``KvtierScheduler`` (``vllm_scheduler.py``)
    or ``KvtierWorker`` (``vllm_worker.py``); this one delegates to the one its role made."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        side = KvtierScheduler if role == KVConnectorRole.SCHEDULER else KvtierWorker
        self._side = side(vllm_config, role, kv_cache_config, self._kv_transfer_config)

    @property
    def session_stats(self) -> dict:
        """What requests' session hints did (scheduler side)."""
        return self._side.session_stats

    # ---- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        return self._side.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        return self._side.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return self._side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._side.build_connector_meta(scheduler_output)

    def take_events(self):
        return self._side.take_events()

    def prefill_rate(self) -> float:
        return self._side.prefill_rate()

    def update_connector_output(self, connector_output):
        return self._side.update_connector_output(connector_output)

    def request_finished_all_groups(self, request, block_ids):
        return self._side.request_finished_all_groups(request, block_ids)

    def request_finished(self, request, block_ids):
        return self._side.request_finished(request, block_ids)

    # ---- worker side -----------------------------------------------------------------------

    def requires_kv_delivery(self) -> bool:
        # A cache: a save dropped at preemption is a later miss, not a lost hand-off.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        # Layer by layer, save_kv_layer and wait_for_layer_load must run around every layer's
        # attention: a full CUDA graph replays the pass without them (LMCache does the same).
        return bool((extra_config or {}).get("layerwise", False))

    def register_kv_caches(self, kv_caches):
        return self._side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata):
        return self._side.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._side.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._side.clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs):
        return self._side.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):
        return self._side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return self._side.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        return self._side.wait_for_save()

    def build_connector_worker_meta(self):
        return self._side.build_connector_worker_meta()

    def get_finished(self, finished_req_ids):
        return self._side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids):
        return self._side.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._side.get_block_ids_with_load_errors()

    def shutdown(self):
        return self._side.shutdown()

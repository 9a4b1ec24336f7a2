"""kvtier as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {...}}'

Extra config keys:
  mode: "embedded" (default; the store lives in the engine process) or "sidecar"
  socket: kvtierd's engine socket (sidecar mode)
  host_bytes, disk_dir, disk_bytes, admission, write_through: the embedded store
  lease_ms: lease TTL for sidecar loads (default 30000)

Keys are vLLM's own ``request.block_hashes`` (one kvtier block per vLLM block) mixed with a
namespace fingerprint (model, KV dtype, layout, block size, TP rank), so engines only share
blocks they can use. Hashes agree across processes only with a fixed PYTHONHASHSEED (use
``--prefix-caching-hash-algo sha256_cbor``). Loads are synchronous (done in ``start_load_kv``
before the forward pass); saves of newly computed full prompt blocks happen in ``wait_for_save``.
A block that fails to load is reported through ``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import PagedKv, Sidecar, Store, engine_key, namespace_fingerprint

_STORES: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def _open(extra: dict) -> Any:
    """One store (or sidecar connection) per process and configuration, shared by roles."""
    mode = extra.get("mode", "embedded")
    if mode == "sidecar":
        key = ("sidecar", extra["socket"])
    elif mode == "embedded":
        key = ("embedded", extra.get("disk_dir"), int(extra.get("host_bytes", 1 << 30)))
    else:
        raise ValueError(f"kvtier: mode must be embedded or sidecar, not {mode!r}")
    with _LOCK:
        if key not in _STORES:
            if mode == "sidecar":
                _STORES[key] = Sidecar(extra["socket"], "vllm")
            else:
                _STORES[key] = Store(
                    int(extra.get("host_bytes", 1 << 30)),
                    segment_bytes=int(extra.get("segment_bytes", 16 << 20)),
                    disk_dir=extra.get("disk_dir"),
                    disk_bytes=int(extra.get("disk_bytes", 1 << 30)),
                    admission=extra.get("admission", "always"),
                    write_through=bool(extra.get("write_through", True)),
                )
        return _STORES[key]


@dataclass
class _Transfer:
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self._sidecar = extra.get("mode", "embedded") == "sidecar"
        self._lease_ms = int(extra.get("lease_ms", 30_000))
        par = vllm_config.parallel_config
        tp_size = getattr(par, "tensor_parallel_size", 1) or 1
        tp_rank = getattr(par, "rank", 0) % tp_size if tp_size > 1 else 0
        model = vllm_config.model_config
        self._ns_enc, self._fp = namespace_fingerprint(
            model=f"{model.model}@{getattr(model, 'revision', None) or ''}",
            dtype=str(vllm_config.cache_config.cache_dtype),
            layout="vllm-v1",
            block_tokens=self._block_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )
        backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
        if not self._sidecar and backend not in (None, "uni"):
            raise ValueError(
                "kvtier: embedded mode keeps the store in the engine-core process, so it needs "
                "distributed_executor_backend='uni'; with worker processes use mode='sidecar' "
                f"(kvtierd), not {backend!r}"
            )
        self._store = _open(extra)
        self._ns = self._store.register_namespace(self._ns_enc)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # Scheduler side.
        self._reqs: dict[str, Any] = {}
        self._pending_loads: dict[str, tuple[list[bytes], int]] = {}
        self._saved: dict[str, int] = {}
        self._block_ids: dict[str, list[int]] = {}
        # Worker side.
        self._paged: PagedKv | None = None
        self._failed: set[int] = set()

    # ---- keys ------------------------------------------------------------------------------

    def _keys(self, request) -> list[bytes]:
        return [engine_key(self._fp, bytes(h)) for h in request.block_hashes]

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        keys = self._keys(request)
        n = self._store.match_prefix(keys) if keys else 0
        prompt = len(request.prompt_token_ids or [])
        hit = n * self._block_size
        if hit >= prompt:
            # The engine must compute at least the last token to get logits.
            hit = ((prompt - 1) // self._block_size) * self._block_size
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._reqs[request.request_id] = request
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = (self._keys(request), num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = KvtierMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            ids = list(new.block_ids[0])
            self._block_ids[new.req_id] = ids
            req = self._reqs.get(new.req_id)
            computed = new.num_computed_tokens
            if new.req_id in self._pending_loads:
                keys, ext = self._pending_loads.pop(new.req_id)
                first = (computed - ext) // bs
                last = computed // bs
                meta.loads.append(_Transfer(keys[first:last], ids[first:last]))
                self._saved[new.req_id] = last
            self._add_saves(meta, new.req_id, req, computed + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in getattr(cached, "resumed_req_ids", set()):
                    self._block_ids[req_id] = list(new_ids[0])
                else:
                    self._block_ids.setdefault(req_id, []).extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._add_saves(meta, req_id, self._reqs.get(req_id), done)
        return meta

    def _add_saves(self, meta, req_id, req, computed_after_step):
        """Full prompt blocks computed by the end of this step and not stored yet."""
        if req is None:
            return
        keys = self._keys(req)
        prompt_blocks = len(req.prompt_token_ids or []) // self._block_size
        upto = min(computed_after_step // self._block_size, prompt_blocks, len(keys))
        start = self._saved.get(req_id, 0)
        ids = self._block_ids.get(req_id, [])
        if upto > start and len(ids) >= upto:
            meta.saves.append(_Transfer(keys[start:upto], ids[start:upto]))
            self._saved[req_id] = upto

    def request_finished(self, request, block_ids):
        for d in (self._reqs, self._saved, self._block_ids, self._pending_loads):
            d.pop(request.request_id, None)
        # Saves are done synchronously in the step that computed the blocks.
        return False, None

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        layers = []
        for name, t in kv_caches.items():
            dims = ["inner"] * t.dim()
            shape = list(t.shape)
            taken = set()
            for role, size in (("blocks", self._num_blocks), ("kv", 2), ("tokens", self._block_size)):
                for j, s in enumerate(shape):
                    if j not in taken and s == size and (role != "blocks" or size is not None):
                        dims[j] = role
                        taken.add(j)
                        break
            if "blocks" not in dims:  # num_blocks unknown: the first dim not otherwise named
                j = next(j for j in range(len(dims)) if dims[j] == "inner")
                dims[j] = "blocks"
            layers.append((t.data_ptr(), shape, list(t.stride()), dims, t.element_size()))
        self._kv_caches = kv_caches  # keep the tensors alive
        self._paged = PagedKv(layers)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        for t in meta.loads:
            if not t.keys:
                continue
            ids = [[b] for b in t.block_ids]
            if self._sidecar:
                n = self._store.load(self._paged, t.keys, ids, self._lease_ms)
            else:
                n = self._store.load(self._paged, t.keys, ids)
            if n < len(t.keys):
                self._failed.update(t.block_ids[n:])

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        for t in meta.saves:
            if t.keys:
                self._store.save(self._ns, self._paged, t.keys, [[b] for b in t.block_ids])

    def get_block_ids_with_load_errors(self):
        failed, self._failed = self._failed, set()
        return failed

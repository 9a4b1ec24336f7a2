"""kvtier as an SGLang HiCache L3 storage backend.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierHiCache",
        "mode": "sidecar", "socket": "/run/kvtierd/kvtierd.sock"}'

Extra config keys (besides the three the factory needs):
  mode: "sidecar" (default; kvtierd on this node, shared by every engine there) or "embedded"
  socket: kvtierd's engine socket (sidecar mode)
  host_bytes, disk_dir, disk_bytes: the embedded store (one per process: SGLang's TP ranks
         are processes, so only kvtierd lets them share, e.g. an MLA model's single copy)
  dtype: the KV dtype, part of the namespace (default "unspecified": set it when engines with
         different KV dtypes share one store)

Keys are SGLang's page hashes (chained SHA-256 per page) mixed with a namespace fingerprint
(model, dtype, layout, page size, TP rank and size; MLA models share one copy across ranks),
so engines only ever read pages they can use. A page whose size differs from the buffer it is
read into is a miss, never a partial copy; ``batch_exists`` counts leading pages only; a store
or daemon failure is a logged miss (get) or a False (set), never an exception into SGLang's
cache controller.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from . import engine_key, namespace_fingerprint
from ._open import open_store

log = logging.getLogger("kvtier.sglang")


def _bytes_of(t: torch.Tensor) -> tuple[int, int]:
    """(address, byte length) of a contiguous CPU tensor."""
    if t.device.type != "cpu":
        raise ValueError(f"kvtier: HiCache pages must be host tensors, not on {t.device}")
    if not t.is_contiguous():
        raise ValueError("kvtier: HiCache pages must be contiguous")
    return t.data_ptr(), t.numel() * t.element_size()


class KvtierHiCache(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        mode = extra.get("mode", "sidecar")
        self._store = open_store(extra, "sidecar", "sglang")
        self._embedded = mode == "embedded"
        c = storage_config
        layout = "sglang-" + ("page_first" if c.is_page_first_layout else "layer_first")
        if c.pp_size > 1:
            layout += f"-pp{c.pp_rank}of{c.pp_size}"
        if c.attn_cp_size > 1:
            layout += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
        if getattr(c, "dcp_size", 1) > 1:  # MLA shards under decode context parallelism
            layout += f"-dcp{c.dcp_rank}of{c.dcp_size}"
        self._ns_enc, self._fp = namespace_fingerprint(
            model=c.model_name or "",
            dtype=str(extra.get("dtype", "unspecified")),
            layout=layout,
            block_tokens=int(c.logical_page_size or extra.get("page_size", 1)),
            # MLA: one latent KV shared by all TP ranks.
            tp_size=0 if c.is_mla_model else c.tp_size,
            tp_rank=0 if c.is_mla_model else c.tp_rank,
        )
        self._ns = self._store.register_namespace(self._ns_enc)
        self._writer = c.is_storage_writer
        self.mem_pool_host = None

    def _key(self, key: str) -> bytes:
        return engine_key(self._fp, key.encode())

    # ---- the generic interface (copies through the tensors SGLang hands over) ---------------

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        if target_location is None:
            raise ValueError("kvtier: get needs target_location (the page buffer to fill)")
        ptr, n = _bytes_of(target_location)
        try:
            ok = self._store._read_into(self._key(key), ptr, n)
        except RuntimeError:  # store or daemon failure: a miss, logged
            log.exception("kvtier: get %s failed", key)
            ok = False
        return target_location if ok else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvtier: batch_get needs one target buffer per key")
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        if not self._writer:
            return True  # another rank writes the shared (MLA) copy
        if value is None:
            raise ValueError("kvtier: set needs a value tensor")
        v = value.contiguous()  # keep the contiguous copy alive during the call
        ptr, n = _bytes_of(v)
        try:
            return self._store._write_from(self._ns, self._key(key), ptr, n)
        except RuntimeError:  # no room, daemon gone: not stored, logged
            log.exception("kvtier: set %s failed", key)
            return False

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("kvtier: batch_set needs one value per key")
        ok = True
        for k, v in zip(keys, values):
            ok = self.set(k, v) and ok
        return ok

    def exists(self, key: str) -> bool:
        return self._store.match_prefix([self._key(key)]) == 1

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return self._store.match_prefix([self._key(k) for k in keys]) if keys else 0

    # ---- zero-copy variants: pages addressed by host-pool indices ---------------------------

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pool = self.mem_pool_host
        out = []
        for i, k in enumerate(keys):
            page = pool.get_dummy_flat_data_page()
            ok = self.get(k, page) is not None
            if ok:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), page)
            out.append(ok)
        return out

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        pool = self.mem_pool_host
        return [self.set(k, pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True))
                for i, k in enumerate(keys)]

    def clear(self) -> None:
        if self._embedded:
            self._store.clear_namespace(self._ns)
        else:
            log.warning("kvtier: clear a kvtierd namespace with `kvtier clear` (admin API)")

    def get_stats(self):
        return self._store.stats() if self._embedded else None

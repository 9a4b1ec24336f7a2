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
  interface_v1: 1 makes SGLang call batch_get_v1/batch_set_v1, which copy each page once,
         straight between the host pool and the store (recommended); without it SGLang copies
         pages through a temporary tensor (its generic path). The two lay a page's bytes out
         differently, so they use different namespaces.

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
        if extra.get("interface_v1"):  # pages as the pool's buffer segments, in their order
            layout += "-v1"
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

    def _read(self, key: str, segs: list[tuple[int, int]]) -> bool:
        """One page into memory segments; a store or daemon failure is a logged miss."""
        try:
            return self._store._read_into(self._key(key), segs)
        except RuntimeError:
            log.exception("kvtier: get %s failed", key)
            return False

    def _write(self, key: str, segs: list[tuple[int, int]]) -> bool:
        """One page from memory segments; no room or no daemon is a logged False."""
        if not self._writer:
            return True  # another rank writes the shared (MLA) copy
        try:
            return self._store._write_from(self._ns, self._key(key), segs)
        except RuntimeError:
            log.exception("kvtier: set %s failed", key)
            return False

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        if target_location is None:
            raise ValueError("kvtier: get needs target_location (the page buffer to fill)")
        return target_location if self._read(key, [_bytes_of(target_location)]) else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvtier: batch_get needs one target buffer per key")
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        if value is None:
            raise ValueError("kvtier: set needs a value tensor")
        v = value.contiguous()  # keep the contiguous copy alive during the call
        return self._write(key, [_bytes_of(v)])

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

    def _pages(self, keys: List[str], host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Each page's memory segments in the host pool (`get_page_buffer_meta`), in order."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys) or len(ptrs) != len(sizes):
            raise ValueError(f"kvtier: {len(ptrs)} buffer segments for {len(keys)} pages")
        per = len(ptrs) // len(keys)
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
                for i in range(len(keys))]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return [self._read(k, segs) for k, segs in zip(keys, self._pages(keys, host_indices))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return [self._write(k, segs) for k, segs in zip(keys, self._pages(keys, host_indices))]

    def clear(self) -> None:
        if self._embedded:
            self._store.clear_namespace(self._ns)
        else:
            log.warning("kvtier: clear a kvtierd namespace with `kvtier clear` (admin API)")

    def get_stats(self):
        return self._store.stats() if self._embedded else None

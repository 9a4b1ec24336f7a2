"""kvtier as an SGLang HiCache L3 storage backend.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierHiCache",
        "mode": "sidecar", "socket": "/run/kvtierd/kvtierd.sock"}'

Extra config keys (besides the three the factory needs):
  mode: "sidecar" (default; kvtierd on this node, shared by every engine there) or "embedded"
  socket: kvtierd's engine socket (sidecar mode)
  host_bytes, disk_dir, disk_bytes: the embedded store (one per process: SGLang's TP ranks
         are processes, so only kvtierd lets them share, e.g. an MLA model's single copy; an
         MLA model with TP > 1 is refused in embedded mode, since SGLang writes it from rank 0
         only)
  dtype: the KV dtype, part of the namespace (default "unspecified": set it when engines with
         different KV dtypes share one store)
  tenant_secret: the secret of this engine's tenant (kvtierd with server.isolation = "tenant")
  copy_threads: threads a large batch is split across (default 0: the cores available to the
         process less one in 8, at most 16; 1: the calling thread only)
  preload: true (default): batch_exists, which SGLang calls as a request joins the queue,
         also starts moving the hit's pages found only on disk into host memory, so the
         batch_get that follows reads host memory (preload_deadline_ms, default 10000, bounds
         how long such a preload may wait to start). With SGLang's
         "hicache_storage_pass_prefix_keys": true in the same extra config, batch_exists
         also learns which pages continue a prefix SGLang holds itself (a conversation's new
         turn): kvtier's disk admission (seen-twice) then keeps the first few of them, as it
         does for vLLM, instead of writing a page to disk only the second time it leaves
         host memory
  retain_s, retain_priority: session retention. Pages SGLang saves with a session
         (``batch_set_v1`` whose extra info carries ``{"session_id": ...}``, the form SGLang's
         session-aware offload path passes it in) are retained under that session for
         ``retain_s`` seconds (default 0: off) at ``retain_priority`` (0..255): kept out of
         eviction's reach in whatever tier holds them, bounded by kvtierd's
         preload.max_retained_bytes / preload.max_retain_ms. The backend's ``retain(page_hashes,
         session=, ttl_s=, priority=)`` and ``demote(page_hashes=, session=)`` are the same
         hints for programmatic use (SGLang's Retain / Demote requests): each answers what it
         did (a dict: retained, clipped and by which bound, refused and why / freed, queued,
         busy...).
  interface_v1: 1 makes SGLang call batch_get_v1/batch_set_v1, which copy each page once,
         straight between the host pool and the store (recommended); without it SGLang copies
         pages through a temporary tensor (its generic path). The two lay a page's bytes out
         differently, so they use different namespaces.

Keys are SGLang's page hashes (chained SHA-256 per page) mixed with a namespace fingerprint,
so engines only ever read pages they can use. Once SGLang registers its host pool
(``register_mem_pool_host``), the namespace is taken from the pool itself: its layout
(layer_first, page_first, page_first_direct, page_head, ...), dtype, page size and the sizes of
a page's memory segments, plus model, TP rank and size (MLA models share one copy across
ranks) and the PP/CP/DCP shard; two engines that differ in any of these never share a page.
Host indices are checked before any copy: their count must be pages x page size, every page
must lie inside the pool, and (in Rust) every memory segment inside the pool's buffers. A page whose size differs from the buffer it is
read into is a miss, never a partial copy; ``batch_exists`` counts leading pages only; a store
or daemon failure is a logged miss (get) or a False (set), never an exception into SGLang's
cache controller. kvtierd may restart under a running engine: while it is away every call is a
miss (exists 0, get None/False, set False; logged once, counted in ``connection_stats()``), and
the backend reconnects by itself with backoff (100 ms doubling to 2 s), registering its
namespaces again.
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


def _keys(keys) -> list[str]:
    if keys is None or any(k is None for k in keys):
        raise ValueError("kvtier: keys must be page hash strings, not None")
    return list(keys)


def _leading(sent: list, first: dict, n: int) -> int:
    """How many leading keys of `sent` are among the first `n` distinct ones (`first`: each
    key's index among the distinct keys, in order of first occurrence)."""
    count = 0
    for k in sent:
        if first[k] >= n:
            break
        count += 1
    return count


def _regions(pool) -> list[tuple[int, int]]:
    """The host pool's memory, `(address, bytes)` of each buffer's whole allocation: the only
    memory the v1 calls may copy into or out of."""
    out = []
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        t = getattr(pool, name, None)
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out.append((st.data_ptr(), st.nbytes()))
        elif isinstance(t, (list, tuple)):
            for x in t:
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    out.append((st.data_ptr(), st.nbytes()))
    if not out:
        raise ValueError(f"kvtier: cannot find the memory of host pool {type(pool).__name__}")
    return out


class KvtierHiCache(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        mode = extra.get("mode", "sidecar")
        if mode == "embedded" and storage_config.is_mla_model and storage_config.tp_size > 1:
            # SGLang backs up an MLA model's pages from one rank only (is_storage_writer); an
            # embedded store lives in each rank's process, so the other ranks' stores would stay
            # empty and the MIN-reduced hit count would always be 0.
            raise ValueError(
                "kvtier: an MLA model with TP > 1 needs mode='sidecar' (kvtierd on this node): "
                "SGLang writes an MLA page from one rank only, and embedded stores are per "
                f"process (tp_size={storage_config.tp_size})")
        self._store = open_store(extra, "sidecar", "sglang")
        self._embedded = mode == "embedded"
        self._v1 = bool(extra.get("interface_v1"))
        self._writer = storage_config.is_storage_writer
        self._preload = bool(extra.get("preload", True))
        self._preload_ms = int(extra.get("preload_deadline_ms", 10_000))
        self._retain_s = float(extra.get("retain_s", 0))
        self._retain_priority = int(extra.get("retain_priority", 0))
        if not self._retain_s >= 0:
            raise ValueError(f"kvtier: retain_s must be >= 0, not {self._retain_s}")
        if not 0 <= self._retain_priority <= 255:
            raise ValueError(f"kvtier: retain_priority must be in 0..255, not "
                             f"{self._retain_priority}")
        self.mem_pool_host = None
        self._pool_regions = None
        # Until SGLang registers its host pool, the namespace comes from the configuration.
        c = storage_config
        self._register(
            layout="page_first" if c.is_page_first_layout else "layer_first",
            dtype=str(extra.get("dtype", "unspecified")),
            page_size=int(c.logical_page_size or extra.get("page_size", 1)),
            segments="",
        )

    def _register(self, layout: str, dtype: str, page_size: int, segments: str) -> None:
        c = self.config
        layout = "sglang-" + layout
        if c.pp_size > 1:
            layout += f"-pp{c.pp_rank}of{c.pp_size}"
        if c.attn_cp_size > 1:
            layout += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
        if getattr(c, "dcp_size", 1) > 1:  # MLA shards under decode context parallelism
            layout += f"-dcp{c.dcp_rank}of{c.dcp_size}"
        # v1 pages are the pool's buffer segments back to back; the generic path's pages are
        # the pool's flat data page: two byte orders, two namespaces.
        layout += ("-v1" + segments) if self._v1 else ""
        self._page_size = page_size
        self._ns_enc, self._fp = namespace_fingerprint(
            model=c.model_name or "",
            dtype=dtype,
            layout=layout,
            block_tokens=page_size,
            # MLA: one latent KV shared by all TP ranks.
            tp_size=0 if c.is_mla_model else c.tp_size,
            tp_rank=0 if c.is_mla_model else c.tp_rank,
        )
        self._ns = self._store.register_namespace(self._ns_enc)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """The host pool SGLang copies pages through: the namespace is taken from its real
        layout, dtype, page size and segment sizes, and the v1 calls may only touch its
        memory."""
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        segments = ""
        if self._v1:
            probe = torch.arange(0, page_size, dtype=torch.int64)
            _, sizes = mem_pool_host.get_page_buffer_meta(probe)
            segments = "-seg" + "x".join(str(int(s)) for s in sizes)
            self._pool_regions = _regions(mem_pool_host)
        self._register(
            layout=str(mem_pool_host.layout),
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            page_size=page_size,
            segments=segments,
        )

    def _key(self, key: str) -> bytes:
        if not isinstance(key, str):
            raise ValueError(f"kvtier: a key must be a page hash string, not {key!r}")
        return engine_key(self._fp, key.encode())

    # ---- the generic interface (copies through the tensors SGLang hands over) ---------------

    def _read(self, keys: List[str], pages, regions=None) -> List[bool]:
        """Pages into memory segments; a store or daemon failure is a logged miss."""
        ks = [self._key(k) for k in keys]
        try:
            return self._store.read_pages(ks, pages, regions)
        except RuntimeError:
            log.exception("kvtier: get of %d pages failed", len(keys))
            return [False] * len(keys)

    def _write(self, keys: List[str], pages, regions=None) -> List[bool]:
        """Pages from memory segments; no room or no daemon is a logged False."""
        ks = [self._key(k) for k in keys]
        if not self._writer:
            return [True] * len(keys)  # another rank writes the shared (MLA) copy
        try:
            return self._store.write_pages(self._ns, ks, pages, regions)
        except RuntimeError:
            log.exception("kvtier: set of %d pages failed", len(keys))
            return [False] * len(keys)

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        if target_location is None:
            raise ValueError("kvtier: get needs target_location (the page buffer to fill)")
        return target_location if self._read([key], [[_bytes_of(target_location)]])[0] else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        keys = _keys(keys)
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvtier: batch_get needs one target buffer per key")
        ok = self._read(keys, [[_bytes_of(t)] for t in target_locations])
        return [t if g else None for t, g in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        if value is None:
            raise ValueError("kvtier: set needs a value tensor")
        v = value.contiguous()  # keep the contiguous copy alive during the call
        return self._write([key], [[_bytes_of(v)]])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        keys = _keys(keys)
        if values is None or len(values) != len(keys):
            raise ValueError("kvtier: batch_set needs one value per key")
        vs = [v.contiguous() for v in values]  # alive during the call
        return all(self._write(keys, [[_bytes_of(v)] for v in vs]))

    def exists(self, key: str) -> bool:
        return self._store.match_prefix([self._key(key)]) == 1

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading keys are stored. Never raises: a failure counts as none. SGLang
        calls it when a request joins the waiting queue, before its batch_get: the pages of the
        hit found only on disk start moving into host memory now (preload), so the batch_get
        that follows reads host memory."""
        try:
            sent = [self._key(k) for k in _keys(keys)]
            if not sent:
                return 0
            # The store walks a prefix of distinct keys (it stops at a repeated one); SGLang
            # counts the keys as sent: ask for each key once, then count the leading keys sent
            # whose first occurrence is within what the store found.
            first = {}
            for k in sent:
                first.setdefault(k, len(first))
            ks = list(first)
            if not self._preload:
                return _leading(sent, first, self._store.match_prefix(ks))
            prefix = getattr(extra_info, "prefix_keys", None)
            if prefix:
                # SGLang holds the pages before `keys` (it asks only beyond its own hit): hint
                # from the last of them, so a continuation of a prefix kvtier holds too is
                # learned as one (the store's hint rule: a present prefix, then new blocks).
                p = self._key(prefix[-1])
                if p not in first:
                    n = int(self._store.prefetch([p] + ks, 0, self._preload_ms, 0)["present"])
                    if n > 0:
                        return _leading(sent, first, n - 1)
                # That page is not in kvtier (or is one of `keys`): ask for `keys` alone.
            n = int(self._store.prefetch(ks, 0, self._preload_ms, 0)["present"])
            return _leading(sent, first, n)
        except Exception:  # noqa: BLE001 - the controller's prefetch thread must not die
            log.exception("kvtier: batch_exists failed: counted as a miss")
            return 0

    # ---- zero-copy variants: pages addressed by host-pool indices ---------------------------

    def _pages(self, keys: List[str], host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Each page's memory segments in the host pool (`get_page_buffer_meta`), in order,
        after checking the indices: pages x page size of them, every page inside the pool."""
        pool = self.mem_pool_host
        if pool is None:
            raise ValueError("kvtier: the v1 calls need register_mem_pool_host first")
        ps = int(pool.page_size)
        n = int(host_indices.numel())
        if n != len(keys) * ps:
            raise ValueError(
                f"kvtier: {n} host indices for {len(keys)} pages of {ps} tokens "
                f"(expected {len(keys) * ps})")
        idx = host_indices.reshape(-1)
        size = int(getattr(pool, "size", 0) or 0)
        if n and (int(idx.min()) < 0 or (size and int(idx.max()) >= size)):
            raise ValueError(
                f"kvtier: host indices {int(idx.min())}..{int(idx.max())} fall outside the "
                f"host pool of {size} tokens")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if len(ptrs) % len(keys) or len(ptrs) != len(sizes):
            raise ValueError(f"kvtier: {len(ptrs)} buffer segments for {len(keys)} pages")
        per = len(ptrs) // len(keys)
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
                for i in range(len(keys))]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        keys = _keys(keys)
        if not keys:
            return []
        return self._read(keys, self._pages(keys, host_indices), self._pool_regions)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        keys = _keys(keys)
        if not keys:
            return []
        ok = self._write(keys, self._pages(keys, host_indices), self._pool_regions)
        self._retain_saved(keys, ok, extra_info)
        return ok

    # ---- hints: Retain / Demote --------------------------------------------------------------

    def _retain_saved(self, keys: List[str], ok: List[bool],
                      extra_info: Optional[HiCacheStorageExtraInfo]) -> None:
        """Pages just saved for a session (SGLang's extra info names it) are retained under it
        (``retain_s`` > 0). Never raises: a failed hint is logged."""
        info = getattr(extra_info, "extra_info", None) or {}
        session = info.get("session_id") if isinstance(info, dict) else None
        if self._retain_s <= 0 or not session or not self._writer:
            return
        saved = [k for k, good in zip(keys, ok) if good]
        if not saved:
            return
        try:
            r = self.retain(saved, session=str(session), ttl_s=self._retain_s,
                            priority=self._retain_priority)
            if r["refused"]:
                log.warning("kvtier: retain for session %s refused: %s", session, r["refused"])
        except Exception:  # noqa: BLE001 - a hint is an optimisation: never fail the save
            log.exception("kvtier: retain for session %s failed", session)

    def retain(self, page_hashes: List[str], session: Optional[str] = None,
               ttl_s: float = 0, priority: int = 0) -> dict:
        """Retain hint: keeps the stored prefix of these pages out of eviction's reach for
        ``ttl_s`` seconds (0: kvtierd's longest), under ``session`` (added to what it holds;
        None: anonymous). Returns the store's answer (retained, clipped, clipped_by, refused,
        ttl_ms, retained_bytes, displaced)."""
        if not 0 <= priority <= 255:
            raise ValueError(f"kvtier: priority must be in 0..255, not {priority}")
        if ttl_s < 0:
            raise ValueError(f"kvtier: ttl_s must be >= 0, not {ttl_s}")
        ks = [self._key(k) for k in _keys(page_hashes)]
        return self._store.retain(ks, session=session, ttl_ms=int(ttl_s * 1000),
                                  priority=priority)

    def demote(self, page_hashes: List[str] = (), session: Optional[str] = None) -> dict:
        """Demote hint: these pages (and/or the session) are done for now: their retention ends
        and they leave host memory for disk at once. Returns the store's answer (released,
        freed, queued, busy, not_in_host, kept)."""
        ks = [self._key(k) for k in _keys(list(page_hashes))]
        return self._store.demote(keys=ks, session=session)

    def clear(self) -> None:
        if self._embedded:
            self._store.clear_namespace(self._ns)
        else:
            log.warning("kvtier: clear a kvtierd namespace with `kvtier clear` (admin API)")

    def get_stats(self):
        return self._store.stats() if self._embedded else None

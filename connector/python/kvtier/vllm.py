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
        to the process, at most 8; 1: the calling thread only)
  preload: true (default): when a request arrives (``on_new_request``) its blocks found only
        on disk are promoted into host memory while it waits in the queue (and held there for
        it until it is served or finishes, at least 30 s)
  load_policy: what ``get_num_new_matched_tokens`` does while a request's preloads are still
        arriving: "timeout" (default: the request waits in the queue while its preloads move
        into host memory, at most ``load_deadline_ms`` since its arrival, then loads what has
        arrived and computes the rest; when none of its blocks is being preloaded (no preload
        room) it does not wait: it loads them all, reading what is on disk itself),
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

import atexit
import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:  # newer vLLM: workers report back to the scheduler's connector each step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no measured prefill rate
    KVConnectorWorkerMetadata = object

from . import PagedKv, engine_key, namespace_fingerprint
from ._native import Cuda
from ._open import open_store
from .layouts import CANONICAL, describe, kv_view

log = logging.getLogger("kvtier.vllm")

# Layer-by-layer saves whose GPU copies could not be waited for: kept referenced (their slots
# never given back while DMA may still write them).
_LEAKED: list[Any] = []

def namespace(model: str, revision: str | None, cache_dtype: str, block_size: int,
              tp_size: int = 1, tp_rank: int = 0,
              layout: str = CANONICAL) -> tuple[bytes, bytes]:
    """``(encoding, fingerprint)`` of the namespace an engine with this configuration uses
    (``layout``: the canonical block layout every known attention backend is copied in, see
    :mod:`kvtier.layouts`)."""
    return namespace_fingerprint(
        model=f"{model}@{revision or ''}",
        dtype=str(cache_dtype),
        layout=layout,
        block_tokens=block_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def prompt_keys(token_ids: list[int], *, model: str, block_size: int, revision: str | None = None,
                cache_dtype: str = "auto", tp_size: int = 1, tp_rank: int = 0,
                hash_algo: str = "sha256_cbor", hash_seed: str | None = None) -> list[bytes]:
    """The kvtier keys the connector uses for a plain token prompt (no LoRA, multimodal input
    or cache_salt), one per full block: for tools that inspect or pre-warm the store.
    ``hash_seed`` is the engine's PYTHONHASHSEED (default: this process's, as vLLM does)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name(hash_algo)
    seed = hash_seed if hash_seed is not None else kcu.resolve_none_hash_seed(fn)
    _, fp = namespace(model, revision, cache_dtype, block_size, tp_size, tp_rank)
    keys, parent = [], kcu.BlockHash(fn(seed))  # vLLM's NONE_HASH for that seed
    for i in range(len(token_ids) // block_size):
        parent = kcu.hash_block_tokens(fn, parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(engine_key(fp, bytes(parent)))
    return keys


HINT_FIELDS = ("session", "retain_s", "priority", "demote")


def session_hints(params) -> dict | None:
    """The kvtier hints of a request's ``kv_transfer_params`` (``{"kvtier": {...}}``), checked
    and normalised to ``{"session": str | None, "retain_s": float, "priority": int, "demote":
    bool}``; None when there are none. Raises ValueError naming a bad field."""
    if not isinstance(params, dict) or params.get("kvtier") is None:
        return None
    h = params["kvtier"]
    if not isinstance(h, dict):
        raise ValueError(f"kv_transfer_params.kvtier must be an object, not {type(h).__name__}")
    unknown = sorted(set(h) - set(HINT_FIELDS))
    if unknown:
        raise ValueError(f"kv_transfer_params.kvtier: unknown field(s) {unknown} "
                         f"(known: {list(HINT_FIELDS)})")
    session = h.get("session")
    if session is not None and (not isinstance(session, str)
                                or not 0 < len(session.encode()) <= 256):
        raise ValueError("kv_transfer_params.kvtier.session must be a string of 1 to 256 bytes")
    retain = h.get("retain_s", 0)
    if isinstance(retain, bool) or not isinstance(retain, (int, float)) or not retain >= 0:
        raise ValueError("kv_transfer_params.kvtier.retain_s must be a number of seconds >= 0")
    priority = h.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255:
        raise ValueError("kv_transfer_params.kvtier.priority must be an integer in 0..255")
    demote = h.get("demote", False)
    if not isinstance(demote, bool):
        raise ValueError("kv_transfer_params.kvtier.demote must be true or false")
    return {"session": session, "retain_s": float(retain), "priority": priority,
            "demote": demote}


@dataclass
class _Transfer:
    """Engine blocks and their vLLM block hashes (each worker keys them in its own namespace:
    TP ranks hold different shards)."""
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    # Models with several KV-cache groups (hybrid allocator): each group's engine blocks, one
    # per hash (0: vLLM's null block, a sliding-window position outside the window: skipped).
    # Empty for one group (``block_ids`` are its blocks).
    group_ids: list[list[int]] = field(default_factory=list)
    # GPU: a CUDA event on the engine's stream that the copies wait for (the forward pass's
    # KV writes for a save; what the stream ran before the step for a load). Worker-side only.
    after: Any = None
    # Saves through kvtierd: the hash of the block before the first (b"": none) and the
    # blocks' token ids, for the daemon's BlockStored events (vLLM's parent_block_hash and
    # token_ids). Empty otherwise.
    parent: bytes = b""
    token_ids: list[int] = field(default_factory=list)

    def described(self, block_size: int, idx=None) -> dict:
        """The save's tags for blocks `idx` (all by default): engine hashes, parents, token
        ids."""
        idx = range(len(self.hashes)) if idx is None else idx
        out = {"engine_hashes": [bytes(self.hashes[i]) for i in idx]}
        if len(self.token_ids) == len(self.hashes) * block_size:
            out["parent_hashes"] = [bytes(self.hashes[i - 1]) if i else self.parent
                                    for i in idx]
            out["token_ids"] = [self.token_ids[i * block_size:(i + 1) * block_size]
                                for i in idx]
        return out


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    async_load: bool = True
    # Tokens the step computes (all requests): the workers time the forward pass for the
    # measured prefill rate.
    step_tokens: int = 0


# Steps with fewer tokens (decode) say little about the prefill rate. Small steps run below
# the engine's full rate (fixed costs per step): they understate it, which errs towards loading.
MIN_TIMED_TOKENS = 64


class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, per step: the tokens the step computed and the seconds its forward
    pass took on this worker (load waits taken out). Workers of one step (tensor parallel)
    aggregate to the slowest: the step is as fast as its slowest rank."""

    def __init__(self, tokens: int, seconds: float):
        self.tokens = tokens
        self.seconds = seconds

    def aggregate(self, other):
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        return KvtierWorkerMetadata(max(self.tokens, other.tokens),
                                    max(self.seconds, other.seconds))


class _PrefillRate:
    """The engine's prefill rate as measured from its steps, exponentially weighted (a fifth
    of each new step), in tokens/s; 0 until a step was measured."""

    def __init__(self):
        self.rate = 0.0
        self.steps = 0

    def note(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_TIMED_TOKENS or not seconds > 0:
            return
        r = tokens / seconds
        self.rate = r if self.steps == 0 else 0.8 * self.rate + 0.2 * r
        self.steps += 1


class _LayerLoads:
    """One step's synchronous loads, layer by layer on a thread of their own while the forward
    pass runs: ``wait(layer)`` returns once that layer of every loaded block is in the engine's
    tensors (blocks are verified before any layer is copied); ``finish()`` waits for all and
    returns the engine blocks that were not loaded."""

    def __init__(self, load_one, transfers: list[_Transfer], layers: int, trace=None):
        self._cv = threading.Condition()
        self._layers = layers
        self._reached = [-1] * len(transfers)
        self._failed: set[int] = set()
        self._blocks = [b for t in transfers for b in t.block_ids]
        # Layers the forward pass waited for (wait_for_layer_load).
        self.awaited: set[int] = set()
        # GPU loads: per layer, the CUDA events of its queued copies (the engine's stream
        # waits on them before the layer runs).
        self.events: list[list[Any]] = [[] for _ in range(layers)]
        self._trace = trace
        self._thread = threading.Thread(target=self._run, args=(load_one, transfers),
                                        name="kvtier-layer-loads", daemon=True)
        self._thread.start()

    def _run(self, load_one, transfers) -> None:
        for i, t in enumerate(transfers):
            def on_layer(layer, n, event=None, i=i):
                if event is not None:
                    # Kept first: whatever happens next, the wait finds the layer's event.
                    with self._cv:
                        self.events[layer].append(event)
                if self._trace:
                    self._trace("loaded", layer)
                with self._cv:
                    self._reached[i] = max(self._reached[i], layer)
                    self._cv.notify_all()
            try:
                self._failed.update(load_one(t, on_layer))
            except Exception:  # noqa: BLE001 - the blocks are reported failed, never used
                log.exception("kvtier: layer-wise load for %s failed", t.req_id)
                self._failed.update(t.block_ids)
            finally:
                with self._cv:
                    self._reached[i] = self._layers - 1
                    self._cv.notify_all()

    def wait(self, layer: int) -> list[Any]:
        """Returns once layer ``layer`` of every block is in (CPU) or its copies are queued
        (GPU: the events to make the engine's stream wait on come back)."""
        with self._cv:
            while not all(r >= layer for r in self._reached):
                if not self._thread.is_alive():
                    break
                self._cv.wait(timeout=1.0)
            return list(self.events[layer])

    def finish(self) -> set[int]:
        self._thread.join()
        if len(self.awaited) < self._layers:
            # A layer ran without waiting for its KV (an attention backend that does not call
            # wait_for_layer_load): what it computed may have read blocks still being copied.
            # Every block of the step is reported failed, so vLLM recomputes them.
            log.error("kvtier: %d of %d layers ran without waiting for their layer-wise load; "
                      "the step's %d loaded blocks are reported failed (use layerwise: false "
                      "with this attention backend)", self._layers - len(self.awaited),
                      self._layers, len(self._blocks))
            return set(self._blocks)
        return self._failed


class _Mover:
    """The worker's transfer thread. Loads (requests waiting for their KV) go first, then ops
    (a step's layer-by-layer save: begin, layers, commit), then whole saves; each kind in order.
    Tracks which async loads finished (with their failed blocks) and which requests still have
    saves queued."""

    def __init__(self, load, save):
        self._load, self._save = load, save
        self._cv = threading.Condition()
        self._ops: deque[tuple[Any, tuple[str, ...]]] = deque()
        self._loads: deque[_Transfer] = deque()
        self._saves: deque[_Transfer] = deque()
        self._saving: dict[str, int] = {}
        self._loaded: list[tuple[str, list[int]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvtier-mover", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def submit_load(self, t: _Transfer) -> None:
        with self._cv:
            self._loads.append(t)
            self._cv.notify_all()

    def submit_save(self, t: _Transfer) -> None:
        with self._cv:
            self._saves.append(t)
            self._saving[t.req_id] = self._saving.get(t.req_id, 0) + 1
            self._cv.notify_all()

    def submit_op(self, op, starts=(), ends=()) -> None:
        """Runs ``op()`` on the transfer thread after the queued loads, before any queued whole
        save (ops in order).
        The requests in ``starts`` count as saving from now on until an op that ``ends`` them
        has run (a layer-by-layer save: begun, layers, finished)."""
        with self._cv:
            for r in starts:
                self._saving[r] = self._saving.get(r, 0) + 1
            self._ops.append((op, tuple(ends)))
            self._cv.notify_all()

    def _done_saving(self, req_ids) -> None:
        with self._cv:
            for r in req_ids:
                left = self._saving[r] - 1
                if left:
                    self._saving[r] = left
                else:
                    del self._saving[r]
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._ops or self._loads or self._saves or self._stop)
                if self._loads:
                    job, is_load = self._loads.popleft(), True
                elif self._ops:
                    job, is_load = self._ops.popleft(), None
                elif self._saves:
                    job, is_load = self._saves.popleft(), False
                else:
                    return
            if is_load is None:
                op, ends = job
                try:
                    op()
                except Exception:  # noqa: BLE001 - an op logs its own failures; never fatal
                    log.exception("kvtier: a transfer-thread operation failed")
                self._done_saving(ends)
            elif is_load:
                failed = self._load(job)
                with self._cv:
                    self._loaded.append((job.req_id, failed))
                    self._cv.notify_all()
            else:
                self._save(job)
                self._done_saving((job.req_id,))

    def take_loaded(self) -> list[tuple[str, list[int]]]:
        with self._cv:
            out, self._loaded = self._loaded, []
            return out

    def saving(self, req_id: str) -> bool:
        with self._cv:
            return req_id in self._saving

    def wait_saves(self, req_ids) -> None:
        with self._cv:
            while any(r in self._saving for r in req_ids):
                if not self._thread.is_alive():
                    raise RuntimeError("kvtier: the transfer thread died with saves queued")
                self._cv.wait(timeout=1.0)

    def close(self, timeout: float = 120.0) -> None:
        """Finishes what is queued (saves included), then stops."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class _StepSave:
    """One step's saves, layer by layer (``layerwise``): ``begin`` reserves every block's slot,
    ``layer(i)`` copies layer i of every block into them, ``finish`` copies any layer left and
    commits. All three run on the transfer thread, in order. A transfer whose begin failed is
    saved whole at the finish; one whose layer copy or commit failed stores nothing."""

    def __init__(self, conn: "KvtierConnector", transfers: list[_Transfer]):
        self._conn = conn
        self.transfers = transfers
        self._sessions: list[Any] = []
        # Layers save_kv_layer reported; one reported twice (micro-batches: the second batch
        # writes its KV after the first copy was queued) turns the step into whole saves.
        self.reported: set[int] = set()
        self.whole = False
        # Requests whose KV this step was computed over a failed load: nothing of theirs is
        # committed (set at wait_for_save).
        self.skip: set[str] = set()

    def begin(self) -> None:
        c = self._conn
        for t in self.transfers:
            keys = [engine_key(c._fp, h) for h in t.hashes]
            try:
                s = c._store.begin_layer_save(c._ns, c._paged, keys, [[b] for b in t.block_ids],
                                              **t.described(c._block_size))
            except Exception:  # noqa: BLE001 - saved whole at the finish instead
                log.exception("kvtier: layer-by-layer save of %d blocks for %s could not begin",
                              len(keys), t.req_id)
                s = None
            self._sessions.append(s)

    def layer(self, layer: int, after=None) -> None:
        c = self._conn
        held = 0
        for t, s in zip(self.transfers, self._sessions):
            if s is None:
                continue
            try:
                if c._cuda is not None:
                    c._store.save_layer_cuda(s, c._cuda, c._paged, layer, after)
                else:
                    c._store.save_layer(s, c._paged, layer)
                held += s.held
            except Exception:  # noqa: BLE001 - the finish commits nothing of it
                log.exception("kvtier: layer %d of the save for %s failed", layer, t.req_id)
        c._trace_layer("saved", layer, blocks=held)

    def finish(self, after=None) -> None:
        """``after``: GPU, an event on the engine's stream once the forward pass was queued
        (the layers save_kv_layer never reported are copied after it)."""
        c = self._conn
        if c._cuda is not None and after is not None:
            c._cuda.wait_for(after, saves=True)
        if (self.whole or self.skip) and c._cuda is not None:
            # The layers already queued land before their slots are given back.
            try:
                c._cuda.synchronize()
            except Exception:
                _LEAKED.extend(s for s in self._sessions if s is not None)
                raise
        stored = 0
        for t, s in zip(self.transfers, self._sessions):
            if t.req_id in self.skip:
                if s is not None:
                    c._store.abort_layer_save(s)
                continue
            if s is not None and self.whole:
                c._store.abort_layer_save(s)
                s = None
            if s is None:
                t.after = after
                c._save(t)
                continue
            try:
                if c._cuda is not None:
                    stored += c._store.finish_layer_save_cuda(s, c._cuda, c._paged)
                else:
                    stored += c._store.finish_layer_save(s, c._paged)
            except Exception:  # noqa: BLE001 - nothing half-written was committed
                log.exception("kvtier: save of %d blocks for %s failed", len(t.hashes), t.req_id)
        c._trace_layer("committed", -1, blocks=stored)


@dataclass
class _Group:
    """One KV-cache group of a hybrid model: its layers, and its sliding window in blocks
    (``window``: blocks a hit needs right before its end; 0: full attention)."""
    layers: list[str]
    window: int
    ns_enc: bytes
    fp: bytes
    ns: int = -1


def _groups_of(kv_cache_config, block_size: int) -> list[tuple[list[str], int, str]]:
    """``(layer names, window blocks, description)`` per KV-cache group, or one entry (no layer
    names) when the engine has one group. Groups kvtier cannot key safely are refused."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return [([], 0, "")]
    out = []
    for g, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        kind = type(spec).__name__
        if getattr(spec, "block_size", block_size) != block_size:
            raise ValueError(
                f"kvtier: KV-cache group {g} ({kind}) has blocks of {spec.block_size} tokens, "
                f"the others {block_size}; kvtier keys every group by the same block hashes")
        if kind == "FullAttentionSpec":
            window = 0
        elif kind == "SlidingWindowSpec":
            # vLLM's SlidingWindowManager: a hit needs cdiv(window - 1, block) blocks before
            # its end; the ones before are not used (null blocks).
            window = max(1, -(-(int(spec.sliding_window) - 1) // block_size))
        else:
            raise ValueError(
                f"kvtier: KV-cache group {g} is {kind}; kvtier handles full-attention and "
                "sliding-window groups (run without the hybrid allocator: "
                "--disable-hybrid-kv-cache-manager)")
        layers = list(grp.layer_names)
        tag = hashlib.blake2b(",".join(layers).encode(), digest_size=8).hexdigest()
        out.append((layers, window, f"group{g}:{kind}:{window}:{tag}"))
    return out


def _event_group(kv_cache_config, g: int) -> dict:
    """What kvtierd's KV events say of KV-cache group `g` (vLLM's `group_idx`,
    `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, as vLLM's own offloading events fill
    them): keyword arguments of `register_namespace`; none without the engine's KV-cache
    config."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if g >= len(groups):
        return {}
    spec = groups[g].kv_cache_spec
    try:
        from vllm.v1.kv_cache_interface import (get_kv_cache_spec_kind,
                                                get_kv_cache_spec_sliding_window)
        kind = get_kv_cache_spec_kind(spec).value
        window = get_kv_cache_spec_sliding_window(spec)
    except (ImportError, AttributeError, TypeError):  # an older vLLM: the index only
        kind, window = None, None
    return dict(group_idx=g, spec_kind=kind, sliding_window=window)


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module documentation. ``SupportsHMA``: a model with several KV-cache groups
    (full attention and sliding window) keeps vLLM's hybrid allocator; each group's blocks are
    keyed in a namespace of its own and copied through that group's layers only."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self._sidecar = extra.get("mode", "embedded") == "sidecar"
        self._async = bool(extra.get("async_load", True))
        self._layerwise = bool(extra.get("layerwise", False))
        if self._layerwise and self._async:
            log.info("kvtier: layerwise: saves move layer by layer; loads are asynchronous "
                     "(they finish before their request runs)")
        # A debugging aid (and what the tests read): one JSON line per layer event.
        self._layer_trace_path = extra.get("layer_trace")
        self._lease_ms = int(extra.get("lease_ms", 30_000))
        self._preload = bool(extra.get("preload", True))
        self._policy = str(extra.get("load_policy", "timeout"))
        if self._policy not in ("timeout", "wait_complete", "best_effort"):
            raise ValueError(f"kvtier: load_policy must be timeout, wait_complete or "
                             f"best_effort, not {self._policy!r}")
        self._deadline_s = float(extra.get("load_deadline_ms", 2000)) / 1000.0
        # How long a hint's preloads and holds last: until the request is served or finished
        # (request_finished cancels), however long it queues — at least 30 s. (A hint that
        # lapsed while its request still queued was hinted again and waited for, where a plain
        # asynchronous load would have read at once.)
        self._hint_ttl_s = max(2 * self._deadline_s, 30.0)
        rate = extra.get("prefill_tokens_per_s", 0.0)
        self._measure_prefill = rate != "off"
        self._prefill_rate = 0.0 if rate == "off" else float(rate)
        self._measured = _PrefillRate()
        # kv_role: "kv_both" loads and saves, "kv_consumer" only loads, "kv_producer" only saves.
        kv_role = str(getattr(self._kv_transfer_config, "kv_role", None) or "kv_both")
        if kv_role not in ("kv_both", "kv_consumer", "kv_producer"):
            raise ValueError(f"kvtier: kv_role must be kv_both, kv_consumer or kv_producer, "
                             f"not {kv_role!r}")
        self._may_load = kv_role != "kv_producer"
        self._may_save = kv_role != "kv_consumer"
        par = vllm_config.parallel_config
        tp_size = getattr(par, "tensor_parallel_size", 1) or 1
        tp_rank = 0
        if tp_size > 1 and role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001 - TP group not up: fall back to the global rank
                tp_rank = getattr(par, "rank", 0) % tp_size
        model = vllm_config.model_config
        # MLA: one latent KV, the same on every TP rank: one shared copy, written by rank 0.
        mla = bool(getattr(model, "use_mla", False))
        self._writer = not mla or tp_rank == 0
        # The scheduler looks up rank 0's blocks (or the shared MLA copy).
        self._ns_args = (model.model, getattr(model, "revision", None),
                         vllm_config.cache_config.cache_dtype, self._block_size,
                         0 if mla else tp_size, 0 if mla else tp_rank)
        self._ns_enc, self._fp = namespace(*self._ns_args)
        # Hybrid models: one namespace per KV-cache group (the layout names the group, so a
        # group's blocks never meet another group's, nor a run without the hybrid allocator).
        self._groups: list[_Group] = []
        for layers, window, desc in _groups_of(kv_cache_config, self._block_size):
            if desc:
                enc, fp = namespace(*self._ns_args, layout=f"{CANONICAL}|{desc}")
                self._groups.append(_Group(layers, window, enc, fp))
        self._hybrid = len(self._groups) > 1
        if self._hybrid:
            if self._layerwise:
                log.warning("kvtier: layerwise is off for a model with several KV-cache groups "
                            "(its loads are asynchronous, its saves whole requests)")
                self._layerwise = False
            # vLLM reports a failed load of a hybrid model only per request, for requests that
            # wait for their loads asynchronously (failed_recving): loads are asynchronous.
            self._async = True
            log.info("kvtier: %d KV-cache groups (%s)", len(self._groups),
                     ", ".join(f"{len(g.layers)} layers, window {g.window or 'full'}"
                               for g in self._groups))
        backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
        if not self._sidecar and backend not in (None, "uni"):
            raise ValueError(
                "kvtier: embedded mode keeps the store in the engine-core process, so it needs "
                "distributed_executor_backend='uni' (vLLM's CPU build also needs "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 for that); with worker processes use "
                f"mode='sidecar' (kvtierd), not {backend!r}"
            )
        # Sidecar: the scheduler and the worker each get a connection (with the uni executor
        # they share a process, and lookups must not wait behind a background save).
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._store = open_store(extra, "embedded", f"vllm-{side}")
        # Each namespace with its KV-cache group, for kvtierd's KV events (a hybrid model's
        # primary namespace keys no group's blocks of its own).
        self._ns = self._store.register_namespace(
            self._ns_enc, **({} if self._hybrid else _event_group(kv_cache_config, 0)))
        for g, grp in enumerate(self._groups):
            grp.ns = self._store.register_namespace(grp.ns_enc,
                                                    **_event_group(kv_cache_config, g))
        # The group this connector's own BlockStored events name (the primary group's, which
        # lookups follow, for a hybrid model).
        self._stored_group = _event_group(
            kv_cache_config, self._groups.index(self._primary()) if self._hybrid else 0)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # Scheduler side.
        self._reqs: dict[str, Any] = {}
        self._lookup_start: dict[str, int] = {}
        self._loads: list[_Transfer] = []
        self._saved: dict[str, int] = {}
        self._saving: set[str] = set()
        self._block_ids: dict[str, list[int]] = {}
        self._loading: dict[str, tuple[int, list[int]]] = {}  # first block index, engine blocks
        self._hinted: dict[str, float] = {}  # request → when its preload hint was sent
        # Synchronous loads: the requests the last step built loads.
        self._sync_loading: list[str] = []
        self._tiers: dict[str, list[str]] = {}  # request → tier of each block at its lookup
        # Requests waiting for blocks another engine is saving: since when.
        self._pending_since: dict[str, float] = {}
        self._hint_failed = False
        # Finished requests' session hints, sent once their saves are written.
        self._after_save: dict[str, tuple[dict, list[list[bytes]]]] = {}
        # What the session hints did (retains, demotes, blocks retained/demoted, refused).
        self.session_stats = {"retains": 0, "retained": 0, "clipped": 0, "demotes": 0,
                              "demoted": 0, "refused": 0, "bad": 0}
        # BlockStored events for the blocks this connector saves, for vLLM's KV event
        # publisher (`take_events`), when the engine publishes events at all.
        ev = getattr(vllm_config, "kv_events_config", None)
        self._kv_events = bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))
        self._events: list[Any] = []
        # Worker side.
        self._paged: PagedKv | None = None
        self._mover: _Mover | None = None
        self._failed: set[int] = set()
        self._save_reqs: set[str] = set()
        self._finishing: set[str] = set()
        self._layer_index: dict[str, int] = {}
        self._layer_loads: _LayerLoads | None = None
        self._step_save: _StepSave | None = None
        # Requests whose synchronous load failed: the pass computed their KV over blocks that
        # were not loaded, so none of their saves is committed until they finish.
        self._tainted: set[str] = set()
        # GPU KV caches: kvtier's copier (its own stream in the device's primary context).
        self._cuda: Cuda | None = None
        self._device = None
        self._group_paged: list[PagedKv] = []

    # ---- keys ------------------------------------------------------------------------------

    def _keys(self, request) -> list[bytes]:
        """The request's keys in the primary namespace (the only one, or, for a hybrid model,
        its first full-attention group's: the one lookups, hints and hit sources follow)."""
        fp = self._primary().fp if self._hybrid else self._fp
        return [engine_key(fp, bytes(h)) for h in request.block_hashes]

    def _primary(self) -> _Group:
        return next((g for g in self._groups if g.window == 0), self._groups[0])

    def _hybrid_hit(self, request, n: int) -> int:
        """Blocks of a hybrid model's hit: at most ``n`` (the primary group's present prefix)
        and one block short of the prompt's end, cut until every group can use it: a
        full-attention group needs every block before the end, a sliding-window group the
        ``window`` blocks right before it (vLLM's hybrid prefix-cache rule)."""
        bs = self._block_size
        hashes = self._hashes(request)
        end = min(n, (len(request.prompt_token_ids or []) - 1) // bs, len(hashes))
        primary = self._primary()
        changed = True
        while changed and end > 0:
            changed = False
            for grp in self._groups:
                if grp is primary:
                    continue
                if grp.window == 0:
                    have = self._store.match_prefix(
                        [engine_key(grp.fp, h) for h in hashes[:end]])
                else:
                    # The window before `end`; a missing block moves the end to it.
                    have = end
                    while have > 0:
                        lo = max(0, have - grp.window)
                        got = self._store.match_prefix(
                            [engine_key(grp.fp, h) for h in hashes[lo:have]])
                        if got == have - lo:
                            break
                        have = lo + got
                if have < end:
                    end, changed = have, True
        return max(0, end)

    def _hashes(self, request) -> list[bytes]:
        return [bytes(h) for h in request.block_hashes]

    # ---- scheduler side --------------------------------------------------------------------

    @staticmethod
    def _tag(req_id: str) -> int:
        return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")

    def _hint(self, req_id: str, keys: list[bytes], deadline_s: float) -> dict | None:
        """Sends the hint; the store's reply (what it found and did), or None if it failed."""
        try:
            return self._store.prefetch(keys, 0, max(1, int(deadline_s * 1000)),
                                        self._tag(req_id))
        except Exception:  # noqa: BLE001 - a hint is an optimisation: never fail the request
            if not self._hint_failed:
                self._hint_failed = True
                log.exception("kvtier: preload hint failed (hints are off until it works)")
            return None

    def on_new_request(self, request) -> None:
        """The request's block hashes are known on arrival: hint them, so the blocks found only
        on disk are read while the request waits in the queue."""
        if not self._preload or not self._may_load:
            return
        keys = self._keys(request)
        if keys:
            self._hinted[request.request_id] = time.monotonic()
            self._hint(request.request_id, keys, self._hint_ttl_s)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        keys = self._keys(request) if self._may_load else []
        rid = request.request_id
        n, tiers = 0, []
        if keys:
            n, _present, tiers = self._store.lookup(keys, self._block_size,
                                                    self.prefill_rate())
        since = self._hinted.get(rid)
        if since is not None and n:
            host = next((i for i, t in enumerate(tiers) if t != "host"), n)
            if host < n:
                waited = time.monotonic() - since
                if self._policy == "best_effort":
                    n = host
                elif waited < (60.0 if self._policy == "wait_complete" else self._deadline_s):
                    # Still arriving: hint again (what was cut for room gets queued now) and
                    # let the scheduler ask again later; the request waits in the queue.
                    r = self._hint(rid, keys[:n], max(self._hint_ttl_s - waited, 1.0))
                    moving = r is not None and int(r["queued"]) + int(r["joined"]) > 0
                    if moving or self._policy == "wait_complete":
                        return None, False
                    # None of its blocks is moving up (no preload room: held blocks of the
                    # requests ahead take it; or the preloads were dropped): waiting would only
                    # delay it, and computing what is on disk would waste the hit. It loads
                    # now, its load reading the disk blocks itself (issue 31: on the agent
                    # trace with a small host tier, requests waited out the deadline and then
                    # recomputed 90% of their disk hits).
                else:
                    # Past the deadline with its preloads still moving: the disk is slower or
                    # busier than the deadline allows. What has arrived; vLLM computes the rest.
                    n = host
        # Read-your-writes: the blocks right after the hit are being saved by another engine
        # now (a turn routed here while the previous turn's saves are still being written).
        # They are hits in a moment: the request waits for them as it waits for preloads (the
        # scheduler asks again next step), unless vLLM holds them itself, at most
        # load_deadline_ms since it first saw them (60 s with wait_complete).
        pending = sum(1 for t in tiers[n:] if t == "pending")
        if (pending and self._policy != "best_effort"
                and n == len(tiers) - pending  # not cut for preloads still moving
                and n + pending > num_computed_tokens // self._block_size):
            first = self._pending_since.setdefault(rid, time.monotonic())
            limit = 60.0 if self._policy == "wait_complete" else self._deadline_s
            if time.monotonic() - first < limit:
                return None, False
        prompt = len(request.prompt_token_ids or [])
        if self._hybrid:
            # Whole blocks only (the engine's hybrid allocator aligns hits to blocks).
            n = self._hybrid_hit(request, n)
            hit = n * self._block_size
        else:
            # A hit covering the whole prompt reports one token fewer: the engine must compute
            # the last token to get logits (it rewrites that token's KV in the loaded block).
            hit = min(n * self._block_size, prompt - 1)
        self._tiers[rid] = tiers[:n]
        ext = max(0, hit - num_computed_tokens)
        # Where the external range starts, for update_state_after_alloc (not a store change).
        self._lookup_start[request.request_id] = num_computed_tokens
        return ext, self._async and ext > 0

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        """Which tier served the external tokens (vLLM's per-source hit metrics)."""
        if num_external_tokens <= 0:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
        rid = request.request_id
        tiers = self._tiers.get(rid, [])
        start = self._loading.get(rid, (0, []))[0]
        # The remote tier (another node's kvtierd) is vLLM's peer-to-peer source.
        by = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
              "remote": CacheHitSource.P2P}
        out: dict = {}
        left = num_external_tokens
        for t in tiers[start:]:
            if left <= 0:
                break
            take = min(self._block_size, left)
            src = by.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + take
            left -= take
        if left > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(
                CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return out

    def _end_hint(self, rid: str) -> None:
        """The request no longer needs its hint (its load is done, it loads nothing, or it
        finished): what the hint still holds or has waiting is let go now, so it no longer
        takes the preload room of the requests behind it."""
        if self._hinted.pop(rid, None) is not None:
            try:
                self._store.cancel_prefetch(self._tag(rid))
            except Exception:  # noqa: BLE001 - best effort
                pass

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        rid = request.request_id
        self._reqs[rid] = request
        self._pending_since.pop(rid, None)
        start = self._lookup_start.pop(rid, None)
        if num_external_tokens <= 0 or start is None:
            self._end_hint(rid)  # scheduled with nothing to load
            return
        bs = self._block_size
        first, last = start // bs, -(-(start + num_external_tokens) // bs)  # whole blocks
        per_group = blocks.get_block_ids()
        ids = list(per_group[0])
        hashes = self._hashes(request)
        if self._hybrid:
            # Each group's blocks of the range; a sliding-window group's positions before its
            # window are null blocks (0): nothing is loaded there.
            groups = [list(g[first:last]) for g in per_group]
            flat = sorted({b for g in groups for b in g if b})
            self._loads.append(_Transfer(rid, hashes[first:last], flat, groups))
        else:
            self._loads.append(_Transfer(rid, hashes[first:last], ids[first:last]))
        self._loading[rid] = (first, ids[first:last])
        self._saved[rid] = max(self._saved.get(rid, 0), last)

    def build_connector_meta(self, scheduler_output):
        meta = KvtierMetadata(loads=self._loads, async_load=self._async,
                              preempted=list(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                              step_tokens=int(getattr(scheduler_output,
                                                      "total_num_scheduled_tokens", 0) or 0))
        self._loads = []
        if not self._async:
            # The workers loaded the previous step's synchronously before it ran: those
            # requests' hints end (this step's end at the next).
            for rid in self._sync_loading:
                self._end_hint(rid)
            self._sync_loading = [t.req_id for t in meta.loads]
        # A preempted request's blocks are freed now: its queued saves are flushed by the
        # workers (handle_preemptions), so it no longer needs delay_free for them.
        self._saving.difference_update(meta.preempted)
        groups = len(self._groups) if self._hybrid else 1
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = [list(new.block_ids[g]) for g in range(groups)]
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._add_saves(meta, new.req_id, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in getattr(cached, "resumed_req_ids", set()):
                    self._block_ids[req_id] = [list(new_ids[g]) for g in range(groups)]
                else:
                    have = self._block_ids.setdefault(req_id, [[] for _ in range(groups)])
                    for g in range(groups):
                        have[g].extend(new_ids[g])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._add_saves(meta, req_id, done)
        return meta

    def _add_saves(self, meta, req_id, computed_after_step):
        """Full prompt blocks computed by the end of this step and not stored yet."""
        req = self._reqs.get(req_id)
        if req is None or not self._may_save:
            return
        hashes = self._hashes(req)
        prompt_blocks = len(req.prompt_token_ids or []) // self._block_size
        upto = min(computed_after_step // self._block_size, prompt_blocks, len(hashes))
        start = self._saved.get(req_id, 0)
        per_group = self._block_ids.get(req_id, [[]])
        if upto > start and all(len(g) >= upto for g in per_group):
            if self._hybrid:
                # Blocks computed in this step are in every group's window (a sliding-window
                # block leaves it, and is freed, at a later step: the worker writes this
                # step's saves before it returns from the step).
                groups = [g[start:upto] for g in per_group]
                flat = sorted({b for g in groups for b in g if b})
                t = _Transfer(req_id, hashes[start:upto], flat, groups)
            else:
                t = _Transfer(req_id, hashes[start:upto], per_group[0][start:upto])
            if self._sidecar:
                # For kvtierd's KV events (its BlockStored carries them as vLLM's does).
                bs = self._block_size
                t.parent = bytes(hashes[start - 1]) if start > 0 else b""
                t.token_ids = list(req.all_token_ids[start * bs:upto * bs])
            meta.saves.append(t)
            self._saved[req_id] = upto
            self._saving.add(req_id)
            if self._kv_events:
                self._events.append(self._stored_event(req, start, upto))

    def _stored_event(self, req, start, upto):
        """vLLM's BlockStored for the blocks [start, upto) of a request, saved to kvtier
        (medium "CPU": kvtier's host tier takes them first), under the engine's own hashes, as
        vLLM 0.32's offloading tiers describe theirs (locality, ownership, the KV-cache group
        and its spec)."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        bs = self._block_size
        lora = getattr(req, "lora_request", None)
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in req.block_hashes[start:upto]],
            parent_block_hash=(maybe_convert_block_hash(req.block_hashes[start - 1])
                               if start > 0 else None),
            token_ids=list(req.all_token_ids[start * bs:upto * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium="CPU",
            lora_name=lora.name if lora else None,
            group_idx=self._stored_group.get("group_idx"),
            kv_cache_spec_kind=self._stored_group.get("spec_kind"),
            kv_cache_spec_sliding_window=self._stored_group.get("sliding_window"),
            locality="LOCAL",
            ownership="kvtier",
        )

    def take_events(self):
        """BlockStored events of the saves queued since the last call (vLLM's scheduler
        publishes them with its own KV events when `--kv-events-config` enables them)."""
        events, self._events = self._events, []
        return events

    def prefill_rate(self) -> float:
        """The prefill rate lookups state for break-even admission: the configured one, else
        the one measured from the engine's steps (0: load every hit)."""
        if self._prefill_rate > 0 or not self._measure_prefill:
            return self._prefill_rate
        return self._measured.rate

    def update_connector_output(self, connector_output):
        """Blocks that failed to load are recomputed by the engine: save them again then."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KvtierWorkerMetadata):
            self._measured.note(wm.tokens, wm.seconds)
        # Finished requests whose saves are written: their session hints go now.
        for rid in getattr(connector_output, "finished_sending", None) or ():
            pending = self._after_save.pop(rid, None)
            if pending is not None:
                self._session_hint(rid, *pending)
        # Asynchronous loads done (or failed): their requests' hints end.
        for rid in (*(getattr(connector_output, "finished_recving", None) or ()),
                    *(getattr(connector_output, "failed_recving", None) or ())):
            self._end_hint(rid)
        # A hybrid model's failed load fails its request: vLLM recomputes all of it, so all of
        # it is saved again.
        for rid in getattr(connector_output, "failed_recving", None) or ():
            if rid in self._loading and rid in self._saved:
                self._saved[rid] = min(self._saved[rid], self._loading[rid][0])
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        for rid, (first, ids) in self._loading.items():
            failed = [i for i, b in enumerate(ids) if b in bad]
            if failed and rid in self._saved:
                self._saved[rid] = min(self._saved[rid], first + failed[0])

    def request_finished_all_groups(self, request, block_ids):
        """The hybrid allocator's ``request_finished`` (``SupportsHMA``): the same, for every
        group's blocks at once."""
        return self.request_finished(request, block_ids)

    def _session_keys(self, request) -> list[list[bytes]]:
        """The request's prompt blocks to retain or demote, per namespace: the primary one;
        for a hybrid model also each other full-attention group's, and each sliding-window
        group's window before the prompt's end (the blocks a later hit needs)."""
        hashes = self._hashes(request)[:len(request.prompt_token_ids or []) // self._block_size]
        if not self._hybrid:
            return [[engine_key(self._fp, h) for h in hashes]]
        out = []
        for grp in self._groups:
            hs = hashes if grp.window == 0 else hashes[max(0, len(hashes) - grp.window):]
            out.append([engine_key(grp.fp, h) for h in hs])
        return out

    def _session_hint(self, rid: str, hint: dict, keys: list[list[bytes]]) -> None:
        """Sends a finished request's session hint (its saves are written)."""
        st = self.session_stats
        try:
            if hint["demote"]:
                if hint["session"] is not None:
                    r = self._store.demote(session=hint["session"])
                    st["demoted"] += int(r["freed"]) + int(r["queued"])
                for ks in keys if hint["session"] is None else ():
                    r = self._store.demote(keys=ks)
                    st["demoted"] += int(r["freed"]) + int(r["queued"])
                st["demotes"] += 1
            elif hint["retain_s"] > 0:
                for ks in keys:
                    r = self._store.retain(ks, session=hint["session"],
                                           ttl_ms=max(1, int(hint["retain_s"] * 1000)),
                                           priority=hint["priority"])
                    if r["refused"]:
                        st["refused"] += 1
                        log.warning("kvtier: retain of request %s refused: %s", rid,
                                    r["refused"])
                        break
                    st["retained"] += int(r["retained"])
                    st["clipped"] += int(r["clipped"])
                st["retains"] += 1
        except Exception:  # noqa: BLE001 - a hint is an optimisation: never fail the engine
            log.exception("kvtier: session hint of request %s failed", rid)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        # Finished or aborted: its preloads not started yet are dropped.
        self._end_hint(rid)
        hint = None
        try:
            hint = session_hints(getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            self.session_stats["bad"] += 1
            log.warning("kvtier: request %s: %s: hint ignored", rid, e)
        if hint is not None and (hint["demote"] or hint["retain_s"] > 0):
            keys = self._session_keys(request)
            if rid in self._saving:
                # After its saves are written (update_connector_output), so the blocks it
                # computed are there to retain.
                self._after_save[rid] = (hint, keys)
            else:
                self._session_hint(rid, hint, keys)
        for d in (self._reqs, self._saved, self._block_ids, self._lookup_start, self._loading,
                  self._tiers, self._pending_since):
            d.pop(rid, None)
        # Blocks with queued saves stay allocated until the worker reports them written.
        delay = rid in self._saving
        self._saving.discard(rid)
        return delay, None

    # ---- worker side -----------------------------------------------------------------------

    def requires_kv_delivery(self) -> bool:
        # A cache: a save dropped at preemption is a later miss, not a lost hand-off.
        return False

    def register_kv_caches(self, kv_caches):
        layers = []
        devices = {t.device for t in kv_caches.values()}
        if len(devices) != 1:
            raise ValueError(f"kvtier: the KV caches are on several devices: {devices}")
        device = next(iter(devices))
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kvtier: KV caches on {device} (kvtier copies from CPU or CUDA)")
        for name, t in kv_caches.items():
            shape, strides, dims, kind = kv_view(list(t.shape), list(t.stride()),
                                                 self._num_blocks, self._block_size)
            if kind != "canonical":
                # Read with guessed roles, its blocks would be other bytes under the same keys
                # (the scheduler, which never sees the tensors, keys lookups by the canonical
                # namespace): refuse rather than serve them.
                raise ValueError(
                    f"kvtier: KV cache {name} has a layout kvtier does not know "
                    f"({describe(t.shape, t.stride())}, {self._num_blocks} blocks of "
                    f"{self._block_size} tokens); known: FlashAttention, FlashInfer/Triton, "
                    "vLLM CPU, MLA (see kvtier/layouts.py)")
            layers.append((t.data_ptr(), shape, strides, dims, t.element_size()))
        self._kv_caches = kv_caches  # keep the tensors alive
        kind = device.type
        if kind == "cuda":
            # kvtier's own stream in the device's primary context (torch's), and the host
            # memory its copies use registered with the driver: DMA straight between HBM and
            # the store's (or kvtierd's shared) arena.
            self._device = device
            self._cuda = Cuda(device.index if device.index is not None else 0)
            if self._store.pin_for_cuda(self._cuda):
                log.info("kvtier: GPU copies on %s go straight to and from the pinned arena",
                         device)
        self._paged = PagedKv(layers, device=kind)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        if self._hybrid:
            # Each group through its own layers only: the groups' tensors overlay one buffer
            # (block b of group 0 and of group 1 are different blocks in the same memory), so
            # a copy through another group's layers would read or overwrite the wrong block.
            by_name = dict(zip(kv_caches, layers))
            self._group_paged = []
            for g, grp in enumerate(self._groups):
                missing = [n for n in grp.layers if n not in by_name]
                if missing:
                    raise ValueError(f"kvtier: KV-cache group {g} names layers the engine did "
                                     f"not register: {missing}")
                self._group_paged.append(PagedKv([by_name[n] for n in grp.layers],
                                                 device=kind))
        self._mover = _Mover(self._load, self._save)

    def _load_groups(self, t: _Transfer) -> list[int]:
        """A hybrid model's load: every group's non-null blocks, each group through its own
        layers; any block missing fails the whole transfer (vLLM recomputes the request)."""
        for g, grp in enumerate(self._groups):
            pairs = [(h, b) for h, b in zip(t.hashes, t.group_ids[g]) if b]
            if not pairs:
                continue
            keys = [engine_key(grp.fp, h) for h, _ in pairs]
            ids = [[b] for _, b in pairs]
            try:
                n = self._load_blocks(self._group_paged[g], keys, ids, t.after)
            except Exception:
                log.exception("kvtier: load of group %d (%d blocks) for %s failed", g,
                              len(keys), t.req_id)
                n = 0
            if n < len(keys):
                log.warning("kvtier: %d of %d blocks of group %d for %s could not be loaded; "
                            "the request is recomputed", len(keys) - n, len(keys), g, t.req_id)
                return list(t.block_ids)
        return []

    def _load(self, t: _Transfer) -> list[int]:
        """Loads one transfer; returns the engine blocks that were not loaded."""
        if not t.hashes:
            return list(t.block_ids)
        if t.group_ids:
            return self._load_groups(t)
        keys = [engine_key(self._fp, h) for h in t.hashes]
        ids = [[b] for b in t.block_ids]
        try:
            n = self._load_blocks(self._paged, keys, ids, t.after)
        except Exception:
            log.exception("kvtier: load of %d blocks for %s failed", len(keys), t.req_id)
            n = 0
        if n < len(keys):
            log.warning("kvtier: %d of %d blocks for %s could not be loaded",
                        len(keys) - n, len(keys), t.req_id)
        return list(t.block_ids[n:])

    def _stream(self) -> int:
        """The engine's current CUDA stream (the raw handle)."""
        import torch
        return torch.cuda.current_stream(self._device).cuda_stream

    def _load_blocks(self, paged, keys, ids, after=None) -> int:
        """Loads whole blocks (CPU or GPU); returns how many leading keys were loaded."""
        if self._cuda is None:
            return self._store.load(paged, keys, ids, self._lease_ms)
        if after is not None:
            self._cuda.wait_for(after)
        # Returns once every copy completed: the blocks are in HBM.
        return self._store.load_layerwise_cuda(self._cuda, paged, keys, ids,
                                               lambda *_: None, self._lease_ms)

    def _save_blocks(self, ns, paged, keys, ids, tags, after=None) -> int:
        """Saves whole blocks (CPU or GPU) with their tags for the KV events (engine_hashes,
        parent_hashes, token_ids); returns how many were stored now."""
        if self._cuda is None:
            return self._store.save(ns, paged, keys, ids, **tags)
        s = self._store.begin_layer_save(ns, paged, keys, ids, **tags)
        try:
            if after is not None:
                # The copies wait for the forward pass that wrote the blocks' KV.
                self._store.save_layer_cuda(s, self._cuda, paged, 0, after)
            return self._store.finish_layer_save_cuda(s, self._cuda, paged)
        except Exception:
            try:
                self._cuda.synchronize()  # what was queued lands before the slots go back
            except Exception:
                _LEAKED.append(s)
                raise
            self._store.abort_layer_save(s)
            raise

    def _save(self, t: _Transfer) -> None:
        if t.group_ids:
            for g, grp in enumerate(self._groups):
                idx = [i for i, b in enumerate(t.group_ids[g]) if b]
                if not idx:
                    continue
                keys = [engine_key(grp.fp, t.hashes[i]) for i in idx]
                try:
                    # Events name full-attention blocks by vLLM's hashes (a router matches
                    # prompts against those); a sliding-window group's copy is published
                    # under its kvtier key.
                    tags = t.described(self._block_size, idx) if grp.window == 0 else {}
                    self._save_blocks(grp.ns, self._group_paged[g], keys,
                                      [[t.group_ids[g][i]] for i in idx], tags, t.after)
                except Exception:
                    log.exception("kvtier: save of group %d (%d blocks) for %s failed", g,
                                  len(keys), t.req_id)
            return
        keys = [engine_key(self._fp, h) for h in t.hashes]
        try:
            # vLLM's own block hashes go along: kvtierd's KV events name the blocks by them,
            # as vLLM's publisher does.
            self._save_blocks(self._ns, self._paged, keys, [[b] for b in t.block_ids],
                              t.described(self._block_size), t.after)
        except Exception:
            log.exception("kvtier: save of %d blocks for %s failed", len(keys), t.req_id)

    def handle_preemptions(self, kv_connector_metadata):
        # A preempted request's blocks are freed at once: its queued saves must read them
        # first; after that it has nothing in flight (the scheduler stopped delaying its free).
        preempted = kv_connector_metadata.preempted
        if self._mover is not None and preempted:
            self._mover.wait_saves(preempted)
            self._save_reqs.difference_update(preempted)
            self._finishing.difference_update(preempted)

    def _trace_layer(self, what: str, layer: int, **extra) -> None:
        if self._layer_trace_path:
            import json
            with open(self._layer_trace_path, "a") as f:
                f.write(json.dumps({"event": what, "layer": layer, "t": time.monotonic(),
                                    **extra}) + "\n")

    def _load_layerwise(self, t: _Transfer, on_layer) -> list[int]:
        """Loads one transfer layer by layer; returns the engine blocks not loaded."""
        if not t.hashes:
            for layer in range(len(self._layer_index)):
                on_layer(layer, 0)
            return list(t.block_ids)
        keys = [engine_key(self._fp, h) for h in t.hashes]
        ids = [[b] for b in t.block_ids]
        if self._cuda is not None:
            if t.after is not None:
                self._cuda.wait_for(t.after)
            n = self._store.load_layerwise_cuda(self._cuda, self._paged, keys, ids, on_layer,
                                                self._lease_ms)
        else:
            n = self._store.load_layerwise(self._paged, keys, ids, on_layer, self._lease_ms)
        if n < len(keys):
            log.warning("kvtier: %d of %d blocks for %s could not be loaded",
                        len(keys) - n, len(keys), t.req_id)
        return list(t.block_ids[n:])

    def _finish_layer_loads(self) -> None:
        if self._layer_loads is not None:
            self._failed.update(self._layer_loads.finish())
            self._layer_loads = None

    def _finish_step_save(self, after=None) -> None:
        """Queues the commit of the step's layer-by-layer saves (whatever layers the forward
        pass did not report are copied then: the pass is over, their KV is final; on a GPU,
        after ``after``, an event recorded once the pass was queued)."""
        step, self._step_save = self._step_save, None
        if step is not None:
            self._mover.submit_op(lambda: step.finish(after),
                                  ends=[t.req_id for t in step.transfers])

    def _record(self):
        """An event on the engine's current CUDA stream now; if recording fails, the host
        waits for the stream instead (what was queued is then done) and None comes back."""
        try:
            return self._cuda.record_on(self._stream())
        except Exception:  # noqa: BLE001 - ordering falls back to a host wait
            log.exception("kvtier: cannot record a CUDA event; waiting for the stream instead")
            import torch
            torch.cuda.current_stream(self._device).synchronize()
            return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        # Layer by layer, save_kv_layer and wait_for_layer_load must run around every layer's
        # attention: a full CUDA graph replays the pass without them (LMCache does the same).
        return bool((extra_config or {}).get("layerwise", False))

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The forward pass starts after this (and after start_load_kv, whose synchronous loads
        # are taken out of the step's time): wait_for_save ends the timing.
        self._step_t0 = time.perf_counter()
        self._step_waited = 0.0
        self._step_timed = None
        # The step's layer-by-layer saves begin here, before the forward pass (vLLM calls
        # start_load_kv after it when the step has no synchronous loads).
        # A step whose forward pass never reached wait_for_save: its saves commit now (on a
        # GPU, after what its stream queued).
        if self._step_save is not None:
            self._finish_step_save(self._record() if self._cuda is not None else None)
        if (self._layerwise and self._writer and self._mover is not None
                and isinstance(connector_metadata, KvtierMetadata)):
            saves = [t for t in connector_metadata.saves if t.hashes]
            if saves:
                self._step_save = _StepSave(self, saves)
                self._mover.submit_op(self._step_save.begin,
                                      starts=[t.req_id for t in saves])

    def start_load_kv(self, forward_context, **kwargs):
        t0 = time.perf_counter()
        try:
            self._start_load_kv()
        finally:
            self._step_waited += time.perf_counter() - t0

    def _start_load_kv(self):
        meta = self._get_connector_metadata()
        if self._cuda is not None and meta.loads:
            # Loads write blocks only after what the engine's stream queued before them.
            after = self._record()
            for t in meta.loads:
                t.after = after
        sync = []
        for t in meta.loads:
            if meta.async_load:
                self._mover.submit_load(t)
            elif self._layerwise:
                sync.append(t)
            else:
                self._failed.update(self._load(t))
        if sync:
            self._finish_layer_loads()
            trace = self._trace_layer if self._layer_trace_path else None
            self._layer_loads = _LayerLoads(self._load_layerwise, sync, len(self._layer_index),
                                            trace)

    def wait_for_layer_load(self, layer_name):
        if self._layer_loads is None:
            return
        t0 = time.perf_counter()
        try:
            self._wait_for_layer_load(layer_name)
        finally:
            self._step_waited += time.perf_counter() - t0

    def _wait_for_layer_load(self, layer_name):
        layer = self._layer_index.get(layer_name)
        if layer is None:
            # A layer kvtier does not know: wait for every layer rather than guess.
            self._layer_loads.awaited.update(range(len(self._layer_index)))
            self._finish_layer_loads()
            return
        events = self._layer_loads.wait(layer)
        if events:
            # GPU: the layer's copies are queued; the engine's stream waits for them (the
            # host does not).
            try:
                stream = self._stream()
                for ev in events:
                    ev.wait_on(stream)
            except Exception:  # noqa: BLE001 - the host waits for the copies instead
                log.exception("kvtier: cannot make the stream wait for a layer's load; "
                              "waiting for the copies instead")
                self._cuda.synchronize()
        self._layer_loads.awaited.add(layer)
        self._trace_layer("waited", layer)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        # Called after the layer's attention wrote its KV (what the layer-wise tests check
        # against): the layer's copy into the step's reserved slots is queued now.
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._layer_trace_path:
            self._trace_layer("ran", layer)
        step = self._step_save
        if step is not None:
            if layer in step.reported:
                step.whole = True  # micro-batches: see _StepSave
                return
            step.reported.add(layer)
            # GPU: the layer's copies wait for what the stream queued up to now (its attention).
            after = self._record() if self._cuda is not None else None
            self._mover.submit_op(lambda: step.layer(layer, after))

    def wait_for_save(self):
        # The forward pass is over (on a CPU engine; a GPU's runs on after the host queued it,
        # so its steps are not timed): the step's layer-wise loads are all in.
        meta = self._get_connector_metadata()
        t0 = getattr(self, "_step_t0", None)
        if (t0 is not None and self._cuda is None
                and getattr(meta, "step_tokens", 0) >= MIN_TIMED_TOKENS):
            secs = time.perf_counter() - t0 - self._step_waited
            if secs > 0:
                self._step_timed = (meta.step_tokens, secs)
        self._step_t0 = None
        self._finish_layer_loads()
        # A synchronous load that failed: vLLM recomputes from the failed block, but this
        # pass already computed (and would save) the blocks after it over stale KV.
        failed = self._failed
        for t in meta.loads:
            if not meta.async_load and failed.intersection(t.block_ids):
                if t.req_id not in self._tainted:
                    log.warning("kvtier: a load for %s failed: its saves are dropped until it "
                                "finishes (computed over blocks that were not loaded)",
                                t.req_id)
                self._tainted.add(t.req_id)
        if self._step_save is not None:
            self._step_save.skip = {t.req_id for t in self._step_save.transfers
                                    if t.req_id in self._tainted}
        layered = self._step_save is not None
        after = None
        if self._cuda is not None and meta.saves:
            # The copies wait for the forward pass that wrote the blocks' KV (a layer-by-layer
            # save's unreported layers too).
            after = self._record()
        self._finish_step_save(after)
        for t in meta.saves:
            t.after = after
            # Every rank reports the save done (the scheduler waits for all of them); a rank
            # that does not write (MLA, rank > 0) has nothing to queue.
            if t.hashes:
                self._save_reqs.add(t.req_id)
                if self._writer and not layered and t.req_id not in self._tainted:
                    self._mover.submit_save(t)
        if self._hybrid and meta.saves and any(g.window for g in self._groups):
            # A sliding-window block that leaves the window is freed at the next step and may
            # be reused at once (delay_free covers only finished requests): this step's saves
            # are written before the step ends.
            self._mover.wait_saves({t.req_id for t in meta.saves})

    def build_connector_worker_meta(self):
        """The step's timing for the scheduler's measured prefill rate (None: not timed)."""
        timed, self._step_timed = getattr(self, "_step_timed", None), None
        return None if timed is None else KvtierWorkerMetadata(*timed)

    def _transfers_done(self, finished_req_ids) -> tuple[set[str], set[str], set[str]]:
        """Requests whose saves are written, whose loads finished, and (hybrid models) whose
        loads failed."""
        if self._mover is None:
            return set(), set(), set()
        recving, failed_reqs = set(), set()
        for rid, failed in self._mover.take_loaded():
            recving.add(rid)
            if failed and self._hybrid:
                # vLLM takes a hybrid model's load failures only per request (failed_recving):
                # it recomputes the whole request.
                failed_reqs.add(rid)
            else:
                # Reported in this step's get_block_ids_with_load_errors, before it runs.
                self._failed.update(failed)
        self._tainted -= set(finished_req_ids)
        self._finishing |= set(finished_req_ids) & self._save_reqs
        sending = {r for r in self._finishing if not self._mover.saving(r)}
        self._finishing -= sending
        self._save_reqs -= sending
        return sending, recving, failed_reqs

    def get_finished(self, finished_req_ids):
        sending, recving, _ = self._transfers_done(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )
        sending, recving, failed = self._transfers_done(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self):
        self._finish_layer_loads()
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self):
        if self._mover is not None:
            self._finish_step_save()
            self._mover.close()

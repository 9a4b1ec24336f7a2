"""The vLLM connector's worker side: the KV caches' layouts (CPU and GPU), the transfer thread
that moves whole requests (``_Mover``), layer-by-layer loads and saves, preemptions, and what
workers report back (finished transfers, failed blocks, the step's timing).
``kvtier.vllm.KvtierConnector`` with the worker role delegates here."""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from typing import Any

from . import PagedKv, engine_key
from ._native import Cuda
from .layouts import describe, kv_view
from .vllm_common import (KvtierMetadata, KvtierWorkerMetadata, MIN_TIMED_TOKENS, _Side,
                          _Transfer, log)

# Layer-by-layer saves whose GPU copies could not be waited for: kept referenced (their slots
# never given back while DMA may still write them).
_LEAKED: list[Any] = []


class _LayerLoads:
    """One step's synchronous loads, layer by layer on a thread of their own while the forward
    pass runs: ``wait(layer)`` returns once that layer of every loaded block is in the engine's
    tensors (CPU) or its copies are queued (GPU); ``finish()`` waits for all and returns the
    engine blocks that were not loaded, those whose check failed included (CPU: the engine's
    copy, once every layer is in; GPU: the shared slot, hashed while the copies run)."""

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

    def __init__(self, conn: "KvtierWorker", transfers: list[_Transfer]):
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


class KvtierWorker(_Side):
    """The worker role's state and calls."""

    def __init__(self, vllm_config, role, kv_cache_config, kv_transfer_config):
        super().__init__(vllm_config, role, kv_cache_config, kv_transfer_config)
        # The step's metadata (bound by the connector before each forward pass).
        self._meta: Any = None
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

    def _get_connector_metadata(self):
        return self._meta

    def clear_connector_metadata(self) -> None:
        self._meta = None


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

    def bind_connector_metadata(self, connector_metadata) -> None:
        self._meta = connector_metadata
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

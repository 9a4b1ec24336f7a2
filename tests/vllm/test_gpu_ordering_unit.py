"""The vLLM connector's GPU ordering, without a GPU: the worker's hooks driven as vLLM's model
runner drives them, with a stand-in for kvtier's CUDA copier that records what was ordered
after what, and a store whose "GPU" transfers are the real CPU ones (so bytes really move).
This machine has no GPU; scripts/gpu-check.sh runs the real copier on one. Checked here:

- a layer-by-layer save copies layer L only after an event recorded on the engine's stream
  when save_kv_layer(L) was called (its attention queued), and commits after the last layer;
- a whole-request save waits on an event recorded at wait_for_save (the forward pass queued);
- a layer-by-layer load makes the engine's stream wait on layer L's events in
  wait_for_layer_load(L), and only there; loads wait on an event recorded at start_load_kv.
"""

from __future__ import annotations

import itertools

import numpy as np

import kvtier
from kvtier.vllm import KvtierMetadata, KvtierWorker, _Mover, _Transfer, namespace

BS, LAYERS, NB = 32, 3, 8
STREAM = 77  # the engine's "current stream" handle


class FakeEvent:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def wait_on(self, stream):
        self.log.append(("stream_waits", self.what, stream))


class FakeCuda:
    """Records events and waits in one log, in call order."""

    def __init__(self):
        self.log = []
        self._n = itertools.count()

    def record_on(self, stream):
        ev = FakeEvent(self.log, f"engine#{next(self._n)}")
        self.log.append(("record_on", ev.what, stream))
        return ev

    def wait_for(self, ev, saves=False):
        self.log.append(("copies_wait", ev.what))

    def synchronize(self):
        self.log.append(("synchronize",))


class GpuStandIn:
    """The store's GPU transfers done by its CPU ones on host tensors, logged."""

    def __init__(self, store, log):
        self.s, self.log = store, log

    def __getattr__(self, name):
        return getattr(self.s, name)

    def save_layer_cuda(self, save, cuda, paged, layer, after=None):
        if after is not None:
            self.log.append(("copies_wait", after.what))
        self.log.append(("save_layer", layer))
        self.s.save_layer(save, paged, layer)

    def finish_layer_save_cuda(self, save, cuda, paged):
        self.log.append(("commit",))
        return self.s.finish_layer_save(save, paged)

    def load_layerwise_cuda(self, cuda, paged, keys, ids, on_layer, ttl_ms=30_000):
        def each(layer, n):
            ev = FakeEvent(self.log, f"load-layer{layer}")
            self.log.append(("load_layer", layer))
            on_layer(layer, n, ev)
        return self.s.load_layerwise(paged, keys, ids, each, ttl_ms)


def spec(t):
    return (t.__array_interface__["data"][0], list(t.shape),
            [s // t.itemsize for s in t.strides], ["blocks", "kv", "tokens", "inner"],
            t.itemsize)


def worker(store, layerwise=True, seed=0, gpu=True):
    """A worker-side connector as register_kv_caches leaves it, with the stand-ins (``gpu``
    false: the CPU path, the real store's transfers only)."""
    c = object.__new__(KvtierWorker)
    cuda = FakeCuda()
    rng = np.random.default_rng(seed)
    c._caches = [rng.standard_normal((NB, 2, BS, 64)).astype(np.float32) for _ in range(LAYERS)]
    c._paged = kvtier.PagedKv([spec(t) for t in c._caches])
    c._store = GpuStandIn(store, cuda.log) if gpu else store
    c._ns_enc, c._fp = namespace("test/gpu-order", None, "auto", BS)
    c._ns = store.register_namespace(c._ns_enc)
    c._cuda, c._device = (cuda if gpu else None), None
    c._stream = lambda: STREAM
    c._layerwise, c._writer, c._hybrid, c._groups = layerwise, True, False, []
    c._block_size = BS
    c._layer_index = {f"layer{i}": i for i in range(LAYERS)}
    c._layer_trace_path = None
    c._lease_ms = 30_000
    c._failed, c._save_reqs, c._finishing = set(), set(), set()
    c._layer_loads, c._step_save, c._tainted = None, None, set()
    c._connector_metadata = None
    c._mover = _Mover(c._load, c._save)
    return c, cuda.log


def hashes(n, salt=0):
    return [bytes([salt, i + 1]) * 16 for i in range(n)]


def forward(c, meta):
    """One step as vLLM's model runner drives the worker (bind, loads first when synchronous,
    each layer: wait for its load, run, save it; then wait_for_save)."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    for name in c._layer_index:
        c.wait_for_layer_load(name)
        c.save_kv_layer(name, None, None)
    c.wait_for_save()
    c.clear_connector_metadata()


def test_layerwise_saves_copy_each_layer_after_its_attention_and_commit_after_the_last():
    store = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    c, log = worker(store)
    try:
        t = _Transfer("r", hashes(2), [3, 5])
        forward(c, KvtierMetadata(saves=[t], async_load=False))
        c._mover.wait_saves(["r"])
    finally:
        c._mover.close()
    recorded = [e for e in log if e[0] == "record_on"]
    # One per layer (save_kv_layer), one at wait_for_save (what no layer reported waits on).
    assert [e[2] for e in recorded] == [STREAM] * (LAYERS + 1)
    copies = [e for e in log if e[0] in ("copies_wait", "save_layer", "commit")]
    want = []
    for layer, ev in enumerate(recorded[:LAYERS]):
        want += [("copies_wait", ev[1]), ("save_layer", layer)]
    assert copies == want + [("copies_wait", recorded[-1][1]), ("commit",)], copies
    keys = [kvtier.engine_key(c._fp, h) for h in t.hashes]
    assert store.match_prefix(keys) == 2
    assert store.get(keys[1]) == c._paged.gather([5])


def test_whole_saves_wait_for_the_forward_pass():
    store = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    c, log = worker(store, layerwise=False)
    try:
        t = _Transfer("r", hashes(1, salt=1), [2])
        forward(c, KvtierMetadata(saves=[t], async_load=False))
        c._mover.wait_saves(["r"])
    finally:
        c._mover.close()
    recorded = [e for e in log if e[0] == "record_on"]
    assert len(recorded) == 1, log  # at wait_for_save: after every layer was queued
    assert log.index(recorded[0]) < log.index(("copies_wait", recorded[0][1]))
    assert log.index(("copies_wait", recorded[0][1])) < log.index(("save_layer", 0))
    assert log[-1] == ("commit",)
    key = kvtier.engine_key(c._fp, t.hashes[0])
    assert store.get(key) == c._paged.gather([2])


def test_a_layer_reported_twice_turns_the_step_into_whole_saves():
    """Micro-batches (two save_kv_layer calls per layer): the second batch's KV is written
    after the first copy was queued, so the step is saved whole after the pass's event."""
    store = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    c, log = worker(store)
    try:
        t = _Transfer("r", hashes(2, salt=3), [0, 6])
        c.bind_connector_metadata(KvtierMetadata(saves=[t], async_load=False))
        c.start_load_kv(None)
        for _ in range(2):
            for name in c._layer_index:
                c.save_kv_layer(name, None, None)
        c.wait_for_save()
        c._mover.wait_saves(["r"])
    finally:
        c._mover.close()
    final = [e for e in log if e[0] == "record_on"][-1][1]
    # The whole save's copies wait for the pass; the blocks hold every layer as at the end.
    i = log.index(("copies_wait", final))
    assert [e for e in log[i:] if e[0] in ("save_layer", "commit")][-1] == ("commit",)
    keys = [kvtier.engine_key(c._fp, h) for h in t.hashes]
    assert store.get(keys[0]) == c._paged.gather([0])
    assert store.get(keys[1]) == c._paged.gather([6])


def test_layerwise_loads_make_the_stream_wait_per_layer():
    store = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    src, _ = worker(store, seed=1)
    src._mover.close()
    hs = hashes(2, salt=2)
    keys = [kvtier.engine_key(src._fp, h) for h in hs]
    assert store.save(src._ns, src._paged, keys, [[1], [4]]) == 2
    c, log = worker(store, seed=2)
    try:
        forward(c, KvtierMetadata(loads=[_Transfer("r", hs, [6, 7])], async_load=False))
        assert c.get_block_ids_with_load_errors() == set()
    finally:
        c._mover.close()
    assert c._paged.gather([6, 7]) == src._paged.gather([1, 4])
    # The loads waited for what the engine's stream queued before the step.
    first = log[0]
    assert first[0] == "record_on" and ("copies_wait", first[1]) in log
    # Layer L's events are waited on by the stream in wait_for_layer_load(L), in order.
    waits = [e for e in log if e[0] == "stream_waits"]
    assert waits == [("stream_waits", f"load-layer{layer}", STREAM) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        assert log.index(("load_layer", layer)) < log.index(waits[layer])


def test_saves_computed_over_a_failed_synchronous_load_are_never_committed():
    """A synchronous load that fails (here: the block is not in the store) leaves stale KV in
    the engine block; the pass computes the request's next blocks over it. vLLM recomputes
    them, but kvtier must not store them under their keys: the request's saves are dropped
    until it finishes; it is still reported finished_sending (vLLM delays its free)."""
    for layerwise in (False, True):
        store = kvtier.Store(64 << 20, segment_bytes=4 << 20)
        c, _ = worker(store, layerwise=layerwise, gpu=False)
        try:
            bad = _Transfer("bad", hashes(1, salt=5), [1])  # never stored: the load fails
            good_load = _Transfer("good", [], [])
            saves = [_Transfer("bad", hashes(2, salt=6), [2, 3]),
                     _Transfer("good", hashes(1, salt=7), [4])]
            forward(c, KvtierMetadata(loads=[bad, good_load], saves=saves, async_load=False))
            assert c.get_block_ids_with_load_errors() == {1}
            c._mover.wait_saves(["bad", "good"])
            bad_keys = [kvtier.engine_key(c._fp, h) for h in saves[0].hashes]
            good_key = kvtier.engine_key(c._fp, saves[1].hashes[0])
            assert store.match_prefix(bad_keys) == 0, layerwise
            assert store.get(good_key) == c._paged.gather([4])
            # A later step's save for the tainted request is dropped too.
            more = _Transfer("bad", hashes(1, salt=8), [5])
            forward(c, KvtierMetadata(saves=[more], async_load=False))
            c._mover.wait_saves(["bad"])
            assert store.match_prefix([kvtier.engine_key(c._fp, more.hashes[0])]) == 0
            # Both finish: both reported finished_sending, the taint forgotten.
            sending, _, _ = c._transfers_done({"bad", "good"})
            assert sending == {"bad", "good"}
            assert not c._tainted
        finally:
            c._mover.close()

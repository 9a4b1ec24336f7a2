"""The vLLM connector's layer-wise load bookkeeping, without an engine: a layer's wait returns
only once that layer is in, and a step whose layers ran without waiting reports every block it
loaded as failed (vLLM then recomputes them); a step's layer-by-layer saves commit whole blocks
only after the last layer, and count as saving from their begin to their finish."""

import threading

from kvtier.vllm import _LayerLoads, _Transfer


def loads(layers, gate, failed=()):
    def load_one(t, on_layer):
        for layer in range(layers):
            gate[layer].wait(10)
            on_layer(layer, len(t.block_ids))
        return list(failed)
    return load_one


def test_each_wait_returns_once_its_layer_is_in():
    gate = [threading.Event() for _ in range(3)]
    t = _Transfer("r", [b"h" * 32] * 2, [5, 6])
    ll = _LayerLoads(loads(3, gate, failed=[6]), [t], 3)
    gate[0].set()
    ll.wait(0)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ll.wait(1), done.set()))
    waiter.start()
    assert not done.wait(0.3), "layer 1 waited for returned before it was loaded"
    gate[1].set()
    assert done.wait(10)
    gate[2].set()
    ll.wait(2)
    ll.awaited.update({0, 1, 2})
    assert ll.finish() == {6}


def test_layers_that_ran_without_waiting_fail_the_whole_step():
    gate = [threading.Event() for _ in range(2)]
    for g in gate:
        g.set()
    ts = [_Transfer("a", [b"a" * 32], [1]), _Transfer("b", [b"b" * 32] * 2, [2, 3])]
    ll = _LayerLoads(loads(2, gate), ts, 2)
    ll.wait(0)
    ll.awaited.add(0)  # layer 1 never waited for
    assert ll.finish() == {1, 2, 3}


class _FakeConnector:
    """What a step's layer-by-layer save uses of the connector: a real embedded store and
    paged caches (numpy), the namespace, and the whole-request save it falls back to."""

    def __init__(self, layers=3, nb=8, bs=32, inner=128):
        import numpy as np
        from kvtier import PagedKv, Store, namespace_fingerprint  # noqa: F401
        from kvtier.vllm import namespace
        self.np = np
        self.caches = [np.random.default_rng(l).standard_normal((nb, 2, bs, inner))
                       .astype(np.float32) for l in range(layers)]
        self._paged = PagedKv([self._spec(t) for t in self.caches])
        self._store = Store(64 << 20, segment_bytes=4 << 20)
        self._ns_enc, self._fp = namespace("test/layer-saves", None, "auto", bs, 1, 0)
        self._ns = self._store.register_namespace(self._ns_enc)
        self._block_size = bs
        self.whole, self.trace = [], []
        self._cuda = None  # the CPU path

    @staticmethod
    def _spec(t):
        return (t.__array_interface__["data"][0], list(t.shape),
                [s // t.itemsize for s in t.strides], ["blocks", "kv", "tokens", "inner"],
                t.itemsize)

    def _save(self, t):
        self.whole.append(t.req_id)

    def _trace_layer(self, what, layer, **extra):
        self.trace.append((what, layer, extra))

    def keys(self, t):
        from kvtier import engine_key
        return [engine_key(self._fp, h) for h in t.hashes]


def test_a_step_save_commits_whole_blocks_after_its_last_layer():
    from kvtier.vllm import _StepSave
    c = _FakeConnector(layers=3)
    a = _Transfer("a", [bytes([1]) * 32, bytes([2]) * 32], [3, 4])
    b = _Transfer("b", [bytes([3]) * 32], [6])
    step = _StepSave(c, [a, b])
    step.begin()
    step.layer(0)
    step.layer(2)
    assert c._store.match_prefix(c.keys(a)) == 0, "visible with a layer missing"
    # Layer 1 changes after the pass reported layer 0 and before the finish: the finish copies
    # layer 1 as it is then; layer 0 stays as it was when it was copied.
    before = c._paged.gather([3, 4, 6])
    c.caches[0][...] += 1.0
    c.caches[1][...] += 1.0
    after = c._paged.gather([3, 4, 6])
    step.finish()
    assert c.whole == []
    assert c._store.match_prefix(c.keys(a)) == 2 and c._store.match_prefix(c.keys(b)) == 1
    per = c._paged.block_bytes // 3
    got = b"".join(c._store.get(k) for k in c.keys(a) + c.keys(b))
    for blk in range(3):
        o = blk * c._paged.block_bytes
        assert got[o:o + per] == before[o:o + per]
        assert got[o + per:o + 3 * per] == after[o + per:o + 3 * per]
    assert [e[0] for e in c.trace] == ["saved", "saved", "committed"]
    assert c.trace[-1][2]["blocks"] == 3


def test_a_step_save_that_cannot_begin_falls_back_to_a_whole_save():
    from kvtier.vllm import _StepSave
    c = _FakeConnector(layers=2)
    bad = _Transfer("bad", [bytes([9]) * 32], [99])  # no engine block 99: refused at begin
    good = _Transfer("good", [bytes([8]) * 32], [1])
    step = _StepSave(c, [bad, good])
    step.begin()
    step.layer(0)
    step.finish()
    assert c.whole == ["bad"]
    assert c._store.match_prefix(c.keys(good)) == 1


def test_requests_count_as_saving_from_a_step_begin_to_its_finish():
    from kvtier.vllm import _Mover
    gate = threading.Event()
    ran = []
    m = _Mover(lambda t: ran.append(("load", t.req_id)) or [], lambda t: None)
    try:
        started = threading.Event()
        m.submit_op(lambda: (started.set(), gate.wait(10), ran.append("begin")), starts=["r"])
        assert m.saving("r")
        assert started.wait(10)  # the thread is busy with the begin
        m.submit_load(_Transfer("x", [], []))
        m.submit_op(lambda: ran.append("layer"))
        gate.set()
        m.submit_op(lambda: ran.append("finish"), ends=["r"])
        m.wait_saves(["r"])
        assert not m.saving("r")
    finally:
        m.close()
    # Loads queued while the thread was busy go first (a request waits for them), then the
    # step's ops, in order.
    assert ran[:3] == ["begin", ("load", "x"), "layer"], ran
    assert ran.count("finish") == 1

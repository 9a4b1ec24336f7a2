"""The vLLM connector's layer-wise load bookkeeping, without an engine: a layer's wait returns
only once that layer is in, and a step whose layers ran without waiting reports every block it
loaded as failed (vLLM then recomputes them)."""

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

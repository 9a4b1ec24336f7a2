"""The vLLM connector ends a request's preload hint as soon as the request no longer needs it
(issue 30): its asynchronous load is done or failed, its synchronous load ran, or it was
scheduled with nothing to load; not only when it finishes. Until then the blocks the hint holds
(and the rest of it waiting for room) take preload room from the requests behind it. Runs the
scheduler side of the connector without an engine, against a real embedded store: a hint holds
the request's blocks found in host memory, so `cancel_prefetch` says whether the hint was still
alive (how many holds it ended)."""

from types import SimpleNamespace

import kvtier
from kvtier.vllm import KvtierConnector, _Transfer


def store_and_keys(n=4):
    enc, fp = kvtier.namespace_fingerprint(model="tiny/llama", dtype="float32", layout="cpu",
                                           block_tokens=32, tp_size=1, tp_rank=0, tenant="",
                                           lora="")
    s = kvtier.Store(16 << 20, segment_bytes=4 << 20)
    ns = s.register_namespace(enc)
    keys = [kvtier.engine_key(fp, bytes([i + 1]) * 32) for i in range(n)]
    for i, k in enumerate(keys):
        assert s.put(ns, k, bytes([i]) * 4096)
    return s, keys


def scheduler(store, asynchronous=True):
    c = object.__new__(KvtierConnector)
    c.__dict__.update(_store=store, _hinted={}, _async=asynchronous, _loads=[],
                      _sync_loading=[], _saving=set(), _reqs={}, _lookup_start={},
                      _loading={}, _saved={}, _block_ids={}, _tiers={}, _hybrid=False,
                      _groups=[], _hint_failed=False, _prefill_rate=0.0, _measure_prefill=False)
    return c


def hinted(c, rid, keys):
    c._hinted[rid] = 0.0
    c._hint(rid, keys, 30.0)


def alive(c, rid, store):
    """Whether the request's hint still held blocks (cancelling it now ends them)."""
    return store.cancel_prefetch(c._tag(rid)) > 0


def no_steps():
    return SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=[],
                           total_num_scheduled_tokens=0, num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[]))


def test_a_hint_lives_until_its_request_needs_it_no_more():
    s, keys = store_and_keys()
    c = scheduler(s)
    # The control: a hint nobody ended still holds its blocks.
    hinted(c, "kept", keys)
    assert alive(c, "kept", s)

    # Scheduled with nothing to load (vLLM's own cache had it all): its hint ends at once.
    hinted(c, "none", keys)
    c.update_state_after_alloc(SimpleNamespace(request_id="none"), None, 0)
    assert not alive(c, "none", s)

    # An asynchronous load that finished, and one that failed: their hints end.
    for rid, field in (("done", "finished_recving"), ("failed", "failed_recving")):
        hinted(c, rid, keys)
        out = SimpleNamespace(kv_connector_worker_meta=None, invalid_block_ids=set(),
                              **{field: {rid}})
        c.update_connector_output(out)
        assert not alive(c, rid, s), rid

    # A finished (or aborted) request: its hint ends.
    hinted(c, "gone", keys)
    c._block_ids["gone"] = []
    c.request_finished(SimpleNamespace(request_id="gone"), [])
    assert not alive(c, "gone", s)


def test_a_synchronous_load_ends_its_hint_once_its_step_ran():
    s, keys = store_and_keys()
    c = scheduler(s, asynchronous=False)
    hinted(c, "sync", keys)
    c._loads.append(_Transfer("sync", [], []))
    c.build_connector_meta(no_steps())
    # The step that loads it has not run yet: its hint lives on.
    assert c._sync_loading == ["sync"] and "sync" in c._hinted
    c.build_connector_meta(no_steps())
    assert c._sync_loading == []
    assert not alive(c, "sync", s)

"""The vLLM connector ends a request's preload hint as soon as the request no longer needs it
(issue 30): its asynchronous load is done or failed, its synchronous load ran, or it was
scheduled with nothing to load; not only when it finishes. Until then the blocks the hint holds
(and the rest of it waiting for room) take preload room from the requests behind it. Runs the
scheduler side of the connector without an engine, against a real embedded store: a hint holds
the request's blocks found in host memory, so `cancel_prefetch` says whether the hint was still
alive (how many holds it ended)."""

from types import SimpleNamespace

import kvtier
from kvtier.vllm import KvtierScheduler, _Transfer


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
    c = object.__new__(KvtierScheduler)
    c.__dict__.update(_store=store, _hinted={}, _in_host={}, _delivered_at=None,
                      _async=asynchronous, _loads=[],
                      _sync_loading=[], _saving=set(), _reqs={}, _lookup_start={},
                      _loading={}, _saved={}, _block_ids={}, _tiers={}, _hybrid=False,
                      _groups=[], _hint_failed=False, _prefill_rate=0.0, _measure_prefill=False,
                      _pending_since={})
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


def test_a_request_whose_disk_blocks_cannot_be_preloaded_loads_them_at_once(tmp_path):
    """Issue 31 (agent trace, small host tier): held blocks of the requests ahead took all the
    preload room, so a request's disk blocks were never preloaded; it waited out the load
    deadline in the queue and then recomputed them. With none of its blocks moving up it now
    loads them at once (its load reads the disk), under the default policy; `wait_complete`
    still waits."""
    import time

    enc, fp = kvtier.namespace_fingerprint(model="tiny/llama", dtype="float32", layout="cpu",
                                           block_tokens=32, tp_size=1, tp_rank=0, tenant="",
                                           lora="")
    s = kvtier.Store(16 << 20, segment_bytes=4 << 20, disk_dir=str(tmp_path),
                     disk_bytes=128 << 20, admission="always")
    ns = s.register_namespace(enc)
    block = bytes(1 << 20)
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    keys = [kvtier.engine_key(fp, h) for h in hashes]
    for k in keys:
        assert s.put(ns, k, block)
    # Twice the host tier of other blocks: the request's four go down to disk.
    filler = [kvtier.engine_key(fp, bytes([200, i]) * 16) for i in range(32)]
    for k in filler:
        assert s.put(ns, k, block)
    assert s.lookup(keys)[2] == ["disk"] * 4
    # Another request's hint holds host blocks up to the preload bound (an eighth of the
    # host tier: two blocks): no room is left for this one's preloads.
    ahead = s.prefetch(filler[-2:], 0, 30_000, 99)
    assert ahead["held"] == 2, ahead

    bs = 32
    for policy, expect in (("timeout", (4 * bs, True)), ("wait_complete", (None, False))):
        c = scheduler(s)
        c.__dict__.update(_fp=fp, _may_load=True, _block_size=bs, _policy=policy,
                          _deadline_s=30.0, _hint_ttl_s=60.0)
        rid = f"r-{policy}"
        req = SimpleNamespace(request_id=rid, block_hashes=hashes,
                              prompt_token_ids=list(range(4 * bs + 1)))
        c._hinted[rid] = time.monotonic()
        r = c._hint(rid, keys, 60.0)
        assert r["present"] == 4 and r["queued"] + r["joined"] == 0, r
        assert c.get_num_new_matched_tokens(req, 0) == expect, policy
        c._end_hint(rid)

"""Per-request session hints of the vLLM connector (issue 32): ``kv_transfer_params``
``{"kvtier": {"session", "retain_s", "priority", "demote"}}`` checked field by field, sent once
the request's saves are written (not before: its own blocks would not be there yet), and a bad
hint logged and ignored, never failing the request. The scheduler side of the connector runs
without an engine, against a real embedded store; the native `retain`/`demote`/`pin` are
exercised on the same store."""

from types import SimpleNamespace

import pytest

import kvtier
from kvtier.vllm import KvtierScheduler, session_hints

BS = 32


def store_and_keys(n=4):
    enc, fp = kvtier.namespace_fingerprint(model="tiny/llama", dtype="float32", layout="cpu",
                                           block_tokens=BS, tp_size=1, tp_rank=0, tenant="",
                                           lora="")
    s = kvtier.Store(16 << 20, segment_bytes=4 << 20)
    ns = s.register_namespace(enc)
    hashes = [bytes([i + 1]) * 32 for i in range(n)]
    keys = [kvtier.engine_key(fp, h) for h in hashes]
    for i, k in enumerate(keys):
        assert s.put(ns, k, bytes([i]) * 4096)
    return s, fp, hashes, keys


def scheduler(store, fp):
    c = object.__new__(KvtierScheduler)
    c.__dict__.update(_store=store, _fp=fp, _hinted={}, _in_host={}, _delivered_at=None,
                      _saving=set(), _reqs={},
                      _lookup_start={}, _loading={}, _saved={}, _block_ids={}, _tiers={},
                      _hybrid=False, _groups=[], _block_size=BS, _after_save={},
                      _pending_since={},
                      session_stats={"retains": 0, "retained": 0, "clipped": 0, "demotes": 0,
                                     "demoted": 0, "refused": 0, "bad": 0})
    return c


def request(rid, hashes, params):
    return SimpleNamespace(request_id=rid, block_hashes=hashes,
                           prompt_token_ids=list(range(len(hashes) * BS + 5)),
                           kv_transfer_params=params)


def test_hints_are_checked_field_by_field():
    assert session_hints(None) is None
    assert session_hints({"other": 1}) is None
    assert session_hints({"kvtier": {"session": "s", "retain_s": 600, "priority": 3}}) == {
        "session": "s", "retain_s": 600.0, "priority": 3, "demote": False}
    assert session_hints({"kvtier": {}})["session"] is None
    for bad, field in ((["x"], "object"), ({"retain": 5}, "unknown"),
                       ({"retain_s": -1}, "retain_s"), ({"retain_s": "600"}, "retain_s"),
                       ({"priority": 256}, "priority"), ({"priority": True}, "priority"),
                       ({"session": ""}, "session"), ({"session": "x" * 257}, "session"),
                       ({"demote": "yes"}, "demote")):
        with pytest.raises(ValueError, match=field):
            session_hints({"kvtier": bad})


def test_a_retain_goes_once_the_saves_are_written_and_a_demote_ends_it():
    s, fp, hashes, keys = store_and_keys()
    c = scheduler(s, fp)
    # Its saves are still being written: nothing yet.
    c._saving.add("t1")
    r = request("t1", hashes, {"kvtier": {"session": "chat-1", "retain_s": 600, "priority": 3}})
    assert c.request_finished(r, []) == (True, None)
    assert c.session_stats["retains"] == 0
    assert s.demote(keys=[keys[0]])["released"] == 0, "retained before its saves were written"
    # Written: the prompt's four blocks are retained under the session.
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None,
                                              finished_sending={"t1"}, invalid_block_ids=set()))
    assert c.session_stats == {"retains": 1, "retained": 4, "clipped": 0, "demotes": 0,
                               "demoted": 0, "refused": 0, "bad": 0}
    # Nothing saving: the next turn's demote goes at once and ends the session (this store has
    # no disk: the blocks stay where they are, kept).
    r = request("t2", hashes, {"kvtier": {"session": "chat-1", "demote": True}})
    assert c.request_finished(r, []) == (False, None)
    assert c.session_stats["demotes"] == 1
    assert s.demote(session="chat-1")["released"] == 0, "the session outlived its demote"


def test_a_bad_hint_is_ignored_and_counted():
    s, fp, hashes, _ = store_and_keys()
    c = scheduler(s, fp)
    r = request("b", hashes, {"kvtier": {"retain_s": 600, "sesion": "typo"}})
    assert c.request_finished(r, []) == (False, None)
    assert c.session_stats["bad"] == 1
    assert c.session_stats["retains"] == 0


def test_native_retain_demote_and_pin_answer():
    s, _, _, keys = store_and_keys()
    r = s.retain(keys, session="a", ttl_ms=7_200_000, priority=1)
    assert (r["present"], r["retained"], r["clipped"], r["refused"]) == (4, 4, 0, "")
    assert r["clipped_by"] == ["preload.max_retain_ms"] and r["ttl_ms"] == 3_600_000
    assert r["retained_bytes"] == 4 * 4096
    with pytest.raises(ValueError, match="session"):
        s.demote()
    d = s.demote(session="a")
    assert (d["released"], d["kept"]) == (4, 4)  # no disk tier: nowhere to go
    p = s.pin(keys[:2], ttl_ms=1000)
    assert (p["n"], p["tiers"], p["refused"]) == (2, ["host", "host"], "")
    assert p["lease"] is not None
    assert s.unpin(p["lease"]) is True
    assert s.unpin(p["lease"]) is False

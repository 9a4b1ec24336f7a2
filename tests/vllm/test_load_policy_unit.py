"""What the vLLM connector's scheduler answers for a request whose disk blocks are still being
preloaded, under each ``load_policy`` (the unit tests had none for this; the end-to-end tests
run the default and wait_complete through a real daemon). The store is a stand-in that answers
as kvtierd does while a hint's preloads are queued: the first two blocks in host memory, the
last two on disk and moving up."""

import time
from types import SimpleNamespace

from kvtier.vllm import KvtierScheduler

BS = 32


class Preloading:
    """Two blocks in host memory, two on disk whose preloads are queued."""

    def __init__(self):
        self.hints = 0

    def lookup(self, keys, *_):
        return 4, 4, ["host", "host", "disk", "disk"]

    def prefetch(self, keys, *_):
        self.hints += 1
        return {"present": 4, "in_host": 2, "queued": 2, "joined": 0, "held": 0}


def scheduler(store, policy, deadline_s=30.0):
    c = object.__new__(KvtierScheduler)
    c.__dict__.update(_store=store, _fp=b"\0" * 16, _may_load=True, _block_size=BS,
                      _policy=policy, _deadline_s=deadline_s, _hint_ttl_s=60.0, _hinted={},
                      _in_host={}, _delivered_at=None,
                      _hybrid=False, _groups=[], _tiers={}, _lookup_start={},
                      _pending_since={}, _async=True, _prefill_rate=0.0,
                      _measure_prefill=False, _hint_failed=False)
    return c


def request(rid):
    return SimpleNamespace(request_id=rid, block_hashes=[bytes([i + 1]) * 32 for i in range(4)],
                           prompt_token_ids=list(range(4 * BS + 7)))


def ask(policy, deadline_s=30.0):
    s = Preloading()
    c = scheduler(s, policy, deadline_s)
    r = request(f"r-{policy}")
    # Its hint was sent on arrival (`on_new_request`), just now.
    c._hinted[r.request_id] = time.monotonic()
    return c.get_num_new_matched_tokens(r, 0), s.hints


def test_timeout_and_wait_complete_keep_the_request_queued_while_its_preloads_move():
    for policy in ("timeout", "wait_complete"):
        answer, hints = ask(policy)
        assert answer == (None, False), policy
        # The wait re-hints (what was cut for room is queued now).
        assert hints == 1, policy


def test_best_effort_loads_what_is_in_host_memory():
    assert ask("best_effort")[0] == (2 * BS, True)


def test_timeout_past_its_deadline_computes_the_rest_when_no_preload_lands():
    # No preload has landed (a stalled disk): what is in host memory loads, vLLM computes the
    # rest.
    answer, hints = ask("timeout", deadline_s=0.0)
    assert answer == (2 * BS, True)
    assert hints == 1


class Landing(Preloading):
    """Each reply finds one more of the request's blocks in host memory (preloads landing)."""

    def __init__(self):
        super().__init__()
        self.in_host = 1

    def prefetch(self, keys, *_):
        self.hints += 1
        self.in_host += 1
        return {"present": 4, "in_host": self.in_host, "queued": 4 - self.in_host,
                "joined": 0, "held": 1}


def test_timeout_past_its_deadline_loads_the_disk_blocks_while_preloads_land():
    # A request first asked after waiting out its turn in vLLM's queue, while preloads land:
    # it waits no longer, and its load reads the blocks still on disk itself rather than
    # leaving them to be computed.
    s = Landing()
    c = scheduler(s, "timeout", deadline_s=0.0)
    r = request("queued-behind-others")
    c._hinted[r.request_id] = time.monotonic()
    c._hint(r.request_id, [b"k"], 1.0)  # its hint on arrival: 2 of its blocks in host memory
    assert c._delivered_at is None
    # Asked past the deadline, the reply finds 3: a preload landed, so it loads all four.
    assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
    assert c._delivered_at is not None
    # The hint ends with the request (scheduled, or finished).
    c._end_hint(r.request_id)
    assert r.request_id not in c._in_host
    # Long after the last landing (the disk stalled since), the same request computes them.
    c._hinted[r.request_id] = time.monotonic()
    c._delivered_at -= 60.0
    s.in_host = 0
    assert c.get_num_new_matched_tokens(r, 0) == (2 * BS, True)

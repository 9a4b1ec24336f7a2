"""Read-your-writes in the vLLM connector's scheduler (issue 32): blocks right after a hit that
another engine is saving now (kvtier's lookup answers them "pending") keep the request waiting
(the scheduler asks again next step) until they are committed, at most load_deadline_ms, unless
vLLM holds them itself or the policy is best_effort. The store is a stand-in that answers
lookups as kvtierd does mid-save (the store's and the daemon's side are tested in Rust:
kvstore's a_load_waits_for_a_save_in_progress..., kvtierd's a_load_reads_another_engines...)."""

from types import SimpleNamespace

from kvtier.vllm import KvtierScheduler

BS = 32


class MidSave:
    """Answers 2 blocks present and 2 being saved, until `commit()`; then 4 present."""

    def __init__(self):
        self.committed = False

    def lookup(self, keys, *_):
        if self.committed:
            return 4, 4, ["host"] * 4
        return 2, 2, ["host", "host", "pending", "pending"]

    def commit(self):
        self.committed = True


def scheduler(store, policy="timeout", deadline_s=30.0):
    c = object.__new__(KvtierScheduler)
    c.__dict__.update(_store=store, _fp=b"\0" * 16, _may_load=True, _block_size=BS,
                      _policy=policy, _deadline_s=deadline_s, _hinted={}, _in_host={},
                      _delivered_at=None, _hybrid=False,
                      _groups=[], _tiers={}, _lookup_start={}, _pending_since={},
                      _async=True, _prefill_rate=0.0, _measure_prefill=False)
    return c


def request(rid):
    return SimpleNamespace(request_id=rid, block_hashes=[bytes([i + 1]) * 32 for i in range(4)],
                           prompt_token_ids=list(range(4 * BS + 7)))


def test_a_request_waits_for_blocks_being_saved_then_loads_them():
    s = MidSave()
    c = scheduler(s)
    r = request("next-turn")
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)
    s.commit()
    assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)


def test_it_does_not_wait_when_vllm_holds_them_or_the_policy_says_not_to():
    c = scheduler(MidSave())
    # vLLM's own prefix cache covers the blocks being saved: nothing to wait for.
    assert c.get_num_new_matched_tokens(request("local"), 4 * BS) == (0, False)
    c = scheduler(MidSave(), policy="best_effort")
    assert c.get_num_new_matched_tokens(request("be"), 0) == (2 * BS, True)


def test_it_waits_at_most_the_deadline():
    c = scheduler(MidSave(), deadline_s=0.05)
    r = request("slow-save")
    assert c.get_num_new_matched_tokens(r, 0) == (None, False)
    # The request has waited past the deadline (its first sight moved back, not slept for).
    c._pending_since["slow-save"] -= 1.0
    # Past it: what is committed loads, vLLM computes the rest.
    assert c.get_num_new_matched_tokens(r, 0) == (2 * BS, True)

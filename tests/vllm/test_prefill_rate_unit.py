"""The vLLM connector's measured prefill rate, without an engine: a worker times each step's
forward pass (load waits taken out) and reports it through vLLM's worker metadata; the
scheduler's connector keeps an exponentially weighted rate and states it with its lookups
unless the config states one (or turns pricing off)."""

import time
from types import SimpleNamespace

import pytest

from kvtier.vllm import (MIN_TIMED_TOKENS, KvtierMetadata, KvtierScheduler, KvtierWorker,
                         KvtierWorkerMetadata, _PrefillRate)


def worker():
    w = object.__new__(KvtierWorker)
    w.__dict__.update(_step_save=None, _layerwise=False, _writer=False, _mover=None, _cuda=None,
                      _layer_loads=None, _failed=set(), _tainted=set(), _save_reqs=set(),
                      _hybrid=False, _groups=[])
    return w


def scheduler(rate=0.0, measure=True):
    s = object.__new__(KvtierScheduler)
    s.__dict__.update(_prefill_rate=rate, _measure_prefill=measure, _measured=_PrefillRate(),
                      _loading={}, _saved={})
    return s


def step(w, tokens, forward_s, load_s=0.0):
    w.bind_connector_metadata(KvtierMetadata(step_tokens=tokens))
    w.start_load_kv(None)
    # A synchronous load that took load_s: not the forward pass's time.
    w._step_waited += load_s
    time.sleep(forward_s + load_s)
    w.wait_for_save()
    return w.build_connector_worker_meta()


def output(meta):
    return SimpleNamespace(kv_connector_worker_meta=meta, failed_recving=(),
                           invalid_block_ids=set())


def test_a_worker_times_its_forward_pass_and_the_scheduler_states_the_rate():
    w, s = worker(), scheduler()
    assert s.prefill_rate() == 0, "nothing measured yet: every hit loads"
    m = step(w, 1000, 0.05, load_s=1.0)
    assert isinstance(m, KvtierWorkerMetadata) and m.tokens == 1000
    assert 0.05 <= m.seconds < 1.0, "the load's time is not the forward pass's"
    assert w.build_connector_worker_meta() is None, "reported once"
    s.update_connector_output(output(m))
    assert s.prefill_rate() == pytest.approx(1000 / m.seconds)
    # Exponentially weighted: a step twice as slow moves it a fifth of the way.
    first = s.prefill_rate()
    s.update_connector_output(output(KvtierWorkerMetadata(1000, 2 * m.seconds)))
    assert s.prefill_rate() == pytest.approx(0.8 * first + 0.2 * first / 2)
    # Decode steps (few tokens) are not timed, and say nothing.
    assert step(w, MIN_TIMED_TOKENS - 1, 0.01) is None
    s.update_connector_output(output(None))
    assert s.prefill_rate() == pytest.approx(0.8 * first + 0.2 * first / 2)


def test_tensor_parallel_workers_aggregate_to_the_slowest():
    a, b = KvtierWorkerMetadata(512, 0.1), KvtierWorkerMetadata(512, 0.3)
    m = a.aggregate(b)
    assert (m.tokens, m.seconds) == (512, 0.3)


def test_a_configured_rate_wins_and_off_turns_pricing_off():
    s = scheduler(rate=25_000.0)
    s.update_connector_output(output(KvtierWorkerMetadata(1000, 0.001)))
    assert s.prefill_rate() == 25_000.0
    off = scheduler(rate=0.0, measure=False)
    off.update_connector_output(output(KvtierWorkerMetadata(1000, 0.001)))
    assert off.prefill_rate() == 0.0


def test_gpu_workers_do_not_time_steps_the_host_did_not_wait_for():
    w = worker()
    w._cuda = object()
    w.bind_connector_metadata(KvtierMetadata(step_tokens=4096))
    w._step_t0 -= 1.0
    # wait_for_save's GPU branch records an event only when there are saves or loads: none.
    w.wait_for_save()
    assert w.build_connector_worker_meta() is None

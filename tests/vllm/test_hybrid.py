"""A hybrid model through kvtier with vLLM's hybrid allocator on (``SupportsHMA``): a tiny
Gemma2 whose first layer attends through a 64-token sliding window and whose second attends to
everything, so the engine has two KV-cache groups with blocks of their own (the groups' tensors
overlay one buffer). Each group is saved and loaded through its own layers, in a namespace of
its own; a hit needs the full-attention group's whole prefix and the sliding-window group's
window before the hit's end; a failed load fails the request's load and vLLM recomputes it.
Every output is compared with an engine without a connector."""

import subprocess
import sys

import msgspec
import pytest

from kvtier import Sidecar
from test_kv_events import subscriber
from test_vllm_e2e import BS, HERE, Daemon, engine, same, scramble_data_files

H1 = list(range(1, 301))                          # 300 tokens: 9 full blocks + 12
H2 = list(range(1, 161)) + list(range(400, 540))  # its first 5 blocks are H1's
H3 = list(range(600, 664))                        # exactly 2 blocks


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinygemma2")
    subprocess.run([sys.executable, str(HERE / "make_tiny_llama.py"), str(d), "--hybrid"],
                   check=True)
    return d


def test_a_hybrid_model_keeps_the_hybrid_allocator_and_loads_every_group(hybrid, tmp_path):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    ref = engine(hybrid, [H1, H2, H3])
    d = Daemon(tmp_path / "kvtierd", "--set", "events.endpoint=tcp://127.0.0.1:0")
    try:
        sub = subscriber(d.events, Sidecar(d.socket, "hybrid-events"))
        # The subscriber's probe blocks gone (only the engine's namespaces hold blocks next).
        for n in d.cli("stats")["namespaces"]:
            d.cli("clear", str(n["id"]))
        first = engine(hybrid, [H1, H3], d.conn())
        # The connector supports the hybrid allocator: vLLM kept it on.
        assert first["hybrid_allocator"], first
        for out, r in zip(first["outputs"], [ref["outputs"][0], ref["outputs"][2]]):
            assert out["num_cached_tokens"] == 0
            same(out, r)
        # Two groups, each in its own namespace, every prompt block of each saved.
        held = [n for n in d.cli("stats")["namespaces"] if n["host_blocks"] > 0]
        assert len(held) == 2, held
        assert all(n["host_blocks"] == 9 + 2 for n in held), held
        # kvtierd's KV events name each group's blocks as vLLM names the group: its index, its
        # spec's kind and window (the connector registered each namespace with them). (The
        # subscriber's probe blocks were 16-token ones.)
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        groups = {}
        while sub.poll(1000):
            for e in dec.decode(sub.recv_multipart()[2]).events:
                if isinstance(e, BlockStored) and e.block_size == BS:
                    key = (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                    groups[key] = groups.get(key, 0) + len(e.block_hashes)
        sub.close(linger=0)
        assert sorted(k[1:] for k in groups) == [("full_attention", None),
                                                 ("sliding_window", 64)], groups
        assert {k[0] for k in groups} == {0, 1}, groups
        assert all(n == 9 + 2 for n in groups.values()), groups

        second = engine(hybrid, [H1, H2, H3], d.conn())["outputs"]
        # Whole blocks, one short of the prompt's end.
        assert second[0]["num_cached_tokens"] == 9 * BS
        assert second[1]["num_cached_tokens"] == 5 * BS
        assert second[2]["num_cached_tokens"] == 1 * BS
        for out, r in zip(second, ref["outputs"]):
            same(out, r)

        # Without either group's blocks there is no hit (the sliding-window group's window or
        # the full-attention prefix is missing): computed, same output.
        for ns in sorted(n["id"] for n in held):
            # H1's 9, H3's 2 and H2's 4 blocks of its own.
            assert d.cli("clear", str(ns))["removed"] == 9 + 2 + 4
            out = engine(hybrid, [H1], d.conn())["outputs"][0]
            assert out["num_cached_tokens"] == 0, ns
            same(out, ref["outputs"][0])

        # Data files corrupted on disk: the index says present, the checksum says no. vLLM
        # takes no block-level load failures from a hybrid model: the connector fails the
        # request's load (failed_recving) and vLLM recomputes it; never served, no crash.
        d.stop()
        scramble_data_files(d.data_dir)
        d.start()
        # (Without preloads: a preload would meet the damage first and drop the blocks.)
        out = engine(hybrid, [H1], d.conn(preload=False), policy="recompute")["outputs"][0]
        same(out, ref["outputs"][0])
        disk = next(t for t in d.cli("stats")["tiers"] if t["tier"] == "disk")
        assert disk["checksum_failures"] > 0
    finally:
        d.stop()

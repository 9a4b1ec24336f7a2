"""kvtier.router against two real kvtierd nodes (a cluster on loopback): the lookup names the
node and tier that hold a prefix, and score() prefers the engine whose node has it."""

import json
import pathlib
import signal
import subprocess
import time

from kvtier import Sidecar, engine_key, namespace_fingerprint, router
from ports import free_ports

REPO = pathlib.Path(__file__).resolve().parents[2]


def start(data_dir, port, members):
    p = subprocess.Popen(
        [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(data_dir),
         "--host-capacity", "128M", "--no-disk", "--grpc", "127.0.0.1:0",
         "--metrics", "127.0.0.1:0", "--set", "host.segment=16M", "--set", "log=warn",
         "--set", f"cluster.listen=127.0.0.1:{port}", "--set", "cluster.push_queue_bytes=0",
         "--set", "cluster.members=[" + ",".join(f'"127.0.0.1:{m}"' for m in members) + "]"],
        stdout=subprocess.PIPE, text=True)
    f = dict(w.split("=", 1) for w in p.stdout.readline().split() if "=" in w)
    return p, f


def test_lookup_and_score_find_the_node_with_the_prefix(tmp_path):
    ports = free_ports(2)
    nodes = [start(tmp_path / f"n{i}", p, ports) for i, p in enumerate(ports)]
    try:
        (_, a), (_, b) = nodes
        side = Sidecar(a["socket"], "router-test")
        enc, fp = namespace_fingerprint(model="router/model", dtype="bf16", layout="nhd",
                                        block_tokens=16, tp_size=1, tp_rank=0)
        ns = side.register_namespace(enc)
        # Twelve blocks, on A only: saved blocks are not pushed to their owners here (pushed,
        # B would hold those it owns, and the whole prefix where it owns all twelve).
        keys = [engine_key(fp, bytes([i]) * 32) for i in range(12)]
        for k in keys:
            assert side.put(ns, k, b"k" * 8192)
        # Asked through node B (which no engine wrote to): node A has all of it in host memory.
        r = router.lookup(b["grpc"], keys, cluster=True)
        by = {n["node"]: n for n in r["nodes"]}
        na = by[f"127.0.0.1:{ports[0]}"]
        assert na["n"] == 12 and na["tiers"] == ["host"] * 12 and not na["local"], r
        assert by[f"127.0.0.1:{ports[1]}"]["local"]
        # Costs in seconds: host blocks load for nothing (and no unmeasured tier is involved).
        assert na["load_seconds"] == 0.0 and na["load_measured"], na
        engines = {"on-a": f"127.0.0.1:{ports[0]}", "on-b": f"127.0.0.1:{ports[1]}"}
        costs = router.score(engines, keys=keys, via=b["grpc"])
        assert costs["on-a"] < costs["on-b"], costs
        assert abs(costs["on-a"] - 12 * (1 - router.WEIGHTS["host"])) < 1e-9
        # B's engine can still load what B does not hold from A (the remote weight).
        assert costs["on-b"] <= 12 * (1 - router.WEIGHTS["remote"]) + 1e-9
        # One lookup per node (no `via`): A answers host for all twelve.
        direct = router.score({"on-a": a["grpc"]}, keys=keys)
        assert abs(direct["on-a"] - costs["on-a"]) < 1e-9
        # GPU-resident blocks weigh most; an unknown prompt costs every block.
        assert router.score({"on-a": a["grpc"]}, keys=keys, gpu={"on-a": 12})["on-a"] == 0.0
        other = [engine_key(fp, bytes([200 + i]) * 32) for i in range(4)]
        assert router.score(engines, keys=other, via=b["grpc"]) == {"on-a": 4.0, "on-b": 4.0}
        # In seconds, at a prefill rate: A loads its twelve blocks for nothing; a node that
        # holds nothing computes every block (16 tokens at 1000 tokens/s).
        secs = router.score(engines, keys=keys, via=b["grpc"], prefill_tokens_per_s=1000.0)
        assert secs["on-a"] == 0.0 and secs["on-b"] >= secs["on-a"], secs
        secs = router.score(engines, keys=other, via=b["grpc"], prefill_tokens_per_s=1000.0)
        assert secs == {"on-a": 4 * 0.016, "on-b": 4 * 0.016}, secs
        # Token ids with their namespace: kvtier's token keys, computed by the daemon.
        r = router.lookup(a["grpc"], token_ids=list(range(40)),
                          namespace=dict(model="router/model", block_tokens=16))
        assert r["n"] == 0 and r["tiers"] == []
        # score(endpoints, prompt): a prompt no node holds costs each of its full blocks.
        ns = dict(model="router/model", block_tokens=16)
        assert router.score(engines, list(range(40)), namespace=ns, via=b["grpc"]) == {
            "on-a": 2.0, "on-b": 2.0}
    finally:
        for p, _ in nodes:
            p.terminate()
            assert p.wait(timeout=60) == 0


def test_requests_encode_as_protobuf():
    # Field 1 (keys) length-delimited, field 5 (token_ids) packed, field 6 (cluster) varint.
    b = router._encode_request([b"\x01" * 16], [1, 300], None, {"model": "m"}, True, "")
    fields = [(n, w) for n, w, _ in router._fields(b)]
    assert fields == [(1, 2), (3, 2), (5, 2), (6, 0)]
    reply = bytes([0x08, 0x02, 0x12, 0x02, 0x01, 0x02])  # n=2, tiers=[host, disk] packed
    assert router._decode_reply(reply) == {"n": 2, "tiers": ["host", "disk"], "nodes": []}


def test_bad_lookup_input_is_refused_with_an_error_naming_it():
    # A negative token id never ended the hand-written varint loop (the call spun and
    # allocated); out-of-range ids, non-integers and malformed keys are refused up front.
    ns = dict(model="m", block_tokens=16)
    for bad, why in (([1, -1], "token id"), ([1 << 32], "token id"), (["7"], "token id"),
                     ([1.5], "token id")):
        try:
            router._encode_request(None, bad, None, ns, False, "")
        except ValueError as e:
            assert why in str(e), e
        else:
            raise AssertionError(f"{bad!r} was accepted")
    for bad_ns in (dict(model="m", block_tokens=-16), dict(model="m", tp_rank=1 << 40)):
        try:
            router._encode_request(None, [1, 2], None, bad_ns, False, "")
        except ValueError as e:
            assert "namespace" in str(e), e
        else:
            raise AssertionError(f"{bad_ns!r} was accepted")
    for bad_keys in ([b"short"], ["not bytes at all, 16"]):
        try:
            router._encode_request(bad_keys, None, None, None, False, "")
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"{bad_keys!r} was accepted")
    # What is accepted encodes as protobuf does: field 5 packed uint32, the namespace nested.
    req = router._encode_request(None, [0, 1, 300, (1 << 32) - 1], None, ns, True, "")
    fields = list(router._fields(req))
    assert [f[0] for f in fields] == [3, 5, 6]
    packed = fields[1][2]
    ids, i = [], 0
    while i < len(packed):
        v, i = router._read_varint(packed, i)
        ids.append(v)
    assert ids == [0, 1, 300, (1 << 32) - 1]


def test_the_index_follows_the_nodes_block_events(tmp_path):
    """router.Index: subscribed to both nodes' Watch streams, it knows which node holds which
    blocks in which tier without asking, scores as the cluster lookup does, starts complete
    on a warm cluster too (each stream's snapshot), and stops vouching for itself when a
    node's stream breaks (a node killed): then score() answers None (ask the cluster)."""
    ports = free_ports(2)
    nodes = [start(tmp_path / f"n{i}", p, ports) for i, p in enumerate(ports)]
    idx = warm = None
    try:
        (_, a), (_, b) = nodes
        idx = router.Index({"on-a": a["grpc"], "on-b": b["grpc"]})
        assert idx.wait_complete(30), idx.blocks()
        side = Sidecar(b["socket"], "index-test")
        enc, fp = namespace_fingerprint(model="router/model", dtype="bf16", layout="nhd",
                                        block_tokens=16, tp_size=1, tp_rank=0)
        ns = side.register_namespace(enc)
        keys = [engine_key(fp, bytes([i]) * 32) for i in range(6)]
        for k in keys:
            assert side.put(ns, k, b"k" * 8192)
        assert idx.wait(lambda: idx.blocks() == {"on-a": 0, "on-b": 6}, 30), idx.blocks()
        # B's engine loads the six from host memory; A's from B (remote).
        costs = idx.score(keys)
        assert abs(costs["on-b"] - 6 * (1 - router.WEIGHTS["host"])) < 1e-9, costs
        assert abs(costs["on-a"] - 6 * (1 - router.WEIGHTS["remote"])) < 1e-9, costs
        # The same as the cluster lookup (one round trip through A) says.
        engines = {"on-a": f"127.0.0.1:{ports[0]}", "on-b": f"127.0.0.1:{ports[1]}"}
        assert costs == router.score(engines, keys=keys, via=a["grpc"]), costs
        # A prefix: only its leading held blocks count; GPU blocks first, as in score().
        other = [engine_key(fp, bytes([100]) * 32)]
        assert idx.score(keys[:2] + other)["on-b"] == 2 * (1 - router.WEIGHTS["host"]) + 1
        assert idx.score(keys, gpu={"on-a": 6})["on-a"] == 0.0
        # An index started now, on the warm cluster: complete from the snapshots, the same.
        warm = router.Index({"on-a": a["grpc"], "on-b": b["grpc"]}, keepalive_s=1.0)
        assert warm.wait_complete(30), warm.blocks()
        assert warm.blocks() == {"on-a": 0, "on-b": 6}, warm.blocks()
        assert warm.score(keys) == costs
        # Node B stops answering with its connections open (SIGSTOP: the kernel still acks):
        # the keepalive pings go unanswered, the stream breaks, the index stops vouching.
        # Once B answers again the index starts it over from a new snapshot.
        nodes[1][0].send_signal(signal.SIGSTOP)
        try:
            assert warm.wait(lambda: not warm.complete(), 60), "a silent node went unnoticed"
            assert warm.score(keys) is None
        finally:
            nodes[1][0].send_signal(signal.SIGCONT)
        assert warm.wait_complete(60), warm.blocks()
        assert warm.blocks() == {"on-a": 0, "on-b": 6}, warm.blocks()
        try:
            idx.score([b"short"])
            raise AssertionError("a 5-byte key was scored")
        except ValueError as e:
            assert "16 bytes" in str(e)
        # Node A goes away: its stream breaks, the index is no longer complete.
        nodes[0][0].kill()
        nodes[0][0].wait(timeout=60)
        assert idx.wait(lambda: not idx.complete(), 30)
        assert idx.score(keys) is None
    finally:
        for i in (idx, warm):
            if i is not None:
                i.close()
        for p, _ in nodes:
            if p.poll() is None:
                p.terminate()
                assert p.wait(timeout=60) == 0

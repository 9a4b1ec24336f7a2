"""End to end with the real vLLM engine (CPU build 0.32.0) and a tiny random Llama, through
kvtierd (sidecar mode, the worker in its own process) and embedded.

One story, each engine a fresh process (tests/vllm/run_engine.py), every output compared with an
engine without any connector (greedy tokens equal, log-probabilities within 1e-3):
- an engine with too few KV blocks saves prompts while requests are preempted;
- a fresh engine loads them asynchronously (WAITING_FOR_REMOTE_KVS) and reports the hits; a
  prompt sharing one block hits that block; a request aborted during its load leaks no lease;
- blocks corrupted inside the store (zeroed, K/V swapped, one layer from another block) move
  the log-probabilities: the comparison can fail;
- after a daemon restart the blocks come from its disk tier (synchronous loads, scheduler and
  worker in one process);
- after clearing the namespace it is a miss;
- data files corrupted on disk: the checksum turns the load into a reported failure, which
  vLLM recomputes (kv_load_failure_policy "recompute") or fails ("fail") — never served.
And embedded mode (the store in the engine process, engine core and worker in one process:
VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor) with a disk tier that a fresh engine reads."""

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest
from ports import free_ports

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BS = 32
LAYERS = 2                                       # make_tiny_llama.py
A = list(range(1, 71))                           # 70 tokens: 2 full blocks + 6
B = list(range(1, 33)) + list(range(500, 540))   # shares only the first block with A
P = [list(range(300 + 94 * i, 394 + 94 * i)) for i in range(3)]  # 94 tokens: cross a block
C = list(range(600, 694))                        # while decoding (preemption in a tight cache)
D = list(range(700, 794))
E = list(range(800, 894))
F = list(range(900, 964))                        # exactly 2 blocks: a full-prompt hit
ENV = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1")


def engine(model, prompts, connector=None, in_process=False, **kw):
    """Runs prompts on a fresh engine. in_process: the engine core and its worker in this one
    process (uni executor), which embedded mode needs; otherwise a worker process (mp)."""
    args = {"model": str(model), "prompts": prompts, "executor": "uni" if in_process else "mp",
            **kw}
    if connector:
        args["connector"] = connector
    env = dict(ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0") if in_process else ENV
    p = subprocess.run([sys.executable, str(HERE / "run_engine.py"), json.dumps(args)],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


class PhasedEngine:
    """An engine that runs prompt groups one after the other and waits between them, so a test
    can act on the world (restart kvtierd) under a running engine."""

    def __init__(self, model, phases, connector):
        args = {"model": str(model), "prompts": [], "executor": "mp", "phases": phases,
                "connector": connector}
        self.p = subprocess.Popen([sys.executable, str(HERE / "run_engine.py"), json.dumps(args)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=ENV)

    def phase(self):
        for line in self.p.stdout:
            if line.startswith("PHASE "):
                return json.loads(line[len("PHASE "):])["outputs"]
        raise AssertionError(f"the engine ended without a phase (exit {self.p.wait()})")

    def go(self):
        self.p.stdin.write("go\n")
        self.p.stdin.flush()

    def close(self):
        assert self.p.wait(timeout=300) == 0


class Daemon:
    def __init__(self, data_dir, *extra):
        self.data_dir = data_dir
        self.start(*extra)

    def start(self, *extra):
        self.p = subprocess.Popen(
            [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(self.data_dir),
             "--host-capacity", "256M", "--disk-capacity", "256M", "--grpc", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", "--set", "host.segment=16M",
             "--set", "disk.admission=always", "--set", "log=warn",
             "--set", "server.token=e2e-token", *extra],
            stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        f = dict(w.split("=", 1) for w in line.split() if "=" in w)
        self.socket, self.grpc = f["socket"], f["grpc"]
        self.events = f.get("events")

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
        assert self.p.wait(timeout=120) == 0

    def cli(self, *args):
        out = subprocess.run([str(REPO / "target" / "debug" / "kvtier"), "--addr", self.grpc,
                              "--token", "e2e-token", "--json", *args],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    def conn(self, **kw):
        return {"mode": "sidecar", "socket": self.socket, **kw}


def scramble_data_files(data_dir):
    """Overwrites every block's bytes in kvtierd's disk tier with random ones (the 4 KiB file
    headers stay valid, so the tier opens and its journal still lists the blocks)."""
    files = list(Path(data_dir).glob("**/data-*.kvd"))
    assert files
    for f in files:
        size = f.stat().st_size
        with open(f, "r+b") as fh:
            fh.seek(4096)
            for off in range(4096, size, 1 << 24):
                fh.write(os.urandom(min(1 << 24, size - off)))


def same(a, b):
    assert "error" not in a, a
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["logprobs"], b["logprobs"]):
        assert abs(x - y) < 1e-3, (a["logprobs"], b["logprobs"])


def moved(a, b):
    """The output differs from the reference beyond the comparison's tolerance."""
    return a["tokens"] != b["tokens"] or max(
        abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) > 1e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinyllama")
    subprocess.run([sys.executable, str(HERE / "make_tiny_llama.py"), str(d)], check=True)
    return d


NAMES = ["A", "B", "P0", "P1", "P2", "C", "D", "E", "F"]


@pytest.fixture(scope="module")
def ref(model):
    """Every prompt's output from an engine without any connector."""
    return dict(zip(NAMES, engine(model, [A, B, *P, C, D, E, F])["outputs"]))


def corrupt(block: bytes, other: bytes, how: str) -> bytes:
    """One engine block in kvtier's canonical form: per layer, K then V, tokens, heads."""
    layer = len(block) // LAYERS
    half = layer // 2
    b = bytearray(block)
    if how == "zero":
        b[:] = bytes(len(b))
    elif how == "swap_kv":
        for l in range(LAYERS):
            o = l * layer
            b[o:o + half], b[o + half:o + layer] = block[o + half:o + layer], block[o:o + half]
    elif how == "layer_from_other_block":
        b[layer:2 * layer] = other[layer:2 * layer]
    return bytes(b)


def test_embedded_store_with_a_disk_tier_outlives_the_engine(model, ref, tmp_path):
    """Embedded mode: the store inside the engine process, its disk tier in a directory; a
    fresh engine process finds the blocks there."""
    conn = {"mode": "embedded", "disk_dir": str(tmp_path / "store"), "host_bytes": 64 << 20,
            "disk_bytes": 256 << 20, "segment_bytes": 16 << 20}
    first = engine(model, [A, C, F], conn, in_process=True)["outputs"]
    for out, name in zip(first, "ACF"):
        assert out["num_cached_tokens"] == 0
        same(out, ref[name])
    again = engine(model, [A, B, C, F], conn, in_process=True)["outputs"]
    assert again[0]["num_cached_tokens"] >= len(A) - BS
    same(again[0], ref["A"])
    assert again[1]["num_cached_tokens"] >= BS
    same(again[1], ref["B"])
    assert again[2]["num_cached_tokens"] >= 2 * BS
    same(again[2], ref["C"])
    # The whole prompt is stored: all but its last token come from kvtier.
    assert again[3]["num_cached_tokens"] == len(F) - 1
    same(again[3], ref["F"])
    # Embedded mode with a worker process is refused with a message naming the fix.
    p = subprocess.run(
        [sys.executable, str(HERE / "run_engine.py"),
         json.dumps({"model": str(model), "prompts": [A], "executor": "mp", "connector": conn})],
        capture_output=True, text=True, env=ENV, timeout=900)
    assert p.returncode != 0 and "mode='sidecar'" in p.stdout + p.stderr


def test_vllm_engines_share_kv_through_kvtierd(model, ref, tmp_path):
    from kvtier import Sidecar
    from kvtier.vllm import namespace, prompt_keys

    def keys(prompt):
        return prompt_keys(prompt, model=str(model), block_size=BS, hash_seed=ENV["PYTHONHASHSEED"])

    d = Daemon(tmp_path / "kvtierd")
    try:
        # Saves under preemption: 7 usable blocks, prompts that grow into a 4th block.
        first = engine(model, [A, *P, C, D, E], d.conn(), batch=True, gpu_blocks=8)
        assert first["preemptions"] > 0, first
        for out, name in zip(first["outputs"], ["A", "P0", "P1", "P2", "C", "D", "E"]):
            assert out["num_cached_tokens"] == 0
            same(out, ref[name])
        side = Sidecar(d.socket, "e2e-test")
        for prompt in (A, *P, C, D, E):
            assert side.match_prefix(keys(prompt)) == len(prompt) // BS

        # kvtierd restarted under a running engine: during the outage every lookup is a miss
        # (same output, computed); after it the engine reconnects and hits resume.
        running = PhasedEngine(model, [[B], [F], [P[0]]], d.conn())
        out = running.phase()
        assert out[0]["num_cached_tokens"] >= BS  # B shares a block with A
        same(out[0], ref["B"])
        d.stop()
        running.go()
        out = running.phase()
        assert out[0]["num_cached_tokens"] == 0, "a hit while kvtierd was down"
        same(out[0], ref["F"])
        d.start()
        time.sleep(2.5)  # the engine's next reconnection attempt (backoff at most 2 s)
        running.go()
        out = running.phase()
        assert out[0]["num_cached_tokens"] >= 2 * BS, "no hits after kvtierd came back"
        same(out[0], ref["P0"])
        running.close()
        side = Sidecar(d.socket, "e2e-test")

        # A fresh engine: asynchronous loads, all but the last block from kvtier.
        again = engine(model, [A, B, *P], d.conn(), abort=[E])
        outs = again["outputs"]
        assert again["aborted"] == ["abort-0"]
        assert outs[0]["num_cached_tokens"] >= len(A) - BS
        same(outs[0], ref["A"])
        assert outs[1]["num_cached_tokens"] >= BS  # B shares one block with A
        same(outs[1], ref["B"])
        for i in range(3):  # saved while requests were being preempted
            assert outs[2 + i]["num_cached_tokens"] >= 2 * BS
            same(outs[2 + i], ref[f"P{i}"])
        stats = d.cli("stats")
        assert stats["hits"] > 0
        assert stats["leases"] == 0, "a lease outlived its load (aborted request)"

        # Corrupted inside the store (valid checksums, wrong KV): the output must move.
        ns_enc, _ = namespace(str(model), None, "auto", BS)
        ns = side.register_namespace(ns_enc)
        saved = {k: side.get(k) for prompt in (A, *P, C, D, E) for k in keys(prompt)}
        assert all(v is not None for v in saved.values())
        assert d.cli("clear", str(ns))["removed"] >= len(saved)
        for i, how in enumerate(["zero", "swap_kv", "layer_from_other_block"]):
            k0, k1 = keys(P[i])
            saved[k1] = corrupt(saved[k1], saved[k0], how)
        for k, v in saved.items():
            assert side.put(ns, k, v)
        bad = engine(model, [*P, A], d.conn())["outputs"]
        for i in range(3):
            assert bad[i]["num_cached_tokens"] >= 2 * BS
            assert moved(bad[i], ref[f"P{i}"]), f"corruption {i} went unnoticed"
        same(bad[3], ref["A"])

        # Restart the daemon: the blocks come back from its disk tier (synchronous loads, the
        # engine core and its worker in one process, each side on its own connection).
        del side
        d.stop()
        d.start()
        after = engine(model, [A], d.conn(async_load=False), in_process=True)["outputs"]
        assert after[0]["num_cached_tokens"] >= len(A) - BS
        same(after[0], ref["A"])

        # Preloads on a slow disk (every I/O 5 s, then 300 ms), A's blocks on disk only after a
        # restart.
        # A 50 ms load deadline: the request waits 50 ms in the queue for its preloads, then
        # computes everything (nothing had arrived): no hit, the same output.
        slow = ("--set", "disk.fault_delay_ms=300")
        d.stop()
        # (5 s an I/O here: nothing can have arrived at the 50 ms deadline, however late the
        # engine's scheduler looks.)
        d.start("--set", "disk.fault_delay_ms=5000")
        late = engine(model, [A], d.conn(load_policy="timeout", load_deadline_ms=50))["outputs"]
        assert late[0]["num_cached_tokens"] == 0, late
        same(late[0], ref["A"])
        assert d.cli("stats")["prefetch"]["hinted"] > 0
        # wait_complete: the request waits in the queue until its preloads are in host memory,
        # then loads them from there (no disk read on the critical path).
        d.stop()
        d.start(*slow)
        done = engine(model, [A], d.conn(load_policy="wait_complete"))["outputs"]
        assert done[0]["num_cached_tokens"] >= len(A) - BS
        same(done[0], ref["A"])
        pre = d.cli("stats")["prefetch"]
        assert pre["hinted"] > 0 and pre["in_time"] > 0, pre
        d.stop()
        # Integer hashes, as vLLM publishes them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
        d.start("--set", "events.endpoint=tcp://127.0.0.1:0", "--set", "events.int_hashes=true")

        # Cleared: a miss, and still the same output. A consumer engine (kv_role kv_consumer)
        # stores nothing; C and D are stored again by the next one.
        ns = d.cli("stats")["namespaces"][0]["id"]
        assert d.cli("clear", str(ns))["removed"] > 0
        consumer = engine(model, [A], d.conn(), role="kv_consumer")["outputs"]
        assert consumer[0]["num_cached_tokens"] == 0
        same(consumer[0], ref["A"])
        side = Sidecar(d.socket, "e2e-test")
        assert side.match_prefix(keys(A)) == 0, "a kv_consumer engine saved blocks"
        del side
        # With vLLM's KV events on, the connector's saves surface through vLLM's own publisher
        # (take_events): BlockStored, medium CPU, the engine's hashes and tokens.
        import socket as _socket
        import msgspec
        import zmq
        from vllm.distributed.kv_events import BlockStored, KVEventBatch
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # kvtierd's own publisher ([events]) at the same time.
        daemon_sub = zmq.Context.instance().socket(zmq.SUB)
        daemon_sub.connect(d.events)
        daemon_sub.setsockopt(zmq.SUBSCRIBE, b"")
        cleared = engine(model, [C, D], d.conn(), kv_events=f"tcp://*:{port}")["outputs"]
        for out, name in zip(cleared, "CD"):
            assert out["num_cached_tokens"] == 0
            same(out, ref[name])
        # No prefill rate configured: the engine measured its own from C's prefill step (its
        # worker's timing, through vLLM's worker metadata) and stated it with D's lookup.
        assert d.cli("stats")["break_even_prefill_tokens_per_s"] > 0
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        ours = []
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            ours += [e for e in dec.decode(payload).events
                     if isinstance(e, BlockStored) and e.medium == "CPU"]
        sub.close(linger=0)
        saved_tokens = [tuple(e.token_ids) for e in ours]
        for prompt in (C, D):
            full = tuple(prompt[:len(prompt) // BS * BS])
            assert full in saved_tokens, (full, saved_tokens)
        assert all(len(e.block_hashes) * BS == len(e.token_ids) and e.block_size == BS
                   for e in ours)
        # kvtierd names the blocks the connector saved by vLLM's own block hashes (sent with
        # the commits), so a router indexing vLLM's events matches kvtierd's, evictions
        # included.
        daemon = []
        while daemon_sub.poll(1000):
            _, _, payload = daemon_sub.recv_multipart()
            daemon += [e for e in dec.decode(payload).events if isinstance(e, BlockStored)]
        daemon_sub.close(linger=0)
        vllm_hashes = {h for e in ours for h in e.block_hashes}
        daemon_hashes = {h for e in daemon for h in e.block_hashes}
        assert vllm_hashes and vllm_hashes <= daemon_hashes, (vllm_hashes, daemon_hashes)
        assert all(isinstance(h, int) for h in daemon_hashes)

        # Each block's parent and token ids, as vLLM's own events say them and as kvtierd's
        # do (the connector sends them with its commits): the same, block by block, so an
        # indexer keyed by token hashes (Dynamo's, llm-d's) reads kvtierd's events too.
        def per_block(evs):
            out = {}
            for e in evs:
                if not e.token_ids:
                    continue
                for j, h in enumerate(e.block_hashes):
                    parent = e.parent_block_hash if j == 0 else e.block_hashes[j - 1]
                    out[h] = (parent, tuple(e.token_ids[j * BS:(j + 1) * BS]))
            return out

        theirs, mine = per_block(ours), per_block(e for e in daemon if e.medium == "CPU")
        assert theirs and all(mine.get(h) == v for h, v in theirs.items()), (theirs, mine)
        # Host memory, and the disk tier (admission always) as the blocks are written below;
        # the tokens per block as the engine registered them, after a restart too.
        assert all(e.medium in ("CPU", "STORAGE") and e.block_size == BS for e in daemon), \
            [(e.medium, e.block_size) for e in daemon]
        # The KV-cache group as vLLM's own events name it (the connector registered it with
        # the namespace): group 0, full attention, no window; the connector's own events and
        # kvtierd's alike, a local tier named "kvtier".
        def described(evs):
            return {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
                     e.locality, e.ownership) for e in evs}

        assert described(ours) == described(daemon) == \
            {(0, "full_attention", None, "LOCAL", "kvtier")}

        # Data files corrupted on disk: the index says present, the checksum says no.
        d.stop()
        scramble_data_files(d.data_dir)
        d.start()
        side = Sidecar(d.socket, "e2e-test")
        assert side.match_prefix(keys(C)) == 2 and side.match_prefix(keys(D)) == 2
        rec = engine(model, [C], d.conn(), policy="recompute")["outputs"]
        same(rec[0], ref["C"])
        stats = d.cli("stats")
        disk = next(t for t in stats["tiers"] if t["tier"] == "disk")
        assert disk["checksum_failures"] > 0
        # The corrupt block was dropped, recomputed by the engine and saved again.
        assert side.get(keys(C)[0]) is not None
        # Without preloads (a preload would find the damage first, drop the block and let the
        # request compute it: C above went that way or the load's): the load fails, and vLLM's
        # "fail" policy fails the request.
        fail = engine(model, [D], d.conn(preload=False), policy="fail")["outputs"]
        assert "error" in fail[0], fail
        assert d.cli("stats")["leases"] == 0
        del side
    finally:
        d.stop()


def test_session_hints_retain_then_demote_through_kvtierd(model, ref, tmp_path):
    """kv_transfer_params {"kvtier": {...}} on real requests: a turn that asks for retention
    leaves its prompt's blocks retained under its session in kvtierd once its saves are written
    (and past the engine's exit: a session outlives the engine); a malformed hint is ignored
    (the request is served as without it); the next turn loads them and demotes the session:
    the retention ends and the blocks leave host memory for disk."""
    from kvtier import Sidecar
    from kvtier.vllm import prompt_keys

    d = Daemon(tmp_path / "kvtierd")
    try:
        turn = {"kvtier": {"session": "chat-1", "retain_s": 600, "priority": 3}}
        first = engine(model, [A, F], d.conn(),
                       hints=[turn, {"kvtier": {"retain_s": 600, "sesion": "typo"}}])["outputs"]
        same(first[0], ref["A"])
        same(first[1], ref["F"])
        r = d.cli("stats")["retention"]
        assert (r["retentions"], r["blocks"], r["retains"]) == (1, len(A) // BS, 1), r
        again = engine(model, [A], d.conn(),
                       hints=[{"kvtier": {"session": "chat-1", "demote": True}}])["outputs"]
        assert again[0]["num_cached_tokens"] >= len(A) - BS
        same(again[0], ref["A"])
        r = d.cli("stats")["retention"]
        assert (r["retentions"], r["demotes"]) == (0, 1), r
        keys = prompt_keys(A, model=str(model), block_size=BS, hash_seed=ENV["PYTHONHASHSEED"])
        side = Sidecar(d.socket, "e2e-test")
        deadline = time.time() + 60
        while True:
            n, _, tiers = side.lookup(keys)
            if n == len(keys) and all(t == "disk" for t in tiers):
                break
            # Each lookup is a round trip to the daemon writing them: the loop is paced by it.
            assert time.time() < deadline, f"demoted blocks still at {tiers}"
    finally:
        d.stop()


def test_two_nodes_share_a_prefix_over_the_remote_tier(model, ref, tmp_path):
    """Engine 1 on node A writes; a fresh engine 2 on node B (its own kvtierd, empty local
    tiers) gets the prefixes from A's cluster over the remote tier: same tokens and
    log-probabilities as an engine without any connector."""
    from kvtier import Sidecar
    from kvtier.vllm import prompt_keys

    def keys(prompt):
        return prompt_keys(prompt, model=str(model), block_size=BS, hash_seed=ENV["PYTHONHASHSEED"])

    ports = free_ports(2)
    members = "[" + ",".join(f'"127.0.0.1:{p}"' for p in ports) + "]"
    # (A roomy peer deadline: on a loaded 2-core machine a push or a remote read may take
    # seconds, and one that times out is a miss; the test is about bytes, not speed.)
    nodes = [Daemon(tmp_path / f"node{i}", "--set", f"cluster.listen=127.0.0.1:{p}",
                    "--set", f"cluster.members={members}", "--set", "cluster.secret=e2e",
                    "--set", "cluster.timeout_ms=10000")
             for i, p in enumerate(ports)]
    a, b = nodes
    try:
        first = engine(model, [A, C, F], a.conn())["outputs"]
        for out, name in zip(first, "ACF"):
            assert out["num_cached_tokens"] == 0
            same(out, ref[name])
        # Pushed to their owners in the background: node B sees every full block.
        side = Sidecar(b.socket, "e2e-test")
        deadline = time.time() + 90  # a failed push is tried again 1, 4 and 16 s later
        while not all(side.match_prefix(keys(p)) == len(p) // BS for p in (A, C, F)):
            if time.time() > deadline:
                # What each node did: its pushes (tries, retries, failures), its peers
                # (breakers, failures) and what it holds; the daemons' warnings are on stderr.
                seen = [side.match_prefix(keys(p)) for p in (A, C, F)]
                state = {n: {"stats": d.cli("stats"), "cluster": d.cli("cluster")}
                         for n, d in (("A", a), ("B", b))}
                raise AssertionError(f"node B never saw the prefixes: {seen} of "
                                     f"{[len(p) // BS for p in (A, C, F)]} blocks; {state}")
            time.sleep(0.2)
        # The blocks placement gives B are in its host memory now (pushed); the rest are A's.
        on_b = next(t for t in b.cli("stats")["tiers"] if t["tier"] == "host")["blocks"]
        blocks = len({k for p in (A, C, F) for k in keys(p)})
        del side
        again = engine(model, [A, C, F], b.conn(load_deadline_ms=30000))["outputs"]
        assert again[0]["num_cached_tokens"] >= len(A) - BS
        same(again[0], ref["A"])
        assert again[1]["num_cached_tokens"] >= 2 * BS
        same(again[1], ref["C"])
        assert again[2]["num_cached_tokens"] == len(F) - 1
        same(again[2], ref["F"])
        st = b.cli("stats")
        remote = [t for t in st["tiers"] if t["tier"] == "remote"]
        if on_b < blocks:
            # A's blocks crossed the network when engine 2 asked for them.
            assert remote and remote[0]["bytes_read"] > 0, st["tiers"]
            assert a.cli("cluster")["served_bytes"] > 0
        else:
            # The ports' draw gave B every block (one in 2**blocks): all of them came by push.
            assert b.cli("cluster")["received_bytes"] > 0
    finally:
        for n in nodes:
            n.stop()


def test_layerwise_loads_are_awaited_layer_by_layer(model, ref, tmp_path):
    """`layerwise` with synchronous loads: saves are copied layer by layer as the layers run and
    committed after the pass; a step's loads run layer by layer on a thread while the forward
    pass starts; each layer waits for its own KV (wait_for_layer_load) and runs only after it
    is in. Same tokens and log-probabilities as without kvtier."""
    trace = tmp_path / "layers.jsonl"
    conn = {"mode": "embedded", "disk_dir": str(tmp_path / "store"), "host_bytes": 64 << 20,
            "disk_bytes": 256 << 20, "segment_bytes": 16 << 20, "async_load": False,
            "layerwise": True, "layer_trace": str(trace)}
    first = engine(model, [A, C], conn, in_process=True)["outputs"]
    for out, name in zip(first, "AC"):
        assert out["num_cached_tokens"] == 0
        same(out, ref[name])
    # The saves went layer by layer: each layer copied after it ran (queued by save_kv_layer),
    # every layer of a step before its commit.
    ev = sorted((json.loads(l) for l in trace.read_text().splitlines()), key=lambda e: e["t"])
    commits = [e for e in ev if e["event"] == "committed"]
    saved = [e for e in ev if e["event"] == "saved"]
    assert commits and sum(e["blocks"] for e in commits) >= 4, commits  # A's 2, C's 2+
    assert len(saved) == LAYERS * len(commits), (saved, commits)
    for e in saved:
        before = ev[:ev.index(e)]
        ran = sum(x["event"] == "ran" and x["layer"] == e["layer"] for x in before)
        done = sum(x["event"] == "saved" and x["layer"] == e["layer"] for x in before)
        assert ran > done, ("a layer was saved before it ran", e, before)
    trace.unlink(missing_ok=True)
    again = engine(model, [A, C, B], conn, in_process=True)["outputs"]
    assert again[0]["num_cached_tokens"] >= len(A) - BS
    same(again[0], ref["A"])
    assert again[1]["num_cached_tokens"] >= 2 * BS
    same(again[1], ref["C"])
    assert again[2]["num_cached_tokens"] >= BS  # B shares a block with A
    same(again[2], ref["B"])
    ev = sorted((json.loads(l) for l in trace.read_text().splitlines()), key=lambda e: e["t"])
    waited = [e for e in ev if e["event"] == "waited"]
    # A's and C's first steps loaded KV (B's shared block is in vLLM's own prefix cache by
    # then); each waited for every layer, in order.
    steps = len(waited) // LAYERS
    assert steps >= 2 and [e["layer"] for e in waited] == list(range(LAYERS)) * steps, waited
    for e in waited:
        i = ev.index(e)
        before = [x for x in ev[:i] if x["layer"] == e["layer"]]
        # The layer's KV was in before its wait returned (one more time than it was waited
        # for before)...
        loads = sum(x["event"] == "loaded" for x in before)
        waits = sum(x["event"] == "waited" for x in before)
        assert loads > waits, (e, before)
        # ...and the layer ran after its wait, before the next layer's.
        nxt = next(x for x in ev[i + 1:] if x["event"] == "ran")
        assert nxt["layer"] == e["layer"], (e, nxt)


def test_layerwise_saves_through_kvtierd(model, ref, tmp_path):
    """`layerwise` in sidecar mode (asynchronous loads): the first engine's saves reserve slots
    in kvtierd's arena when a step starts and copy each layer as it runs; a fresh engine loads
    those blocks and computes what it would have computed without kvtier."""
    d = Daemon(tmp_path / "data")
    try:
        trace = tmp_path / "layers.jsonl"
        conn = d.conn(layerwise=True, layer_trace=str(trace))
        first = engine(model, [A, C], conn)["outputs"]
        for out, name in zip(first, "AC"):
            same(out, ref[name])
        ev = [json.loads(l) for l in trace.read_text().splitlines()]
        commits = [e for e in ev if e["event"] == "committed"]
        assert sum(e["blocks"] for e in commits) >= 4, commits
        assert sum(e["event"] == "saved" for e in ev) == LAYERS * len(commits)
        again = engine(model, [A, C], d.conn())["outputs"]
        assert again[0]["num_cached_tokens"] >= len(A) - BS
        assert again[1]["num_cached_tokens"] >= 2 * BS
        for out, name in zip(again, "AC"):
            same(out, ref[name])
    finally:
        d.stop()

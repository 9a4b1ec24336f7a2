"""End to end with the real vLLM engine (CPU build 0.32.0) and a tiny random Llama: a fresh
engine, with nothing in its own prefix cache, loads a prompt's KV from kvtierd and produces the
same greedy tokens and log-probabilities as an engine without any connector; a prompt sharing
only a prefix hits that prefix; after a daemon restart the blocks come from the disk tier; after
clearing the namespace it is a miss with the same output.

Each engine runs in its own process (tests/vllm/run_engine.py). vLLM's CPU platform always runs
its worker in a separate process, so the connector runs in sidecar mode here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BS = 32
A = list(range(1, 71))                      # 70 tokens: 2 full blocks + 6
B = list(range(1, 33)) + list(range(500, 540))  # shares only the first block with A


def engine(model, prompts, connector=None):
    args = {"model": str(model), "prompts": prompts, "executor": "mp"}
    if connector:
        args["connector"] = connector
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run([sys.executable, str(HERE / "run_engine.py"), json.dumps(args)],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


class Daemon:
    def __init__(self, data_dir):
        self.data_dir = data_dir
        self.start()

    def start(self):
        self.p = subprocess.Popen(
            [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(self.data_dir),
             "--host-capacity", "256M", "--disk-capacity", "256M", "--grpc", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", "--set", "host.segment=16M",
             "--set", "disk.admission=always", "--set", "log=warn"],
            stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        f = dict(w.split("=", 1) for w in line.split() if "=" in w)
        self.socket, self.grpc = f["socket"], f["grpc"]

    def stop(self):
        self.p.terminate()
        assert self.p.wait(timeout=120) == 0

    def cli(self, *args):
        out = subprocess.run([str(REPO / "target" / "debug" / "kvtier"), "--addr", self.grpc,
                              "--json", *args], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)


def same(a, b):
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["logprobs"], b["logprobs"]):
        assert abs(x - y) < 1e-3, (a["logprobs"], b["logprobs"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tinyllama")
    subprocess.run([sys.executable, str(HERE / "make_tiny_llama.py"), str(d)], check=True)
    return d


def test_fresh_engine_loads_prompt_kv_from_kvtierd(model, tmp_path):
    base = engine(model, [A, B])
    d = Daemon(tmp_path / "kvtierd")
    try:
        conn = {"mode": "sidecar", "socket": d.socket}
        first = engine(model, [A], conn)
        same(first[0], base[0])
        assert first[0]["num_cached_tokens"] == 0
        # A fresh engine: the whole prompt but the last block comes from kvtier.
        again = engine(model, [A, B], conn)
        assert again[0]["num_cached_tokens"] >= len(A) - BS
        same(again[0], base[0])
        # B shares one block with A: that block is a hit, the rest is computed.
        assert again[1]["num_cached_tokens"] >= BS
        same(again[1], base[1])
        stats = d.cli("stats")
        assert stats["hits"] > 0
        # Restart the daemon: the blocks come back from its disk tier.
        d.stop()
        d.start()
        conn = {"mode": "sidecar", "socket": d.socket}
        after = engine(model, [A], conn)
        assert after[0]["num_cached_tokens"] >= len(A) - BS
        same(after[0], base[0])
        # Cleared: a miss, and still the same output.
        ns = d.cli("stats")["namespaces"][0]["id"]
        assert d.cli("clear", str(ns))["removed"] > 0
        cleared = engine(model, [A], conn)
        assert cleared[0]["num_cached_tokens"] == 0
        same(cleared[0], base[0])
    finally:
        d.stop()

"""A smoke run of bench/serving/run.py (the full run is a benchmark, not a test): vLLM's own
OpenAI server and `vllm bench serve --dataset-name timed_trace` on four requests, vLLM alone
against vLLM with a kvtierd sidecar (host tier only). The fourth request repeats the first's
prefix after two others pushed it out of vLLM's small KV pool: only the kvtier server gets it
back without computing it."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_served_trace_through_vllm_bench_serve_with_and_without_kvtier(tmp_path):
    a, b, c = list(range(0, 30)), list(range(100, 130)), list(range(200, 230))
    reqs = [(0, a), (1000, b), (2000, c), (3000, a + [300])]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 32,
                    "hash_ids": ids}) + "\n" for t, ids in reqs))
    p = subprocess.run(
        [sys.executable, str(REPO / "bench" / "serving" / "run.py"), "--trace", str(trace),
         "--limit", "4", "--speedup", "1", "--prefill-rate", "2000", "--configs",
         "vllm,kvtier-host", "--no-control", "--no-build", "--kvtierd",
         str(REPO / "target" / "debug" / "kvtierd"), "--json"],
        capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["bench"] == "serving" and out["requests"] == 4
    runs = out["runs"]
    alone, kv = runs["reuse vllm"][0], runs["reuse kvtier-host"][0]
    for r in (alone, kv):
        assert (r["completed"], r["failed"]) == (4, 0), r
        # Every prompt token is accounted for: computed, vLLM's cache or the connector.
        assert r["prompt_tokens"] == (r["computed_tokens"] + r["vllm_cache_tokens"]
                                      + r["connector_tokens"]), r
    # The repeated 30-block prefix (960 tokens) came from kvtier, and was not computed again.
    assert alone["connector_tokens"] == 0
    assert kv["connector_tokens"] >= 30 * 32, kv
    assert kv["computed_tokens"] <= alone["computed_tokens"] - 30 * 32, (kv, alone)
    assert kv["kvtier"]["hits"] >= 30, kv
    cases = {r["case"]: r for r in out["results"]}
    assert {"ttft p50 kvtier host vs vllm", "throughput kvtier host vs vllm"} <= set(cases)
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in cases.values()), cases
    # What could not run here says why.
    assert {x["config"] for x in out["not_run"]} >= {"vllm OffloadingConnector", "lmcache"}

"""Time to first token of a queue of vLLM requests whose long prefixes kvtier holds: in host
memory, only on disk, and only on disk with preload hints; and recomputed (no connector).

Run with the vLLM virtualenv's Python (vLLM's CPU build):

    .venv-vllm/bin/python bench/vllm_ttft.py --json [--requests 8] [--prefix 1536]
        [--question 256] [--batch-tokens 512] [--busy 1984] [--rounds 2]

It builds its own random Llama (8 layers, hidden 512: big enough that prefill costs), starts its
own kvtierd (the release build if there is one, else the debug build), saves the prefixes once
(one engine computes them), then per round runs one fresh engine per case, each on the same
queue of requests submitted at once, behind a long prompt of its own (`--busy` tokens) whose
chunked prefill takes the engine's whole token budget (--batch-tokens) for its first steps:
meanwhile vLLM's scheduler does not reach the queue, so without hints a queued request's disk
read starts only when its turn comes. Each request is its prefix and then a question of its own
that every engine computes (`--busy 0 --question 32 --batch-tokens 2048`: no queue, the whole
burst in one step). TTFT is measured for the queued requests. Cases: `host` (prefixes in the
daemon's host memory), `disk` (daemon restarted: disk only, hints off), `disk+hints`
(restarted again: disk only, each request's blocks hinted as it arrives, load_policy
wait_complete), and `recompute` (no connector). Measured engines only
load (kv_role kv_consumer), so every case finds the same blocks. TTFT = first token time -
submit time, per request; every engine's tokens must equal the no-connector engine's. Cases
are interleaved within each round; figures are medians over rounds of each case's p50 / p99.

The last line is {"bench": "vllm-ttft", "results": [{"case", "unit", "value", "baseline",
"ratio"}]}: cases `ttft p50 disk+hints vs host` and `ttft p50 disk vs host` have ratio =
host / case (higher is better; 1 = as fast as host memory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# VLLM_CPU_NUM_OF_RESERVED_CPU: the same cores for every case (the CPU build reserves one more
# core when a KV connector is configured, so on 2 cores the recompute case, without one, ran its
# forward passes on 1 thread and the connector cases on 2; see bench/serving/run.py).
ENV = dict(os.environ, PYTHONHASHSEED="0", VLLM_CPU_KVCACHE_SPACE="2",
           VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
           VLLM_CPU_NUM_OF_RESERVED_CPU="1")
BS = 32


def build_model(out: Path, max_positions: int = 4096) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(1000)}
    vocab.update({"<unk>": 1000, "<s>": 1001, "</s>": 1002})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1003, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=max_positions, initializer_range=0.02,
                      bos_token_id=1001, eos_token_id=1002, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(out)


def child(args: dict) -> None:
    """One engine: submit every prompt at once, step, record each request's first token."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args["model"], dtype="float32", block_size=BS, max_model_len=2048,
              enforce_eager=True, seed=0, prefix_caching_hash_algo="sha256_cbor",
              max_num_batched_tokens=args["batch_tokens"],
              distributed_executor_backend="mp")
    if args.get("connector"):
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role=args.get("role", "kv_both"), kv_connector_extra_config=args["connector"],
            kv_load_failure_policy="recompute")
    llm = LLM(**kw)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    # Warm-up (kernels, first-step costs) on a prompt that shares nothing with the queue, so
    # the figures time loads and prefill, not the engine's first step.
    warm = [1001] + [(7 * i + 3) % 997 for i in range(2 * BS + 5)]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], sp, use_tqdm=False)
    t0 = time.monotonic()
    if args.get("busy"):
        # A long prompt of its own first: while its chunked prefill takes every step's token
        # budget, the scheduler does not reach the queued requests (nor look them up).
        busy = [(11 * j + 5) % 997 for j in range(args["busy"])]
        engine.add_request("busy", TokensPrompt(prompt_token_ids=busy), sp)
    for i, ids in enumerate(args["prompts"]):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids), sp)
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.monotonic() - t0
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens or 0
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    rids = [f"r{i}" for i in range(len(args["prompts"]))]
    print("RESULT " + json.dumps({"ttft": [first[r] for r in rids],
                                  "cached": [cached.get(r, 0) for r in rids],
                                  "tokens": [tokens.get(r, []) for r in rids]}), flush=True)


class Daemon:
    def __init__(self, data_dir: Path):
        rel = REPO / "target" / "release" / "kvtierd"
        self.bin = rel if rel.exists() else REPO / "target" / "debug" / "kvtierd"
        self.data_dir = data_dir
        self.p = None

    def start(self):
        self.p = subprocess.Popen(
            [str(self.bin), "--data-dir", str(self.data_dir), "--host-capacity", "2G",
             "--disk-capacity", "4G", "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
             "--set", "disk.admission=always", "--set", "log=warn"],
            stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        self.socket = next(w[7:] for w in line.split() if w.startswith("socket="))
        self.grpc = next(w[5:] for w in line.split() if w.startswith("grpc="))

    def stats(self) -> dict:
        cli = self.bin.parent / "kvtier"
        out = subprocess.run([str(cli), "--addr", f"http://{self.grpc}", "--json", "stats"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
        return json.loads(out.strip().splitlines()[-1])

    def stop(self):
        self.p.terminate()
        assert self.p.wait(timeout=300) == 0


def engine(model: Path, prompts, batch_tokens: int, connector=None,
           role: str = "kv_consumer", busy: int = 0) -> dict:
    """One engine run; a connector engine only loads (kv_consumer) unless `role` says."""
    args = {"model": str(model), "prompts": prompts, "connector": connector,
            "batch_tokens": batch_tokens, "role": role, "busy": busy}
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)],
                       capture_output=True, text=True, env=ENV, timeout=1800)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(p.stdout[-3000:] + p.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def pct(v, q):
    s = sorted(v)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1536, help="prefix tokens per request")
    ap.add_argument("--question", type=int, default=256,
                    help="tokens of each request's own question (after the prefix)")
    ap.add_argument("--batch-tokens", type=int, default=512,
                    help="the engine's max_num_batched_tokens")
    ap.add_argument("--busy", type=int, default=1984,
                    help="tokens of a prompt of its own submitted first, that keeps the engine "
                         "busy while the queue waits (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    model = tmp / "model"
    build_model(model)
    # Distinct prefixes (whole blocks), each with its own short question.
    prompts = [[(7 * i + 13 * j) % 1000 for j in range(a.prefix)] +
               [(3 * i + 5 * j + 1) % 1000 for j in range(a.question)]
               for i in range(a.requests)]
    assert a.prefix + a.question <= 2048, "--prefix + --question must fit max_model_len 2048"
    d = Daemon(tmp / "kvtierd")
    d.start()
    conn = {"mode": "sidecar", "socket": d.socket}
    try:
        # The prefixes only (and one token, so the last prefix block is full): the questions
        # are computed by every measured engine (which only loads: kv_consumer).
        saving = [p[:a.prefix + 1] for p in prompts]
        saved = engine(model, saving, a.batch_tokens, dict(conn, preload=False), "kv_both")
        print(f"vllm-ttft: {a.requests} prefixes of {a.prefix} tokens saved (TTFT p50 computing "
              f"them {pct(saved['ttft'], 0.5):.2f} s)", file=sys.stderr)
        runs: dict[str, list[dict]] = {c: [] for c in ("host", "disk", "disk+hints",
                                                        "recompute")}
        def case(name, connector=None):
            before = d.stats()["hits"] if connector else 0
            x = engine(model, prompts, a.batch_tokens, connector, busy=a.busy)
            x["hits"] = d.stats()["hits"] - before if connector else 0
            runs[name].append(x)

        for r in range(a.rounds):
            # host: the daemon holds them in host memory (just saved, or just loaded by the
            # previous round's last case); a fresh engine per case.
            case("host", dict(conn, preload=False))
            d.stop()
            d.start()
            conn["socket"] = d.socket
            case("disk", dict(conn, preload=False))
            d.stop()
            d.start()
            conn["socket"] = d.socket
            case("disk+hints", dict(conn, preload=True, load_policy="wait_complete"))
            case("recompute")
            print(f"vllm-ttft: round {r + 1}: " + ", ".join(
                f"{c} p50 {pct(x[-1]['ttft'], 0.5):.3f} s ({x[-1]['hits']} block hits)"
                for c, x in runs.items()), file=sys.stderr)
        blocks = a.requests * (a.prefix // BS)
        ref = runs["recompute"][0]["tokens"]
        for c, xs in runs.items():
            for x in xs:
                assert x["tokens"] == ref, f"{c}: outputs differ from the engine without kvtier"
                if c != "recompute":
                    # Every prefix block loaded from kvtier (lookups may count a block twice).
                    assert x["hits"] >= blocks, (c, x["hits"], blocks)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {c: (statistics.median(pct(x["ttft"], 0.5) for x in xs),
               statistics.median(pct(x["ttft"], 0.99) for x in xs)) for c, xs in runs.items()}
    host50, host99 = med["host"]
    results = []
    for c in ("disk+hints", "disk", "recompute"):
        for q, i in (("p50", 0), ("p99", 1)):
            base = (host50, host99)[i]
            results.append({"case": f"ttft {q} {c} vs host", "unit": "s", "value": med[c][i],
                            "baseline": base, "ratio": base / med[c][i] if med[c][i] else 0.0,
                            "baseline_is": "prefixes in kvtier's host memory"})
    for r in results:
        print(f"{r['case']:<32} {r['value']:8.3f} {r['baseline']:8.3f} {r['ratio']:6.2f}")
    if a.json:
        print(json.dumps({"bench": "vllm-ttft", "results": results}))


if __name__ == "__main__":
    main()

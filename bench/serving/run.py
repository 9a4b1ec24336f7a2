"""Served traffic: vLLM's own OpenAI server and vLLM's own benchmark client (`vllm bench serve
--dataset-name timed_trace`) replay a Mooncake-format trace against vLLM alone and vLLM with
kvtier, on the same requests, configurations interleaved.

    .venv-vllm/bin/python bench/serving/run.py --trace T --json [--limit N] [--speedup X]
        [--configs vllm,kvtier-host,kvtier-disk] [--rounds 1] [--minutes 30] [--report DIR]
        [--connector JSON] [--kvtierd-set KEY=VALUE ...]

T: a Mooncake-format file (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
512-token blocks), or `gen:chat`, `gen:agent`, `gen:docqa` (with parameters, as `kvtier-bench
tracegen --kind` takes them): written out by `kvtier-bench tracegen --format mooncake`.

Scaling to this CPU. The engine is the random Llama of bench/vllm_ttft.py (8 layers, hidden
512, head_dim 64, fp32): one 32-token block of KV is 1 MiB, and the CPU build prefills it at a
rate this run measures first (stated in the output, with the blocks per second kvtier must move
to beat recomputing). Each trace block (512 tokens) becomes one 32-token block
(`--timed-trace-chunk-hash-size 32`): prompt and output lengths are scaled by 32/512 (output at
least 1, at most 32 tokens), so a prefix shared in the trace is shared here block for block.
Timestamps are divided by the speedup: by default the one at which the trace's prompt tokens,
all computed, arrive at `--load` times the measured prefill rate (vLLM alone is then just
saturated: what it saves by reuse shows as queueing it avoids). With no `--limit`, the run takes
the first requests whose prompt tokens fit the `--minutes` budget across every run, and says how
much of the trace that was.

Configurations (each a fresh `vllm serve` with `--prefix-caching-hash-algo sha256_cbor`, a fixed
PYTHONHASHSEED, a KV pool of `--pool-pct` of the working set, `--kv-cache-memory-bytes`):
  vllm         vLLM alone (its own prefix cache);
  kvtier-host  + kvtierd sidecar, host tier twice the working set, no disk tier;
  kvtier-disk  + kvtierd sidecar, host tier `--host-pct` of the working set, a disk tier of twice
               the working set, preloading on (the daemon's and connector's defaults).
  prefix-routed, round-robin (configuration 4, only when named in --configs): two servers, each
               computing on a core of its own with a kvtierd of its own (kvtier-disk's sizes),
               the two kvtierds in one cluster, behind bench/serving/router.py: by prefix (where
               `kvtier.router.score` says the prompt's prefix is cheapest, plus the blocks
               already queued on each server; the blocks the router last sent to a server, up
               to its pool, count as in that server's own cache; a server with more than 4
               requests waiting for a first token beyond the other, and 1.5 times as many,
               gets none until it catches up: the router's balance guard) or round-robin. The
               trace's arrivals come twice as often (two servers' worth of load).
  prefix-no-estimate, prefix-decode, least-work (the same pair, to tell where routing's
               gain comes from): prefix routing without the estimate of each server's own
               cache, or with the decode load added to its cost (router.py --decode-load), and
               routing by queued work alone (every prompt block counted as computed, no kvtier
               lookup).
  prefix-balanced, prefix-inflight: prefix routing with the queued work counted in whole
               prompt blocks (router.py --queue prompt), and with one block more per request in
               flight on a server (--inflight-weight 1).
  prefix-unguarded: prefix routing without the balance guard (router.py --balance-abs 0).
  prefix-lookup: prefix routing that asks the cluster (one Lookup a request) where the prefix
               configurations score from the router's own index of the nodes' block events
               (router.py --admin, kvtier.router.Index): the same costs, with a round trip on
               each request's path.
vllm and kvtier-disk also run on a no-reuse copy of the trace (every block id made unique:
same lengths, same arrivals) as a control, unless `--no-control`.
Not run here, reported with the reason: vLLM's OffloadingConnector and LMCache (both assert
CUDA tensors: `vllm/v1/kv_offload/cpu/gpu_worker.py`).

Figures: TTFT p50/p99 and request throughput from vLLM's result JSON (`--save-result
--save-detailed`), prompt tokens computed / taken from vLLM's prefix cache / from the connector
from vLLM's /metrics (`vllm:prompt_tokens_by_source`), hits and bytes per tier from kvtierd's
/metrics. The last line is {"bench": "serving", "results": [{"case", "unit", "value",
"baseline", "ratio"}], ...}: ratio = value / baseline, value the first configuration named in
the case, baseline the second ("kvtier" is kvtier-disk, the defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from vllm_ttft import build_model  # noqa: E402

PY = Path(sys.executable)
# vLLM's own CLI (see vllm_cli.py for why not the `vllm` script).
VLLM = [str(PY), str(Path(__file__).resolve().parent / "vllm_cli.py")]
BT = 32                 # tokens per vLLM block (the CPU build needs a multiple of 32)
TRACE_BT = 512          # tokens per trace block (Mooncake's; kvtier-bench tracegen's)
BLOCK_BYTES = 8 * 2 * BT * 8 * 64 * 4   # layers x (K, V) x tokens x heads x head_dim x fp32
# VLLM_CPU_NUM_OF_RESERVED_CPU: the CPU build keeps cores out of the worker's OpenMP threads
# for its scheduler process, one more when a KV connector is configured (for NIXL); on 2 cores
# that gives vLLM alone 1 worker thread and vLLM with any connector 2 (the reservation is
# dropped when it would take every core). The same reservation for every configuration: one
# core computes, the other serves the scheduler, kvtierd and the benchmark client.
ENV = dict(os.environ, PYTHONHASHSEED="0", VLLM_LOGGING_LEVEL="WARNING",
           TOKENIZERS_PARALLELISM="false", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
ENV.pop("VLLM_CPU_KVCACHE_SPACE", None)
CONFIGS = ("vllm", "kvtier-host", "kvtier-disk")
# Configuration 4, asked for by name (`--configs prefix-routed,round-robin`): two servers.
PAIR_CONFIGS = ("prefix-routed", "round-robin", "prefix-no-estimate", "prefix-decode",
                "least-work", "prefix-balanced", "prefix-inflight", "prefix-lookup",
                "prefix-unguarded")
# The router's flags per pair configuration beyond its policy.
ROUTER_ARGS = {"prefix-decode": ["--decode-load"],
               "prefix-balanced": ["--queue", "prompt"],
               "prefix-inflight": ["--queue", "prompt", "--inflight-weight", "1"],
               "prefix-unguarded": ["--balance-abs", "0"]}
NOT_RUN = {
    "vllm OffloadingConnector": "asserts CUDA tensors in the CPU build "
    "(vllm/v1/kv_offload/cpu/gpu_worker.py): needs a GPU",
    "lmcache": "LMCacheConnectorV1 moves KV with CUDA kernels: needs a GPU",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def http_post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def samples(text: str) -> dict[str, float]:
    """Prometheus text: sample name with labels -> value (counters' `_total` kept)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def pick(m: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for k, v in m.items():
        base, _, rest = k.partition("{")
        if base != name:
            continue
        if all(f'{lk}="{lv}"' in rest for lk, lv in labels.items()):
            total += v
    return total


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    if not s:
        return math.nan
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# ---- traces ---------------------------------------------------------------------------------

def load_trace(spec: str, tmp: Path, requests: int) -> list[dict]:
    if spec.startswith("gen:"):
        bench = REPO / "target" / "release" / "kvtier-bench"
        if not bench.exists():
            subprocess.run(["cargo", "build", "--release", "--locked", "-p", "kvtier-bench"],
                           cwd=REPO, check=True)
        out = tmp / "generated.jsonl"
        subprocess.run([str(bench), "tracegen", "--kind", spec[4:], "--requests",
                        str(requests), "--out", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
        spec = str(out)
    rows = []
    with open(spec) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append({"timestamp": float(r["timestamp"]),
                             "input_length": int(r["input_length"]),
                             "output_length": int(r["output_length"]),
                             "hash_ids": [int(h) for h in r["hash_ids"]]})
            except (ValueError, KeyError, TypeError) as e:
                sys.exit(f"serving: {spec} line {i + 1}: not a Mooncake request ({e})")
    if not rows:
        sys.exit(f"serving: {spec} holds no request")
    return rows


def scale(r: dict) -> dict:
    """One trace request on this CPU's scale: 512-token blocks become 32-token ones."""
    blocks = len(r["hash_ids"])
    n_in = max(1, min(blocks * BT, round(r["input_length"] * BT / TRACE_BT)))
    n_out = max(1, min(32, round(r["output_length"] * BT / TRACE_BT)))
    return dict(r, input_length=n_in, output_length=n_out)


def no_reuse(reqs: list[dict]) -> list[dict]:
    """The same requests with every block id made unique (nothing shared)."""
    nxt = 1 << 40
    out = []
    for r in reqs:
        ids = list(range(nxt, nxt + len(r["hash_ids"])))
        nxt += len(ids)
        out.append(dict(r, hash_ids=ids))
    return out


def write_trace(reqs: list[dict], speedup: float, path: Path) -> None:
    t0 = reqs[0]["timestamp"]
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(dict(r, timestamp=(r["timestamp"] - t0) / 1000.0 / speedup))
                    + "\n")


def working_set(reqs: list[dict]) -> int:
    return len({h for r in reqs for h in r["hash_ids"]})


# ---- processes ------------------------------------------------------------------------------

def stop_process(p: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout` seconds."""
    p.terminate()
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class Kvtierd:
    def __init__(self, binary: Path, data_dir: Path, host: int, disk: int | None,
                 extra: list[str] = ()):
        shutil.rmtree(data_dir, ignore_errors=True)
        self.data_dir = data_dir
        cmd = [str(binary), "--data-dir", str(data_dir), "--host-capacity", str(host),
               "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--set", "log=warn"]
        cmd += ["--disk-capacity", str(disk)] if disk else ["--set", "disk.enabled=false"]
        cmd += list(extra)
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if not line.startswith("kvtierd ready:"):
            self.p.kill()
            raise RuntimeError(f"kvtierd did not start: {line!r}")
        kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
        self.socket, self.metrics, self.grpc = kv["socket"], kv["metrics"], kv["grpc"]

    def scrape(self) -> dict[str, float]:
        return samples(http_get(f"http://{self.metrics}/metrics"))

    def stop(self) -> None:
        stop_process(self.p, 120)
        # A disk tier of twice the working set per daemon: gone with its run (the next run's
        # preallocation needs the room).
        shutil.rmtree(self.data_dir, ignore_errors=True)


class Server:
    """`vllm serve` of the model, with or without the kvtier connector."""

    def __init__(self, model: Path, max_len: int, pool_bytes: int, log: Path,
                 connector: dict | None, batch_tokens: int, cpus: str | None = None,
                 wait: bool = True):
        self.port = free_port()
        cmd = [*VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--block-size", str(BT), "--max-model-len", str(max_len),
               "--enforce-eager", "--seed", "0", "--prefix-caching-hash-algo", "sha256_cbor",
               "--kv-cache-memory-bytes", str(pool_bytes), "--max-num-batched-tokens",
               str(batch_tokens), "--served-model-name", "tiny"]
        if connector is not None:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": connector,
                "kv_load_failure_policy": "recompute"})]
        self.log_path = log
        self.log = open(log, "w")
        env = ENV if cpus is None else dict(ENV, VLLM_CPU_OMP_THREADS_BIND=cpus)
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 600
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.p.returncode}): see "
                                   f"{self.log_path}")
            try:
                http_get(self.url + "/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"vllm serve not ready in 600 s: see {self.log_path}")
                time.sleep(0.5)  # polling a starting server, deadline above

    def complete(self, ids: list[int], max_tokens: int = 1) -> float:
        t = time.monotonic()
        http_post(self.url + "/v1/completions",
                  {"model": "tiny", "prompt": ids, "max_tokens": max_tokens,
                   "temperature": 0.0, "ignore_eos": True})
        return time.monotonic() - t

    def scrape(self) -> dict[str, float]:
        return samples(http_get(self.url + "/metrics"))

    def stop(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(timeout=120)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait()
        self.log.close()


def warm_prompt(seed: int, n: int) -> list[int]:
    """A prompt that shares nothing with the trace (token ids the trace's sampler also uses,
    in an order it practically never produces)."""
    rng = random.Random(1_000_003 + seed)
    return [rng.randrange(1000) for _ in range(n)]


class RouterProc:
    """bench/serving/router.py in front of the pair of servers."""

    def __init__(self, policy: str, servers: list[Server], daemons: list[Kvtierd],
                 cluster: list[str], model: Path, log: Path, engine_blocks: int,
                 extra: list[str]):
        cmd = [str(PY), str(Path(__file__).resolve().parent / "router.py"), "--policy", policy,
               "--backends", ",".join(s.url for s in servers), "--cluster", ",".join(cluster),
               "--via", daemons[0].grpc, "--model", str(model), "--block-size", str(BT),
               "--engine-blocks", str(engine_blocks), *extra]
        self.log = open(log, "w")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=ENV)
        line = self.p.stdout.readline()
        if not line.startswith("router ready:"):
            self.stop()
            raise RuntimeError(f"the router did not start: {line!r}: see {log}")
        self.url = line.split("url=", 1)[1].strip()

    def stats(self) -> dict:
        return json.loads(http_get(self.url + "/router/stats"))

    def stop(self) -> None:
        stop_process(self.p, 30)
        self.log.close()


PAIR = {"prefix-routed": "prefix", "round-robin": "round-robin", "prefix-no-estimate": "prefix",
        "prefix-decode": "prefix", "least-work": "least-work", "prefix-balanced": "prefix",
        "prefix-inflight": "prefix", "prefix-lookup": "prefix", "prefix-unguarded": "prefix"}


def start_daemons(cfg: str, plan: dict, tmp: Path, tag: str) -> tuple[list[Kvtierd], list[str]]:
    """kvtier-host / kvtier-disk: one kvtierd; a pair configuration: two, in one cluster (the
    kvtier-disk sizes each)."""
    ws = plan["working_set_blocks"] * BLOCK_BYTES
    if cfg == "vllm":
        return [], []
    if cfg == "kvtier-host":
        return [Kvtierd(plan["kvtierd"], tmp / f"kvtierd-{tag}", max(2 * ws, 64 << 20),
                        None, plan["kvtierd_set"])], []
    host = max(int(ws * plan["host_pct"] / 100), 64 << 20)
    disk = max(2 * ws, 256 << 20)
    if cfg == "kvtier-disk":
        return [Kvtierd(plan["kvtierd"], tmp / f"kvtierd-{tag}", host, disk,
                        plan["kvtierd_set"])], []
    ports = [free_port() for _ in range(2)]
    listen = [f"127.0.0.1:{p}" for p in ports]
    members = "[" + ",".join(f'"{a}"' for a in listen) + "]"
    out: list[Kvtierd] = []
    try:
        for i, addr in enumerate(listen):
            out.append(Kvtierd(plan["kvtierd"], tmp / f"kvtierd-{tag}-{i}", host, disk,
                               ["--set", f"cluster.listen={addr}",
                                "--set", f"cluster.members={members}"] + plan["kvtierd_set"]))
    except BaseException:
        for d in out:
            d.stop()
        raise
    return out, listen


def run_one(cfg: str, trace: Path, n: int, plan: dict, tmp: Path, tag: str) -> dict:
    servers: list[Server] = []
    router = None
    daemons, listen = start_daemons(cfg, plan, tmp, tag)
    try:
        pair = cfg in PAIR
        for i in range(2 if pair else 1):
            connector = None
            if daemons:
                connector = dict(plan["connector"], mode="sidecar", socket=daemons[i].socket)
            # A pair: each server computes on a core of its own (the scheduler processes,
            # kvtierd, the router and the client share both); one server: vLLM's default
            # binding under the reservation above (one core).
            servers.append(Server(plan["model"], plan["max_len"], plan["pool_bytes"],
                                  tmp / f"vllm-{tag}-{i}.log", connector, plan["batch_tokens"],
                                  cpus=str(i) if pair else None, wait=False))
        for s in servers:
            s.wait_ready()
        url = servers[0].url
        if pair:
            # The router's estimate of each server's own prefix cache: its KV pool's blocks.
            engine_blocks = 0 if cfg == "prefix-no-estimate" else plan["pool_bytes"] // BLOCK_BYTES
            extra = list(ROUTER_ARGS.get(cfg, []))
            if PAIR[cfg] == "prefix" and cfg != "prefix-lookup":
                # Its own index of the nodes' blocks (each node's snapshot, then its events):
                # complete once the snapshots ended, before the warm-up below.
                extra += ["--admin", ",".join(d.grpc for d in daemons)]
            router = RouterProc(PAIR[cfg], servers, daemons, listen, plan["model"],
                                tmp / f"router-{tag}.log", engine_blocks, extra)
            url = router.url
        for s in servers:
            # Kernels and first-step costs out of the figures: a prompt of its own, twice.
            for i in range(2):
                s.complete(warm_prompt(i, 2 * BT + 5))
        before = [s.scrape() for s in servers]
        kv_before = [d.scrape() for d in daemons]
        out = tmp / f"result-{tag}.json"
        cmd = [*VLLM, "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--model", "tiny", "--tokenizer", str(plan["model"]),
               "--dataset-name", "timed_trace", "--dataset-path", str(trace),
               "--timed-trace-chunk-hash-size", str(BT), "--num-prompts", str(n),
               "--save-result", "--save-detailed", "--result-dir", str(tmp),
               "--result-filename", out.name, "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,99", "--disable-tqdm", "--seed", "0"]
        p = subprocess.run(cmd, env=ENV, capture_output=True, text=True,
                           timeout=plan["run_timeout_s"])
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        res = json.loads(out.read_text())
        after = []
        for i, s in enumerate(servers):
            text = http_get(s.url + "/metrics")
            (tmp / f"metrics-vllm-{tag}-{i}.txt").write_text(text)
            after.append(samples(text))
        kv_after = []
        for i, d in enumerate(daemons):
            text = http_get(f"http://{d.metrics}/metrics")
            (tmp / f"metrics-kvtierd-{tag}-{i}.txt").write_text(text)
            kv_after.append(samples(text))
        routed = router.stats() if router is not None else None
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()
        for d in daemons:
            d.stop()

    def delta(name, **labels):
        return sum(pick(a, name, **labels) - pick(b, name, **labels)
                   for a, b in zip(after, before))

    def kdelta(name, **labels):
        return sum(pick(a, name, **labels) - pick(b, name, **labels)
                   for a, b in zip(kv_after, kv_before))

    ok = [t for t, e in zip(res["ttfts"], res["errors"]) if not e]
    r = {
        "config": cfg,
        "completed": res["completed"],
        "failed": res.get("failed", 0),
        "duration_s": res["duration"],
        "ttfts": ok,
        "ttft_p50_s": pct(ok, 0.5),
        "ttft_p99_s": pct(ok, 0.99),
        "request_throughput": res["request_throughput"],
        "prompt_tokens": delta("vllm:prompt_tokens_total"),
        "computed_tokens": delta("vllm:prompt_tokens_by_source_total", source="local_compute"),
        "vllm_cache_tokens": delta("vllm:prompt_tokens_by_source_total",
                                   source="local_cache_hit"),
        "connector_tokens": delta("vllm:prompt_tokens_by_source_total",
                                  source="external_kv_transfer"),
    }
    if daemons:
        r["kvtier"] = {
            "hits": kdelta("kvtier_hits_total"),
            "misses": kdelta("kvtier_misses_total"),
            "hits_host": kdelta("kvtier_tier_hits_total", tier="host"),
            "hits_disk": kdelta("kvtier_tier_hits_total", tier="disk"),
            "hits_remote": kdelta("kvtier_tier_hits_total", tier="remote"),
            "read_bytes_host": kdelta("kvtier_read_bytes_total", tier="host"),
            "read_bytes_disk": kdelta("kvtier_read_bytes_total", tier="disk"),
            "written_bytes_host": kdelta("kvtier_written_bytes_total", tier="host"),
            "written_bytes_disk": kdelta("kvtier_written_bytes_total", tier="disk"),
            "preloaded_in_time": kdelta("kvtier_prefetch_blocks_total", outcome="in_time"),
        }
    if routed is not None:
        r["router"] = routed
    return r


# ---- the plan -------------------------------------------------------------------------------

def measure_prefill(model: Path, max_len: int, pool_bytes: int, tmp: Path,
                    batch_tokens: int) -> float:
    """Prompt tokens per second vLLM alone prefills here (a 1,024-token prompt, max 1 token
    out, median of three after a warm-up)."""
    s = Server(model, max_len, pool_bytes, tmp / "vllm-calibrate.log", None, batch_tokens)
    try:
        s.complete(warm_prompt(0, 2 * BT + 5))
        n = 1024
        times = [s.complete(warm_prompt(10 + i, n)) for i in range(3)]
    finally:
        s.stop()
    return n / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True,
                    help="a Mooncake-format file, or gen:chat / gen:agent / gen:docqa[:params]")
    ap.add_argument("--limit", type=int, default=0,
                    help="requests from the start of the trace (default: what fits --minutes)")
    ap.add_argument("--speedup", type=float, default=0,
                    help="divide the trace's timestamps by this (default: from --load)")
    ap.add_argument("--load", type=float, default=1.0,
                    help="offered prompt tokens per second over the measured prefill rate, "
                         "for the default speedup")
    ap.add_argument("--minutes", type=float, default=30,
                    help="budget of the whole run, for the default --limit")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"some of {', '.join(CONFIGS + PAIR_CONFIGS)} (the last five: two "
                         "servers, a kvtierd each in one cluster, behind the harness's router)")
    ap.add_argument("--no-control", action="store_true",
                    help="skip the no-reuse control")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--pool-pct", type=float, default=10,
                    help="vLLM's KV pool, percent of the working set")
    ap.add_argument("--host-pct", type=float, default=20,
                    help="kvtier-disk's host tier, percent of the working set")
    ap.add_argument("--batch-tokens", type=int, default=2048,
                    help="vLLM's max_num_batched_tokens")
    ap.add_argument("--prefill-rate", type=float, default=0,
                    help="prompt tokens/s of vLLM here (default: measured first)")
    ap.add_argument("--generate", type=int, default=2000,
                    help="requests to generate for a gen: trace")
    ap.add_argument("--kvtierd", type=Path, default=REPO / "target" / "release" / "kvtierd",
                    help="the daemon (built with cargo when it is the release build and missing)")
    ap.add_argument("--report", type=Path, help="write a markdown table and TTFT CDFs here")
    ap.add_argument("--connector", type=json.loads, default={},
                    help="extra keys of the kvtier connector's config (JSON), e.g. "
                         "'{\"preload\": false}'")
    ap.add_argument("--kvtierd-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvtierd config key for every daemon (its --set), e.g. "
                         "disk.admission=always; repeatable")
    ap.add_argument("--no-build", action="store_true",
                    help="use the kvtier package installed in this interpreter as it is (default: "
                         "build its native code in release mode first)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory (servers' logs, results, traces)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS + PAIR_CONFIGS:
            sys.exit(f"serving: no configuration {c!r}: use some of "
                     f"{', '.join(CONFIGS + PAIR_CONFIGS)}")
    if not a.no_build:
        # The connector's native code (copies and checksums of every save and load) must be the
        # release build: `maturin develop` without --release (the test command's) is many times
        # slower and put the saves' copies on the engine's critical path.
        subprocess.run([str(PY.parent / "maturin"), "develop", "-q", "--release",
                        "--manifest-path", str(REPO / "connector" / "python" / "Cargo.toml")],
                       cwd=REPO, check=True, env=dict(os.environ, VIRTUAL_ENV=str(PY.parent.parent)))
    if not a.kvtierd.exists():
        if a.kvtierd != REPO / "target" / "release" / "kvtierd":
            sys.exit(f"serving: --kvtierd {a.kvtierd} does not exist")
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "kvtierd"], cwd=REPO,
                       check=True)

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-serving-"))
    raw = [scale(r) for r in load_trace(a.trace, tmp, a.generate)]
    longest = max(r["input_length"] + r["output_length"] for r in raw)
    max_len = -(-(longest + BT) // BT) * BT
    model = tmp / "model"
    build_model(model, max_positions=max_len)

    # The pool for calibration: one longest request.
    cal_pool = (max_len // BT + 8) * BLOCK_BYTES
    rate = a.prefill_rate or measure_prefill(model, max_len, cal_pool, tmp, a.batch_tokens)
    traces = ["reuse"] + ([] if a.no_control else ["no-reuse"])
    control_cfgs = [c for c in configs if c in ("vllm", "kvtier-disk")]
    # A pair run costs two servers' start-up.
    runs = a.rounds * (len(configs) + sum(c in PAIR_CONFIGS for c in configs)
                       + (len(control_cfgs) if not a.no_control else 0))
    # Per run: ~60 s of server start and warm-up; the rest replays.
    per_run = max(30.0, (a.minutes * 60 - 60) / max(runs, 1) - 60)
    if a.limit:
        n = min(a.limit, len(raw))
    else:
        budget = a.load * rate * per_run
        n, tokens = 0, 0
        while n < len(raw) and tokens + raw[n]["input_length"] <= budget:
            tokens += raw[n]["input_length"]
            n += 1
        n = max(n, 2)
    reqs = raw[:n]
    tokens = sum(r["input_length"] for r in reqs)
    span_ms = max(reqs[-1]["timestamp"] - reqs[0]["timestamp"], 1.0)
    speedup = a.speedup or max(span_ms / 1000.0 / (tokens / (a.load * rate)), 1e-3)
    ws_blocks = working_set(reqs)
    longest = max(r["input_length"] + r["output_length"] for r in reqs)
    pool_blocks = max(int(ws_blocks * a.pool_pct / 100), max_len // BT + 8)
    plan = {
        "model": model, "max_len": max_len, "kvtierd": a.kvtierd, "host_pct": a.host_pct,
        "working_set_blocks": ws_blocks, "pool_bytes": pool_blocks * BLOCK_BYTES,
        "batch_tokens": a.batch_tokens, "connector": a.connector,
        "kvtierd_set": [x for kv in a.kvtierd_set for x in ("--set", kv)],
        "run_timeout_s": max(600.0, 20 * (span_ms / 1000 / speedup + tokens / rate)),
    }
    files = {"reuse": tmp / "trace.jsonl", "no-reuse": tmp / "trace-no-reuse.jsonl",
             "pair": tmp / "trace-pair.jsonl"}
    write_trace(reqs, speedup, files["reuse"])
    # Two servers compute twice as fast: the pair configurations get the requests twice as
    # often, so each server sees the load one server sees in configurations 1-3.
    write_trace(reqs, 2 * speedup, files["pair"])
    write_trace(no_reuse(reqs), speedup, files["no-reuse"])
    print(f"serving: prefill {rate:,.0f} prompt tokens/s here (vLLM alone, {BT}-token blocks of "
          f"{BLOCK_BYTES >> 20} MiB: kvtier must move {rate / BT:,.0f} blocks/s, "
          f"{rate / BT * BLOCK_BYTES / 1e6:,.0f} MB/s, to beat recomputing); {n} of "
          f"{len(raw)} requests of {a.trace} ({100 * n / len(raw):.1f}%, {tokens:,} prompt "
          f"tokens, {ws_blocks:,} distinct blocks = {ws_blocks * BLOCK_BYTES / 2**30:.2f} GiB), "
          f"speedup {speedup:.2f} ({span_ms / 1000 / speedup:.0f} s of arrivals), vLLM pool "
          f"{pool_blocks} blocks ({100 * pool_blocks / ws_blocks:.0f}% of the working set)",
          file=sys.stderr, flush=True)

    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(a.rounds):
        order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
        for t in traces:
            for c in order:
                if t == "no-reuse" and c not in control_cfgs:
                    continue
                if t == "no-reuse" and c in PAIR_CONFIGS:
                    continue
                path = files["pair"] if c in PAIR_CONFIGS else files[t]
                r = run_one(c, path, n, plan, tmp, f"{t}-{c}-{rnd}")
                results.setdefault((t, c), []).append(r)
                print(f"serving: round {rnd + 1} {t} {c}: {r['completed']} done, "
                      f"{r['failed']} failed, TTFT p50 {r['ttft_p50_s']:.3f} s p99 "
                      f"{r['ttft_p99_s']:.3f} s, {r['request_throughput']:.3f} req/s, "
                      f"computed {r['computed_tokens']:,.0f} of {r['prompt_tokens']:,.0f} "
                      f"prompt tokens (vLLM cache {r['vllm_cache_tokens']:,.0f}, connector "
                      f"{r['connector_tokens']:,.0f})"
                      + (f", kvtier {r['kvtier']}" if "kvtier" in r else "")
                      + (f", router {r['router']}" if "router" in r else ""),
                      file=sys.stderr, flush=True)

    def med(t, c, k):
        return statistics.median(r[k] for r in results[(t, c)])

    rows = []

    def case(name, t, c1, c2, key, unit, higher_better=False):
        if (t, c1) not in results or (t, c2) not in results:
            return
        rounds = [(x[key], y[key]) for x, y in zip(results[(t, c1)], results[(t, c2)])]
        ratios = [v / b if b else math.nan for v, b in rounds]
        rows.append({"case": name, "unit": unit, "value": med(t, c1, key),
                     "baseline": med(t, c2, key), "ratio": statistics.median(ratios),
                     "baseline_is": c2, "higher_is_better": higher_better})

    case("ttft p50 kvtier vs vllm", "reuse", "kvtier-disk", "vllm", "ttft_p50_s", "s")
    case("ttft p99 kvtier vs vllm", "reuse", "kvtier-disk", "vllm", "ttft_p99_s", "s")
    case("throughput kvtier vs vllm", "reuse", "kvtier-disk", "vllm", "request_throughput",
         "req/s", True)
    case("prefill tokens kvtier vs vllm", "reuse", "kvtier-disk", "vllm", "computed_tokens",
         "tokens")
    case("ttft p50 kvtier host vs vllm", "reuse", "kvtier-host", "vllm", "ttft_p50_s", "s")
    case("throughput kvtier host vs vllm", "reuse", "kvtier-host", "vllm",
         "request_throughput", "req/s", True)
    case("ttft p50 kvtier disk vs kvtier host", "reuse", "kvtier-disk", "kvtier-host",
         "ttft_p50_s", "s")
    case("ttft p50 prefix routing vs round-robin", "reuse", "prefix-routed", "round-robin",
         "ttft_p50_s", "s")
    case("ttft p99 prefix routing vs round-robin", "reuse", "prefix-routed", "round-robin",
         "ttft_p99_s", "s")
    case("throughput prefix routing vs round-robin", "reuse", "prefix-routed", "round-robin",
         "request_throughput", "req/s", True)
    case("prefill tokens prefix routing vs round-robin", "reuse", "prefix-routed",
         "round-robin", "computed_tokens", "tokens")
    case("ttft p50 prefix routing without estimate vs round-robin", "reuse",
         "prefix-no-estimate", "round-robin", "ttft_p50_s", "s")
    case("ttft p50 prefix routing with decode load vs round-robin", "reuse",
         "prefix-decode", "round-robin", "ttft_p50_s", "s")
    case("ttft p50 least work vs round-robin", "reuse", "least-work", "round-robin",
         "ttft_p50_s", "s")
    case("ttft p50 prefix routing vs least work", "reuse", "prefix-routed", "least-work",
         "ttft_p50_s", "s")
    case("ttft p50 prefix routing balanced vs round-robin", "reuse", "prefix-balanced",
         "round-robin", "ttft_p50_s", "s")
    case("ttft p50 prefix routing balanced with in-flight vs round-robin", "reuse",
         "prefix-inflight", "round-robin", "ttft_p50_s", "s")
    case("ttft p50 prefix routing without balance guard vs round-robin", "reuse",
         "prefix-unguarded", "round-robin", "ttft_p50_s", "s")
    case("ttft p99 prefix routing without balance guard vs round-robin", "reuse",
         "prefix-unguarded", "round-robin", "ttft_p99_s", "s")
    case("ttft p50 kvtier vs vllm no-reuse", "no-reuse", "kvtier-disk", "vllm", "ttft_p50_s",
         "s")
    case("throughput kvtier vs vllm no-reuse", "no-reuse", "kvtier-disk", "vllm",
         "request_throughput", "req/s", True)
    summary = {
        "bench": "serving",
        "results": rows,
        "trace": a.trace, "requests": n, "trace_requests": len(raw), "speedup": speedup,
        "prefill_tokens_per_s": rate, "working_set_blocks": ws_blocks,
        "pool_blocks": pool_blocks, "rounds": a.rounds,
        "runs": {f"{t} {c}": [{k: v for k, v in r.items() if k != "ttfts"} for r in rs]
                 for (t, c), rs in results.items()},
        "not_run": [{"config": k, "reason": v} for k, v in NOT_RUN.items()],
    }
    if a.report:
        write_report(a.report, summary, results)
    for r in rows:
        print(f"{r['case']:<40} {r['value']:>12.4f} {r['baseline']:>12.4f} {r['ratio']:>8.3f}"
              f"  {r['unit']} / {r['baseline_is']}")
    for k, v in NOT_RUN.items():
        print(f"not run: {k}: {v}")
    if a.json:
        print(json.dumps(summary))
    if a.keep:
        print(f"serving: work directory kept: {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def write_report(out: Path, summary: dict, results: dict) -> None:
    """A markdown table and one TTFT CDF (SVG) per trace, a line per configuration."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Served traffic: {summary['trace']}", "",
             f"{summary['requests']} of {summary['trace_requests']} requests, speedup "
             f"{summary['speedup']:.2f}, prefill {summary['prefill_tokens_per_s']:,.0f} "
             f"tokens/s, working set {summary['working_set_blocks']} blocks, vLLM pool "
             f"{summary['pool_blocks']} blocks.", "",
             "| trace | configuration | TTFT p50 s | TTFT p99 s | req/s | computed tokens | "
             "vLLM cache tokens | connector tokens |", "|---|---|---|---|---|---|---|---|"]
    for (t, c), rs in results.items():
        m = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        lines.append(f"| {t} | {c} | {m('ttft_p50_s'):.3f} | {m('ttft_p99_s'):.3f} | "
                     f"{m('request_throughput'):.3f} | {m('computed_tokens'):,.0f} | "
                     f"{m('vllm_cache_tokens'):,.0f} | {m('connector_tokens'):,.0f} |")
    lines += ["", "| case | value | baseline | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['value']:.4f} {r['unit']} | {r['baseline']:.4f} | "
              f"{r['ratio']:.3f} |" for r in summary["results"]]
    colors = {"vllm": "#444444", "kvtier-host": "#1f77b4", "kvtier-disk": "#d62728",
              "prefix-routed": "#9467bd", "round-robin": "#8c564b",
              "prefix-no-estimate": "#e377c2", "prefix-decode": "#bcbd22",
              "least-work": "#17becf", "prefix-balanced": "#ff7f0e",
              "prefix-inflight": "#2ca02c", "prefix-unguarded": "#7f7f7f"}
    for t in ("reuse", "no-reuse"):
        curves = {c: sorted(x for r in rs for x in r["ttfts"])
                  for (tt, c), rs in results.items() if tt == t}
        if not curves:
            continue
        top = max((v[-1] for v in curves.values() if v), default=1.0) or 1.0
        w, h, pad = 640, 400, 50
        svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
               f'<text x="{pad}" y="20">TTFT CDF, {t} trace (x: 0..{top:.2f} s)</text>',
               f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" '
               'fill="none" stroke="black"/>']
        for i, (c, v) in enumerate(curves.items()):
            pts = " ".join(f"{pad + (w - 2 * pad) * x / top:.1f},"
                           f"{h - pad - (h - 2 * pad) * (j + 1) / len(v):.1f}"
                           for j, x in enumerate(v))
            col = colors.get(c, "#2ca02c")
            svg.append(f'<polyline fill="none" stroke="{col}" points="{pts}"/>')
            svg.append(f'<text x="{w - pad - 120}" y="{pad + 20 + 16 * i}" fill="{col}">{c}'
                       '</text>')
        svg.append("</svg>")
        (out / f"ttft-cdf-{t}.svg").write_text("\n".join(svg))
        lines += ["", f"![TTFT CDF, {t}](ttft-cdf-{t}.svg)"]
    (out / "serving.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

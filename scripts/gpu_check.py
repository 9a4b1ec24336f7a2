"""kvtier's HBM path on a real GPU, with torch (no vLLM needed): run by `scripts/gpu-check.sh run`
after it installed the kvtier wheel built here.

For vLLM's paged layouts, bf16, 16-token blocks: FlashAttention (2, blocks, 16, H, D) and
FlashInfer (blocks, 2, 16, H, D) shaped as Llama-3-8B (32 layers, 8 KV heads, head dim 128), and
MLA (blocks, 16, 576) shaped as DeepSeek-V3 (61 layers):
- saves 4,096 tokens (256 blocks) layer by layer from HBM into kvtier's arena (registered with
  the driver: DMA, no staging), each layer after an event on torch's stream, and loads them layer
  by layer into a second set of tensors at other block ids: byte-exact (torch.equal per block);
- byte-exact against the CPU path both ways: the GPU save loaded by the CPU path into host
  tensors, and a CPU save loaded by the GPU path;
- ordering: a save's copies wait for the engine's event (bytes written on torch's stream behind
  a long GPU sleep are the ones stored) and a block is committed only after its copies completed
  (nothing visible before the finish, and what is stored is those bytes); a load's layer event
  holds back what torch's stream queues after waiting on it (a copy of the layer queued right
  after the wait sees the loaded bytes);
- times the save's copies (D2H) and the load's (H2D, the slots' checksums verified on the host
  while the copies run: what engines use) against torch copying the same bytes between the GPU
  and pinned host memory in the same run (goal on the Llama-shaped cases: >= 0.8 x); beside:
  the load with the slots verified before any copy is queued (the copies then run alone: the
  DMA's own rate), so the verification's share is stated; and the Llama-shaped
  FlashAttention case again with 8 copy threads (the default: the cores less one in 8, at
  most 16);
- overlap: 32 layer loads while a fake per-layer compute (matmuls sized to about one layer's
  copy time) waits on each layer's event on torch's stream; total time against
  max(compute alone, copies alone) (goal: <= 1.1 x);
- with KVTIERD naming a kvtierd binary: the same save, load and timing through a kvtierd's shared
  arena (registered by the engine process).
Prints one JSON object as its last line, as `kvtier-bench --json` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

from kvtier._native import Cuda, PagedKv, Sidecar, Store, engine_key, namespace_fingerprint

BS, TOKENS = 16, 4096
BLOCKS = TOKENS // BS  # 256 saved
NB = 2 * BLOCKS + 8  # room for the loads at other ids
REPS = 5
KINDS = {
    # name: (layers, shape, roles, goal applies)
    "flash_attn": (32, (2, NB, BS, 8, 128), ["kv", "blocks", "tokens", "inner", "inner"], True),
    "flashinfer": (32, (NB, 2, BS, 8, 128), ["blocks", "kv", "tokens", "inner", "inner"], True),
    "mla": (61, (NB, BS, 576), ["blocks", "tokens", "inner"], False),
}


def spec(t: torch.Tensor, roles: list[str]):
    return (t.data_ptr(), list(t.shape), list(t.stride()), roles, t.element_size())


def block(t: torch.Tensor, kind: str, b: int) -> torch.Tensor:
    return t[:, b] if kind == "flash_attn" else t[b]


def timed(fn, reps=REPS) -> float:
    """Best wall time of fn() over reps (each ends synchronized)."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


class Case:
    """One layout's tensors, a store (embedded or a kvtierd's) and its namespace."""

    def __init__(self, kind: str, store, cuda: Cuda, label: str):
        self.kind, self.store, self.cuda, self.label = kind, store, cuda, label
        dev = torch.device("cuda", 0)
        self.layers, shape, self.roles, self.goal = KINDS[kind]
        self.src = [torch.randn(shape, dtype=torch.bfloat16, device=dev)
                    for _ in range(self.layers)]
        self.dst = [torch.zeros(shape, dtype=torch.bfloat16, device=dev)
                    for _ in range(self.layers)]
        self.ps = PagedKv([spec(t, self.roles) for t in self.src], device="cuda")
        self.pd = PagedKv([spec(t, self.roles) for t in self.dst], device="cuda")
        self.nbytes = BLOCKS * self.ps.block_bytes
        enc, self.fp = namespace_fingerprint(model=f"gpu-check/{kind}", dtype="bfloat16",
                                             layout="vllm-v1/" + kind, block_tokens=BS)
        self.ns = store.register_namespace(enc)
        self.stream = torch.cuda.current_stream(dev).cuda_stream
        self.ids = list(range(BLOCKS))
        self.into = [BLOCKS + 8 + i for i in range(BLOCKS)]
        self.round = 0
        self.phases: dict[str, float] = {}
        self.failures: list[str] = []

    def keys(self, tag: int | None = None):
        r = self.round if tag is None else tag
        return [engine_key(self.fp, r.to_bytes(8, "little") + i.to_bytes(24, "little"))
                for i in range(BLOCKS)]

    def save(self):
        self.round += 1  # fresh keys each round: every round stores (and copies) every block
        s = self.store.begin_layer_save(self.ns, self.ps, self.keys(), [[b] for b in self.ids])
        t0 = time.perf_counter()
        for layer in range(self.layers):
            self.store.save_layer_cuda(s, self.cuda, self.ps, layer, self.cuda.record_on(self.stream))
        self.cuda.synchronize()
        self.phases["save_copies"] = time.perf_counter() - t0  # the DMA, queued and done
        n = self.store.finish_layer_save_cuda(s, self.cuda, self.ps)  # checksums, commit
        assert n == BLOCKS, f"{self.label}: {n} of {BLOCKS} stored"

    def load(self, verify="beside"):
        first = []

        def on_layer(layer, n, ev):
            if not first:
                first.append(time.perf_counter())
            ev.wait_on(self.stream)
        n = self.store.load_layerwise_cuda(self.cuda, self.pd, self.keys(),
                                           [[b] for b in self.into], on_layer,
                                           verify=verify)
        self.phases["load_copies"] = time.perf_counter() - first[0]
        assert n == BLOCKS, f"{self.label}: {n} of {BLOCKS} loaded"

    def differing(self) -> int:
        torch.cuda.synchronize()
        return sum(not torch.equal(block(s_, self.kind, a), block(d_, self.kind, b))
                   for s_, d_ in zip(self.src, self.dst) for a, b in zip(self.ids, self.into))


def against_cpu_path(c: Case, failures: list) -> None:
    """The GPU save read back by the CPU path, and a CPU save loaded by the GPU path."""
    src_cpu = [t.cpu() for t in c.src]
    got_cpu = [torch.zeros_like(t) for t in src_cpu]
    pcpu = PagedKv([spec(t, c.roles) for t in got_cpu])
    n = c.store.load(pcpu, c.keys(), [[b] for b in c.ids])
    bad = sum(not torch.equal(block(s_, c.kind, b), block(g, c.kind, b))
              for s_, g in zip(src_cpu, got_cpu) for b in c.ids)
    if n != BLOCKS or bad:
        failures.append(f"{c.label}: the CPU path read {n} of the GPU save's blocks, {bad} "
                        "layer-blocks differ")
    # A CPU save (other keys) loaded into the GPU tensors.
    psrc = PagedKv([spec(t, c.roles) for t in src_cpu])
    keys = c.keys(1 << 40)
    stored = c.store.save(c.ns, psrc, keys, [[b] for b in c.ids])
    for t in c.dst:
        t.zero_()
    n2 = c.store.load_layerwise_cuda(c.cuda, c.pd, keys, [[b] for b in c.into],
                                     lambda layer, n, ev: ev.wait_on(c.stream))
    bad2 = c.differing()
    if stored != BLOCKS or n2 != BLOCKS or bad2:
        failures.append(f"{c.label}: CPU save {stored}, GPU load {n2} of {BLOCKS}, {bad2} "
                        "layer-blocks differ")
    print(f"{c.label}: byte-exact against the CPU path: "
          f"{'yes' if not (bad or bad2) and n == n2 == BLOCKS else 'NO'}", flush=True)


def ordering(c: Case, failures: list) -> None:
    """A load's layer event holds back what the engine's stream queues after waiting on it;
    saves wait for the engine's event and commit only after their copies completed."""
    # Loads: a copy of each layer queued on torch's stream right after waiting on its event
    # (the last round's 256 blocks: the callbacks come within a millisecond, the DMA takes
    # several, so a wait that did not hold would let the copies read zeros).
    for t in c.dst:
        t.zero_()
    torch.cuda.synchronize()
    seen = []

    def on_layer(layer, n, ev):
        ev.wait_on(c.stream)
        seen.append(c.dst[layer].clone())  # queued on torch's stream, after the wait
    c.store.load_layerwise_cuda(c.cuda, c.pd, c.keys(), [[b] for b in c.into], on_layer)
    torch.cuda.synchronize()
    early = sum(not torch.equal(block(seen[layer], c.kind, b), block(c.src[layer], c.kind, a))
                for layer in range(c.layers) for a, b in zip(c.ids, c.into))
    del seen
    # Saves: the engine writes the blocks behind a long GPU sleep; the event follows the writes.
    blocks = list(range(8))
    keys = c.keys(1 << 41)[:len(blocks)]
    s = c.store.begin_layer_save(c.ns, c.ps, keys, [[b] for b in blocks])
    torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz
    for layer, t in enumerate(c.src):
        for b in blocks:
            block(t, c.kind, b).fill_(float(layer % 7 + b + 1))
    ev = c.cuda.record_on(c.stream)
    for layer in range(c.layers):
        c.store.save_layer_cuda(s, c.cuda, c.ps, layer, ev)
    visible = c.store.match_prefix(keys)
    n = c.store.finish_layer_save_cuda(s, c.cuda, c.ps)
    cpu = [t.cpu() for t in c.src]  # kept alive while `want` reads them
    want = PagedKv([spec(t, c.roles) for t in cpu])
    wrong = sum(c.store.get(k) != want.gather([b]) for k, b in zip(keys, blocks))
    if visible or n != len(blocks) or wrong or early:
        failures.append(f"{c.label}: ordering: {early} layer-blocks read by the engine's stream "
                        f"before their load completed; {visible} blocks visible before the "
                        f"save's finish, {n} stored, {wrong} differ from the bytes written "
                        "before the event")
    print(f"{c.label}: ordering: read early {early}; visible before finish {visible}, "
          f"stored {n}, wrong {wrong}", flush=True)


def measure(c: Case, results: list) -> dict:
    dev = torch.device("cuda", 0)
    flat_dev = torch.empty(c.nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(c.nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = timed(lambda: flat_host.copy_(flat_dev, non_blocking=True))
    h2d = timed(lambda: flat_dev.copy_(flat_host, non_blocking=True))
    del flat_dev, flat_host
    g = lambda s: gbps(c.nbytes, s)  # noqa: E731

    def best_phase(fn, key):
        """(best end-to-end time, best copy-phase time) over REPS rounds."""
        ends, copies = [], []
        for _ in range(REPS):
            ends.append(timed(fn, reps=1))
            copies.append(c.phases[key])
        return min(ends), min(copies)

    t_save, c_save = best_phase(c.save, "save_copies")
    t_load, c_load = best_phase(c.load, "load_copies")
    # Verified first: the copies run alone after the hashing (the DMA's own rate), and the
    # verification's share of the whole.
    t_first, c_alone = best_phase(lambda: c.load(verify="first"), "load_copies")
    bad = c.differing()  # the last load
    if bad:
        c.failures.append(f"{c.label}: {bad} layer-blocks differ after a load")
    # The goals are on the copies (DMA between HBM and the arena against torch's own pinned
    # copies, the slots verified while they run: what engines use); end to end adds the
    # save's commit checksums, reported beside, as is the load verified first.
    for case, t, base, gl in ((f"{c.label}/save_d2h", c_save, d2h, c.goal),
                              (f"{c.label}/load_h2d", c_load, h2d, c.goal),
                              (f"{c.label}/load_h2d_alone", c_alone, h2d, False),
                              (f"{c.label}/save_end_to_end", t_save, d2h, False),
                              (f"{c.label}/load_end_to_end", t_load, h2d, False),
                              (f"{c.label}/load_end_to_end_verify_first", t_first, h2d, False)):
        results.append({"case": case, "unit": "GB/s", "value": g(t), "baseline": g(base),
                        "ratio": base / t, "goal": gl})
    print(f"{c.label}: {c.nbytes / 2**20:.0f} MiB; save copies {g(c_save):.1f} GB/s, end to end "
          f"{g(t_save):.1f} (torch D2H {g(d2h):.1f}); load copies {g(c_load):.1f}, end to end "
          f"{g(t_load):.1f}, verified first {g(t_first):.1f}; copies alone {g(c_alone):.1f} "
          f"(torch H2D {g(h2d):.1f}); verification's share of the load: "
          f"{max(0.0, 1 - c_alone / t_load):.0%} beside the copies, "
          f"{max(0.0, 1 - c_alone / t_first):.0%} first", flush=True)
    return {"c_load": c_load, "t_load": t_load}


def overlap(c: Case, c_load: float, results: list) -> None:
    dev = torch.device("cuda", 0)
    n_mm = 1
    a = torch.randn(2048, 2048, dtype=torch.bfloat16, device=dev)
    per_layer_copy = c_load / c.layers
    while timed(lambda: [a @ a for _ in range(n_mm)], reps=3) < per_layer_copy and n_mm < 512:
        n_mm *= 2

    def compute_only():
        for _ in range(c.layers):
            for _ in range(n_mm):
                a @ a

    def overlapped():
        # As vLLM's forward pass after start_load_kv: the loads queue each layer's copies on
        # a thread of their own; the "layers" run on torch's stream, each after its event.
        events, out = [], {}

        def loader():
            out["n"] = c.store.load_layerwise_cuda(c.cuda, c.pd, c.keys(),
                                                   [[b] for b in c.into],
                                                   lambda layer, n, ev: events.append(ev))

        th = threading.Thread(target=loader)
        th.start()
        for layer in range(c.layers):
            while len(events) <= layer and th.is_alive():
                time.sleep(0)
            if layer < len(events):
                events[layer].wait_on(c.stream)
            for _ in range(n_mm):
                a @ a
        th.join()
        assert out.get("n") == BLOCKS

    t_compute = timed(compute_only, reps=3)
    t_both = timed(overlapped, reps=3)
    bound = max(t_compute, c_load)
    results.append({"case": f"{c.label}/layerwise_overlap", "unit": "s", "value": t_both,
                    "baseline": bound, "ratio": t_both / bound, "goal": True})
    print(f"{c.label}: overlap {t_both * 1e3:.1f} ms vs max(compute {t_compute * 1e3:.1f}, "
          f"copy {c_load * 1e3:.1f}) ms", flush=True)


def run(kind: str, store, cuda: Cuda, label: str, results: list, failures: list,
        full: bool, goals: bool = True) -> None:
    c = Case(kind, store, cuda, label)
    c.goal = c.goal and goals
    # Correctness first (the first round also touches the arena's pages).
    c.save()
    c.load()
    bad = c.differing()
    if bad:
        failures.append(f"{label}: {bad} layer-blocks differ after save and load")
    print(f"{label}: GPU save and load {'byte-exact' if not bad else 'DIFFER'}", flush=True)
    if full:
        against_cpu_path(c, failures)
    m = measure(c, results)
    failures += c.failures
    if full and kind == "flash_attn":
        ordering(c, failures)
        overlap(c, m["c_load"], results)
    del c
    torch.cuda.empty_cache()


def start_kvtierd(binary: str, data: str):
    p = subprocess.Popen([binary, "--data-dir", data, "--host-capacity", "3G",
                          "--set", "disk.enabled=false", "--grpc", "127.0.0.1:0",
                          "--metrics", "127.0.0.1:0", "--set", "log=warn"],
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    f = dict(w.split("=", 1) for w in line.split() if "=" in w)
    if "socket" not in f:
        p.kill()
        raise RuntimeError(f"kvtierd did not start: {line!r}")
    return p, f["socket"]


def main() -> int:
    if not torch.cuda.is_available() or not Cuda.driver_present():
        print("SKIPPED: no GPU")
        print(json.dumps({"bench": "gpu-check", "results": []}))
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"{os.cpu_count()} cores", flush=True)
    results, failures = [], []
    cuda = Cuda(0)
    for kind in KINDS:
        # Copy threads: the cores less one in 8 (at most 16) hash the blocks (commit checksums,
        # load checks).
        store = Store(4 << 30, segment_bytes=64 << 20)
        pinned = store.pin_for_cuda(cuda)
        print(f"{kind}: embedded arena registered with the driver: {pinned}", flush=True)
        if not pinned:
            failures.append(f"{kind}: the embedded arena could not be registered")
        try:
            run(kind, store, cuda, kind, results, failures, full=True)
        except Exception as e:  # noqa: BLE001 - reported, the other layouts still run
            failures.append(f"{kind}: {type(e).__name__}: {e}")
        del store
    # The host's hashing (the save's commit checksums, the load's verification) on 8 threads.
    store = Store(4 << 30, segment_bytes=64 << 20, copy_threads=8)
    store.pin_for_cuda(cuda)
    try:
        run("flash_attn", store, cuda, "flash_attn/8-threads", results, failures, full=False,
            goals=False)  # a comparison: no goal
    except Exception as e:  # noqa: BLE001
        failures.append(f"flash_attn/8-threads: {type(e).__name__}: {e}")
    del store
    binary = os.environ.get("KVTIERD")
    if binary:
        with tempfile.TemporaryDirectory() as data:
            p, socket = start_kvtierd(binary, data)
            try:
                sc = Sidecar(socket, client="gpu-check")
                pinned = sc.pin_for_cuda(cuda)
                print(f"kvtierd: shared arena registered with the driver: {pinned}", flush=True)
                if not pinned:
                    failures.append("kvtierd: the shared arena could not be registered")
                run("flash_attn", sc, cuda, "kvtierd/flash_attn", results, failures, full=False)
            except Exception as e:  # noqa: BLE001
                failures.append(f"kvtierd: {type(e).__name__}: {e}")
            finally:
                p.terminate()
                rc = p.wait(timeout=60)
                if rc != 0:
                    failures.append(f"kvtierd exited {rc}")
    else:
        print("kvtierd: KVTIERD not set, the shared arena is not checked")
    for r in results:
        if not r.pop("goal"):
            continue
        goal = 1.1 if r["case"].endswith("overlap") else 0.8
        ok = r["ratio"] <= goal if r["case"].endswith("overlap") else r["ratio"] >= goal
        if not ok:
            failures.append(f"{r['case']}: ratio {r['ratio']:.2f} misses the goal {goal}")
    for f in failures:
        print("FAILED:", f)
    print(json.dumps({"bench": "gpu-check", "results": results}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

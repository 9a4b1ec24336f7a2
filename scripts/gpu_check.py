"""kvtier's HBM path on a real GPU, with torch (no vLLM needed): run by `scripts/gpu-check.sh run`
after it installed the kvtier wheel built here.

For each of vLLM's two paged layouts (FlashAttention: (2, blocks, 16, H, D); FlashInfer:
(blocks, 2, 16, H, D)), bf16, 32 layers, 16-token blocks:
- saves 4,096 tokens (256 blocks) layer by layer from HBM into kvtier's arena (registered with
  the driver: DMA, no staging), each layer after an event on torch's stream, and loads them layer
  by layer into a second set of tensors at other block ids: byte-exact (torch.equal per block);
- times the save's copies (D2H) and the load's (H2D) against torch copying the same bytes
  between the GPU and pinned host memory in the same run (goal: >= 0.8 x), and reports both
  end to end beside (the host's checksums added: commit, and verification before a load);
- overlap: 32 layer loads while a fake per-layer compute (matmuls sized to about one layer's
  copy time) waits on each layer's event on torch's stream; total time against
  max(compute alone, copies alone) (goal: <= 1.1 x).
Prints one JSON object as its last line, as `kvtier-bench --json` does."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from kvtier._native import Cuda, PagedKv, Store, engine_key, namespace_fingerprint

LAYERS, BS, H, D, TOKENS = 32, 16, 8, 128, 4096
BLOCKS = TOKENS // BS  # 256 saved
NB = 2 * BLOCKS + 8  # room for the loads at other ids
REPS = 5


def spec(t: torch.Tensor, roles: list[str]):
    return (t.data_ptr(), list(t.shape), list(t.stride()), roles, t.element_size())


def layout(kind: str):
    if kind == "flash_attn":
        shape, roles = (2, NB, BS, H, D), ["kv", "blocks", "tokens", "inner", "inner"]
    else:
        shape, roles = (NB, 2, BS, H, D), ["blocks", "kv", "tokens", "inner", "inner"]
    return shape, roles


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


def run(kind: str, results: list, failures: list) -> None:
    dev = torch.device("cuda", 0)
    shape, roles = layout(kind)
    src = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    ps = PagedKv([spec(t, roles) for t in src], device="cuda")
    pd = PagedKv([spec(t, roles) for t in dst], device="cuda")
    nbytes = BLOCKS * ps.block_bytes
    cuda = Cuda(0)
    # Copy threads: the cores (at most 8) hash the blocks (commit checksums, load checks).
    store = Store(4 * nbytes + (256 << 20), segment_bytes=64 << 20)
    pinned = store.pin_for_cuda(cuda)
    if not pinned:
        failures.append(f"{kind}: the arena could not be registered")
    enc, fp = namespace_fingerprint(model=f"gpu-check/{kind}", dtype="bfloat16",
                                    layout="vllm-v1/kv-token-head-dim", block_tokens=BS)
    ns = store.register_namespace(enc)
    stream = torch.cuda.current_stream(dev).cuda_stream
    ids = list(range(BLOCKS))
    into = [BLOCKS + 8 + i for i in range(BLOCKS)]
    rnd = [0]

    def keys():
        return [engine_key(fp, rnd[0].to_bytes(8, "little") + i.to_bytes(24, "little"))
                for i in range(BLOCKS)]

    phases = {}

    def save():
        rnd[0] += 1  # fresh keys each round: every round stores (and copies) every block
        s = store.begin_layer_save(ns, ps, keys(), [[b] for b in ids])
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            store.save_layer_cuda(s, cuda, ps, layer, cuda.record_on(stream))
        cuda.synchronize()
        phases["save_copies"] = time.perf_counter() - t0  # the DMA, queued and done
        assert store.finish_layer_save_cuda(s, cuda, ps) == BLOCKS  # checksums, commit

    def load():
        first = []

        def on_layer(layer, n, ev):
            if not first:
                first.append(time.perf_counter())  # every block verified, layer 0 queued
            ev.wait_on(stream)
        n = store.load_layerwise_cuda(cuda, pd, keys(), [[b] for b in into], on_layer)
        phases["load_copies"] = time.perf_counter() - first[0]
        assert n == BLOCKS, n

    # Correctness first (the first round also touches the arena's pages).
    save()
    load()
    torch.cuda.synchronize()
    bad = sum(not torch.equal(block(s_, kind, a), block(d_, kind, b))
              for s_, d_ in zip(src, dst) for a, b in zip(ids, into))
    if bad:
        failures.append(f"{kind}: {bad} layer-blocks differ after save and load")
    # The baseline: torch moving the same bytes between HBM and pinned host memory.
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = timed(lambda: flat_host.copy_(flat_dev, non_blocking=True))
    h2d = timed(lambda: flat_dev.copy_(flat_host, non_blocking=True))
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731

    def best_phase(fn, key):
        """(best end-to-end time, best copy-phase time) over REPS rounds."""
        ends, copies = [], []
        for _ in range(REPS):
            ends.append(timed(fn, reps=1))
            copies.append(phases[key])
        return min(ends), min(copies)

    t_save, c_save = best_phase(save, "save_copies")
    t_load, c_load = best_phase(load, "load_copies")
    # The goals are on the copies (DMA between HBM and the arena against torch's own pinned
    # copies); end to end adds the host's checksums (commit; verification before the first
    # byte reaches the GPU), reported beside.
    for case, t, base in ((f"{kind}/save_d2h", c_save, d2h), (f"{kind}/load_h2d", c_load, h2d),
                          (f"{kind}/save_end_to_end", t_save, d2h),
                          (f"{kind}/load_end_to_end", t_load, h2d)):
        results.append({"case": case, "unit": "GB/s", "value": gbps(t), "baseline": gbps(base),
                        "ratio": base / t})
    # Overlap: a fake per-layer compute on torch's stream, each layer after its load's event.
    n_mm = 1
    a = torch.randn(2048, 2048, dtype=torch.bfloat16, device=dev)
    per_layer_copy = c_load / LAYERS
    while timed(lambda: [a @ a for _ in range(n_mm)], reps=3) < per_layer_copy and n_mm < 512:
        n_mm *= 2

    def compute_only():
        for _ in range(LAYERS):
            for _ in range(n_mm):
                a @ a

    def overlapped():
        # As vLLM's forward pass after start_load_kv: the loads queue each layer's copies on
        # a thread of their own; the "layers" run on torch's stream, each after its event.
        events, out = [], {}

        def loader():
            out["n"] = store.load_layerwise_cuda(cuda, pd, keys(), [[b] for b in into],
                                                 lambda layer, n, ev: events.append(ev))

        th = threading.Thread(target=loader)
        th.start()
        for layer in range(LAYERS):
            while len(events) <= layer and th.is_alive():
                time.sleep(0)
            if layer < len(events):
                events[layer].wait_on(stream)
            for _ in range(n_mm):
                a @ a
        th.join()
        assert out.get("n") == BLOCKS

    t_compute = timed(compute_only, reps=3)
    t_both = timed(overlapped, reps=3)
    bound = max(t_compute, t_load)
    results.append({"case": f"{kind}/layerwise_overlap", "unit": "s", "value": t_both,
                    "baseline": bound, "ratio": t_both / bound})
    print(f"{kind}: save copies {gbps(c_save):.1f} GB/s, end to end {gbps(t_save):.1f} (torch D2H "
          f"{gbps(d2h):.1f}); load copies {gbps(c_load):.1f}, end to end {gbps(t_load):.1f} "
          f"(torch H2D {gbps(h2d):.1f}); overlap {t_both * 1e3:.1f} ms "
          f"vs max(compute {t_compute * 1e3:.1f}, copy {t_load * 1e3:.1f}) ms; "
          f"arena pinned: {pinned}; {'byte-exact' if not bad else 'DIFFERS'}", flush=True)


def main() -> int:
    if not torch.cuda.is_available() or not Cuda.driver_present():
        print("SKIPPED: no GPU")
        print(json.dumps({"bench": "gpu-check", "results": []}))
        return 1
    results, failures = [], []
    for kind in ("flash_attn", "flashinfer"):
        run(kind, results, failures)
    for r in results:
        if r["case"].endswith("end_to_end"):
            continue  # reported, no goal
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

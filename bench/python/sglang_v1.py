"""SGLang's v1 HiCache calls through kvtier, against torch copies of the same bytes.

batch_set_v1 / batch_get_v1 move whole pages between SGLang's own host pool
(MHATokenToKVPoolHost, page_first: a page is its K and V segments) and kvtier, embedded and
through kvtierd, with 1 and 2 copy threads (copy_threads). The baseline, measured in the same
round, is torch's copy of the same number of bytes between two aligned tensors with
torch.set_num_threads at the same count. Rounds interleave baseline and kvtier.

    .venv-vllm/bin/python bench/python/sglang_v1.py --json [--threads 1,2] [--rounds 5]

The last line is {"bench": "sglang-v1", "results": [{"case", "unit", "value", "baseline",
"ratio", ...}]} like every kvtier-bench subcommand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# torch's OpenMP threads otherwise spin for a while after each torch copy (the baseline), taking
# the cores kvtier's copy threads need in the same round: an artefact of interleaving on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def host_pool(pages, page, layers, heads, dim):
    kv = MHATokenToKVPool(pages * page, page, torch.bfloat16, heads, dim, layers, "cpu", False,
                          start_layer=0, end_layer=layers)
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, page, "page_first",
        device_capacity_tokens=kv.size, start_layer=0, end_layer=layers,
        write_back_staging=kv.hicache_write_back_staging, pin_memory=False)


def backend(extra, name):
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=name,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.sglang",
                      "class_name": "KvtierHiCache", "interface_v1": 1, **extra})
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def aligned(nbytes):
    t = torch.empty(nbytes + 4096, dtype=torch.uint8)
    off = (-t.data_ptr()) % 4096
    return t[off:off + nbytes]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=8, help="pages per call")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kvtierd", default=str(REPO / "target" / "release" / "kvtierd"))
    ap.add_argument("--embedded-only", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    pool = host_pool(2 * a.pages, a.page_tokens, a.layers, a.heads, a.head_dim)
    pool.kv_buffer.normal_()  # touched once, before any timing
    page_bytes = 2 * a.page_tokens * a.layers * a.heads * a.head_dim * 2
    nbytes = a.pages * page_bytes
    print(f"sglang-v1: {a.pages} pages of {page_bytes >> 20} MiB per call "
          f"({nbytes >> 20} MiB)", file=sys.stderr)
    src, dst = aligned(nbytes), aligned(nbytes)
    src.random_(0, 255)
    dst.zero_()
    ps = a.page_tokens
    idx_from = torch.arange(0, a.pages * ps, dtype=torch.int64)
    idx_to = torch.arange(a.pages * ps, 2 * a.pages * ps, dtype=torch.int64)

    modes = [("embedded", {"mode": "embedded", "host_bytes": 2 * nbytes + (64 << 20),
                           "segment_bytes": 64 << 20})]
    daemon = None
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-sglang-bench-")
    if not a.embedded_only:
        # Fresh keys every round (no removal over the engine socket): room for all of them.
        cap = nbytes * (a.rounds + 2) * len(threads) + (64 << 20)
        daemon = subprocess.Popen(
            [a.kvtierd, "--data-dir", tmp.name, "--no-disk", "--host-capacity", str(cap),
             "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--set", "host.segment=64M",
             "--set", "log=warn"],
            stdout=subprocess.PIPE, text=True)
        line = daemon.stdout.readline()
        f = dict(w.split("=", 1) for w in line.split() if "=" in w)
        modes.append(("kvtierd", {"mode": "sidecar", "socket": f["socket"]}))

    results = []
    gen = 0
    try:
        for t in threads:
            for mode, extra in modes:
                b = backend(dict(extra, copy_threads=t), f"bench/{mode}/{t}")
                b.register_mem_pool_host(pool)
                sets, gets = [], []
                for r in range(a.rounds + 1):
                    gen += 1
                    keys = [f"{gen:032x}{i:032x}" for i in range(a.pages)]
                    torch.set_num_threads(t)
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    base = nbytes / (time.perf_counter() - t0) / 1e9
                    t0 = time.perf_counter()
                    ok = b.batch_set_v1(keys, idx_from)
                    s_bw = nbytes / (time.perf_counter() - t0) / 1e9
                    assert ok == [True] * a.pages, ok
                    t0 = time.perf_counter()
                    ok = b.batch_get_v1(keys, idx_to)
                    g_bw = nbytes / (time.perf_counter() - t0) / 1e9
                    assert ok == [True] * a.pages, ok
                    if r == 0:
                        for i in range(a.pages):
                            assert torch.equal(pool.get_data_page(i * ps),
                                               pool.get_data_page((a.pages + i) * ps))
                    else:
                        sets.append((s_bw, base))
                        gets.append((g_bw, base))
                    if mode == "embedded":
                        b._store.clear_namespace(b._ns)
                suffix = "" if t == 1 else f" x{t}t"
                for what, rows in (("batch_set_v1", sets), ("batch_get_v1", gets)):
                    ratios = [v / base for v, base in rows]
                    results.append({
                        "case": f"{what} {a.pages}x{page_bytes >> 20}MiB, {mode}{suffix}",
                        "unit": "GB/s",
                        "value": statistics.median(v for v, _ in rows),
                        "baseline": statistics.median(base for _, base in rows),
                        "ratio": statistics.median(ratios),
                        "ratio_spread": [min(ratios), max(ratios)],
                        "baseline_is": f"torch copy, {t} thread(s)",
                    })
    finally:
        if daemon:
            daemon.terminate()
            daemon.wait(timeout=60)
    for r in results:
        print(f"{r['case']:<44} {r['value']:8.2f} {r['baseline']:8.2f} {r['ratio']:6.2f} "
              f"({r['ratio_spread'][0]:.2f}..{r['ratio_spread'][1]:.2f})")
    if a.json:
        print(json.dumps({"bench": "sglang-v1", "results": results}))


if __name__ == "__main__":
    main()

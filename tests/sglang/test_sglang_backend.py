"""kvtier.sglang.KvtierHiCache against the real sglang package (0.5.23): built by SGLang's own
backend factory from `--hicache-storage-backend dynamic`, subclass of its HiCacheStorage, and
exercised with CPU tensors through set, get, batch_set, batch_get, exists, batch_exists and the
index-addressed v1 variants (each page copied once, between the host pool's buffers and the
store), embedded and through kvtierd. The v1 tests use SGLang's own host pools
(MHATokenToKVPoolHost in every layout, MLATokenToKVPoolHost), built on CPU from a CPU device
pool as SGLang's cache controller builds them."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvtier.sglang import KvtierHiCache

REPO = Path(__file__).resolve().parents[2]
PAGE = (2, 4, 64, 2, 64)  # layers, K/V, page tokens, heads, head dim: one flat page
DT = torch.bfloat16


def config(extra, tp_rank=0, tp_size=1, mla=False, model="tiny/llama"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.sglang",
                      "class_name": "KvtierHiCache", "dtype": "bfloat16", **extra})


def page(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(PAGE, generator=g).to(DT).flatten()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvtierd")
    p = subprocess.Popen(
        [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(d), "--no-disk",
         "--host-capacity", "64M", "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
         "--set", "host.segment=16M", "--set", "log=warn"], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    f = dict(w.split("=", 1) for w in line.split() if "=" in w)
    yield f["socket"]
    p.terminate()
    assert p.wait(timeout=60) == 0


@pytest.fixture(params=["embedded", "sidecar"])
def extra(request, daemon):
    if request.param == "embedded":
        return {"mode": "embedded", "host_bytes": 64 << 20, "segment_bytes": 16 << 20}
    return {"mode": "sidecar", "socket": daemon}


def make(extra, **kw):
    b = StorageBackendFactory.create_backend("dynamic", config(extra, **kw), None)
    assert isinstance(b, KvtierHiCache) and isinstance(b, HiCacheStorage)
    return b


def test_batch_exists_counts_repeated_keys_as_sent(extra, request):
    """SGLang counts consecutive existing keys from the first, as it sent them: a page asked
    twice counts twice (the store walks distinct keys, and used to stop at the repeat)."""
    b = make(extra, model=f"m/{request.node.name}")
    k0, k1, k2 = (f"{i:064x}" for i in (0xA0, 0xA1, 0xA2))
    assert b.batch_set([k0, k1], [page(1), page(2)])
    assert b.batch_exists([k0, k0, k1, k1]) == 4
    assert b.batch_exists([k0] * 200) == 200
    assert b.batch_exists([k0, k2, k0]) == 1
    assert b.batch_exists([k0, k1, k0, k2, k1]) == 3
    held = HiCacheStorageExtraInfo(prefix_keys=[k0])
    assert b.batch_exists([k1, k1], held) == 2
    assert b.batch_exists([k0, k1], held) == 2


def test_set_get_exists(extra, request):
    b = make(extra, model=f"m/{request.node.name}")
    keys = [f"{i:064x}" for i in range(1, 6)]
    vals = [page(i) for i in range(5)]
    assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
    assert b.get(keys[0], torch.empty_like(vals[0])) is None
    assert b.set(keys[0], vals[0])
    assert b.exists(keys[0])
    out = torch.zeros_like(vals[0])
    assert b.get(keys[0], out) is out and torch.equal(out, vals[0])
    # batch_set skips a gap; batch_exists counts leading keys only.
    assert b.batch_set([keys[1], keys[3]], [vals[1], vals[3]])
    assert b.batch_exists(keys) == 2
    assert b.set(keys[2], vals[2])
    assert b.batch_exists(keys) == 4
    outs = [torch.zeros_like(v) for v in vals]
    got = b.batch_get(keys, outs)
    assert [g is not None for g in got] == [True, True, True, True, False]
    for i in range(4):
        assert torch.equal(outs[i], vals[i])
    # Set again: already present, still True, bytes unchanged.
    assert b.set(keys[0], page(99))
    assert b.get(keys[0], out) is out and torch.equal(out, vals[0])
    # A buffer of another size is a miss, never a partial copy.
    small = torch.zeros(vals[0].numel() // 2, dtype=DT)
    assert b.get(keys[1], small) is None and not small.any()


def test_namespaces_keep_ranks_and_models_apart(extra, request):
    name = f"m/{request.node.name}"
    r0 = make(extra, model=name, tp_rank=0, tp_size=2)
    r1 = make(extra, model=name, tp_rank=1, tp_size=2)
    other = make(extra, model=name + "-other", tp_rank=0, tp_size=2)
    k = "ab" * 32
    assert r0.set(k, page(1))
    assert r0.exists(k) and not r1.exists(k) and not other.exists(k)
    # MLA: one copy shared by all ranks; only the writer rank stores it (through kvtierd: an
    # embedded store is per process, and refused for MLA with TP > 1).
    if extra["mode"] == "embedded":
        return
    m0 = make(extra, model=name + "-mla", mla=True, tp_rank=0, tp_size=2)
    m1 = make(extra, model=name + "-mla", mla=True, tp_rank=1, tp_size=2)
    assert m1.set(k, page(2)) and not m1.exists(k)
    assert m0.set(k, page(2)) and m1.exists(k)
    out = torch.empty_like(page(2))
    assert m1.get(k, out) is out and torch.equal(out, page(2))


PS = 4  # tokens per page of the host pools below


def mha_pool(layout, tokens=32, layers=2, heads=2, dim=64, dtype=DT):
    """SGLang's MHA host pool (2x the device pool), as HiCacheController builds it."""
    kv = MHATokenToKVPool(tokens, PS, dtype, heads, dim, layers, "cpu", False,
                          start_layer=0, end_layer=layers)
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, PS, layout,
        device_capacity_tokens=kv.size, start_layer=0, end_layer=layers,
        write_back_staging=kv.hicache_write_back_staging, pin_memory=False)


def mla_pool(layout, tokens=32, layers=2):
    kv = MLATokenToKVPool(tokens, PS, DT, 32, 16, layers, "cpu", False, 0, layers)
    return MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2, 0, PS, layout, pin_memory=False,
        device_capacity_tokens=kv.size, start_layer=0, end_layer=layers,
        target_layer_num=layers)


def fill(pool, page_no, seed):
    """Writes a random page through SGLang's own generic accessor; returns its flat bytes."""
    data = torch.randn(pool.get_dummy_flat_data_page().numel(),
                       generator=torch.Generator().manual_seed(seed)).to(pool.dtype)
    pool.set_from_flat_data_page(page_no * PS, data)
    return data


def slots(first_page, pages):
    return torch.arange(first_page * PS, (first_page + pages) * PS, dtype=torch.int64)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct",
                                    "page_head", "mla-layer_first", "mla-page_first"])
def test_v1_by_host_indices_one_copy_into_the_pool(extra, request, layout):
    name = f"m/{request.node.name}"
    mla = layout.startswith("mla-")
    pool = mla_pool(layout[4:]) if mla else mha_pool(layout)
    b = make(dict(extra, interface_v1=1), model=name, mla=mla)
    b.register_mem_pool_host(pool)
    vals = [fill(pool, i, 10 + i) for i in range(3)]
    keys = [f"{i:064x}" for i in range(100, 103)]
    assert b.batch_set_v1(keys, slots(0, 3)) == [True, True, True]
    assert b.batch_exists(keys) == 3
    # Read them back into pages 4..6 (plus one missing key).
    assert b.batch_get_v1(keys + ["ff" * 32], slots(4, 4)) == [True, True, True, False]
    for i in range(3):
        assert torch.equal(pool.get_data_page((4 + i) * PS), vals[i])
    assert not pool.get_data_page(7 * PS).any()
    # The generic path lays pages out otherwise: it does not see v1 pages.
    assert make(extra, model=name, mla=mla).batch_exists(keys) == 0
    assert b.batch_set_v1([], slots(0, 0)) == [] and b.batch_get_v1([], slots(0, 0)) == []


def test_pools_of_other_layouts_never_share_pages(extra, request):
    """Two engines that differ only in host layout (or an engine restarted with another
    --hicache-mem-layout against the same kvtierd) must never read each other's pages as hits:
    a miss, never other bytes."""
    name = f"m/{request.node.name}"
    layouts = ["layer_first", "page_first", "page_first_direct", "page_head"]
    for v1 in (1, 0):
        for wl in layouts:
            w = make(dict(extra, interface_v1=v1), model=name)
            wpool = mha_pool(wl)
            w.register_mem_pool_host(wpool)
            key = f"{v1}{wl}".encode().hex().ljust(64, "0")
            fill(wpool, 0, 7)
            if v1:
                assert w.batch_set_v1([key], slots(0, 1)) == [True]
            else:
                assert w.set(key, wpool.get_data_page(0))
            for rl in layouts:
                r = make(dict(extra, interface_v1=v1), model=name)
                rpool = mha_pool(rl)
                r.register_mem_pool_host(rpool)
                want = rl == wl
                assert r.batch_exists([key]) == int(want), (v1, wl, rl)
                if v1:
                    assert r.batch_get_v1([key], slots(1, 1)) == [want], (wl, rl)
                    if want:
                        assert torch.equal(rpool.get_data_page(PS), wpool.get_data_page(0))
                    else:
                        assert not rpool.get_data_page(PS).any()


def test_host_indices_are_checked_before_any_copy(extra, request):
    b = make(dict(extra, interface_v1=1), model=f"m/{request.node.name}")
    pool = mha_pool("page_first")
    b.register_mem_pool_host(pool)
    pages = pool.size // PS
    keys = [f"{i:064x}" for i in range(200, 204)]
    for i in range(4):
        fill(pool, i, i)
    # 4 keys with 2 pages of indices: refused whole, nothing stored (not half pages).
    with pytest.raises(ValueError, match="host indices"):
        b.batch_set_v1(keys, slots(0, 2))
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, slots(0, 4)) == [True] * 4
    with pytest.raises(ValueError, match="host indices"):
        b.batch_get_v1(keys, slots(0, 3))
    # Out-of-range pages (one past the end, far away, negative): refused, nothing touched.
    before = pool.kv_buffer.clone()
    for idx in (slots(pages, 1), slots(1 << 24, 1), slots(-1, 1)):
        with pytest.raises(ValueError, match="outside"):
            b.batch_get_v1(keys[:1], idx)
        with pytest.raises(ValueError, match="outside"):
            b.batch_set_v1(["ee" * 32], idx)
    assert torch.equal(pool.kv_buffer, before)
    assert b.batch_exists(["ee" * 32]) == 0
    # The Rust side refuses segments outside the registered pool even if Python's check is
    # bypassed (an index SGLang's pointer arithmetic put past the end).
    ptrs, sizes = pool.get_page_buffer_meta(slots(0, 1))
    end = pool.kv_buffer.data_ptr() + pool.kv_buffer.numel() * pool.kv_buffer.element_size()
    with pytest.raises(ValueError, match="outside the registered host pool"):
        b._store.read_pages([b._key(keys[0])], [[(end, sizes[0])]], b._pool_regions)
    with pytest.raises(ValueError, match="outside the registered host pool"):
        b._store.write_pages(b._ns, [b._key(keys[0])], [[(ptrs[0] - 64, sizes[0])]],
                             b._pool_regions)
    assert torch.equal(pool.kv_buffer, before)
    # None keys name the argument; an empty batch is an empty answer.
    with pytest.raises(ValueError, match="None"):
        b.batch_set_v1([None], slots(0, 1))
    with pytest.raises(ValueError, match="None"):
        b.batch_get([None], [page(0)])
    assert b.batch_exists([None]) == 0  # never raises


def test_bad_input_is_a_clear_error(extra):
    b = make(extra)
    with pytest.raises(ValueError, match="target_location"):
        b.get("00" * 32)
    with pytest.raises(ValueError, match="one value per key"):
        b.batch_set(["a", "b"], [page(0)])
    t = torch.zeros(64, dtype=torch.uint8)
    for segs, why in [([], "none given"), ([(t.data_ptr(), 64), (t.data_ptr() + 32, 8)],
                                            "overlaps"), ([(0, 8)], "address")]:
        with pytest.raises(ValueError, match=why):
            b._store.read_pages([b._key("00" * 32)], [segs])
    # Two pages sharing memory (copied from several threads at once): refused.
    with pytest.raises(ValueError, match="overlaps"):
        b._store.read_pages([b._key("00" * 32), b._key("01" * 32)],
                            [[(t.data_ptr(), 64)], [(t.data_ptr() + 32, 32)]])
    if extra["mode"] == "sidecar":
        with pytest.raises(ValueError, match="socket"):
            make({"mode": "sidecar"})
        # MLA with TP > 1 through kvtierd: rank 1 reads what rank 0 wrote.
        w = make(extra, tp_rank=0, tp_size=2, mla=True, model="m/mla-tp2")
        r = make(extra, tp_rank=1, tp_size=2, mla=True, model="m/mla-tp2")
        assert w.set("cd" * 32, page(3)) and r.exists("cd" * 32)
    else:
        # Embedded, MLA with TP > 1: only rank 0 writes in SGLang, so per-process stores
        # would never hit; refused, naming the fix.
        with pytest.raises(ValueError, match="mode='sidecar'"):
            make(extra, tp_rank=1, tp_size=2, mla=True)
        make(extra, tp_rank=0, tp_size=1, mla=True)


def test_kvtierd_restart_under_a_running_engine_is_misses_then_hits(tmp_path):
    """A rolling upgrade of kvtierd: while it is away every call is a miss (exists 0, get None,
    set False, v1 all False), nothing raises; when it is back the backend reconnects by itself
    and the pages it flushed to disk at SIGTERM hit again."""
    def start():
        p = subprocess.Popen(
            [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(tmp_path),
             "--host-capacity", "64M", "--disk-capacity", "128M", "--grpc", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", "--set", "host.segment=16M", "--set",
             "disk.admission=always", "--set", "log=warn"], stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        return p, dict(w.split("=", 1) for w in line.split() if "=" in w)["socket"]

    p, sock = start()
    extra = {"mode": "sidecar", "socket": sock}
    b = make(extra, model="m/restart")
    v1 = make(dict(extra, interface_v1=1), model="m/restart")
    pool = mha_pool("page_first")
    v1.register_mem_pool_host(pool)
    keys = [f"{i:064x}" for i in range(300, 304)]
    vals = [page(i) for i in range(4)]
    assert b.batch_set(keys, vals)
    assert b.batch_exists(keys) == 4
    p.terminate()
    assert p.wait(timeout=60) == 0
    # Away: misses, not exceptions.
    assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
    assert b.get(keys[0], torch.empty_like(vals[0])) is None
    assert b.batch_get(keys, [torch.empty_like(v) for v in vals]) == [None] * 4
    assert not b.set("aa" * 32, vals[0])
    assert v1.batch_set_v1(["bb" * 32], slots(0, 1)) == [False]
    assert v1.batch_get_v1(keys[:1], slots(1, 1)) == [False]
    st = b._store.connection_stats()
    assert st["outages"] == 1 and st["missed_calls"] >= 4 and st["reconnects"] == 0, st
    # Back (same socket path): within the reconnection backoff (at most 2 s), hits again.
    p, sock2 = start()
    try:
        assert sock2 == sock
        deadline = time.monotonic() + 10
        while b.batch_exists(keys) < 4:
            assert time.monotonic() < deadline, b._store.connection_stats()
            time.sleep(0.1)
        out = torch.zeros_like(vals[2])
        assert b.get(keys[2], out) is out and torch.equal(out, vals[2])
        assert b._store.connection_stats()["reconnects"] == 1
        # Nothing was stored while it was away.
        assert not b.exists("aa" * 32)
        assert v1.batch_set_v1(["bb" * 32], slots(0, 1)) == [True]
    finally:
        p.terminate()
        assert p.wait(timeout=60) == 0


def test_pages_continuing_a_prefix_sglang_holds_are_kept_on_disk(tmp_path):
    """With SGLang's hicache_storage_pass_prefix_keys, batch_exists learns which pages continue
    a prefix (SGLang asks only beyond its own hit): seen-twice disk admission keeps them when
    host memory evicts them, the first time. Pages asked without a prefix, or after a prefix
    kvtier does not hold, are one-offs: evicted, never written. (Seen-twice from the first
    page: by default it admits every page while the disk has room.)"""
    p = subprocess.Popen(
        [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(tmp_path),
         "--host-capacity", "32M", "--disk-capacity", "128M", "--grpc", "127.0.0.1:0",
         "--metrics", "127.0.0.1:0", "--set", "host.segment=16M", "--set", "log=warn",
         "--set", "disk.admit_all_below=0"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        sock = dict(w.split("=", 1) for w in line.split() if "=" in w)["socket"]
        b = make({"mode": "sidecar", "socket": sock}, model="m/continuations")
        key = lambda i: f"{i:064x}"  # noqa: E731
        prefix, cont, alone, orphan = key(1), [key(2), key(3)], [key(4), key(5)], [key(6)]
        assert b.batch_set([prefix], [page(1)])
        held = HiCacheStorageExtraInfo(prefix_keys=[key(100), prefix])
        assert b.batch_exists(cont, held) == 0
        assert b.batch_exists(alone) == 0
        assert b.batch_exists(orphan, HiCacheStorageExtraInfo(prefix_keys=[key(99)])) == 0
        new = cont + alone + orphan
        assert b.batch_set(new, [page(i) for i in range(2, 7)])
        # One-off pages, twice the host tier: everything above leaves host memory.
        flood = [key(1000 + i) for i in range(512)]
        filler = list(torch.ones(64, page(7).numel(), dtype=DT).unbind(0))
        for i in range(0, len(flood), 64):
            assert b.batch_set(flood[i:i + 64], filler)
        kept = [b.exists(k) for k in new]
        assert kept == [True, True, False, False, False], kept
        # Counted from the first page asked for, with or without a held prefix kvtier has.
        assert b.batch_exists(cont, held) == 2
        assert b.batch_exists(cont, HiCacheStorageExtraInfo(prefix_keys=[key(99)])) == 2
        out = torch.zeros_like(page(2))
        assert b.get(cont[1], out) is out and torch.equal(out, page(3))
    finally:
        p.terminate()
        assert p.wait(timeout=60) == 0


def test_batch_exists_brings_disk_pages_to_host_memory_before_batch_get(tmp_path):
    """SGLang calls batch_exists when a request joins the waiting queue: the hit pages found
    only on disk are read into host memory then (a preload), so the batch_get that follows
    reads host memory only: no disk read during it."""
    p = subprocess.Popen(
        [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(tmp_path),
         "--host-capacity", "32M", "--disk-capacity", "128M", "--grpc", "127.0.0.1:0",
         "--metrics", "127.0.0.1:0", "--set", "host.segment=16M",
         "--set", "disk.admission=always", "--set", "log=warn",
         # (A full host tier of dirty pages: a save waits for the writer to make room, which
         # a busy disk may take longer than the default 5 s to do.)
         "--set", "server.load_wait_ms=60000"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        f = dict(w.split("=", 1) for w in line.split() if "=" in w)

        def disk_bytes_read():
            out = subprocess.run([str(REPO / "target" / "debug" / "kvtier"), "--addr", f["grpc"],
                                  "--json", "stats"], capture_output=True, text=True, check=True)
            tiers = json.loads(out.stdout)["tiers"]
            return next(t["bytes_read"] for t in tiers if t["tier"] == "disk")

        b = make({"mode": "sidecar", "socket": f["socket"]}, model="m/preload")
        key = lambda i: f"{i:064x}"  # noqa: E731
        hit = [key(i) for i in range(1, 5)]
        assert b.batch_set(hit, [page(i) for i in range(1, 5)])
        # One-off pages, twice the host tier: the hit leaves host memory for the disk.
        filler = list(torch.ones(64, page(0).numel(), dtype=DT).unbind(0))
        for i in range(0, 512, 64):
            assert b.batch_set([key(1000 + j) for j in range(i, i + 64)], filler)
        before = disk_bytes_read()
        page_bytes = page(0).numel() * page(0).element_size()
        assert b.batch_exists(hit) == 4
        deadline = time.monotonic() + 20
        while disk_bytes_read() < before + 4 * page_bytes:
            assert time.monotonic() < deadline, "the preload never read the pages"
            time.sleep(0.02)
        read = disk_bytes_read()
        assert read == before + 4 * page_bytes, "each page read once, all four were on disk"
        out = [torch.zeros_like(page(0)) for _ in hit]
        got = b.batch_get(hit, out)
        assert all(g is o for g, o in zip(got, out))
        assert all(torch.equal(o, page(i)) for o, i in zip(out, range(1, 5)))
        assert disk_bytes_read() == read, "batch_get read the disk: the preload was not used"
    finally:
        p.terminate()
        assert p.wait(timeout=60) == 0


def test_retain_and_demote_hints_answer(extra, request, tmp_path):
    """SGLang's Retain/Demote requests, programmatic: the stored prefix of pages retained under a
    session (a TTL past the bound shortened, and said so), pages saved with a session id in
    SGLang's extra info retained when retain_s is set, a demote ending it; bad input refused."""
    b = make(dict(extra, retain_s=600, retain_priority=2, interface_v1=1),
             model=f"m/{request.node.name}")
    keys = [f"{i:064x}" for i in range(0x300, 0x304)]
    assert b.batch_set(keys, [page(i) for i in range(4)])
    r = b.retain(keys + [f"{0x999:064x}"], session="s1", ttl_s=7200, priority=1)
    assert (r["present"], r["retained"], r["refused"]) == (4, 4, ""), r
    assert r["clipped_by"] == ["preload.max_retain_ms"] and r["ttl_ms"] == 3_600_000
    # The session's pages are released by its demote (no disk tier here: kept in host).
    d = b.demote(session="s1")
    assert (d["released"], d["kept"]) == (4, 4), d
    assert b.demote(session="s1")["released"] == 0
    with pytest.raises(ValueError, match="priority"):
        b.retain(keys, priority=300)
    # Saved through the v1 path with a session: retained under it.
    pool = mha_pool("layer_first")
    b.register_mem_pool_host(pool)
    fill(pool, 0, 7)
    v1 = [f"{i:064x}" for i in range(0x400, 0x402)]
    info = HiCacheStorageExtraInfo(extra_info={"session_id": "agent-9"})
    assert all(b.batch_set_v1(v1, slots(0, 2), info))
    assert b.demote(session="agent-9")["released"] == 2
    # Without a session id, nothing is retained.
    v1b = [f"{i:064x}" for i in range(0x500, 0x502)]
    assert all(b.batch_set_v1(v1b, slots(0, 2)))
    assert b.demote(page_hashes=v1b)["released"] == 0

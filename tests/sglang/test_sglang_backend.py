"""kvtier.sglang.KvtierHiCache against the real sglang package (0.5.23): built by SGLang's own
backend factory from `--hicache-storage-backend dynamic`, subclass of its HiCacheStorage, and
exercised with CPU tensors through set, get, batch_set, batch_get, exists, batch_exists and the
index-addressed v1 variants (each page copied once, between the host pool's buffers and the
store), embedded and through kvtierd."""

import subprocess
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
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
    # MLA: one copy shared by all ranks; only the writer rank stores it.
    m0 = make(extra, model=name + "-mla", mla=True, tp_rank=0, tp_size=2)
    m1 = make(extra, model=name + "-mla", mla=True, tp_rank=1, tp_size=2)
    assert m1.set(k, page(2)) and not m1.exists(k)
    assert m0.set(k, page(2)) and m1.exists(k)
    out = torch.empty_like(page(2))
    assert m1.get(k, out) is out and torch.equal(out, page(2))


class HostPages:
    """SGLang's host KV pool as the v1 calls see it: `get_page_buffer_meta(indices)` gives each
    page's memory as segments (here K and V in two separate real host tensors, as the
    layer_first pool's per-layer K/V pointers), `page_size` token slots per page. SGLang's own
    pool needs a device pool's pointer tables to be built."""

    page_size = 64

    def __init__(self, pages):
        half = page(0).numel() // 2
        self.k = torch.zeros((pages, half), dtype=DT)
        self.v = torch.zeros((pages, half), dtype=DT)

    def page(self, i):
        return torch.cat([self.k[i], self.v[i]])

    def put(self, i, data):
        half = self.k.shape[1]
        self.k[i], self.v[i] = data[:half], data[half:]

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for p in indices.tolist()[:: self.page_size]:
            for t in (self.k, self.v):
                row = t[p // self.page_size]
                ptrs.append(row.data_ptr())
                sizes.append(row.numel() * row.element_size())
        return ptrs, sizes


def test_v1_by_host_indices_one_copy_into_the_pool(extra, request):
    name = f"m/{request.node.name}"
    b = make(dict(extra, interface_v1=1), model=name)
    pool = HostPages(8)
    b.register_mem_pool_host(pool)
    for i in range(3):
        pool.put(i, page(10 + i))
    keys = [f"{i:064x}" for i in range(100, 103)]
    idx = torch.arange(0, 3 * 64, dtype=torch.int64)  # token slots of pages 0..2
    assert b.batch_set_v1(keys, idx) == [True, True, True]
    # Read them back into pages 4..6 (plus one missing key).
    idx2 = torch.arange(4 * 64, 8 * 64, dtype=torch.int64)
    assert b.batch_get_v1(keys + ["ff" * 32], idx2) == [True, True, True, False]
    for i in range(3):
        assert torch.equal(pool.page(4 + i), page(10 + i))
    assert not pool.page(7).any()
    # The generic path lays pages out otherwise: it does not see v1 pages.
    assert make(extra, model=name).batch_exists(keys) == 0
    # A page whose segments add up to another size is a miss, and nothing is written.
    small = HostPages(8)
    small.k, small.v = small.k[:, :64].contiguous(), small.v[:, :64].contiguous()
    b.register_mem_pool_host(small)
    assert b.batch_get_v1(keys[:1], idx[:64]) == [False]
    assert not small.page(0).any()


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
            b._store._read_into(b._key("00" * 32), segs)
    if extra["mode"] == "sidecar":
        with pytest.raises(ValueError, match="socket"):
            make({"mode": "sidecar"})

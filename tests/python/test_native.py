"""The Python package `kvtier` (PyO3): keys agree with the reference scheme, the embedded store,
and gather/scatter between engine-style paged KV tensors through store slots."""

import numpy as np
import pytest

import keyref
import kvtier


def ns(block_tokens=32, **kw):
    args = dict(model="tiny/llama", dtype="float32", layout="cpu", block_tokens=block_tokens,
                tp_size=1, tp_rank=0, tenant="", lora="")
    args.update(kw)
    return kvtier.namespace_fingerprint(**args)


def test_keys_match_the_reference_scheme():
    enc, fp = ns()
    ref = dict(model="tiny/llama", dtype="float32", layout="cpu", block_tokens=32, tp=(1, 0),
               tenant="", lora="")
    assert enc == keyref.namespace_bytes(**ref)
    assert fp == keyref.fingerprint(ref)
    h = bytes(range(32))
    assert kvtier.engine_key(fp, h) == keyref.engine_key(fp, h)
    with pytest.raises(ValueError, match="16"):
        kvtier.engine_key(fp[:15], h)
    with pytest.raises(ValueError, match="tp rank"):
        ns(tp_size=2, tp_rank=2)


def layer_spec(t, dims):
    """(data_ptr, shape, strides in elements, dims, element size) of a numpy array or view."""
    return (t.__array_interface__["data"][0], list(t.shape),
            [s // t.itemsize for s in t.strides], dims, t.itemsize)


def test_store_put_get_and_prefix():
    s = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    enc, fp = ns()
    n = s.register_namespace(enc)
    keys = [kvtier.engine_key(fp, bytes([i]) * 32) for i in range(4)]
    assert s.put(n, keys[0], b"a" * 1000)
    assert not s.put(n, keys[0], b"a" * 1000)
    assert s.put(n, keys[1], b"b" * 1000)
    assert s.match_prefix(keys) == 2
    assert s.get(keys[1]) == b"b" * 1000
    assert s.get(keys[3]) is None
    assert s.stats()["blocks"] == 2
    with pytest.raises(ValueError):
        s.get(b"short")


@pytest.mark.parametrize("layout", ["cpu", "blocks-first-hnd", "kv-first"])
def test_save_and_load_move_exact_bytes_between_paged_caches(layout, tmp_path):
    rng = np.random.default_rng(5)
    nb, bs, h, d = 12, 32, 2, 64

    def cache():
        if layout == "cpu":  # vLLM's CPU backend: [blocks, 2, tokens, heads*dim], float32
            t = np.zeros((nb, 2, bs, h * d), dtype=np.float32)
            return t, ["blocks", "kv", "tokens", "inner"]
        if layout == "blocks-first-hnd":  # an HND allocation viewed as NHD
            base = np.zeros((nb, 2, h, bs, d), dtype=np.float16)
            return base.transpose(0, 1, 3, 2, 4), ["blocks", "kv", "tokens", "inner", "inner"]
        t = np.zeros((2, nb, bs, h, d), dtype=np.float16)  # FlashAttention: K/V planes first
        return t, ["kv", "blocks", "tokens", "inner", "inner"]

    src = [cache() for _ in range(3)]  # three layers
    for t, _ in src:
        t[...] = rng.standard_normal(t.shape).astype(t.dtype)
    dst = [cache() for _ in range(3)]
    a = kvtier.PagedKv([layer_spec(t, dims) for t, dims in src])
    b = kvtier.PagedKv([layer_spec(t, dims) for t, dims in dst])
    assert a.block_bytes == 3 * 2 * bs * h * d * src[0][0].itemsize

    store = kvtier.Store(64 << 20, segment_bytes=4 << 20, disk_dir=str(tmp_path / "disk"),
                         disk_bytes=64 << 20, admission="always", write_through=True)
    enc, fp = ns(layout=layout)
    n = store.register_namespace(enc)
    keys = [kvtier.engine_key(fp, bytes([i]) * 32) for i in range(3)]
    # Two engine blocks per kvtier block for the first key, one for the others.
    assert store.save(n, a, keys, [[3, 4], [5], [9]]) == 3
    assert store.save(n, a, keys[:1], [[3, 4]]) == 0  # already present
    assert store.load(b, keys + [kvtier.engine_key(fp, b"x" * 32)], [[7, 8], [1], [0], [2]]) == 3
    for (ts, _), (td, _) in zip(src, dst):
        blk = lambda t, i: t[i] if layout != "kv-first" else t[:, i]
        for s_id, d_id in [(3, 7), (4, 8), (5, 1), (9, 0)]:
            assert np.array_equal(blk(ts, s_id), blk(td, d_id)), (layout, s_id, d_id)
        for untouched in [2, 3, 4, 5, 6, 9, 10, 11]:
            assert not blk(td, untouched).any(), (layout, untouched)
    assert a.gather([3, 4]) == store.get(keys[0])
    # A fresh store on the same disk (an engine restart) loads the same bytes.
    del store
    again = kvtier.Store(64 << 20, segment_bytes=4 << 20, disk_dir=str(tmp_path / "disk"),
                         disk_bytes=64 << 20, admission="always")
    assert again.register_namespace(enc) == n
    assert again.match_prefix(keys) == 3
    c = [cache() for _ in range(3)]
    cc = kvtier.PagedKv([layer_spec(t, dims) for t, dims in c])
    assert again.load(cc, keys, [[0, 1], [2], [3]]) == 3
    assert cc.gather([0, 1, 2, 3]) == a.gather([3, 4, 5, 9])
    # Wrong shapes are clear errors, not crashes.
    with pytest.raises(ValueError, match="out of range"):
        a.gather([nb])
    with pytest.raises(ValueError, match="dim"):
        kvtier.PagedKv([(1, [2], [1], ["heads"], 2)])


def test_sidecar_moves_blocks_through_kvtierd(tmp_path):
    import pathlib
    import subprocess

    daemon = pathlib.Path(__file__).resolve().parents[2] / "target" / "debug" / "kvtierd"
    if not daemon.exists():
        pytest.fail(f"{daemon} is missing: run cargo build -p kvstore first")
    p = subprocess.Popen(
        [str(daemon), "--data-dir", str(tmp_path / "d"), "--host-capacity", "64M",
         "--disk-capacity", "128M", "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
         "--set", "host.segment=4M", "--set", "log=warn"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        socket = next(w[len("socket="):] for w in line.split() if w.startswith("socket="))
        rng = np.random.default_rng(9)
        src = rng.standard_normal((8, 2, 32, 128)).astype(np.float32)
        dst = np.zeros_like(src)
        dims = ["blocks", "kv", "tokens", "inner"]
        a = kvtier.PagedKv([layer_spec(src, dims)])
        b = kvtier.PagedKv([layer_spec(dst, dims)])
        side = kvtier.Sidecar(socket)
        enc, fp = ns()
        n = side.register_namespace(enc)
        keys = [kvtier.engine_key(fp, bytes([i]) * 32) for i in range(3)]
        assert side.save(n, a, keys[:2], [[1], [6]]) == 2
        assert side.match_prefix(keys) == 2
        assert side.load(b, keys, [[0], [2], [3]], 10_000) == 2
        assert np.array_equal(dst[0], src[1]) and np.array_equal(dst[2], src[6])
        assert not dst[3].any()
    finally:
        p.terminate()
        assert p.wait(timeout=30) == 0


def _logical(seed, layers, nb, bs, h, d):
    """Per layer, KV in logical order [kv, block, token, head, dim] (float32)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, nb, bs, h, d)).astype(np.float32) for _ in range(layers)]


def _engine(kind, logical):
    """Each layer's tensor as vLLM hands it to a connector for one attention backend: the
    logical shape of that backend, physical stride order in the strides. Returns (arrays to
    keep alive, logical views, layer specs for PagedKv)."""
    from kvtier.layouts import kv_view

    keep, views, specs = [], [], []
    for lg in logical:
        _, nb, bs, h, d = lg.shape
        if kind == "fa-nhd":  # (2, blocks, tokens, H, D), contiguous
            phys = np.ascontiguousarray(lg)
            view = phys
        elif kind == "fa-hnd":  # same logical shape; physical (2, blocks, H, tokens, D)
            phys = np.ascontiguousarray(lg.transpose(0, 1, 3, 2, 4))
            view = phys.transpose(0, 1, 3, 2, 4)
        elif kind == "flashinfer":  # (blocks, 2, tokens, H, D)
            phys = np.ascontiguousarray(lg.transpose(1, 0, 2, 3, 4))
            view = phys
        elif kind == "cpu":  # vLLM's CPU backend: (blocks, H, tokens, 2*D), K rows then V rows
            phys = np.ascontiguousarray(lg.transpose(1, 3, 0, 2, 4)).reshape(nb, h, bs, 2 * d)
            view = phys
        shape, strides, dims, how = kv_view(view.shape, [x // view.itemsize for x in
                                                          view.strides], nb, bs)
        assert how == "canonical", (kind, view.shape)
        keep.append(phys)
        views.append(view)
        specs.append((view.__array_interface__["data"][0], shape, strides, dims,
                      view.itemsize))
    return keep, views, specs


def _as_logical(kind, view, h, d):
    if kind in ("fa-nhd", "fa-hnd"):
        return np.asarray(view)
    if kind == "flashinfer":
        return np.asarray(view).transpose(1, 0, 2, 3, 4)
    nb, _, bs, _ = view.shape
    return np.asarray(view).reshape(nb, h, 2, bs, d).transpose(2, 0, 3, 1, 4)


def test_cpu_layout_is_the_one_vllm_cpu_kernels_read():
    """vLLM's CPU kernels view (blocks, H, tokens, 2*D) as (blocks, H, 2*tokens, D) and take the
    first half of the rows as K: the canonical block must hold exactly those as K."""
    nb, h, bs, d = 3, 2, 4, 8
    t = np.arange(nb * h * bs * 2 * d, dtype=np.float32).reshape(nb, h, bs, 2 * d)
    kernel = t.reshape(nb, h, 2 * bs, d)
    k, v = kernel[:, :, :bs], kernel[:, :, bs:]
    p = kvtier.PagedKv([_engine_spec_cpu(t, nb, bs)])
    got = np.frombuffer(bytes(p.gather([1])), dtype=np.float32).reshape(2, bs, h, d)
    assert np.array_equal(got[0], k[1].transpose(1, 0, 2))
    assert np.array_equal(got[1], v[1].transpose(1, 0, 2))


def _engine_spec_cpu(t, nb, bs):
    from kvtier.layouts import kv_view

    shape, strides, dims, how = kv_view(t.shape, [x // t.itemsize for x in t.strides], nb, bs)
    assert how == "canonical"
    return (t.__array_interface__["data"][0], shape, strides, dims, t.itemsize)


@pytest.mark.parametrize("h", [2, 4])  # h == 2 (a K/V-sized dim), h == block size
def test_blocks_are_canonical_across_vllm_layouts(h):
    """A block saved through one physical layout and loaded through another has exactly the
    same KV (layer, K/V, token, head, dim): FlashAttention NHD and HND, FlashInfer, vLLM CPU."""
    layers, nb, bs, d = 2, 6, 4, 8
    kinds = ["fa-nhd", "fa-hnd", "flashinfer", "cpu"]
    src = _logical(7, layers, nb, bs, h, d)
    s = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    for w in kinds:
        enc, fp = ns(model=f"canon-{h}-{w}", layout="vllm-v1/kv-token-head-dim")
        n = s.register_namespace(enc)
        _, _, wspecs = _engine(w, src)
        wp = kvtier.PagedKv(wspecs)
        keys = [kvtier.engine_key(fp, bytes([i]) * 32) for i in range(3)]
        assert s.save(n, wp, keys, [[1], [3], [5]]) == 3
        for r in kinds:
            dst = [np.zeros_like(x) for x in src]
            keep, views, rspecs = _engine(r, dst)
            rp = kvtier.PagedKv(rspecs)
            assert rp.block_bytes == wp.block_bytes
            assert s.load(rp, keys, [[0], [2], [4]]) == 3
            for layer in range(layers):
                got = _as_logical(r, views[layer], h, d)
                for sb, db in ((1, 0), (3, 2), (5, 4)):
                    assert np.array_equal(got[:, db], src[layer][:, sb]), (w, r, layer)
            del keep


def test_unknown_layouts_are_reported():
    from kvtier.layouts import describe, kv_view

    # vLLM CPU with two heads: not mistaken for a K/V dimension.
    shape, strides, dims, how = kv_view([16, 2, 32, 128], [8192, 4096, 128, 1], 16, 32)
    assert how == "canonical" and dims == ["blocks", "inner", "kv", "tokens", "inner"]
    assert shape == [16, 2, 2, 32, 64] and strides == [8192, 4096, 2048, 64, 1]
    # Blocks last: not a layout kvtier knows.
    _, _, _, how = kv_view([2, 32, 128, 16], [65536, 2048, 16, 1], 16, 32)
    assert how == "other"
    assert describe([2, 32, 128, 16], [1, 2, 64, 4096]) == "shape=2x32x128x16 stride order=3,2,1,0"


def test_block_ids_outside_the_cache_are_refused():
    t = np.zeros((4, 2, 8, 16), dtype=np.float32)
    p = kvtier.PagedKv([layer_spec(t, ["blocks", "kv", "tokens", "inner"])])
    with pytest.raises(ValueError, match="out of range"):
        p.gather([4])
    with pytest.raises(OverflowError):
        p.gather([-1])
    s = kvtier.Store(16 << 20, segment_bytes=4 << 20)
    enc, fp = ns(model="ids")
    n = s.register_namespace(enc)
    k = kvtier.engine_key(fp, b"k" * 32)
    with pytest.raises(ValueError, match="out of range"):
        s.save(n, p, [k], [[9]])
    assert s.match_prefix([k]) == 0


@pytest.mark.parametrize("mode", ["embedded", "sidecar"])
def test_preload_hints_move_disk_blocks_into_host_memory(tmp_path, mode):
    """A hint promotes the blocks found only on disk into host memory in the background; the
    lookup then says host for them; a hint of a missing prefix stops where the prefix ends."""
    import json
    import pathlib
    import subprocess
    import time

    enc, fp = ns()
    keys = [kvtier.engine_key(fp, bytes([i + 1]) * 32) for i in range(4)]
    disk = str(tmp_path / "disk")
    if mode == "embedded":
        s = kvtier.Store(16 << 20, segment_bytes=4 << 20, disk_dir=disk, disk_bytes=64 << 20,
                         write_through=True)
        n = s.register_namespace(enc)
        for i, k in enumerate(keys):
            assert s.put(n, k, bytes([i]) * 70_000)
        s.flush()
        del s
        s = kvtier.Store(16 << 20, segment_bytes=4 << 20, disk_dir=disk, disk_bytes=64 << 20)
        s.register_namespace(enc)
        stop = None
    else:
        daemon = pathlib.Path(__file__).resolve().parents[2] / "target" / "debug" / "kvtierd"
        args = [str(daemon), "--data-dir", str(tmp_path / "d"), "--host-capacity", "64M",
                "--disk-capacity", "128M", "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
                "--set", "host.segment=4M", "--set", "log=warn",
                "--set", "disk.admission=always",
                "--set", "server.allow_unauthenticated_admin=true"]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        sock = next(w[7:] for w in p.stdout.readline().split() if w.startswith("socket="))
        w = kvtier.Sidecar(sock, "writer")
        n = w.register_namespace(enc)
        for i, k in enumerate(keys):
            assert w.put(n, k, bytes([i]) * 70_000)
        del w
        p.terminate()
        assert p.wait(timeout=60) == 0  # flushed to disk
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        grpc = next(w[5:] for w in p.stdout.readline().split() if w.startswith("grpc="))
        s = kvtier.Sidecar(sock, "reader")
        s.register_namespace(enc)
        stop = p
    try:
        nn, present, tiers = s.lookup(keys)
        assert (nn, present, tiers) == (4, 4, ["disk"] * 4)
        r = s.prefetch(keys[:3], priority=1, deadline_ms=30_000, tag=5)
        assert r["present"] == 3 and r["queued"] + r["joined"] == 3 and r["in_host"] == 0
        deadline = time.monotonic() + 20
        while s.lookup(keys)[2][:3] != ["host"] * 3:
            assert time.monotonic() < deadline, s.lookup(keys)
            time.sleep(0.02)
        assert s.lookup(keys)[2][3] == "disk"
        assert s.get(keys[1]) == bytes([1]) * 70_000
        # The request is done: cancelling its hint ends the holds left (keys 0 and 2; key 1's
        # ended at its load), then nothing is left to cancel. A gap ends a hint's prefix.
        assert s.cancel_prefetch(5) == 2
        assert s.cancel_prefetch(5) == 0
        assert s.prefetch([keys[0], b"\0" * 16, keys[2]])["present"] == 1
        if mode == "sidecar":
            # A hint from the admin API (a router's), cancelled there: it holds keys 0 to 2
            # (in host memory) and queues key 3 (on disk); an engine's cancel of the same tag
            # does not touch it (hints belong to whoever sent them).
            cli = pathlib.Path(__file__).resolve().parents[2] / "target" / "debug" / "kvtier"

            def admin(*a):
                out = subprocess.run([str(cli), "--addr", grpc, "--json", *a],
                                     capture_output=True, text=True, timeout=60)
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout.strip().splitlines()[-1])

            r = admin("prefetch", keys[0].hex(), keys[1].hex(), keys[2].hex(), keys[3].hex(),
                      "--tag", "9", "--deadline-ms", "30000")
            assert r["present"] == 4 and r["in_host"] == 3, r
            assert s.cancel_prefetch(9) == 0
            assert admin("cancel-prefetch", "9")["cancelled"] >= 3
            assert admin("cancel-prefetch", "9")["cancelled"] == 0
        if mode == "embedded":
            st = s.stats()
            assert st["prefetch_hinted"] == 3 and st["prefetch_in_time"] >= 1
    finally:
        if stop is not None:
            stop.terminate()
            stop.wait(timeout=60)


def test_gpu_layouts_never_reach_a_cpu_copy_and_no_driver_is_a_clear_error():
    """A PagedKv of GPU memory (device="cuda") is refused by every CPU transfer (the CPU
    would read device addresses), and a CPU one by the GPU transfers; without a CUDA driver
    the copier says so (the GPU checks run in scripts/gpu-check.sh)."""
    t = np.zeros((4, 2, 32, 64), dtype=np.float32)
    spec = layer_spec(t, ["blocks", "kv", "tokens", "inner"])
    gpu = kvtier.PagedKv([spec], device="cuda")
    cpu = kvtier.PagedKv([spec])
    with pytest.raises(ValueError, match="device"):
        kvtier.PagedKv([spec], device="tpu")
    s = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    enc, fp = ns()
    n = s.register_namespace(enc)
    key = [kvtier.engine_key(fp, bytes([7]) * 32)]
    for call in (lambda: gpu.gather([0]), lambda: gpu.scatter([0], bytes(gpu.block_bytes)),
                 lambda: s.save(n, gpu, key, [[0]]), lambda: s.load(gpu, key, [[0]]),
                 lambda: s.load_layerwise(gpu, key, [[0]], lambda *a: None)):
        with pytest.raises(ValueError, match="GPU memory"):
            call()
    assert s.match_prefix(key) == 0
    from kvtier._native import Cuda
    if Cuda.driver_present():
        pytest.skip("a CUDA driver is here: scripts/gpu-check.sh covers the GPU path")
    with pytest.raises(RuntimeError, match="no CUDA driver"):
        Cuda(0)
    # A layer-by-layer save of host memory works without any GPU.
    save = s.begin_layer_save(n, cpu, key, [[1]])
    assert save.held == 1
    s.save_layer(save, cpu, 0)
    assert s.finish_layer_save(save, cpu) == 1
    assert s.match_prefix(key) == 1


def test_a_layer_callback_that_raises_fails_the_whole_layerwise_load():
    """The engine may not have learnt that a layer is in (on a GPU: it would not wait for the
    layer's copies): nothing of the load counts, so every block is recomputed."""
    t = np.random.default_rng(3).standard_normal((4, 2, 32, 64)).astype(np.float32)
    d = np.zeros_like(t)
    dims = ["blocks", "kv", "tokens", "inner"]
    src, dst = kvtier.PagedKv([layer_spec(t, dims)]), kvtier.PagedKv([layer_spec(d, dims)])
    s = kvtier.Store(64 << 20, segment_bytes=4 << 20)
    enc, fp = ns()
    n = s.register_namespace(enc)
    keys = [kvtier.engine_key(fp, bytes([9, i]) * 16) for i in range(2)]
    assert s.save(n, src, keys, [[0], [1]]) == 2
    seen = []
    assert s.load_layerwise(dst, keys, [[2], [3]], lambda l, k: seen.append((l, k))) == 2
    assert seen == [(0, 2)]

    def boom(layer, k):
        raise RuntimeError("engine hook failed")
    assert s.load_layerwise(dst, keys, [[2], [3]], boom) == 0

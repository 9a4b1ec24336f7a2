"""Put/get workload against Mooncake Store (CPU build, TCP), for `kvtier-bench peers`.

Prints one JSON object: {"put": [GB/s per round], "get": [...]}. Buffers are page-aligned
anonymous mappings registered with the store; calls are batched (its fastest API).
"""

import argparse
import ctypes
import json
import mmap
import sys
import time

from mooncake.store import MooncakeDistributedStore


def addr(m):
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=["local", "remote"], default="local")
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    total = a.size * a.count
    st = MooncakeDistributedStore()
    # Every round writes fresh keys (Mooncake keeps a lease on new objects, so removing and
    # re-putting the same key is refused as "already exists" and copies nothing).
    segment = total * (a.rounds + 2) if a.mode == "local" else 0
    rc = st.setup("127.0.0.1", "P2PHANDSHAKE", segment, 2 * total + (64 << 20), "tcp", "", a.master)
    if rc != 0:
        print(f"mooncake setup failed: {rc}", file=sys.stderr)
        sys.exit(2)
    src, dst = mmap.mmap(-1, total), mmap.mmap(-1, total)
    for i in range(0, total, 4096):
        src[i] = (i // 4096) % 251
        dst[i] = 0
    for m in (src, dst):
        if st.register_buffer(addr(m), total) != 0:
            print("register_buffer failed", file=sys.stderr)
            sys.exit(2)
    out = {"put": [], "get": []}
    for r in range(a.rounds + 1):  # round 0 warms up
        keys = [f"kvtier-peer-{a.size}-{r}-{i}" for i in range(a.count)]
        t = time.perf_counter()
        for i in range(0, a.count, a.batch):
            ks = keys[i:i + a.batch]
            res = st.batch_put_from(ks, [addr(src) + j * a.size for j in range(i, i + len(ks))], [a.size] * len(ks))
            if any(x != 0 for x in res):
                print(f"batch_put_from failed: {res}", file=sys.stderr)
                sys.exit(2)
        put = total / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for i in range(0, a.count, a.batch):
            ks = keys[i:i + a.batch]
            res = st.batch_get_into(ks, [addr(dst) + j * a.size for j in range(i, i + len(ks))], [a.size] * len(ks))
            if any(x != a.size for x in res):
                print(f"batch_get_into failed: {res}", file=sys.stderr)
                sys.exit(2)
        get = total / (time.perf_counter() - t) / 1e9
        if src[:4096] != dst[:4096] or src[total - 4096:] != dst[total - 4096:]:
            print("mooncake returned wrong bytes", file=sys.stderr)
            sys.exit(3)
        if r > 0:
            out["put"].append(put)
            out["get"].append(get)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Writes the seed corpora of the fuzz targets (run with the test virtualenv's Python, which has
xxhash): valid journals, records and namespace encodings, byte for byte as ARCHITECTURE.md draws
them, so mutations start from inputs that get past the first checks."""

import struct
import sys
from pathlib import Path

import xxhash

ROOT = Path(__file__).resolve().parent / "corpus"


def h64(b):
    return xxhash.xxh3_64_intdigest(b)


# The journal format (ARCHITECTURE.md, "Disk tier on-disk format"): a corpus of another version
# is refused at its first check and exercises nothing past it.
VERSION = 2


def header(instance):
    h = b"KVTJRNL\0" + struct.pack("<IIQ", VERSION, 64, instance) + bytes(32)
    return h + struct.pack("<Q", h64(h))


def record(kind, ns, key, page, length, file, checksum, seq):
    b = struct.pack("<IBBH", 0x5244564B, kind, VERSION, ns) + key.to_bytes(16, "big")
    b += struct.pack("<QIIQQ", page, length, file, checksum, seq)
    return b + struct.pack("<Q", h64(b))


def put(key, page, length, file=0, seq=0, ns=1):
    return record(1, ns, key, page, length, file, key & 0xFFFF, seq)


def remove(key, seq):
    return record(2, 1, key, 0, 0, 0, 0, seq)


def namespace(i, fp):
    return record(3, i, fp, i, 0, 0, 0, 0)


def ns_encoding(model, dtype, layout, block_tokens, tp, tenant, lora):
    def s(x):
        b = x.encode()
        return struct.pack("<I", len(b)) + b
    out = b"kvtier/ns/v1" + s(model) + s(dtype) + s(layout) + struct.pack("<I", block_tokens)
    out += b"\0" + bytes(8) if tp is None else b"\1" + struct.pack("<II", *tp)
    return out + s(tenant) + s(lora)


def main():
    journals = {
        "empty": header(7),
        "puts": header(7) + namespace(1, 99) + b"".join(
            put(k, 1 + 3 * k, 3 * 4096 - 5, k % 2, k + 1) for k in range(1, 9)),
        "removes-and-overlaps": header(7) + put(1, 1, 8 * 4096, 0, 1) + put(2, 4, 4096, 0, 2)
        + remove(2, 3) + put(3, 500, 4096, 1, 4) + put(3, 10, 2 * 4096, 1, 5),
        "torn-tail": (header(7) + put(1, 1, 4096, 0, 1) + put(2, 2, 4096, 0, 2))[:-20],
        # Valid checksums, extents past the end of u64: `page + pages` must not overflow.
        "page-overflow": header(7) + put(1, 2**64 - 1, 2 * 4096, 0, 1)
        + put(2, 2**64 - 2, 4096, 0, 2) + put(3, 1, 4096, 0, 3),
    }
    for name, b in journals.items():
        (ROOT / "journal" / name).write_bytes(b)
        (ROOT / "journal-records" / name).write_bytes(b[64:])
    for name, enc in {
        "llama": ns_encoding("meta-llama/Llama-3.1-8B", "bfloat16", "nhd", 16, (8, 3), "", ""),
        "mla": ns_encoding("deepseek", "fp8", "mla", 64, None, "tenant-a", "lora-x"),
    }.items():
        (ROOT / "namespace" / name).write_bytes(enc)



def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    return key + varint(len(payload)) + payload


def packed(nums):
    return b"".join(varint(n) for n in nums)


def request(rid, body_field, body):
    return field(1, 0, rid) + field(body_field, 2, body)


def key(i):
    return (i * 0x9E3779B97F4A7C15F39CC0605CEDC835 % (1 << 128)).to_bytes(16, "big")


def ipc_seeds():
    ns = ns_encoding("fuzz/model", "bf16", "nhd", 16, (1, 0), "", "")
    keys = key(1) + key(2)
    reqs = [
        request(2, 3, field(1, 2, ns)),                                  # RegisterNamespace
        request(3, 6, field(1, 0, 0) + field(2, 2, keys) + field(3, 2, packed([70000, 100]))),
        request(4, 7, field(1, 2, packed([1, 2])) + field(2, 2, packed([5, 6]))),  # Commit
        request(5, 4, field(1, 2, keys) + field(2, 0, 1) + field(3, 0, 1000)),     # Lookup+lease
        request(6, 5, field(1, 2, keys) + field(2, 0, 1000)),                       # Load
        request(7, 9, field(1, 0, 12345)),                                          # Release
        request(8, 8, field(1, 2, packed([3]))),                                    # Abort
        request(9, 10, b""),                                                        # Stats
    ]
    def frames(rs):
        return b"".join(struct.pack("<H", len(r)) + r for r in rs)
    seeds = {
        "save-and-load": frames(reqs),
        "stats": frames([reqs[-1]]),
        "reserve-then-close": frames(reqs[:2]),
        "repeated-keys": frames([reqs[0], request(3, 5, field(1, 2, key(1) * 500))]),
    }
    for name, b in seeds.items():
        (ROOT / "ipc-requests" / name).write_bytes(b)


def cluster_seeds():
    """Data-plane input after Auth: pieces `[kind][u16 length][body]`, an even kind a frame
    (u32 length first), an odd one raw bytes (payloads)."""
    def frame(b):
        return bytes([0]) + struct.pack("<H", len(b)) + b

    def raw(b):
        return bytes([1]) + struct.pack("<H", len(b)) + b

    fp = key(99)

    def block(k, n, payload):
        return (field(1, 2, k) + field(2, 0, 1) + field(3, 0, n)
                + bytes([(4 << 3) | 1]) + struct.pack("<Q", h64(payload)) + field(5, 2, fp))

    def req(rid, op, keys=b"", blocks=()):
        b = field(1, 0, rid) + field(2, 0, op)
        if keys:
            b += field(3, 2, keys)
        return b + b"".join(field(4, 2, x) for x in blocks)

    payload = bytes(range(256)) * 20
    seeds = {
        "exists": frame(req(1, 1, key(1) + key(2))),
        "put-then-get": frame(req(2, 3, blocks=[block(key(1), len(payload), payload)]))
        + raw(payload) + frame(req(3, 2, key(1) + key(2))) + frame(req(4, 1, key(1))),
        "put-cut-short": frame(req(2, 3, blocks=[block(key(3), len(payload), payload)]))
        + raw(payload[:100]),
        "put-wrong-checksum": frame(req(2, 3, blocks=[block(key(4), len(payload), b"x")]))
        + raw(payload),
        "oversized-header": raw(struct.pack("<I", (16 << 20) + 1)),
        "unknown-op": frame(req(5, 9, key(1))),
    }
    (ROOT / "cluster-frames").mkdir(exist_ok=True)
    for name, b in seeds.items():
        (ROOT / "cluster-frames" / name).write_bytes(b)


if __name__ == "__main__":
    main()
    ipc_seeds()
    cluster_seeds()
    sys.exit(0)

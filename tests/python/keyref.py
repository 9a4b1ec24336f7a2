"""Reference implementation of kvtier's key scheme (ARCHITECTURE.md, "Key scheme").

Written from the document alone, in another language than the store, so the checked-in test
vectors pin the scheme rather than one implementation. Run as a script to regenerate
`kvstore/tests/vectors/keys.json`.
"""

import json
import struct
import sys
from pathlib import Path

import xxhash

VECTORS = Path(__file__).resolve().parents[2] / "kvstore" / "tests" / "vectors" / "keys.json"


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def namespace_bytes(model, dtype, layout, block_tokens, tp, tenant, lora) -> bytes:
    """tp is None for shared (MLA) KV, else (size, rank)."""
    out = b"kvtier/ns/v1" + _str(model) + _str(dtype) + _str(layout)
    out += struct.pack("<I", block_tokens)
    out += b"\x00" + struct.pack("<II", 0, 0) if tp is None else b"\x01" + struct.pack("<II", *tp)
    return out + _str(tenant) + _str(lora)


def h128(data: bytes) -> bytes:
    """xxh3_128 in canonical (big-endian) form."""
    return xxhash.xxh3_128_digest(data)


def fingerprint(ns: dict) -> bytes:
    return h128(namespace_bytes(**ns))


def engine_key(fp: bytes, engine_hash: bytes) -> bytes:
    return h128(fp + b"E" + struct.pack("<I", len(engine_hash)) + engine_hash)


def chain_tokens(parent: bytes, tokens, extra: bytes = b"") -> bytes:
    body = struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
    return h128(parent + b"T" + body + struct.pack("<I", len(extra)) + extra)


def token_keys(ns: dict, tokens, extras=()):
    bt = ns["block_tokens"]
    parent, keys = fingerprint(ns), []
    for i in range(len(tokens) // bt):
        extra = extras[i] if i < len(extras) else b""
        parent = chain_tokens(parent, tokens[i * bt:(i + 1) * bt], extra)
        keys.append(parent)
    return keys


CASES = [
    {
        "ns": {"model": "meta-llama/Llama-3.1-8B", "dtype": "bfloat16", "layout": "nhd",
               "block_tokens": 16, "tp": (2, 1), "tenant": "", "lora": ""},
        "tokens": list(range(40)),
        "extras": ["73616c74"],  # cache salt on the first block
        "engine_hashes": ["00" * 32, "".join(f"{i:02x}" for i in range(32))],
    },
    {
        "ns": {"model": "deepseek-ai/DeepSeek-V3", "dtype": "fp8_e4m3", "layout": "mla",
               "block_tokens": 64, "tp": None, "tenant": "tenant-a", "lora": "my-adapter"},
        "tokens": [128000 + (i * 7919) % 5000 for i in range(128)],
        "extras": [],
        "engine_hashes": ["ff" * 16],
    },
]


def vectors():
    out = []
    for c in CASES:
        ns = c["ns"]
        fp = fingerprint(ns)
        extras = [bytes.fromhex(e) for e in c["extras"]]
        out.append({
            "namespace": {**ns, "tp": None if ns["tp"] is None else list(ns["tp"])},
            "namespace_bytes_hex": namespace_bytes(**ns).hex(),
            "fingerprint": fp.hex(),
            "tokens": c["tokens"],
            "extras_hex": c["extras"],
            "token_keys": [k.hex() for k in token_keys(ns, c["tokens"], extras)],
            "engine_keys": [{"engine_hash": h, "key": engine_key(fp, bytes.fromhex(h)).hex()}
                            for h in c["engine_hashes"]],
        })
    return out


if __name__ == "__main__":
    VECTORS.write_text(json.dumps(vectors(), indent=1) + "\n")
    print(f"wrote {VECTORS}", file=sys.stderr)

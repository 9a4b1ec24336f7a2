"""Cache-aware routing with kvtier: ask kvtierd where a prompt's prefix is (which node, which
tier) and turn the answer into a cost per engine, the way Dynamo's KV router weights what an
engine already has (GPU > host memory > disk > another node), weights configurable.

    from kvtier import router
    # One kvtierd per node; each engine uses its node's kvtierd.
    costs = router.score({"engine-a": "10.0.0.5:50551", "engine-b": "10.0.0.6:50551"},
                         prompt, namespace=dict(model="meta-llama/Llama-3.1-8B",
                         block_tokens=16))
    best = min(costs, key=costs.get)

    # Or one round trip through any node of a kvtier cluster (engines named by their node's
    # cluster.listen address):
    costs = router.score({"engine-a": "10.0.0.5:7070", "engine-b": "10.0.0.6:7070"},
                         keys=keys, via="10.0.0.5:50551")

    # Or with no round trip a request: the router's own index of every node's blocks, from
    # each kvtierd's Watch stream (a snapshot of each node's blocks, then their events):
    index = router.Index({"engine-a": "10.0.0.5:50551", "engine-b": "10.0.0.6:50551"})
    costs = index.score(keys) or router.score(...)  # None: not complete, ask the cluster

`lookup` is the admin gRPC `Lookup` (grpcio, the one dependency; its messages are encoded
here, so no generated code is needed, and every value is checked against its protobuf type
first: a negative or out-of-range token id, a non-integer, a key that is not 16 bytes is a
ValueError naming it). A cost is in blocks: a block computed costs 1, a block
loaded from tier t costs 1 - weight[t].
"""

from __future__ import annotations

import struct
import threading

TIERS = {0: "?", 1: "host", 2: "disk", 3: "remote"}
WEIGHTS = {"gpu": 1.0, "host": 0.9, "disk": 0.6, "remote": 0.4}
METHOD = "/kvtier.admin.v1.Admin/Lookup"


U32 = (1 << 32) - 1


def _u32(v, what: str) -> int:
    """`v` as a protobuf uint32, or a ValueError naming `what` (a negative number never ended
    the varint loop: the call spun and allocated)."""
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            v = int(v.__index__())
        except (AttributeError, TypeError):
            raise ValueError(f"{what} must be an integer, not {v!r}") from None
    if not 0 <= v <= U32:
        raise ValueError(f"{what} must be in 0..{U32}, not {v}")
    return v


def _varint(n: int) -> bytes:
    if n < 0:
        raise ValueError(f"a varint cannot encode {n}")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    key = _varint(num << 3 | wire)
    if wire == 0:
        return key + payload
    return key + _varint(len(payload)) + payload


def _encode_request(keys, token_ids, block_hashes, namespace, cluster, tenant) -> bytes:
    out = bytearray()
    for k in keys or []:
        if len(k) != 16:
            raise ValueError(f"a key is 16 bytes, not {len(k)}")
        out += _field(1, 2, bytes(k))
    if tenant:
        out += _field(2, 2, tenant.encode())
    if namespace is not None:
        ns = bytearray()
        for i, name in ((1, "model"), (2, "dtype"), (3, "layout")):
            default = {"dtype": "bfloat16", "layout": "nhd"}.get(name, "")
            v = str(namespace.get(name, default))
            if v:
                ns += _field(i, 2, v.encode())
        for i, name, default in ((4, "block_tokens", 16), (5, "tp_size", 1), (6, "tp_rank", 0)):
            v = _u32(namespace.get(name, default), f"namespace {name}")
            if v:
                ns += _field(i, 0, _varint(v))
        for i, name in ((7, "tenant"), (8, "lora")):
            v = str(namespace.get(name, ""))
            if v:
                ns += _field(i, 2, v.encode())
        out += _field(3, 2, bytes(ns))
    for h in block_hashes or []:
        if not isinstance(h, (bytes, bytearray, memoryview)):
            raise ValueError(f"a block hash is bytes, not {type(h).__name__}")
        out += _field(4, 2, bytes(h))
    if token_ids:
        out += _field(5, 2, b"".join(_varint(_u32(t, "a token id")) for t in token_ids))
    if cluster:
        out += _field(6, 0, _varint(1))
    return bytes(out)


def _read_varint(b: bytes, i: int):
    n = shift = 0
    while True:
        x = b[i]
        i += 1
        n |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return n, i


def _fields(b: bytes):
    i = 0
    while i < len(b):
        key, i = _read_varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(b, i)
        elif wire == 2:
            n, i = _read_varint(b, i)
            v, i = b[i:i + n], i + n
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"unknown wire type {wire}")
        yield num, wire, v


def _tiers(wire, v, into):
    if wire == 0:
        into.append(TIERS.get(v, "?"))
    else:  # packed
        i = 0
        while i < len(v):
            t, i = _read_varint(v, i)
            into.append(TIERS.get(t, "?"))


def _decode_reply(b: bytes) -> dict:
    out = {"n": 0, "tiers": [], "nodes": []}
    for num, wire, v in _fields(b):
        if num == 1:
            out["n"] = v
        elif num == 2:
            _tiers(wire, v, out["tiers"])
        elif num == 3:
            node = {"node": "", "n": 0, "tiers": [], "local": False, "error": "",
                    "load_seconds": 0.0, "load_measured": False}
            for n2, w2, v2 in _fields(v):
                if n2 == 1:
                    node["node"] = v2.decode()
                elif n2 == 2:
                    node["n"] = v2
                elif n2 == 3:
                    _tiers(w2, v2, node["tiers"])
                elif n2 == 4:
                    node["local"] = bool(v2)
                elif n2 == 5:
                    node["error"] = v2.decode()
                elif n2 == 6 and w2 == 1:
                    node["load_seconds"] = struct.unpack("<d", v2)[0]
                elif n2 == 7:
                    node["load_measured"] = bool(v2)
            out["nodes"].append(node)
    return out


def lookup(endpoint: str, keys=None, *, token_ids=None, block_hashes=None, namespace=None,
           cluster: bool = False, token: str | None = None, tenant: str = "",
           timeout: float = 5.0) -> dict:
    """kvtierd's answer for a prefix: {"n", "tiers", "nodes": [{"node", "n", "tiers", "local",
    "error", "load_seconds", "load_measured"}]} (`load_seconds`: the member's expected time to
    bring the blocks it holds into its host memory, from its tiers' measured read speeds;
    `load_measured` false when a tier involved was not measured yet there). Name the blocks by 16-byte `keys`, or by `token_ids` / the engine's
    `block_hashes` with the `namespace` (dict: model, dtype, layout, block_tokens, tp_size,
    tp_rank, tenant, lora)."""
    req = _encode_request(keys, token_ids, block_hashes, namespace, cluster, tenant)
    md = [("authorization", f"Bearer {token}")] if token else None
    return _decode_reply(_call(endpoint)(req, timeout=timeout, metadata=md))


_CALLS: dict = {}
_CALLS_LOCK = threading.Lock()


def _call(endpoint: str):
    """The Lookup method on one channel per endpoint, kept for the process: a router asks per
    request, and a new channel each time (a TCP and HTTP/2 handshake) took bench/serving's
    router from 20 to 40 ms a request on a loaded 2-core machine. gRPC channels are
    thread-safe and reconnect on their own."""
    import grpc

    with _CALLS_LOCK:
        call = _CALLS.get(endpoint)
        if call is None:
            ch = grpc.insecure_channel(endpoint)
            call = ch.unary_unary(METHOD, request_serializer=lambda x: x,
                                  response_deserializer=lambda x: x)
            _CALLS[endpoint] = call
        return call


def cost(tiers, total: int, weights=None, gpu_blocks: int = 0, cluster_n: int = 0) -> float:
    """Blocks of work for an engine: its first `gpu_blocks` blocks are in its GPU cache, the
    next ones load from `tiers`, blocks up to `cluster_n` from another node, the rest are
    computed."""
    w = {**WEIGHTS, **(weights or {})}
    c = 0.0
    for i in range(total):
        if i < gpu_blocks:
            c += 1.0 - w["gpu"]
        elif i < len(tiers):
            c += 1.0 - w.get(tiers[i], 0.0)
        elif i < cluster_n:
            c += 1.0 - w["remote"]
        else:
            c += 1.0
    return c


def seconds(node: dict, total: int, block_tokens: int, prefill_tokens_per_s: float,
            gpu_blocks: int = 0) -> float:
    """Seconds of work for an engine whose node answered `node` (a `lookup(..., cluster=True)`
    member): its first `gpu_blocks` blocks are in its GPU cache (free), the blocks its node
    holds load in the node's measured `load_seconds`, the rest are computed at
    `prefill_tokens_per_s`."""
    if prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s must be positive, not {prefill_tokens_per_s}")
    held = 0 if node.get("error") else int(node.get("n", 0))
    load = float(node.get("load_seconds", 0.0)) if held > gpu_blocks else 0.0
    computed = max(0, total - max(held, gpu_blocks))
    return load + computed * block_tokens / prefill_tokens_per_s


def score(endpoints: dict, prompt=None, *, keys=None, block_hashes=None, namespace=None,
          via: str | None = None, weights=None, gpu: dict | None = None,
          token: str | None = None, timeout: float = 5.0,
          prefill_tokens_per_s: float | None = None) -> dict:
    """Cost per engine of serving `prompt` (its token ids, in `namespace`; or name its blocks
    by 16-byte `keys` or the engine's `block_hashes`). Lower is better; see `cost`.

    Without `via`: `endpoints` maps each engine to its node's kvtierd admin address, asked
    one by one (what that node can load, its remote tier included). With `via` (any node's
    admin address): one cluster lookup, and `endpoints` maps each engine to its node's
    `cluster.listen` address. `gpu` maps engines to the leading blocks already in their GPU
    prefix cache (known to the router from vLLM's KV events). With `via` and
    `prefill_tokens_per_s` (the engines' prefill rate), costs are seconds instead (see
    `seconds`): each node's measured time to load what it holds against recomputing the rest."""
    gpu = gpu or {}
    token_ids = prompt
    kw = dict(keys=keys, token_ids=token_ids, block_hashes=block_hashes, namespace=namespace,
              token=token, timeout=timeout)
    if block_hashes is not None:
        total = len(block_hashes)
    elif token_ids is not None:
        total = len(token_ids) // int((namespace or {}).get("block_tokens", 16))
    else:
        total = len(keys or [])
    out = {}
    if via is None:
        for engine, ep in endpoints.items():
            r = lookup(ep, **kw)
            out[engine] = cost(r["tiers"], total, weights, gpu.get(engine, 0))
        return out
    r = lookup(via, cluster=True, **kw)
    best = max([n["n"] for n in r["nodes"] if not n["error"]] or [0])
    by_node = {n["node"]: n for n in r["nodes"]}
    if prefill_tokens_per_s is not None:
        bt = int((namespace or {}).get("block_tokens", 16))
        return {engine: seconds(by_node.get(node, {"n": 0}), total, bt, prefill_tokens_per_s,
                                gpu.get(engine, 0))
                for engine, node in endpoints.items()}
    for engine, node in endpoints.items():
        n = by_node.get(node)
        tiers = n["tiers"] if n and not n["error"] else []
        out[engine] = cost(tiers, total, weights, gpu.get(engine, 0), best)
    return out


WATCH = "/kvtier.admin.v1.Admin/WatchBatched"
_BITS = {1: 1, 2: 2}  # host, disk: the tiers a node serves its own blocks from
_SNAPSHOT_END = 3  # BlockEvent.Kind: the end of a Watch's snapshot


class Index:
    """Where each node's blocks are, kept by the router itself from each kvtierd's `Watch`
    stream (block events: stored, removed, per tier), so that scoring a prompt asks no one:
    no round trip on the request's path. On a loaded machine the cluster `Lookup` waited
    14-37 ms a request for cores (bench/RESULTS.md), in every routed request's time to first
    token.

    `nodes` maps each engine to its node's kvtierd admin address. Each node's stream starts
    with a snapshot (`WatchBatched` with `snapshot`: every block the node holds in host memory and
    on disk, then an end marker, then the events from the subscription on), so a node's part
    of the index is *complete* once its snapshot ended, whether the cluster was empty or warm
    when the router started. A node whose stream broke (killed, restarted: events missed) is
    not complete until a new stream's snapshot ended, and meanwhile `score` answers None: ask
    `score` (the Lookup) instead. A broken stream is retried every `retry_s`. A node that
    drops events for this watcher (it read slower than the node changed: the daemon keeps
    65,536 events for it) ends the stream with DATA_LOSS, and the index starts that node
    again from a new snapshot rather than keep a view that may be wrong. A node that stops
    answering without closing the connection (hung, stopped, cut off) is found by HTTP/2
    keepalive pings every `keepalive_s` (unanswered within as long: the stream breaks).
    Memory: one dict entry a block a node (~100 bytes in Python)."""

    def __init__(self, nodes: dict, *, token: str | None = None, tenant: str = "",
                 retry_s: float = 1.0, keepalive_s: float = 10.0):
        import grpc

        self._grpc = grpc
        self.nodes = dict(nodes)
        self._md = [("authorization", f"Bearer {token}")] if token else None
        # WatchRequest: the tenant (field 1), a snapshot first (field 2).
        self._req = (_field(1, 2, tenant.encode()) if tenant else b"") + _field(2, 0, b"\x01")
        self._retry_s = retry_s
        ms = max(1, int(keepalive_s * 1000))
        # Pings while the stream is open, data or not (grpc stops after 2 without data by
        # default), each answered within as long: grpcio 1.85 bounds a ping's answer by
        # `ping_timeout_ms` (a stopped node went unnoticed for 40 s with the keepalive
        # timeout alone; with it, 2 s at keepalive_s=1).
        self._channel_opts = [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
                              ("grpc.keepalive_permit_without_calls", 1),
                              ("grpc.http2.max_pings_without_data", 0),
                              ("grpc.http2.ping_timeout_ms", ms)]
        self._held = {e: {} for e in self.nodes}
        self._complete = {e: False for e in self.nodes}
        self.events = 0
        self.breaks = 0
        self._closed = threading.Event()
        self._changed = threading.Condition()
        self._calls: dict = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._follow, args=(e,), daemon=True,
                                          name=f"kvtier-index-{e}") for e in self.nodes]
        for t in self._threads:
            t.start()

    def complete(self) -> bool:
        """Every node's part is complete (see the class doc): `score` answers."""
        return all(self._complete.values())

    def wait_complete(self, timeout: float) -> bool:
        """Waits until `complete()`, at most `timeout` seconds (for a router before traffic)."""
        return self.wait(self.complete, timeout)

    def wait(self, predicate, timeout: float) -> bool:
        """Waits until `predicate()` holds, at most `timeout` seconds; asked again after each
        event and each change of completeness. Returns its last answer."""
        with self._changed:
            return bool(self._changed.wait_for(predicate, timeout))

    def _set_complete(self, engine, v: bool) -> None:
        with self._changed:
            self._complete[engine] = v
            self._changed.notify_all()

    def blocks(self) -> dict:
        """Blocks held per engine's node, by the index."""
        return {e: len(h) for e, h in self._held.items()}

    def _prefix(self, engine, keys) -> list:
        held = self._held[engine]
        tiers = []
        for k in keys:
            bits = held.get(k, 0)
            if bits & 1:
                tiers.append("host")
            elif bits & 2:
                tiers.append("disk")
            else:
                break
        return tiers

    def score(self, keys, *, weights=None, gpu: dict | None = None):
        """As `score(endpoints, keys=keys, via=...)`: the cost per engine of a prompt of
        16-byte `keys`, in blocks (see `cost`), from the index alone; None when it is not
        complete (then ask the cluster)."""
        if not self.complete():
            return None
        gpu = gpu or {}
        keys = [bytes(k) for k in keys]
        for k in keys:
            if len(k) != 16:
                raise ValueError(f"a key is 16 bytes, not {len(k)}")
        held = {e: self._prefix(e, keys) for e in self.nodes}
        best = max((len(t) for t in held.values()), default=0)
        return {e: cost(t, len(keys), weights, gpu.get(e, 0), best) for e, t in held.items()}

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for c in calls:
            c.cancel()

    def _follow(self, engine) -> None:
        """Follows one node's stream, resubscribing after a break."""
        grpc = self._grpc
        ep = self.nodes[engine]
        ch = grpc.insecure_channel(ep, options=self._channel_opts)
        watch = ch.unary_stream(WATCH, request_serializer=lambda x: x,
                                response_deserializer=lambda x: x)
        while not self._closed.is_set():
            held = self._held[engine]
            try:
                call = watch(self._req, metadata=self._md)
                with self._lock:
                    self._calls[engine] = call
                if self._closed.is_set():
                    call.cancel()
                    return
                call.initial_metadata()  # subscribed: the snapshot, then events from here on
                with self._changed:
                    held.clear()
                self._set_complete(engine, False)
                # A message is a batch of events (BlockEvents: field 1, each a BlockEvent),
                # applied under the lock at once: grpcio costs ~80 µs a message, so one a
                # event kept up with ~12,000 events a second (a snapshot of 100,000 blocks
                # took 9.5 s).
                for msg in call:
                    end = False
                    with self._changed:
                        for num, _, ev in _fields(msg):
                            if num != 1:
                                continue
                            kind = key = tier = 0
                            for n, _, v in _fields(ev):
                                if n == 1:
                                    kind = v
                                elif n == 2:
                                    key = bytes(v)
                                elif n == 3:
                                    tier = v
                            if kind == _SNAPSHOT_END:
                                end = True
                                continue
                            bit = _BITS.get(tier, 0)
                            self.events += 1
                            if not bit or not key:
                                continue
                            if kind == 1:
                                held[key] = held.get(key, 0) | bit
                            elif kind == 2:
                                left = held.get(key, 0) & ~bit
                                if left:
                                    held[key] = left
                                else:
                                    held.pop(key, None)
                        self._changed.notify_all()
                    if end:
                        self._set_complete(engine, True)
            except Exception:  # noqa: BLE001 - a broken stream: not complete, retried
                pass
            self._set_complete(engine, False)
            if self._closed.is_set():
                return
            self.breaks += 1
            self._closed.wait(self._retry_s)

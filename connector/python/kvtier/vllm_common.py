"""What the vLLM connector's scheduler side (``vllm_scheduler``) and worker side
(``vllm_worker``) share: the key scheme's helpers, the metadata they exchange, the KV-cache
groups of hybrid models, and ``_Side``, the configuration both read from the connector's extra
config (see ``kvtier.vllm`` for its keys)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # newer vLLM: workers report back to the scheduler's connector each step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no measured prefill rate
    KVConnectorWorkerMetadata = object

from . import engine_key, namespace_fingerprint
from ._open import open_store
from .layouts import CANONICAL

log = logging.getLogger("kvtier.vllm")


def namespace(model: str, revision: str | None, cache_dtype: str, block_size: int,
              tp_size: int = 1, tp_rank: int = 0,
              layout: str = CANONICAL) -> tuple[bytes, bytes]:
    """``(encoding, fingerprint)`` of the namespace an engine with this configuration uses
    (``layout``: the canonical block layout every known attention backend is copied in, see
    :mod:`kvtier.layouts`)."""
    return namespace_fingerprint(
        model=f"{model}@{revision or ''}",
        dtype=str(cache_dtype),
        layout=layout,
        block_tokens=block_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def prompt_keys(token_ids: list[int], *, model: str, block_size: int, revision: str | None = None,
                cache_dtype: str = "auto", tp_size: int = 1, tp_rank: int = 0,
                hash_algo: str = "sha256_cbor", hash_seed: str | None = None) -> list[bytes]:
    """The kvtier keys the connector uses for a plain token prompt (no LoRA, multimodal input
    or cache_salt), one per full block: for tools that inspect or pre-warm the store.
    ``hash_seed`` is the engine's PYTHONHASHSEED (default: this process's, as vLLM does)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name(hash_algo)
    seed = hash_seed if hash_seed is not None else kcu.resolve_none_hash_seed(fn)
    _, fp = namespace(model, revision, cache_dtype, block_size, tp_size, tp_rank)
    keys, parent = [], kcu.BlockHash(fn(seed))  # vLLM's NONE_HASH for that seed
    for i in range(len(token_ids) // block_size):
        parent = kcu.hash_block_tokens(fn, parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(engine_key(fp, bytes(parent)))
    return keys


HINT_FIELDS = ("session", "retain_s", "priority", "demote")


def session_hints(params) -> dict | None:
    """The kvtier hints of a request's ``kv_transfer_params`` (``{"kvtier": {...}}``), checked
    and normalised to ``{"session": str | None, "retain_s": float, "priority": int, "demote":
    bool}``; None when there are none. Raises ValueError naming a bad field."""
    if not isinstance(params, dict) or params.get("kvtier") is None:
        return None
    h = params["kvtier"]
    if not isinstance(h, dict):
        raise ValueError(f"kv_transfer_params.kvtier must be an object, not {type(h).__name__}")
    unknown = sorted(set(h) - set(HINT_FIELDS))
    if unknown:
        raise ValueError(f"kv_transfer_params.kvtier: unknown field(s) {unknown} "
                         f"(known: {list(HINT_FIELDS)})")
    session = h.get("session")
    if session is not None and (not isinstance(session, str)
                                or not 0 < len(session.encode()) <= 256):
        raise ValueError("kv_transfer_params.kvtier.session must be a string of 1 to 256 bytes")
    retain = h.get("retain_s", 0)
    if isinstance(retain, bool) or not isinstance(retain, (int, float)) or not retain >= 0:
        raise ValueError("kv_transfer_params.kvtier.retain_s must be a number of seconds >= 0")
    priority = h.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255:
        raise ValueError("kv_transfer_params.kvtier.priority must be an integer in 0..255")
    demote = h.get("demote", False)
    if not isinstance(demote, bool):
        raise ValueError("kv_transfer_params.kvtier.demote must be true or false")
    return {"session": session, "retain_s": float(retain), "priority": priority,
            "demote": demote}


@dataclass
class _Transfer:
    """Engine blocks and their vLLM block hashes (each worker keys them in its own namespace:
    TP ranks hold different shards)."""
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    # Models with several KV-cache groups (hybrid allocator): each group's engine blocks, one
    # per hash (0: vLLM's null block, a sliding-window position outside the window: skipped).
    # Empty for one group (``block_ids`` are its blocks).
    group_ids: list[list[int]] = field(default_factory=list)
    # GPU: a CUDA event on the engine's stream that the copies wait for (the forward pass's
    # KV writes for a save; what the stream ran before the step for a load). Worker-side only.
    after: Any = None
    # Saves through kvtierd: the hash of the block before the first (b"": none) and the
    # blocks' token ids, for the daemon's BlockStored events (vLLM's parent_block_hash and
    # token_ids). Empty otherwise.
    parent: bytes = b""
    token_ids: list[int] = field(default_factory=list)

    def described(self, block_size: int, idx=None) -> dict:
        """The save's tags for blocks `idx` (all by default): engine hashes, parents, token
        ids."""
        idx = range(len(self.hashes)) if idx is None else idx
        out = {"engine_hashes": [bytes(self.hashes[i]) for i in idx]}
        if len(self.token_ids) == len(self.hashes) * block_size:
            out["parent_hashes"] = [bytes(self.hashes[i - 1]) if i else self.parent
                                    for i in idx]
            out["token_ids"] = [self.token_ids[i * block_size:(i + 1) * block_size]
                                for i in idx]
        return out


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    async_load: bool = True
    # Tokens the step computes (all requests): the workers time the forward pass for the
    # measured prefill rate.
    step_tokens: int = 0


# Steps with fewer tokens (decode) say little about the prefill rate. Small steps run below
# the engine's full rate (fixed costs per step): they understate it, which errs towards loading.
MIN_TIMED_TOKENS = 64


class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, per step: the tokens the step computed and the seconds its forward
    pass took on this worker (load waits taken out). Workers of one step (tensor parallel)
    aggregate to the slowest: the step is as fast as its slowest rank."""

    def __init__(self, tokens: int, seconds: float):
        self.tokens = tokens
        self.seconds = seconds

    def aggregate(self, other):
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        return KvtierWorkerMetadata(max(self.tokens, other.tokens),
                                    max(self.seconds, other.seconds))


class _PrefillRate:
    """The engine's prefill rate as measured from its steps, exponentially weighted (a fifth
    of each new step), in tokens/s; 0 until a step was measured."""

    def __init__(self):
        self.rate = 0.0
        self.steps = 0

    def note(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_TIMED_TOKENS or not seconds > 0:
            return
        r = tokens / seconds
        self.rate = r if self.steps == 0 else 0.8 * self.rate + 0.2 * r
        self.steps += 1


@dataclass
class _Group:
    """One KV-cache group of a hybrid model: its layers, and its sliding window in blocks
    (``window``: blocks a hit needs right before its end; 0: full attention)."""
    layers: list[str]
    window: int
    ns_enc: bytes
    fp: bytes
    ns: int = -1


def _groups_of(kv_cache_config, block_size: int) -> list[tuple[list[str], int, str]]:
    """``(layer names, window blocks, description)`` per KV-cache group, or one entry (no layer
    names) when the engine has one group. Groups kvtier cannot key safely are refused."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return [([], 0, "")]
    out = []
    for g, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        kind = type(spec).__name__
        if getattr(spec, "block_size", block_size) != block_size:
            raise ValueError(
                f"kvtier: KV-cache group {g} ({kind}) has blocks of {spec.block_size} tokens, "
                f"the others {block_size}; kvtier keys every group by the same block hashes")
        if kind == "FullAttentionSpec":
            window = 0
        elif kind == "SlidingWindowSpec":
            # vLLM's SlidingWindowManager: a hit needs cdiv(window - 1, block) blocks before
            # its end; the ones before are not used (null blocks).
            window = max(1, -(-(int(spec.sliding_window) - 1) // block_size))
        else:
            raise ValueError(
                f"kvtier: KV-cache group {g} is {kind}; kvtier handles full-attention and "
                "sliding-window groups (run without the hybrid allocator: "
                "--disable-hybrid-kv-cache-manager)")
        layers = list(grp.layer_names)
        tag = hashlib.blake2b(",".join(layers).encode(), digest_size=8).hexdigest()
        out.append((layers, window, f"group{g}:{kind}:{window}:{tag}"))
    return out


def _event_group(kv_cache_config, g: int) -> dict:
    """What kvtierd's KV events say of KV-cache group `g` (vLLM's `group_idx`,
    `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, as vLLM's own offloading events fill
    them): keyword arguments of `register_namespace`; none without the engine's KV-cache
    config."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if g >= len(groups):
        return {}
    spec = groups[g].kv_cache_spec
    try:
        from vllm.v1.kv_cache_interface import (get_kv_cache_spec_kind,
                                                get_kv_cache_spec_sliding_window)
        kind = get_kv_cache_spec_kind(spec).value
        window = get_kv_cache_spec_sliding_window(spec)
    except (ImportError, AttributeError, TypeError):  # an older vLLM: the index only
        kind, window = None, None
    return dict(group_idx=g, spec_kind=kind, sliding_window=window)


class _Side:
    """The connector's configuration and store, as both sides read them."""

    def __init__(self, vllm_config, role, kv_cache_config, kv_transfer_config):
        self._block_size = vllm_config.cache_config.block_size
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self._sidecar = extra.get("mode", "embedded") == "sidecar"
        self._async = bool(extra.get("async_load", True))
        self._layerwise = bool(extra.get("layerwise", False))
        if self._layerwise and self._async:
            log.info("kvtier: layerwise: saves move layer by layer; loads are asynchronous "
                     "(they finish before their request runs)")
        # A debugging aid (and what the tests read): one JSON line per layer event.
        self._layer_trace_path = extra.get("layer_trace")
        self._lease_ms = int(extra.get("lease_ms", 30_000))
        self._preload = bool(extra.get("preload", True))
        self._policy = str(extra.get("load_policy", "timeout"))
        if self._policy not in ("timeout", "wait_complete", "best_effort"):
            raise ValueError(f"kvtier: load_policy must be timeout, wait_complete or "
                             f"best_effort, not {self._policy!r}")
        self._deadline_s = float(extra.get("load_deadline_ms", 2000)) / 1000.0
        # How long a hint's preloads and holds last: until the request is served or finished
        # (request_finished cancels), however long it queues — at least 30 s. (A hint that
        # lapsed while its request still queued was hinted again and waited for, where a plain
        # asynchronous load would have read at once.)
        self._hint_ttl_s = max(2 * self._deadline_s, 30.0)
        rate = extra.get("prefill_tokens_per_s", 0.0)
        self._measure_prefill = rate != "off"
        self._prefill_rate = 0.0 if rate == "off" else float(rate)
        self._measured = _PrefillRate()
        # kv_role: "kv_both" loads and saves, "kv_consumer" only loads, "kv_producer" only saves.
        kv_role = str(getattr(kv_transfer_config, "kv_role", None) or "kv_both")
        if kv_role not in ("kv_both", "kv_consumer", "kv_producer"):
            raise ValueError(f"kvtier: kv_role must be kv_both, kv_consumer or kv_producer, "
                             f"not {kv_role!r}")
        self._may_load = kv_role != "kv_producer"
        self._may_save = kv_role != "kv_consumer"
        par = vllm_config.parallel_config
        tp_size = getattr(par, "tensor_parallel_size", 1) or 1
        tp_rank = 0
        if tp_size > 1 and role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001 - TP group not up: fall back to the global rank
                tp_rank = getattr(par, "rank", 0) % tp_size
        model = vllm_config.model_config
        # MLA: one latent KV, the same on every TP rank: one shared copy, written by rank 0.
        mla = bool(getattr(model, "use_mla", False))
        self._writer = not mla or tp_rank == 0
        # The scheduler looks up rank 0's blocks (or the shared MLA copy).
        self._ns_args = (model.model, getattr(model, "revision", None),
                         vllm_config.cache_config.cache_dtype, self._block_size,
                         0 if mla else tp_size, 0 if mla else tp_rank)
        self._ns_enc, self._fp = namespace(*self._ns_args)
        # Hybrid models: one namespace per KV-cache group (the layout names the group, so a
        # group's blocks never meet another group's, nor a run without the hybrid allocator).
        self._groups: list[_Group] = []
        for layers, window, desc in _groups_of(kv_cache_config, self._block_size):
            if desc:
                enc, fp = namespace(*self._ns_args, layout=f"{CANONICAL}|{desc}")
                self._groups.append(_Group(layers, window, enc, fp))
        self._hybrid = len(self._groups) > 1
        if self._hybrid:
            if self._layerwise:
                log.warning("kvtier: layerwise is off for a model with several KV-cache groups "
                            "(its loads are asynchronous, its saves whole requests)")
                self._layerwise = False
            # vLLM reports a failed load of a hybrid model only per request, for requests that
            # wait for their loads asynchronously (failed_recving): loads are asynchronous.
            self._async = True
            log.info("kvtier: %d KV-cache groups (%s)", len(self._groups),
                     ", ".join(f"{len(g.layers)} layers, window {g.window or 'full'}"
                               for g in self._groups))
        backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
        if not self._sidecar and backend not in (None, "uni"):
            raise ValueError(
                "kvtier: embedded mode keeps the store in the engine-core process, so it needs "
                "distributed_executor_backend='uni' (vLLM's CPU build also needs "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 for that); with worker processes use "
                f"mode='sidecar' (kvtierd), not {backend!r}"
            )
        # Sidecar: the scheduler and the worker each get a connection (with the uni executor
        # they share a process, and lookups must not wait behind a background save).
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._store = open_store(extra, "embedded", f"vllm-{side}")
        # Each namespace with its KV-cache group, for kvtierd's KV events (a hybrid model's
        # primary namespace keys no group's blocks of its own).
        self._ns = self._store.register_namespace(
            self._ns_enc, **({} if self._hybrid else _event_group(kv_cache_config, 0)))
        for g, grp in enumerate(self._groups):
            grp.ns = self._store.register_namespace(grp.ns_enc,
                                                    **_event_group(kv_cache_config, g))
        # The group this connector's own BlockStored events name (the primary group's, which
        # lookups follow, for a hybrid model).
        self._stored_group = _event_group(
            kv_cache_config, self._groups.index(self._primary()) if self._hybrid else 0)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
    # ---- keys ------------------------------------------------------------------------------

    def _keys(self, request) -> list[bytes]:
        """The request's keys in the primary namespace (the only one, or, for a hybrid model,
        its first full-attention group's: the one lookups, hints and hit sources follow)."""
        fp = self._primary().fp if self._hybrid else self._fp
        return [engine_key(fp, bytes(h)) for h in request.block_hashes]

    def _primary(self) -> _Group:
        return next((g for g in self._groups if g.window == 0), self._groups[0])

    def _hybrid_hit(self, request, n: int) -> int:
        """Blocks of a hybrid model's hit: at most ``n`` (the primary group's present prefix)
        and one block short of the prompt's end, cut until every group can use it: a
        full-attention group needs every block before the end, a sliding-window group the
        ``window`` blocks right before it (vLLM's hybrid prefix-cache rule)."""
        bs = self._block_size
        hashes = self._hashes(request)
        end = min(n, (len(request.prompt_token_ids or []) - 1) // bs, len(hashes))
        primary = self._primary()
        changed = True
        while changed and end > 0:
            changed = False
            for grp in self._groups:
                if grp is primary:
                    continue
                if grp.window == 0:
                    have = self._store.match_prefix(
                        [engine_key(grp.fp, h) for h in hashes[:end]])
                else:
                    # The window before `end`; a missing block moves the end to it.
                    have = end
                    while have > 0:
                        lo = max(0, have - grp.window)
                        got = self._store.match_prefix(
                            [engine_key(grp.fp, h) for h in hashes[lo:have]])
                        if got == have - lo:
                            break
                        have = lo + got
                if have < end:
                    end, changed = have, True
        return max(0, end)

    def _hashes(self, request) -> list[bytes]:
        return [bytes(h) for h in request.block_hashes]

"""The vLLM connector's scheduler side: lookups (with break-even admission and read-your-writes),
preload hints, the loads and saves each step's metadata carries, the connector's own KV events,
the measured prefill rate, and requests' session hints. ``kvtier.vllm.KvtierConnector`` with
the scheduler role delegates here."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from . import engine_key
from .vllm_common import (KvtierMetadata, KvtierWorkerMetadata, _Side, _Transfer, log,
                          session_hints)


class KvtierScheduler(_Side):
    """The scheduler role's state and calls."""

    def __init__(self, vllm_config, role, kv_cache_config, kv_transfer_config):
        super().__init__(vllm_config, role, kv_cache_config, kv_transfer_config)
        self._reqs: dict[str, Any] = {}
        self._lookup_start: dict[str, int] = {}
        self._loads: list[_Transfer] = []
        self._saved: dict[str, int] = {}
        self._saving: set[str] = set()
        self._block_ids: dict[str, list[int]] = {}
        self._loading: dict[str, tuple[int, list[int]]] = {}  # first block index, engine blocks
        self._hinted: dict[str, float] = {}  # request → when its preload hint was sent
        # Request → most of its blocks a hint reply found in host memory; and when a reply
        # last found more than the request's earlier replies (preloads landing: the disk is
        # delivering).
        self._in_host: dict[str, int] = {}
        self._delivered_at: float | None = None
        # Synchronous loads: the requests the last step built loads.
        self._sync_loading: list[str] = []
        self._tiers: dict[str, list[str]] = {}  # request → tier of each block at its lookup
        # Requests waiting for blocks another engine is saving: since when.
        self._pending_since: dict[str, float] = {}
        self._hint_failed = False
        # Finished requests' session hints, sent once their saves are written.
        self._after_save: dict[str, tuple[dict, list[list[bytes]]]] = {}
        # What the session hints did (retains, demotes, blocks retained/demoted, refused).
        self.session_stats = {"retains": 0, "retained": 0, "clipped": 0, "demotes": 0,
                              "demoted": 0, "refused": 0, "bad": 0}
        # BlockStored events for the blocks this connector saves, for vLLM's KV event
        # publisher (`take_events`), when the engine publishes events at all.
        ev = getattr(vllm_config, "kv_events_config", None)
        self._kv_events = bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))
        self._events: list[Any] = []

    @staticmethod
    def _tag(req_id: str) -> int:
        return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little")

    def _hint(self, req_id: str, keys: list[bytes], deadline_s: float) -> dict | None:
        """Sends the hint; the store's reply (what it found and did), or None if it failed."""
        try:
            r = self._store.prefetch(keys, 0, max(1, int(deadline_s * 1000)),
                                     self._tag(req_id))
        except Exception:  # noqa: BLE001 - a hint is an optimisation: never fail the request
            if not self._hint_failed:
                self._hint_failed = True
                log.exception("kvtier: preload hint failed (hints are off until it works)")
            return None
        now, before = int(r["in_host"]), self._in_host.get(req_id)
        if before is not None and now > before:
            self._delivered_at = time.monotonic()
        self._in_host[req_id] = max(before or 0, now)
        return r

    def on_new_request(self, request) -> None:
        """The request's block hashes are known on arrival: hint them, so the blocks found only
        on disk are read while the request waits in the queue."""
        if not self._preload or not self._may_load:
            return
        keys = self._keys(request)
        if keys:
            self._hinted[request.request_id] = time.monotonic()
            self._hint(request.request_id, keys, self._hint_ttl_s)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        keys = self._keys(request) if self._may_load else []
        rid = request.request_id
        n, tiers = 0, []
        if keys:
            n, _present, tiers = self._store.lookup(keys, self._block_size,
                                                    self.prefill_rate())
        since = self._hinted.get(rid)
        if since is not None and n:
            host = next((i for i, t in enumerate(tiers) if t != "host"), n)
            if host < n:
                waited = time.monotonic() - since
                if self._policy == "best_effort":
                    n = host
                elif waited < (60.0 if self._policy == "wait_complete" else self._deadline_s):
                    # Still arriving: hint again (what was cut for room gets queued now) and
                    # let the scheduler ask again later; the request waits in the queue.
                    r = self._hint(rid, keys[:n], max(self._hint_ttl_s - waited, 1.0))
                    moving = r is not None and int(r["queued"]) + int(r["joined"]) > 0
                    if moving or self._policy == "wait_complete":
                        return None, False
                    # None of its blocks is moving up (no preload room: held blocks of the
                    # requests ahead take it; or the preloads were dropped): waiting would only
                    # delay it, and computing what is on disk would waste the hit. It loads
                    # now, its load reading the disk blocks itself (issue 31: on the agent
                    # trace with a small host tier, requests waited out the deadline and then
                    # recomputed 90% of their disk hits).
                else:
                    # Past the deadline (counted from arrival: a request that waited out its
                    # turn in vLLM's queue is past it when first asked), it waits no longer.
                    # While preloads are landing (some request's hint found more of its blocks
                    # in host memory than before, within the last deadline or second, whichever
                    # is longer), the disk is delivering: it loads every block the lookup
                    # priced as cheaper to load than to compute, its load reading those still
                    # on disk itself (joining their queued preloads). Computing them, as it did
                    # before, threw away disk hits under a backlog (issue 31: chat at twice the
                    # prefill rate computed 132k prompt tokens with a disk tier against 86k
                    # host-only). With none landing, the disk is stalled or far slower than the
                    # deadline allows: what is in host memory loads and vLLM computes the rest.
                    r = self._hint(rid, keys[:n], max(self._hint_ttl_s - waited, 1.0))
                    last = self._delivered_at
                    if r is None or last is None or time.monotonic() - last > max(
                            self._deadline_s, 1.0):
                        n = host
        # Read-your-writes: the blocks right after the hit are being saved by another engine
        # now (a turn routed here while the previous turn's saves are still being written).
        # They are hits in a moment: the request waits for them as it waits for preloads (the
        # scheduler asks again next step), unless vLLM holds them itself, at most
        # load_deadline_ms since it first saw them (60 s with wait_complete).
        pending = sum(1 for t in tiers[n:] if t == "pending")
        if (pending and self._policy != "best_effort"
                and n == len(tiers) - pending  # not cut for preloads still moving
                and n + pending > num_computed_tokens // self._block_size):
            first = self._pending_since.setdefault(rid, time.monotonic())
            limit = 60.0 if self._policy == "wait_complete" else self._deadline_s
            if time.monotonic() - first < limit:
                return None, False
        prompt = len(request.prompt_token_ids or [])
        if self._hybrid:
            # Whole blocks only (the engine's hybrid allocator aligns hits to blocks).
            n = self._hybrid_hit(request, n)
            hit = n * self._block_size
        else:
            # A hit covering the whole prompt reports one token fewer: the engine must compute
            # the last token to get logits (it rewrites that token's KV in the loaded block).
            hit = min(n * self._block_size, prompt - 1)
        self._tiers[rid] = tiers[:n]
        ext = max(0, hit - num_computed_tokens)
        # Where the external range starts, for update_state_after_alloc (not a store change).
        self._lookup_start[request.request_id] = num_computed_tokens
        return ext, self._async and ext > 0

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        """Which tier served the external tokens (vLLM's per-source hit metrics)."""
        if num_external_tokens <= 0:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
        rid = request.request_id
        tiers = self._tiers.get(rid, [])
        start = self._loading.get(rid, (0, []))[0]
        # The remote tier (another node's kvtierd) is vLLM's peer-to-peer source.
        by = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
              "remote": CacheHitSource.P2P}
        out: dict = {}
        left = num_external_tokens
        for t in tiers[start:]:
            if left <= 0:
                break
            take = min(self._block_size, left)
            src = by.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + take
            left -= take
        if left > 0:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(
                CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
        return out

    def _end_hint(self, rid: str) -> None:
        """The request no longer needs its hint (its load is done, it loads nothing, or it
        finished): what the hint still holds or has waiting is let go now, so it no longer
        takes the preload room of the requests behind it."""
        self._in_host.pop(rid, None)
        if self._hinted.pop(rid, None) is not None:
            try:
                self._store.cancel_prefetch(self._tag(rid))
            except Exception:  # noqa: BLE001 - best effort
                pass

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        rid = request.request_id
        self._reqs[rid] = request
        self._pending_since.pop(rid, None)
        start = self._lookup_start.pop(rid, None)
        if num_external_tokens <= 0 or start is None:
            self._end_hint(rid)  # scheduled with nothing to load
            return
        bs = self._block_size
        first, last = start // bs, -(-(start + num_external_tokens) // bs)  # whole blocks
        per_group = blocks.get_block_ids()
        ids = list(per_group[0])
        hashes = self._hashes(request)
        if self._hybrid:
            # Each group's blocks of the range; a sliding-window group's positions before its
            # window are null blocks (0): nothing is loaded there.
            groups = [list(g[first:last]) for g in per_group]
            flat = sorted({b for g in groups for b in g if b})
            self._loads.append(_Transfer(rid, hashes[first:last], flat, groups))
        else:
            self._loads.append(_Transfer(rid, hashes[first:last], ids[first:last]))
        self._loading[rid] = (first, ids[first:last])
        self._saved[rid] = max(self._saved.get(rid, 0), last)

    def build_connector_meta(self, scheduler_output):
        meta = KvtierMetadata(loads=self._loads, async_load=self._async,
                              preempted=list(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                              step_tokens=int(getattr(scheduler_output,
                                                      "total_num_scheduled_tokens", 0) or 0))
        self._loads = []
        if not self._async:
            # The workers loaded the previous step's synchronously before it ran: those
            # requests' hints end (this step's end at the next).
            for rid in self._sync_loading:
                self._end_hint(rid)
            self._sync_loading = [t.req_id for t in meta.loads]
        # A preempted request's blocks are freed now: its queued saves are flushed by the
        # workers (handle_preemptions), so it no longer needs delay_free for them.
        self._saving.difference_update(meta.preempted)
        groups = len(self._groups) if self._hybrid else 1
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = [list(new.block_ids[g]) for g in range(groups)]
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            self._add_saves(meta, new.req_id, done)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in getattr(cached, "resumed_req_ids", set()):
                    self._block_ids[req_id] = [list(new_ids[g]) for g in range(groups)]
                else:
                    have = self._block_ids.setdefault(req_id, [[] for _ in range(groups)])
                    for g in range(groups):
                        have[g].extend(new_ids[g])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._add_saves(meta, req_id, done)
        return meta

    def _add_saves(self, meta, req_id, computed_after_step):
        """Full prompt blocks computed by the end of this step and not stored yet."""
        req = self._reqs.get(req_id)
        if req is None or not self._may_save:
            return
        hashes = self._hashes(req)
        prompt_blocks = len(req.prompt_token_ids or []) // self._block_size
        upto = min(computed_after_step // self._block_size, prompt_blocks, len(hashes))
        start = self._saved.get(req_id, 0)
        per_group = self._block_ids.get(req_id, [[]])
        if upto > start and all(len(g) >= upto for g in per_group):
            if self._hybrid:
                # Blocks computed in this step are in every group's window (a sliding-window
                # block leaves it, and is freed, at a later step: the worker writes this
                # step's saves before it returns from the step).
                groups = [g[start:upto] for g in per_group]
                flat = sorted({b for g in groups for b in g if b})
                t = _Transfer(req_id, hashes[start:upto], flat, groups)
            else:
                t = _Transfer(req_id, hashes[start:upto], per_group[0][start:upto])
            if self._sidecar:
                # For kvtierd's KV events (its BlockStored carries them as vLLM's does).
                bs = self._block_size
                t.parent = bytes(hashes[start - 1]) if start > 0 else b""
                t.token_ids = list(req.all_token_ids[start * bs:upto * bs])
            meta.saves.append(t)
            self._saved[req_id] = upto
            self._saving.add(req_id)
            if self._kv_events:
                self._events.append(self._stored_event(req, start, upto))

    def _stored_event(self, req, start, upto):
        """vLLM's BlockStored for the blocks [start, upto) of a request, saved to kvtier
        (medium "CPU": kvtier's host tier takes them first), under the engine's own hashes, as
        vLLM 0.32's offloading tiers describe theirs (locality, ownership, the KV-cache group
        and its spec)."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        bs = self._block_size
        lora = getattr(req, "lora_request", None)
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in req.block_hashes[start:upto]],
            parent_block_hash=(maybe_convert_block_hash(req.block_hashes[start - 1])
                               if start > 0 else None),
            token_ids=list(req.all_token_ids[start * bs:upto * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium="CPU",
            lora_name=lora.name if lora else None,
            group_idx=self._stored_group.get("group_idx"),
            kv_cache_spec_kind=self._stored_group.get("spec_kind"),
            kv_cache_spec_sliding_window=self._stored_group.get("sliding_window"),
            locality="LOCAL",
            ownership="kvtier",
        )

    def take_events(self):
        """BlockStored events of the saves queued since the last call (vLLM's scheduler
        publishes them with its own KV events when `--kv-events-config` enables them)."""
        events, self._events = self._events, []
        return events

    def prefill_rate(self) -> float:
        """The prefill rate lookups state for break-even admission: the configured one, else
        the one measured from the engine's steps (0: load every hit)."""
        if self._prefill_rate > 0 or not self._measure_prefill:
            return self._prefill_rate
        return self._measured.rate

    def update_connector_output(self, connector_output):
        """Blocks that failed to load are recomputed by the engine: save them again then."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KvtierWorkerMetadata):
            self._measured.note(wm.tokens, wm.seconds)
        # Finished requests whose saves are written: their session hints go now.
        for rid in getattr(connector_output, "finished_sending", None) or ():
            pending = self._after_save.pop(rid, None)
            if pending is not None:
                self._session_hint(rid, *pending)
        # Asynchronous loads done (or failed): their requests' hints end.
        for rid in (*(getattr(connector_output, "finished_recving", None) or ()),
                    *(getattr(connector_output, "failed_recving", None) or ())):
            self._end_hint(rid)
        # A hybrid model's failed load fails its request: vLLM recomputes all of it, so all of
        # it is saved again.
        for rid in getattr(connector_output, "failed_recving", None) or ():
            if rid in self._loading and rid in self._saved:
                self._saved[rid] = min(self._saved[rid], self._loading[rid][0])
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        for rid, (first, ids) in self._loading.items():
            failed = [i for i, b in enumerate(ids) if b in bad]
            if failed and rid in self._saved:
                self._saved[rid] = min(self._saved[rid], first + failed[0])

    def request_finished_all_groups(self, request, block_ids):
        """The hybrid allocator's ``request_finished`` (``SupportsHMA``): the same, for every
        group's blocks at once."""
        return self.request_finished(request, block_ids)

    def _session_keys(self, request) -> list[list[bytes]]:
        """The request's prompt blocks to retain or demote, per namespace: the primary one;
        for a hybrid model also each other full-attention group's, and each sliding-window
        group's window before the prompt's end (the blocks a later hit needs)."""
        hashes = self._hashes(request)[:len(request.prompt_token_ids or []) // self._block_size]
        if not self._hybrid:
            return [[engine_key(self._fp, h) for h in hashes]]
        out = []
        for grp in self._groups:
            hs = hashes if grp.window == 0 else hashes[max(0, len(hashes) - grp.window):]
            out.append([engine_key(grp.fp, h) for h in hs])
        return out

    def _session_hint(self, rid: str, hint: dict, keys: list[list[bytes]]) -> None:
        """Sends a finished request's session hint (its saves are written)."""
        st = self.session_stats
        try:
            if hint["demote"]:
                if hint["session"] is not None:
                    r = self._store.demote(session=hint["session"])
                    st["demoted"] += int(r["freed"]) + int(r["queued"])
                for ks in keys if hint["session"] is None else ():
                    r = self._store.demote(keys=ks)
                    st["demoted"] += int(r["freed"]) + int(r["queued"])
                st["demotes"] += 1
            elif hint["retain_s"] > 0:
                for ks in keys:
                    r = self._store.retain(ks, session=hint["session"],
                                           ttl_ms=max(1, int(hint["retain_s"] * 1000)),
                                           priority=hint["priority"])
                    if r["refused"]:
                        st["refused"] += 1
                        log.warning("kvtier: retain of request %s refused: %s", rid,
                                    r["refused"])
                        break
                    st["retained"] += int(r["retained"])
                    st["clipped"] += int(r["clipped"])
                st["retains"] += 1
        except Exception:  # noqa: BLE001 - a hint is an optimisation: never fail the engine
            log.exception("kvtier: session hint of request %s failed", rid)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        # Finished or aborted: its preloads not started yet are dropped.
        self._end_hint(rid)
        hint = None
        try:
            hint = session_hints(getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            self.session_stats["bad"] += 1
            log.warning("kvtier: request %s: %s: hint ignored", rid, e)
        if hint is not None and (hint["demote"] or hint["retain_s"] > 0):
            keys = self._session_keys(request)
            if rid in self._saving:
                # After its saves are written (update_connector_output), so the blocks it
                # computed are there to retain.
                self._after_save[rid] = (hint, keys)
            else:
                self._session_hint(rid, hint, keys)
        for d in (self._reqs, self._saved, self._block_ids, self._lookup_start, self._loading,
                  self._tiers, self._pending_since):
            d.pop(rid, None)
        # Blocks with queued saves stay allocated until the worker reports them written.
        delay = rid in self._saving
        self._saving.discard(rid)
        return delay, None

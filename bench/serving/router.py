"""The harness's router for two (or more) vLLM servers: an OpenAI-compatible reverse proxy that
sends each completion to one server, by policy:

  prefix       where kvtier says the prompt's prefix is cheapest (`kvtier.router.score`, one
               cluster Lookup through the first node), plus the prefill work already waiting
               on each server (the cost of each request sent there whose first token has not
               come back yet): cost = blocks to compute here + queued blocks. Ties go to the
               server with fewer requests in flight, then round-robin. With --decode-load, the
               prompt blocks of every request sent there and not finished are added too
               (Dynamo's KV router cost, `overlap_score_weight * prefill_blocks +
               decode_blocks` with weight 1, in kvtier's cost units): off by default, since it
               was slower on both the chat and the agent trace here (bench/RESULTS.md).
               With --engine-blocks N the router also keeps, per server, the last N blocks
               of the prompts it sent there (an LRU, as SGLang's cache-aware router keeps a
               tree of them): its estimate of that server's own prefix cache. The leading
               blocks a server holds by that estimate cost it nothing (`score`'s `gpu`),
               where kvtier's host memory costs a load, so a conversation's next turn goes
               back to the engine that holds it rather than tying with every node kvtier
               holds it on.
               With --queue prompt the work queued on a server counts every prompt block of
               each request waiting there for its first token (as least-work counts it), not
               kvtier's cost of it: a request whose prefix loads still takes its server's time
               (the load, the scheduler's steps, the decodes it shares a step with). With
               --inflight-weight W each request in flight on a server (prefilling or
               decoding) adds W blocks: a server busy decoding prefills slower, since vLLM
               runs the decodes in every step beside the prefill.
               With --admin (each server's kvtierd admin address) the router keeps its own
               index of where each node's blocks are, from the nodes' block event streams
               (`kvtier.router.Index`, kvtierd's Watch), and scores a prompt from it with no
               round trip (the same cost as the Lookup's); it asks the cluster as before while
               the index is not complete (a node's stream's snapshot not ended yet, or its
               stream broken).
               A balance guard (SGLang's cache-aware router's, counted in requests waiting for
               their first token rather than requests running): when the cheapest server has
               more than --balance-abs such requests more than the least-waiting server, and
               more than --balance-rel times as many, the request goes to the least-waiting
               server (the cheapest of those) instead. The cost above counts a waiting
               request as kvtier's cost of its prompt, which is ~0 for a prompt the server's
               own cache holds: a server that falls behind still looks idle to it and keeps
               drawing its sessions back (an agent round here had one server 20 s behind,
               bench/RESULTS.md). On by default (4 requests, 1.5 times); --balance-abs 0
               turns it off.
  least-work   the server with the least prefill work queued (as prefix, with every block
               of every prompt counted as computed: no kvtier lookup). Against prefix, it tells
               how much of prefix routing's gain is balance and how much is kvtier's knowledge
               of where each prefix is.
  round-robin  one server after the other.

    python router.py --policy prefix --backends URL,URL --cluster ADDR,ADDR --via GRPC \\
        --model PATH --block-size 32

Prints `router ready: url=http://127.0.0.1:PORT` once it listens; GET /router/stats answers
how many requests went where and how long the lookups took. A lookup that fails or takes more
than `--lookup-timeout` counts as nothing held anywhere (the request is still served: the
router never stops traffic because kvtier did not answer)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from collections import OrderedDict
import sys
import time

import aiohttp
from aiohttp import web


class Router:
    def __init__(self, a):
        self.backends = a.backends.split(",")
        self.cluster = a.cluster.split(",") if a.cluster else []
        self.policy = a.policy
        self.via = a.via
        self.model = a.model
        self.bs = a.block_size
        self.timeout = a.lookup_timeout
        self.rr = itertools.cycle(range(len(self.backends)))
        self.inflight = [0] * len(self.backends)
        self.queued_blocks = [0.0] * len(self.backends)
        # Per server: prompt blocks of the requests sent there and not finished (decode load).
        self.active_blocks = [0.0] * len(self.backends)
        self.decode_load = a.policy == "prefix" and a.decode_load
        self.queue_prompt = a.policy == "prefix" and a.queue == "prompt"
        self.inflight_weight = a.inflight_weight if a.policy == "prefix" else 0.0
        # Per server: requests sent there whose first token has not come back (the guard's).
        self.waiting = [0] * len(self.backends)
        self.balance_abs = a.balance_abs if a.policy == "prefix" else 0
        self.balance_rel = a.balance_rel
        self.stats = {"sent": [0] * len(self.backends), "lookups": 0, "lookup_errors": 0,
                      "lookup_s": 0.0, "prompt_blocks": 0, "chosen_cost_blocks": 0.0,
                      "balanced": 0}
        self.session: aiohttp.ClientSession | None = None
        # Per server: block key -> None, least recently sent first (--engine-blocks).
        self.engine_blocks = a.engine_blocks
        self.sent_blocks: list[OrderedDict] = [OrderedDict() for _ in self.backends]
        self.stats["engine_cache_blocks"] = 0
        # --admin: the router's own index of the nodes' blocks (kvtier.router.Index).
        self.index = None
        self.stats["index_answers"] = 0
        if a.policy == "prefix" and a.admin:
            from kvtier import router

            admin = a.admin.split(",")
            if len(admin) != len(self.backends):
                sys.exit("router: --admin needs one address per backend")
            self.index = router.Index({str(i): ep for i, ep in enumerate(admin)})

    def _engine_prefix(self, i: int, keys: list) -> int:
        """Leading `keys` that server `i` holds by the router's estimate."""
        held = self.sent_blocks[i]
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def _sent(self, i: int, keys: list) -> None:
        """`keys` went to server `i`: the most recent now; the least recent past the bound go."""
        if not self.engine_blocks:
            return
        held = self.sent_blocks[i]
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.engine_blocks:
            held.popitem(last=False)

    def _keys(self, ids: list[int]) -> list:
        """The prompt's block keys (vLLM's hashes, as kvtier names them); blocking."""
        from kvtier.vllm import prompt_keys

        return [bytes(k) for k in prompt_keys(ids, model=self.model, block_size=self.bs)]

    def _costs(self, keys: list) -> list[float]:
        """Blocks to compute on each server (kvtier's cost) for this prompt; blocking."""
        from kvtier import router

        if not keys:
            return [0.0] * len(self.backends)
        engines = {str(i): c for i, c in enumerate(self.cluster)}
        gpu = ({str(i): self._engine_prefix(i, keys) for i in range(len(self.backends))}
               if self.engine_blocks else None)
        got = router.score(engines, keys=keys, via=self.via, gpu=gpu, timeout=self.timeout)
        self.stats["prompt_blocks"] += len(keys)
        return [got[str(i)] for i in range(len(self.backends))]

    async def choose(self, body: dict) -> tuple[int, float, float]:
        """The server for this request, its cost there, and its blocks."""
        i, work, keys = await self._choose(body)
        self._sent(i, keys)
        return i, work, float(len(keys))

    async def _choose(self, body: dict) -> tuple[int, float, list]:
        if self.policy == "round-robin":
            return next(self.rr), 0.0, []
        ids = body.get("prompt")
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            return next(self.rr), 0.0, []
        if self.policy == "least-work":
            blocks = float(len(ids) // self.bs)
            return self._cheapest([blocks] * len(self.backends)), blocks, []
        t = time.monotonic()
        if self.index is not None and self.index.complete():
            # Scored here, on the event loop: the keys' hashing and the index walk take well
            # under a millisecond, where each thread hop waits for a core on a loaded machine.
            try:
                keys = self._keys(ids)
                gpu = ({str(i): self._engine_prefix(i, keys)
                        for i in range(len(self.backends))} if self.engine_blocks else None)
                got = self.index.score(keys, gpu=gpu)
            except Exception as e:  # noqa: BLE001 - as a failed lookup: never stops traffic
                self.stats["lookup_errors"] += 1
                print(f"router: scoring failed ({e!r}): round-robin", file=sys.stderr)
                return next(self.rr), 0.0, []
            if got is not None:
                self.stats["index_answers"] += 1
                self.stats["prompt_blocks"] += len(keys)
                self.stats["lookup_s"] += time.monotonic() - t
                costs = [got[str(i)] for i in range(len(self.backends))]
                i = self._cheapest(costs)
                if self.engine_blocks:
                    self.stats["engine_cache_blocks"] += self._engine_prefix(i, keys)
                return i, costs[i], keys
        self.stats["lookups"] += 1
        keys = []
        try:
            keys = await asyncio.to_thread(self._keys, ids)
            costs = await asyncio.wait_for(asyncio.to_thread(self._costs, keys),
                                           self.timeout + 1)
        except Exception as e:  # noqa: BLE001 - kvtier not answering never stops traffic
            self.stats["lookup_errors"] += 1
            print(f"router: lookup failed ({e!r}): round-robin", file=sys.stderr)
            return next(self.rr), 0.0, keys
        finally:
            self.stats["lookup_s"] += time.monotonic() - t
        i = self._cheapest(costs)
        if self.engine_blocks:
            self.stats["engine_cache_blocks"] += self._engine_prefix(i, keys)
        return i, costs[i], keys

    def _cheapest(self, costs: list[float]) -> int:
        """The server where `costs` plus the work queued there is least; ties go to fewer
        requests in flight, then round-robin."""
        total = [c + q for c, q in zip(costs, self.queued_blocks)]
        if self.decode_load:
            total = [t + a for t, a in zip(total, self.active_blocks)]
        if self.inflight_weight:
            total = [t + self.inflight_weight * n for t, n in zip(total, self.inflight)]
        if self.balance_abs and self._imbalanced(total):
            # The cheapest server is backed up: the cheapest of the least-waiting ones.
            least = min(self.waiting)
            total = [t if w == least else float("inf") for t, w in zip(total, self.waiting)]
            self.stats["balanced"] += 1
        best = min(total)
        tied = [i for i, c in enumerate(total) if c <= best + 1e-9]
        if len(tied) > 1:
            fewest = min(self.inflight[i] for i in tied)
            tied = [i for i in tied if self.inflight[i] == fewest]
            if len(tied) > 1:
                while (i := next(self.rr)) not in tied:
                    pass
                tied = [i]
        return tied[0]

    def _imbalanced(self, total: list[float]) -> bool:
        """Whether the server cheapest by `total` has more than `balance_abs` requests waiting
        for their first token beyond the least-waiting server, and more than `balance_rel`
        times as many."""
        w = self.waiting[min(range(len(total)), key=total.__getitem__)]
        least = min(self.waiting)
        return w - least > self.balance_abs and w > self.balance_rel * least

    async def completions(self, req: web.Request) -> web.StreamResponse:
        raw = await req.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return web.Response(status=400, text="router: the body is not JSON")
        i, work, blocks = await self.choose(body)
        self.stats["sent"][i] += 1
        self.stats["chosen_cost_blocks"] += work
        self.inflight[i] += 1
        self.waiting[i] += 1
        if self.queue_prompt and blocks:
            work = blocks
        self.queued_blocks[i] += work
        self.active_blocks[i] += blocks
        queued = [work, 1]

        def prefilled():
            # The first token is out: this request's prefill no longer waits on server i.
            self.queued_blocks[i] -= queued[0]
            self.waiting[i] -= queued[1]
            queued[0] = 0.0
            queued[1] = 0

        try:
            return await self._forward(req, self.backends[i], raw, prefilled)
        finally:
            self.inflight[i] -= 1
            self.active_blocks[i] -= blocks
            prefilled()

    async def _forward(self, req: web.Request, base: str, raw: bytes,
                       first=lambda: None) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in req.headers.items()
                   if k.lower() in ("content-type", "authorization", "accept")}
        async with self.session.request(req.method, base + req.path_qs, data=raw,
                                        headers=headers) as r:
            out = web.StreamResponse(status=r.status, headers={
                "Content-Type": r.headers.get("Content-Type", "application/json")})
            await out.prepare(req)
            async for chunk in r.content.iter_any():
                first()
                await out.write(chunk)
            await out.write_eof()
            return out

    async def other(self, req: web.Request) -> web.StreamResponse:
        """Anything else (/v1/models, /health): the first server answers."""
        return await self._forward(req, self.backends[0], await req.read())

    async def stats_handler(self, _req: web.Request) -> web.Response:
        out = dict(self.stats)
        if self.index is not None:
            out["index_complete"] = self.index.complete()
            out["index_blocks"] = [self.index.blocks()[str(i)]
                                   for i in range(len(self.backends))]
            out["index_events"] = self.index.events
        return web.json_response(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", choices=("prefix", "least-work", "round-robin"), required=True)
    ap.add_argument("--backends", required=True, help="the servers' base URLs, comma-separated")
    ap.add_argument("--cluster", default="",
                    help="each server's kvtierd cluster.listen address, in --backends' order")
    ap.add_argument("--via", default="", help="a kvtierd admin gRPC address (prefix policy)")
    ap.add_argument("--model", default="", help="the model as the servers name it (its path)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--engine-blocks", type=int, default=0,
                    help="blocks each server's own prefix cache holds (its KV pool): the router "
                         "estimates what each holds from what it sent there (0: no estimate)")
    ap.add_argument("--decode-load", action="store_true",
                    help="prefix: add the decode load (active blocks) to the cost")
    ap.add_argument("--queue", choices=("cost", "prompt"), default="cost",
                    help="prefix: count a queued request as kvtier's cost of it (cost) or as "
                         "all its prompt blocks (prompt)")
    ap.add_argument("--inflight-weight", type=float, default=0.0,
                    help="prefix: blocks of cost per request in flight on a server")
    ap.add_argument("--balance-abs", type=int, default=4,
                    help="prefix: the balance guard's margin, in requests waiting for their "
                         "first token (0: no guard)")
    ap.add_argument("--balance-rel", type=float, default=1.5,
                    help="prefix: the balance guard's ratio of waiting requests")
    ap.add_argument("--admin", default="",
                    help="prefix: each server's kvtierd admin gRPC address, in --backends' "
                         "order: score from the router's own index of the nodes' block events "
                         "(kvtier.router.Index) instead of a cluster Lookup a request")
    ap.add_argument("--lookup-timeout", type=float, default=2.0)
    ap.add_argument("--read-timeout", type=float, default=600.0,
                    help="seconds a server may stay silent within one response")
    a = ap.parse_args()
    if a.policy == "prefix" and not (a.via and a.model and
                                     len(a.cluster.split(",")) == len(a.backends.split(","))):
        sys.exit("router: --policy prefix needs --via, --model and one --cluster address per "
                 "backend")
    r = Router(a)
    if a.policy == "prefix":
        # vLLM's hashing (prompt_keys) imports much of vLLM: once, before taking traffic.
        r._costs(r._keys([0] * a.block_size))
        r.stats["prompt_blocks"] = 0
    if r.index is not None and not r.index.wait_complete(a.lookup_timeout + 5):
        print("router: the block index is not complete (a node holds blocks already, or its "
              "Watch stream is down): asking the cluster until it is", file=sys.stderr)
    # No bound on a whole streamed completion (a queued request's first token may take
    # minutes under overload), one on connecting and on each read: a server that stops
    # answering fails its requests, it does not hold them forever.
    r.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
        total=None, sock_connect=30, sock_read=a.read_timeout))
    app = web.Application(client_max_size=1 << 28)
    app.router.add_get("/router/stats", r.stats_handler)
    app.router.add_post("/v1/completions", r.completions)
    app.router.add_route("*", "/{tail:.*}", r.other)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp has no getter
    print(f"router ready: url=http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await r.session.close()
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())

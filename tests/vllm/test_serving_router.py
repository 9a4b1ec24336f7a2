"""bench/serving/router.py, the harness's router for configuration 4 of the served-traffic
benchmark, against two real kvtierd nodes in one cluster: a prompt whose prefix one node holds
goes to the server of that node; prompts no node holds alternate, or with --engine-blocks go
back to the server the router sent them to; a kvtierd that does not answer never stops traffic.
The two "servers" are HTTP endpoints that say who they are (the router only forwards; what vLLM
does with a request is test_serving_smoke's)."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvtier import Sidecar, router as kvrouter
from kvtier.vllm import namespace, prompt_keys
from ports import free_ports

REPO = Path(__file__).resolve().parents[2]
BS = 32


def backend(name, seen, gate=None, first_at_once=True, arrived=None, hold=None):
    """A server that answers who it is. With `gate`, a prompt whose last token is 1 streams
    its first bytes at once and the rest once `gate` is set (a request in its decode), or, if
    not `first_at_once`, nothing until then (a request still waiting for its prefill).
    With `hold`, a prompt whose last token is 2 gets nothing until `hold` is set (waiting for
    its prefill). `arrived` (a Condition) is notified of each request."""
    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if arrived is None:
                seen.append((name, body["prompt"]))
            else:
                with arrived:
                    seen.append((name, body["prompt"]))
                    arrived.notify_all()
            if hold is not None and body["prompt"][-1] == 2:
                assert hold.wait(60)
            elif gate is not None and body["prompt"][-1] == 1 and not first_at_once:
                assert gate.wait(60)
            elif gate is not None and body["prompt"][-1] == 1:
                # HTTP/1.0 without a length: the body ends when the connection closes.
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"backend": ')
                self.wfile.flush()
                assert gate.wait(60)
                self.wfile.write(json.dumps(name).encode() + b"}")
                return
            out = json.dumps({"backend": name}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def kvtierd(data_dir, listen, members, *extra):
    p = subprocess.Popen(
        [str(REPO / "target" / "debug" / "kvtierd"), "--data-dir", str(data_dir),
         "--host-capacity", "256M", "--set", "disk.enabled=false", "--grpc", "127.0.0.1:0",
         "--metrics", "127.0.0.1:0", "--set", "host.segment=16M", "--set", "log=warn",
         "--set", f"cluster.listen={listen}", "--set", f"cluster.members={members}", *extra],
        stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("kvtierd ready:"), line
    return p, dict(w.split("=", 1) for w in line.split() if "=" in w)


def start_router(servers, listen, nodes, *extra):
    """router.py --policy prefix over `servers` and the cluster of `nodes`, with `extra` flags:
    the process and its URL."""
    p = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "serving" / "router.py"), "--policy", "prefix",
         "--backends", ",".join(u for _, u in servers), "--cluster", ",".join(listen), "--via",
         nodes[0][1]["grpc"], "--model", "m", "--block-size", str(BS), *extra],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
    line = p.stdout.readline()
    if not line.startswith("router ready:"):
        p.kill()
        p.wait()
        raise AssertionError(line)
    return p, line.split("url=", 1)[1].strip()


def stream(url, prompt):
    """A completion whose first bytes have come back (the router has counted its prefill
    done): the open response, to read the rest of or close."""
    r = urllib.request.urlopen(urllib.request.Request(
        url + "/v1/completions", data=json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"}), timeout=60)
    assert r.read(1) == b"{"
    return r


def post(url, prompt):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["backend"]


def test_the_router_sends_a_prompt_where_its_prefix_is(tmp_path):
    ports = free_ports(2)
    listen = [f"127.0.0.1:{p}" for p in ports]
    members = "[" + ",".join(f'"{a}"' for a in listen) + "]"
    # Saved blocks are not pushed to their owners here: pushed, each of b's blocks that
    # placement gives to a would sit in a's host tier too, and where a owned all four (one
    # port draw in sixteen) both nodes held the prompt and the router rightly saw a tie.
    nodes = [kvtierd(tmp_path / f"n{i}", listen[i], members, "--set",
                     "cluster.push_queue_bytes=0") for i in range(2)]
    seen, gate, hold, arrived = [], threading.Event(), threading.Event(), threading.Condition()
    servers = [backend(n, seen, gate, arrived=arrived, hold=hold) for n in "ab"]
    router = None
    try:
        # Node b holds a 4-block prompt under the keys the vLLM connector would use.
        held = list(range(1000, 1000 + 4 * BS)) + [7]
        enc, _ = namespace("m", None, "auto", BS)
        side = Sidecar(nodes[1][1]["socket"], "router-test")
        ns = side.register_namespace(enc)
        keys = prompt_keys(held, model="m", block_size=BS, hash_seed="0")
        for k in keys:
            assert side.put(ns, k, b"k" * 4096)
        # The cluster is formed: node a, asked for the cluster, hears b's answer (a node that
        # started before its peer listened pauses asking it for a moment: b's blocks would be
        # unknown, and the router would rightly see no difference).
        end = time.monotonic() + 30
        while True:
            r = kvrouter.lookup(nodes[0][1]["grpc"], keys, cluster=True)
            if any(n["node"] == listen[1] and n["n"] == 4 and not n["error"]
                   for n in r["nodes"]):
                # ... and b alone holds it.
                assert [n["n"] for n in r["nodes"] if n["local"]] == [0], r
                break
            # Each lookup is a round trip through node a to node b: the loop is paced by them.
            assert time.monotonic() < end, r
        router = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "serving" / "router.py"), "--policy",
             "prefix", "--backends", ",".join(u for _, u in servers), "--cluster",
             ",".join(listen), "--via", nodes[0][1]["grpc"], "--model", "m", "--block-size",
             str(BS)],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
        line = router.stdout.readline()
        assert line.startswith("router ready:"), line
        url = line.split("url=", 1)[1].strip()

        # Wherever the request arrives first, the prompt goes to b, every time.
        assert [post(url, held) for _ in range(3)] == ["b"] * 3
        # Held nowhere: no server is cheaper, none is busier: one each.
        fresh = [post(url, list(range(5000 + 200 * i, 5000 + 200 * i + 3 * BS)))
                 for i in range(2)]
        assert sorted(fresh) == ["a", "b"], fresh
        # The body reached the server unchanged.
        assert seen[0] == ("b", held)
        stats = json.loads(urllib.request.urlopen(url + "/router/stats", timeout=10).read())
        assert stats["sent"] == [1, 4] and stats["lookup_errors"] == 0, stats

        # With an estimate of each server's own prefix cache (--engine-blocks: what the router
        # sent there), a prompt no kvtierd holds goes back to the server it went to first,
        # whose cache holds it, where the router above alternates between two equal servers.
        sticky = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "serving" / "router.py"), "--policy",
             "prefix", "--backends", ",".join(u for _, u in servers), "--cluster",
             ",".join(listen), "--via", nodes[0][1]["grpc"], "--model", "m", "--block-size",
             str(BS), "--engine-blocks", "64"],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
        try:
            line = sticky.stdout.readline()
            assert line.startswith("router ready:"), line
            surl = line.split("url=", 1)[1].strip()
            again = list(range(9000, 9000 + 3 * BS))
            first = post(surl, again)
            assert [post(surl, again) for _ in range(3)] == [first] * 3
            # What kvtier holds still counts: b's host memory beats a's estimate of nothing.
            assert post(surl, held) == "b"
            st = json.loads(urllib.request.urlopen(surl + "/router/stats", timeout=10).read())
            # Three requests chosen for the 3 blocks the estimate gave their server.
            assert st["engine_cache_blocks"] == 9 and st["lookup_errors"] == 0, st
        finally:
            sticky.kill()
            sticky.wait()

        # --decode-load (Dynamo's cost: prefill blocks + active blocks): a request still
        # streaming from b (first token out, its 4 blocks active there) makes b dearer by 4
        # blocks, and the prompt b holds goes to a, whose remote load of it costs 2 blocks
        # more than b's host memory. Without it (the default) it stays on b.
        bare = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "serving" / "router.py"), "--policy",
             "prefix", "--backends", ",".join(u for _, u in servers), "--cluster",
             ",".join(listen), "--via", nodes[0][1]["grpc"], "--model", "m", "--block-size",
             str(BS), "--decode-load"],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
        streams = []
        try:
            line = bare.stdout.readline()
            assert line.startswith("router ready:"), line
            burl = line.split("url=", 1)[1].strip()
            for u in (url, burl):
                streams.append(stream(u, held[:-1] + [1]))
                assert seen[-1] == ("b", held[:-1] + [1])
            assert post(url, held) == "b"
            assert post(burl, held) == "a"
            gate.set()
            for r in streams:
                assert json.loads(b"{" + r.read())["backend"] == "b"
        finally:
            gate.set()
            for r in streams:
                r.close()
            bare.kill()
            bare.wait()

        # --queue prompt: a request waiting on b for its prefill counts all 4 of its prompt
        # blocks there, where the default counts kvtier's cost of them (0.4: b's host memory
        # holds them). So the prompt b holds goes to a (a remote load, 2.4 < 0.4 + 4), where
        # the default router keeps it on b (0.4 + 0.4). --inflight-weight 3: a request in its
        # decode on b (first token out, nothing queued) makes b dearer by 3 blocks: a again.
        def wait_on_b(u, waiting):
            """A request for the prompt b holds, through the router at `u`, that waits on b
            for its prefill until `hold` is set."""
            t = threading.Thread(target=post, args=(u, held[:-1] + [2]), daemon=True)
            t.start()
            waiting.append(t)
            with arrived:
                assert arrived.wait_for(lambda: seen[-1][1][-1] == 2, 30), seen
                assert seen.pop() == ("b", held[:-1] + [2])

        routers, waiting = [], []
        try:
            for extra in (["--queue", "prompt"], ["--inflight-weight", "3"]):
                routers.append(start_router(servers, listen, nodes, *extra))
            qurl, iurl = (u for _, u in routers)
            for u in (url, qurl):
                wait_on_b(u, waiting)
            assert post(url, held) == "b"
            assert post(qurl, held) == "a"
            assert post(iurl, held) == "b"
            gate.clear()
            waiting.append(stream(iurl, held[:-1] + [1]))
            assert seen[-1] == ("b", held[:-1] + [1])
            assert post(iurl, held) == "a"
        finally:
            hold.set()
            gate.set()
            for w in waiting:
                if isinstance(w, threading.Thread):
                    w.join(60)
                else:
                    w.close()
            for p, _ in routers:
                p.kill()
                p.wait()

        # The balance guard (router.py's default: more than 4 requests waiting for a first
        # token beyond the least-waiting server, and 1.5 times as many): with a margin of 2,
        # three requests for the prompt b holds waiting on b for their prefill send the next
        # one to a, though b is still the cheaper by kvtier's cost (0.4 + 3 × 0.4 < 2.4, a's
        # remote load). Without the guard (--balance-abs 0) it stays on b.
        hold.clear()
        routers, waiting = [], []
        try:
            for margin in ("2", "0"):
                routers.append(start_router(servers, listen, nodes, "--balance-abs", margin))
            for _, u in routers:
                for _ in range(3):
                    wait_on_b(u, waiting)
            (_, gurl), (_, uurl) = routers
            assert post(gurl, held) == "a"
            assert post(uurl, held) == "b"
            assert router_stats(gurl)["balanced"] == 1
            assert router_stats(uurl)["balanced"] == 0
            # Once b's requests have their first tokens, the prompt goes back to b.
            hold.set()
            for w in waiting:
                w.join(60)
            assert post(gurl, held) == "b"
        finally:
            hold.set()
            for w in waiting:
                w.join(60)
            for p, _ in routers:
                p.kill()
                p.wait()

        # kvtierd gone: the router still serves, round-robin, and counts it.
        for p, _ in nodes:
            p.kill()
            p.wait()
        assert sorted(post(url, held) for _ in range(2)) == ["a", "b"]
        stats = json.loads(urllib.request.urlopen(url + "/router/stats", timeout=10).read())
        assert stats["lookup_errors"] == 2, stats
    finally:
        if router is not None:
            router.kill()
            router.wait()
        for s, _ in servers:
            s.shutdown()
        for p, _ in nodes:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)


def test_least_work_sends_a_prompt_where_less_prefill_waits():
    """`--policy least-work` (the harness's control for prefix routing): no kvtier lookup,
    each prompt goes to the server with the fewest prompt blocks waiting for a first token."""
    seen, gate, arrived = [], threading.Event(), threading.Condition()
    servers = [backend(n, seen, gate, first_at_once=False, arrived=arrived) for n in "ab"]
    router = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "serving" / "router.py"), "--policy",
         "least-work", "--backends", ",".join(u for _, u in servers), "--block-size", str(BS)],
        stdout=subprocess.PIPE, text=True)
    waiting = []
    try:
        line = router.stdout.readline()
        assert line.startswith("router ready:"), line
        url = line.split("url=", 1)[1].strip()

        def send_held(blocks):
            t = threading.Thread(target=post, args=(url, [1] * (blocks * BS)), daemon=True)
            t.start()
            waiting.append(t)
            with arrived:
                assert arrived.wait_for(lambda: len(seen) == len(waiting), 30), seen
                return seen[-1][0]

        # Ten blocks wait on one server, two on the other: new prompts go to the second,
        # however many, while its queue stays the shorter (round-robin would alternate).
        big = send_held(10)
        small = send_held(2)
        assert big != small
        assert [post(url, [2] * (3 * BS)) for _ in range(3)] == [small] * 3
        stats = json.loads(urllib.request.urlopen(url + "/router/stats", timeout=10).read())
        assert stats["lookups"] == 0, stats
    finally:
        gate.set()
        for t in waiting:
            t.join(60)
        router.kill()
        router.wait()
        for s, _ in servers:
            s.shutdown()


def router_stats(url):
    return json.loads(urllib.request.urlopen(url + "/router/stats", timeout=10).read())


def test_the_router_scores_from_its_own_index_of_the_nodes_block_events(tmp_path):
    """router.py --admin (kvtier.router.Index): subscribed to both nodes' Watch streams, the
    router scores a prompt from its own index, with no Lookup; stored and removed blocks reach
    the index; a router started when a node already holds blocks gets them from the node's
    snapshot and scores from its index too."""
    ports = free_ports(2)
    listen = [f"127.0.0.1:{p}" for p in ports]
    members = "[" + ",".join(f'"{a}"' for a in listen) + "]"
    # The test clears a namespace through the admin API (a write).
    nodes = [kvtierd(tmp_path / f"n{i}", listen[i], members, "--set",
                     "cluster.push_queue_bytes=0", "--set",
                     "server.allow_unauthenticated_admin=true") for i in range(2)]
    admin = ["--admin", ",".join(n[1]["grpc"] for n in nodes)]
    seen = []
    servers = [backend(n, seen) for n in "ab"]
    routers = []
    try:
        routers.append(start_router(servers, listen, nodes, *admin))
        url = routers[0][1]
        st = router_stats(url)
        assert st["index_complete"] and st["index_blocks"] == [0, 0], st

        # Node b stores a 4-block prompt under the keys the vLLM connector would use: its
        # events reach the router's index.
        held = list(range(1000, 1000 + 4 * BS)) + [7]
        enc, _ = namespace("m", None, "auto", BS)
        side = Sidecar(nodes[1][1]["socket"], "router-index-test")
        ns = side.register_namespace(enc)
        for k in prompt_keys(held, model="m", block_size=BS, hash_seed="0"):
            assert side.put(ns, k, b"k" * 4096)
        end = time.monotonic() + 30
        while (st := router_stats(url))["index_blocks"] != [0, 4]:
            # Each poll is a round trip to the router: the loop is paced by it.
            assert time.monotonic() < end, st
        assert [post(url, held) for _ in range(3)] == ["b"] * 3
        # Held nowhere: a tie, one each.
        fresh = [post(url, list(range(5000 + 200 * i, 5000 + 200 * i + 3 * BS)))
                 for i in range(2)]
        assert sorted(fresh) == ["a", "b"], fresh
        st = router_stats(url)
        assert st["index_answers"] == 5 and st["lookups"] == 0, st
        assert st["index_complete"], st

        # A second router, started after b stored the prompt: b's snapshot tells its index
        # those blocks; it sends the prompt to b with no Lookup.
        routers.append(start_router(servers, listen, nodes, *admin))
        late = routers[1][1]
        st = router_stats(late)
        assert st["index_complete"] and st["index_blocks"] == [0, 4], st
        assert post(late, held) == "b"
        st = router_stats(late)
        assert st["lookups"] == 0 and st["index_answers"] == 1, st

        # b's blocks removed (the namespace cleared through the admin API): the removals
        # reach the first router's index.
        subprocess.run([str(REPO / "target" / "debug" / "kvtier"), "--addr",
                        f"http://{nodes[1][1]['grpc']}", "clear", str(ns)], check=True,
                       timeout=60)
        end = time.monotonic() + 30
        while (st := router_stats(url))["index_blocks"] != [0, 0]:
            assert time.monotonic() < end, st
        assert st["index_complete"], st
    finally:
        for p, _ in routers:
            p.kill()
            p.wait()
        for p, _ in nodes:
            p.kill()
            p.wait()
        for s, _ in servers:
            s.shutdown()

//! The cluster under faults, between real sockets: a peer that stalls behind a proxy, a peer
//! that dies in the middle of a PUT, a flood of connections that never authenticate, a node
//! that joins, a peer that trickles its replies, a peer that reads a push slowly. Every wait has a deadline; no assertion is about wall-clock time.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::proxy::{Fault, Proxy};
use common::*;
use kvstore::{BlockKey, LowerTier};
use kvtier_cluster::wire;
use kvtier_proto::cluster::{request::Op, Auth, AuthReply, Block, Hello, Reply, Request};

/// `n` nodes, the last reached only through a proxy (its name among the members is the
/// proxy's address).
async fn with_a_proxy(n: usize) -> (Vec<Node>, Proxy) {
    let mut ls = Vec::new();
    for _ in 0..n {
        ls.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let real: Vec<String> = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let proxy = Proxy::start(real[n - 1].clone());
    let mut names = real.clone();
    names[n - 1] = proxy.addr.clone();
    let nodes = ls
        .into_iter()
        .enumerate()
        .map(|(i, l)| node(l, &names[i], &names, "s"))
        .collect();
    (nodes, proxy)
}

fn owner_of<'a>(nodes: &'a [Node], k: &BlockKey) -> &'a Node {
    let p = nodes[0].remote.placement();
    let o = p.owner(k).unwrap();
    nodes.iter().find(|n| n.addr == o).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_peer_costs_its_own_keys_and_strikes_never_the_healthy_peers() {
    let (nodes, proxy) = with_a_proxy(4).await;
    let id = register(&nodes);
    let (keys, data) = blocks_owned_by(24, 9, &nodes[0].remote.placement(), &nodes[3].addr);
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| wait_placed(&nodes, &keys));
    let stalled = &nodes[3].addr;
    assert!(keys.iter().any(|k| &owner_of(&nodes, k).addr == stalled));
    // D stops answering: its links stay open, nothing comes back (a black hole).
    proxy.set(Fault::Stall);
    let b = nodes[1].store;
    tokio::task::block_in_place(|| {
        // Lookups that need every peer at once: the stalled one costs its own keys only.
        for _ in 0..5 {
            let ks = keys.clone();
            let remote = nodes[1].remote.clone();
            let found = answered("a lookup past a stalled peer", Duration::from_secs(30), {
                move || remote.lookup_batch(&ks)
            });
            for (k, f) in keys.iter().zip(&found) {
                let o = owner_of(&nodes, k);
                if &o.addr != stalled && o.addr != nodes[1].addr {
                    assert!(f.is_some(), "a block of healthy {} was not found", o.addr);
                }
            }
        }
        // Loads one key at a time, as engines ask: every block a healthy node owns hits.
        for (i, k) in keys.iter().enumerate() {
            let o = owner_of(&nodes, k);
            let l = answered("a load past a stalled peer", Duration::from_secs(30), {
                let k = *k;
                move || b.load(&[k]).unwrap()
            });
            if &o.addr != stalled {
                assert_eq!(l.len(), 1, "block {i} of healthy {} missed", o.addr);
                assert_eq!(l.block(0), &data[i][..]);
            }
        }
    });
    // Strikes only against the stalled peer: the healthy ones never failed.
    for p in nodes[1].remote.peers() {
        if &p.addr == stalled {
            assert!(p.failures > 0, "{p:?}");
        } else if p.state != "self" {
            assert_eq!(p.failures, 0, "{p:?}");
            assert_eq!(p.state, "up", "{p:?}");
        }
    }
    // Healed: D answers again (after its breaker's pause).
    proxy.set(Fault::None);
    let d_keys: Vec<BlockKey> = keys
        .iter()
        .copied()
        .filter(|k| &owner_of(&nodes, k).addr == stalled)
        .collect();
    tokio::task::block_in_place(|| {
        wait_until("the healed peer serves again", 60, || {
            b.load(&d_keys[..1]).unwrap().len() == 1
        })
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_cut_mid_frame_store_nothing_partial_and_arrive_once_the_link_heals() {
    let (nodes, proxy) = with_a_proxy(2).await;
    let id = register(&nodes);
    let (keys, data) = blocks(16, 17);
    let to_b: Vec<usize> = (0..keys.len())
        .filter(|&i| owner_of(&nodes, &keys[i]).addr == nodes[1].addr)
        .collect();
    assert!(!to_b.is_empty());
    // The link to B dies 150 KB into the pushes: in the middle of a block's payload.
    proxy.set(Fault::CutAfter(150_000));
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    let a = nodes[0].store;
    tokio::task::block_in_place(|| wait_until("a push fails", 30, || a.stats().push_retries > 0));
    // Healed: the retries deliver every block B owns, whole (a cut block was never stored,
    // its reservation freed: the same key stores again).
    proxy.set(Fault::None);
    tokio::task::block_in_place(|| {
        wait_placed(&nodes, &keys);
        for &i in &to_b {
            let l = nodes[1].store.load(&keys[i..i + 1]).unwrap();
            assert_eq!(l.block(0), &data[i][..], "block {i}");
        }
    });
    assert_eq!(nodes[1].stats.corrupt.load(Relaxed), 0);
    assert_eq!(nodes[1].store.stats().blocks as usize, to_b.len());
}

/// A raw peer: connected and authenticated to `addr` with `secret`.
fn raw_peer(addr: &str, secret: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let hello: Hello = wire::read_header(&mut s).unwrap();
    let auth = Auth {
        version: hello.version,
        mac: wire::mac(secret, &hello.nonce),
        node: "raw".into(),
    };
    wire::write_header(&mut s, &auth).unwrap();
    let r: AuthReply = wire::read_header(&mut s).unwrap();
    assert!(r.error.is_empty(), "{}", r.error);
    s
}

fn put_header(id: u64, key: BlockKey, payload: &[u8], fp: kvstore::Fingerprint) -> Request {
    Request {
        id,
        op: Op::Put as i32,
        keys: Vec::new(),
        blocks: vec![Block {
            key: key.0.to_be_bytes().to_vec(),
            present: true,
            len: payload.len() as u32,
            checksum: kvstore::checksum(payload),
            fingerprint: wire::fp_bytes(fp),
            tier: 0,
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dies_mid_put_leaks_no_slot() {
    let nodes = cluster(1, &["s"]).await;
    let id = register(&nodes);
    let fp = nodes[0].store.fingerprint(id).unwrap();
    let key = BlockKey(0xdead_beef);
    let payload: Vec<u8> = (0..1 << 20).map(|i| (i * 7) as u8).collect();
    let addr = nodes[0].addr.clone();
    tokio::task::block_in_place(|| {
        // Half a block, then silence (no FIN, no reset: a peer that lost power).
        let mut dying = raw_peer(&addr, "s");
        dying
            .write_all(&wire::encode_header(&put_header(1, key, &payload, fp)))
            .unwrap();
        dying.write_all(&payload[..100_000]).unwrap();
        // The reservation is freed at the deadline: the same block can be stored again (while
        // the half-PUT held it, another writer was told "present").
        wait_until("the half-written block's slot is freed", 30, || {
            let mut s = raw_peer(&addr, "s");
            s.write_all(&wire::encode_header(&put_header(2, key, &payload, fp)))
                .unwrap();
            s.write_all(&payload).unwrap();
            let r: Reply = wire::read_header(&mut s).unwrap();
            r.outcomes == [wire::PutOutcome::Stored as u32]
        });
        // And the dying connection was closed by the server.
        let mut b = [0u8; 1];
        assert!(matches!(dying.read(&mut b), Ok(0) | Err(_)));
        let l = nodes[0].store.load(&[key]).unwrap();
        assert_eq!(l.block(0), &payload[..]);
    });
}

/// A connection from `ip` (another loopback address: a host that is not a member).
fn connect_from(ip: &str, to: &str) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(
        &format!("{ip}:0")
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    s.connect(&to.parse::<std::net::SocketAddr>().unwrap().into())
        .unwrap();
    s.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unauthenticated_connections_is_capped_while_peers_keep_loading() {
    // Set-up deadlines far longer than accepting the flood takes: the 16 held connections must
    // not expire (and give their places to later ones) while the server is still accepting the
    // rest, as 1.5 s deadlines did on a loaded machine (284 refusals not reached).
    let nodes = cluster_timed(2, &["s"], Duration::from_secs(60)).await;
    let id = register(&nodes);
    let (keys, data) = blocks(20, 11);
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| wait_placed(&nodes, &keys));
    let a = &nodes[0];
    let b = nodes[1].store;
    tokio::task::block_in_place(|| {
        // Frames bigger than any Auth: closed at once, never allocated.
        for _ in 0..20 {
            let mut s = connect_from("127.0.0.2", &a.addr);
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let _: Hello = wire::read_header(&mut s).unwrap();
            s.write_all(&(16u32 << 20).to_le_bytes()).unwrap();
            let mut rest = Vec::new();
            assert!(s.read_to_end(&mut rest).is_ok() || rest.is_empty());
        }
        assert_eq!(a.stats.auth_bad_frames.load(Relaxed), 20);
        // Hundreds of connections that never authenticate, held open.
        let flood: Vec<TcpStream> = (0..300)
            .map(|_| connect_from("127.0.0.2", &a.addr))
            .collect();
        wait_until("connections past the cap are refused", 30, || {
            a.stats.refused.load(Relaxed) >= 300 - 16
        });
        // Meanwhile B (another address) loads A's blocks on fresh connections.
        for p in nodes[1].remote.peers() {
            assert_ne!(p.state, "down", "{p:?}");
        }
        for (i, k) in keys.iter().enumerate() {
            if owner_of(&nodes, k).addr == a.addr {
                let l = b.load(&[*k]).unwrap();
                assert_eq!(l.len(), 1, "block {i}");
                assert_eq!(l.block(0), &data[i][..]);
            }
        }
        drop(flood);
    });
    assert_eq!(a.stats.auth_failures.load(Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_joins_costs_no_hits() {
    let mut ls = Vec::new();
    for _ in 0..4 {
        ls.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<String> = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let fourth = ls.pop().unwrap();
    let mut nodes: Vec<Node> = ls
        .into_iter()
        .enumerate()
        .map(|(i, l)| node(l, &addrs[i], &addrs[..3], "s"))
        .collect();
    let id = register(&nodes);
    let members: Vec<kvtier_cluster::Member> = addrs
        .iter()
        .map(|a| kvtier_cluster::Member::new(a.clone(), 1.0))
        .collect();
    // D, once it joins, owns some of these blocks.
    let (keys, data) = blocks_owned_by(
        24,
        13,
        &kvtier_cluster::Placement::new(members.clone()),
        &addrs[3],
    );
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| wait_placed(&nodes, &keys));
    // D joins: it owns a share of blocks it has never seen.
    nodes.push(node(fourth, &addrs[3], &addrs, "s"));
    nodes[3].store.register_namespace(&ns()).unwrap();
    for n in &nodes[..3] {
        n.remote.set_members(members.clone());
    }
    let moved = keys
        .iter()
        .filter(|k| owner_of(&nodes, k).addr == addrs[3])
        .count();
    assert!(moved > 0);
    // Every node, D included, still loads the whole prefix: from the previous owners.
    tokio::task::block_in_place(|| {
        for n in &nodes {
            let l = n.store.load(&keys).unwrap();
            assert_eq!(l.len(), keys.len(), "through {}", n.addr);
            for (i, d) in data.iter().enumerate() {
                assert_eq!(l.block(i), &d[..]);
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_cleanly_hands_its_blocks_over() {
    let nodes = cluster(3, &["s"]).await;
    let id = register(&nodes);
    let (keys, data) = blocks(24, 19);
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| wait_placed(&nodes, &keys));
    let c = &nodes[2];
    let its = keys
        .iter()
        .filter(|k| owner_of(&nodes, k).addr == c.addr)
        .count();
    assert!(its > 0);
    // C stops cleanly: its host blocks go to their next owners, then it stops answering.
    let r = tokio::task::block_in_place(|| {
        kvtier_cluster::hand_over(
            c.store,
            &c.remote,
            64 << 20,
            Instant::now() + Duration::from_secs(30),
        )
    });
    // Each of C's blocks is at its next owner now: sent, or there already (A saved them).
    assert_eq!(r.left, 0, "{r:?}");
    assert_eq!(r.blocks as usize, its, "{r:?}");
    c.server.abort();
    // A's copies of blocks it does not own (after C) go (evicted, say): what C owned is found
    // only where C handed it.
    let after = kvtier_cluster::Placement::new(
        nodes[..2]
            .iter()
            .map(|n| kvtier_cluster::Member::new(n.addr.clone(), 1.0))
            .collect(),
    );
    for k in &keys {
        if after.owner(k) != Some(nodes[0].addr.as_str()) {
            nodes[0].store.remove(k);
        }
    }
    // The prefix still loads through A and B (whose members still name C: C refuses, its
    // blocks' next member answers).
    tokio::task::block_in_place(|| {
        for n in &nodes[..2] {
            let l = n.store.load(&keys).unwrap();
            assert_eq!(l.len(), keys.len(), "through {}", n.addr);
            for (i, d) in data.iter().enumerate() {
                assert_eq!(l.block(i), &d[..]);
            }
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_whose_slot_changed_after_its_commit_is_refused_and_counted_damaged() {
    let nodes = cluster(2, &["s"]).await;
    let id = register(&nodes);
    let (keys, data) = blocks_owned_by(8, 21, &nodes[0].remote.placement(), &nodes[1].addr);
    let i = (0..keys.len())
        .find(|&i| owner_of(&nodes, &keys[i]).addr == nodes[1].addr)
        .unwrap();
    let mut bytes = data[i].clone();
    // Committed with these bytes' checksum; then an engine wrote into the slot.
    let committed = kvstore::checksum(&bytes);
    bytes[1000] ^= 0xff;
    let out = tokio::task::block_in_place(|| {
        let item = kvstore::WriteItem {
            key: keys[i],
            ns: id.0 as u16,
            // SAFETY: `bytes` outlives the call and nobody else touches it.
            buf: unsafe { kvstore::io::IoBuf::from_raw(bytes.as_mut_ptr(), bytes.len()) },
            len: bytes.len() as u32,
            checksum: committed,
        };
        nodes[0].remote.write(vec![item], &|_| true)
    });
    assert_eq!(out, vec![kvstore::WriteOutcome::Corrupt]);
    assert_eq!(nodes[1].stats.corrupt.load(Relaxed), 1);
    assert!(nodes[1].store.probe_local(&keys[i..i + 1])[0].is_none());
}

/// A peer that answers a GET a few bytes at a time costs a miss by the deadline, never a load
/// held for as long as it takes: the reader's deadline bounds all the reads of a reply (its
/// header and each block's payload), not each read. Nothing partial is served or kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_trickles_its_blocks_costs_a_miss_by_the_deadline() {
    let (nodes, proxy) = with_a_proxy(3).await;
    let id = register(&nodes);
    let slow = nodes[2].addr.clone();
    let (keys, data) = blocks_owned_by(8, 21, &nodes[0].remote.placement(), &slow);
    // Its own blocks, stored there only (no other node could serve them at speed).
    let theirs: Vec<usize> = (0..keys.len())
        .filter(|&i| owner_of(&nodes, &keys[i]).addr == slow)
        .collect();
    for &i in &theirs {
        nodes[2].store.put(id, keys[i], &data[i]).unwrap();
    }
    let (i, j) = (theirs[0], *theirs.last().unwrap());
    // Its replies come back at 256 bytes per 20 ms (12.8 KB/s): the handshake and a reply's
    // header well within the 1.5 s deadline, a block of 100 KB in 8 s.
    proxy.set(Fault::Trickle {
        bytes: 256,
        every: Duration::from_millis(20),
    });
    let b = nodes[1].store;
    let errors = nodes[1].remote.stats().read_errors;
    tokio::task::block_in_place(|| {
        let k = keys[i];
        let l = answered("a load from a trickling peer", Duration::from_secs(30), {
            move || b.load(&[k]).unwrap().len()
        });
        assert_eq!(l, 0, "a block that never arrived whole was served");
    });
    // The read itself ends by its deadline, as an error (with a timeout per read only, it
    // ran on for the 8 s, holding the tier's reader, and then succeeded).
    tokio::task::block_in_place(|| {
        wait_until("the trickled read ends as an error", 30, || {
            nodes[1].remote.stats().read_errors > errors
        })
    });
    let t = nodes[1].remote.stats();
    assert_eq!(t.checksum_failures, 0, "{t:?}");
    assert!(!b.in_host(&keys[i]), "part of a block was kept");
    // At speed again: its blocks load whole.
    proxy.set(Fault::None);
    tokio::task::block_in_place(|| {
        wait_until("the peer serves at speed again", 60, || {
            let l = b.load(&keys[j..=j]).unwrap();
            l.len() == 1 && l.block(0) == &data[j][..]
        })
    });
}

/// A peer that reads a push a few bytes at a time costs the push its deadline, never a pusher
/// held for as long as it takes: the writer's deadline bounds all the writes of a request
/// (its header and the block's payload), not each write. Nothing partial is stored, and the
/// block arrives whole once the peer reads at speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_reads_a_push_slowly_costs_the_push_its_deadline() {
    // The slow reader's own server waits for the payload for two minutes, so only the
    // pushing side's deadline can end the push.
    let (la, lb) = (
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    );
    let a = la.local_addr().unwrap().to_string();
    let proxy = Proxy::start(lb.local_addr().unwrap().to_string());
    let names = [a.clone(), proxy.addr.clone()];
    let nodes = [
        node(la, &a, &names, "s"),
        node_timed(lb, &proxy.addr, &names, "s", Duration::from_secs(120)),
    ];
    let id = register(&nodes);
    let slow = nodes[1].addr.clone();
    let (keys, _) = blocks_owned_by(8, 31, &nodes[0].remote.placement(), &slow);
    let k = *keys
        .iter()
        .find(|k| owner_of(&nodes, k).addr == slow)
        .unwrap();
    // Far more than the sockets' buffers hold (at most 4 MiB waiting to be sent here), so the
    // writer waits on the reader.
    let data: Vec<u8> = (0..12usize << 20)
        .map(|j| (j as u8) ^ ((j >> 13) as u8))
        .collect();
    // It reads at 32 KiB per 100 ms (328 KB/s): the block would take 38 s.
    proxy.set(Fault::SlowReader {
        bytes: 32 << 10,
        every: Duration::from_millis(100),
    });
    let errors = nodes[0].remote.stats().write_errors;
    nodes[0].store.put(id, k, &data).unwrap();
    // With a timeout per write only, each write went on as long as a few bytes moved, and no
    // error came in the 30 s.
    tokio::task::block_in_place(|| {
        wait_until("the slow push ends as an error", 30, || {
            nodes[0].remote.stats().write_errors > errors
        })
    });
    assert!(
        nodes[1].store.probe_local(&[k])[0].is_none(),
        "part of a block was stored"
    );
    // At speed again: the push's retry lands the block whole.
    proxy.set(Fault::None);
    tokio::task::block_in_place(|| {
        wait_placed(&nodes, &[k]);
        let l = nodes[1].store.load(&[k]).unwrap();
        assert_eq!(l.len(), 1);
        assert!(l.block(0) == &data[..], "the pushed block differs");
    });
}

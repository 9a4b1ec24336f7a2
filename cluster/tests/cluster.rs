//! Three stores in one process, each with its data-plane server on a real loopback socket and
//! the remote tier in its chain: blocks saved on one node are found and loaded on another.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvstore::{BlockKey, LowerTier, StoreConfig, Tier};
use kvtier_cluster::{Member, RemoteConfig, RemoteTier};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_saved_on_one_node_loads_byte_exact_on_another() {
    let nodes = cluster(3, &["s3cret"]).await;
    let id = register(&nodes);
    let (keys, data) = blocks(12, 1);
    let a = nodes[0].store;
    let events = a.subscribe(1024);
    for (k, d) in keys.iter().zip(&data) {
        a.put(id, *k, d).unwrap();
    }
    let own = keys
        .iter()
        .filter(|k| nodes[0].remote.placement().owner(k) == Some(nodes[0].addr.as_str()))
        .count();
    tokio::task::block_in_place(|| {
        wait_placed(&nodes, &keys);
        // A counts a push once the owner's answer is back: that may come a little after the
        // owner holds the block.
        let until = Instant::now() + Duration::from_secs(60);
        while (a.stats().pushes as usize) < keys.len() - own && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let s = a.stats();
    assert_eq!(s.pushes as usize, keys.len() - own, "{s:?}");
    // Each acknowledged push is an event: stored in the remote tier (KV events' `REMOTE`).
    let pushed: std::collections::HashSet<BlockKey> = events
        .try_iter()
        .filter(|e| e.tier == Tier::Remote)
        .map(|e| {
            assert_eq!(e.kind, kvstore::EventKind::Stored);
            e.key
        })
        .collect();
    let to_others: std::collections::HashSet<BlockKey> = keys
        .iter()
        .copied()
        .filter(|k| nodes[0].remote.placement().owner(k) != Some(nodes[0].addr.as_str()))
        .collect();
    assert_eq!(pushed, to_others);
    let c = nodes[2].store;
    tokio::task::block_in_place(|| {
        // The lookup names the tier of each block; two nodes agree on the owners.
        let m = c.match_prefix(&keys);
        assert_eq!(m.n, keys.len());
        assert!(m.tiers.contains(&Tier::Remote), "{:?}", m.tiers);
        let l = c.load(&keys).unwrap();
        assert_eq!(l.len(), keys.len());
        for (i, d) in data.iter().enumerate() {
            assert_eq!(l.block(i), &d[..], "block {i}");
        }
        drop(l);
        // Now in C's host memory.
        assert_eq!(c.match_prefix(&keys).tiers, vec![Tier::Host; keys.len()]);
        let remote = c
            .stats()
            .tiers
            .into_iter()
            .find(|t| t.tier == Some(Tier::Remote));
        assert!(remote.unwrap().bytes_read > 0);
    });
    assert_eq!(
        nodes[1].remote.placement().owner(&keys[3]),
        nodes[2].remote.placement().owner(&keys[3])
    );
    for n in &nodes {
        assert_eq!(n.stats.auth_failures.load(Relaxed), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_refused_and_its_blocks_stay_local() {
    let nodes = cluster(2, &["right", "wrong"]).await;
    let id = register(&nodes);
    // Some block is B's, so A tries to push it.
    let (keys, data) = blocks_owned_by(8, 2, &nodes[0].remote.placement(), &nodes[1].addr);
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| {
        let until = Instant::now() + Duration::from_secs(10);
        // Failed pushes are tried again later (and given up after 21 s).
        while nodes[0].store.stats().push_retries == 0 {
            assert!(Instant::now() < until);
            std::thread::sleep(Duration::from_millis(20));
        }
        // B cannot read A's blocks either: the prefix ends at the first block B does not own.
        let m = nodes[1].store.match_prefix(&keys);
        assert!(m.tiers.iter().all(|t| *t == Tier::Host));
    });
    assert!(nodes[1].stats.auth_failures.load(Relaxed) > 0);
    assert!(nodes[0].stats.auth_failures.load(Relaxed) > 0);
    let st = nodes[0].remote.peers();
    assert!(st.iter().any(|p| p.state == "self"));
    assert!(st.iter().any(|p| p.failures > 0), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_costs_a_miss_within_the_deadline_and_opens_its_breaker() {
    let nodes = cluster(2, &["s"]).await;
    let id = register(&nodes);
    let (keys, data) = blocks(16, 3);
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| wait_placed(&nodes, &keys));
    // B goes away: its server stops (connections drop) and its address stops answering.
    nodes[0].server.abort();
    let b = nodes[1].store;
    tokio::task::block_in_place(|| {
        for _ in 0..4 {
            // Answered (at its 1 s deadline), not hung on the dead peer: a hang fails here.
            let ks = keys.clone();
            let l = answered(
                "a load past a dead peer",
                Duration::from_secs(30),
                move || b.load(&ks).unwrap(),
            );
            // Only what B itself owns can be served, and only the leading run of it.
            for (i, d) in data.iter().enumerate().take(l.len()) {
                assert_eq!(l.block(i), &d[..]);
            }
            assert!(l.len() < keys.len());
        }
        let st = nodes[1].remote.peers();
        let a = st.iter().find(|p| p.addr == nodes[0].addr).unwrap();
        assert!(a.failures >= 1, "{st:?}");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_to_an_owner_that_was_down_are_retried_when_it_is_back() {
    let mut nodes = cluster(2, &["s"]).await;
    let id = register(&nodes);
    // B's server goes away before anything is saved (its listener with it, once the task is
    // dropped): A's pushes to B fail.
    nodes[1].server.abort();
    let _ = (&mut nodes[1].server).await;
    let (keys, data) = blocks(16, 4);
    let to_b = put_owned(&nodes[0], id, &keys, &data, &nodes[1]);
    assert!(to_b > 0);
    tokio::task::block_in_place(|| {
        let until = Instant::now() + Duration::from_secs(10);
        while nodes[0].store.stats().push_retries == 0 {
            assert!(Instant::now() < until, "no push failed");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    // B is back on its address (same store): the retries deliver every block it owns.
    let again = serve_again(&nodes[1], "s", DEADLINE).await;
    tokio::task::block_in_place(|| {
        let until = Instant::now() + Duration::from_secs(30);
        while (nodes[0].store.stats().pushes as usize) < to_b {
            assert!(
                Instant::now() < until,
                "retried pushes did not arrive: {:?}",
                nodes[0].store.stats()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        wait_placed(&nodes, &keys);
        // Byte-exact on B, from its own host memory.
        let b = nodes[1].store;
        let mine: Vec<(usize, BlockKey)> = keys
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, k)| nodes[0].remote.placement().owner(k) == Some(nodes[1].addr.as_str()))
            .collect();
        for (i, k) in mine {
            assert!(b.probe_local(&[k])[0].is_some());
            let l = b.load(&[k]).unwrap();
            assert_eq!(l.block(0), &data[i][..], "block {i}");
        }
    });
    let s = nodes[0].store.stats();
    assert_eq!(s.push_failed, 0, "{s:?}");
    again.abort();
}

/// An owner down for longer than the pinned retries (1 s, 4 s, 16 s by default; 10, 40, 160 ms
/// here) still gets its blocks once it is back: the later tries (64×, 256×, 1,024× the first
/// wait) hold only the keys, so meanwhile no block is pinned for it and no queue byte used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_down_past_the_pinned_retries_still_gets_its_blocks() {
    let mut nodes = cluster_with(2, &["s"], DEADLINE, Duration::from_millis(10)).await;
    let id = register(&nodes);
    nodes[1].server.abort();
    let _ = (&mut nodes[1].server).await;
    let (keys, data) = blocks_owned_by(8, 5, &nodes[0].remote.placement(), &nodes[1].addr);
    let to_b = put_owned(&nodes[0], id, &keys, &data, &nodes[1]);
    let a = nodes[0].store;
    tokio::task::block_in_place(|| {
        // Every block of B's past its pinned tries (3 each, then a late one queued): none
        // pinned or queued for the push any more.
        let past_pinned = poll_until(30, || {
            let s = a.stats();
            s.push_retries >= 4 * to_b as u64 && s.push_queue_bytes == 0
        });
        assert!(past_pinned, "{:?}", a.stats());
        assert_eq!(a.stats().pushes, 0);
    });
    // One of them leaves A's memory meanwhile: its late try gives it up (nothing to pin).
    let b_owns =
        |k: &BlockKey| nodes[0].remote.placement().owner(k) == Some(nodes[1].addr.as_str());
    let gone = *keys.iter().find(|k| b_owns(k)).unwrap();
    assert!(a.remove(&gone));
    let again = serve_again(&nodes[1], "s", DEADLINE).await;
    tokio::task::block_in_place(|| {
        let arrived = poll_until(60, || {
            let s = a.stats();
            s.pushes as usize >= to_b - 1 && s.push_failed >= 1
        });
        assert!(arrived, "late pushes did not arrive: {:?}", a.stats());
        let b = nodes[1].store;
        for (i, k) in keys.iter().enumerate() {
            if b_owns(k) && *k != gone {
                assert!(b.probe_local(&[*k])[0].is_some(), "block {i} pushed to B");
                assert_eq!(b.load(&[*k]).unwrap().block(0), &data[i][..], "block {i}");
            }
        }
        assert!(
            b.probe_local(&[gone])[0].is_none(),
            "the removed block was pushed"
        );
    });
    let s = a.stats();
    assert_eq!((s.pushes as usize, s.push_failed), (to_b - 1, 1), "{s:?}");
    again.abort();
}

/// A late push (the pusher's tries minutes after a push failed) that finds its owner's
/// breaker past its pause probes the owner there and then, and the owner, back, gets the
/// block. An ordinary push in the same state starts the probe in the background and is busy
/// meanwhile (so a first try never waits on a peer that keeps failing): with nothing else
/// asking that owner, a last try made that way was lost although the owner was back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_push_probes_an_owner_whose_breaker_pause_ended() {
    let mut nodes = cluster(2, &["s"]).await;
    let id = register(&nodes);
    nodes[1].server.abort();
    let _ = (&mut nodes[1].server).await;
    let (keys, data) = blocks_owned_by(8, 31, &nodes[0].remote.placement(), &nodes[1].addr);
    let i = first_owned_by(&nodes[0], &keys, &nodes[1].addr);
    let item = |i: usize| write_item(keys[i], id, &data[i]);
    let b_state = || Some(peer_status(&nodes[0], &nodes[1].addr).state);
    // B is down; failed lookups (three) open A's breaker for it, and its pause ends with
    // nothing asking B since.
    let breaker_past_its_pause = || {
        tokio::task::block_in_place(|| {
            wait_until("A's breaker for B opens", 30, || {
                nodes[0].remote.held_by_owners(&keys);
                b_state() == Some("down")
            });
            wait_until("B's breaker pause ends", 30, || {
                b_state() == Some("failing")
            });
        })
    };
    breaker_past_its_pause();
    // B is back.
    let again = serve_again(&nodes[1], "s", DEADLINE).await;
    tokio::task::block_in_place(|| {
        // An ordinary push: busy, and the probe it started closes the breaker.
        let out = nodes[0].remote.write(vec![item(i)], &|_| true);
        assert_eq!(out, vec![kvstore::WriteOutcome::Busy]);
        wait_until("the background probe finds B", 30, || {
            b_state() == Some("up")
        });
        assert!(nodes[1].store.probe_local(&keys[i..=i])[0].is_none());
    });
    // The same again: B down, its breaker past its pause, B back.
    again.abort();
    let _ = again.await;
    breaker_past_its_pause();
    let again = serve_again(&nodes[1], "s", DEADLINE).await;
    tokio::task::block_in_place(|| {
        // A late push in the same state goes through at once.
        let out = nodes[0].remote.write_late(vec![item(i)], &|_| true);
        assert_eq!(out, vec![kvstore::WriteOutcome::Written]);
        assert_eq!(b_state(), Some("up"));
        let b = nodes[1].store;
        assert_eq!(b.load(&keys[i..=i]).unwrap().block(0), &data[i][..]);
    });
    again.abort();
}

/// A late push whose owner's breaker is past its pause and whose owner accepts connections but
/// never answers (a black hole): the push waits its short probe, is busy, and leaves the
/// verdict to a background probe with the whole timeout (a second connection), so the short
/// wait alone never doubles the pause (which reads then live with); that probe then does,
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_push_leaves_a_silent_owner_to_the_background_probe() {
    let mut nodes = cluster(2, &["s"]).await;
    let id = register(&nodes);
    nodes[1].server.abort();
    let _ = (&mut nodes[1].server).await;
    // B's address now accepts and never says a word.
    let hole = std::net::TcpListener::bind(&nodes[1].addr).unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in hole.incoming() {
            counted.fetch_add(1, Relaxed);
            held.extend(s.ok());
        }
    });
    let (keys, data) = blocks_owned_by(8, 33, &nodes[0].remote.placement(), &nodes[1].addr);
    let i = first_owned_by(&nodes[0], &keys, &nodes[1].addr);
    let b = || peer_status(&nodes[0], &nodes[1].addr);
    let b_state = || Some(b().state);
    tokio::task::block_in_place(|| {
        wait_until("A's breaker for B opens", 60, || {
            nodes[0].remote.held_by_owners(&keys);
            b_state() == Some("down")
        });
        wait_until("B's breaker pause ends", 30, || {
            b_state() == Some("failing")
        });
        let item = write_item(keys[i], id, &data[i]);
        let (connections, failures) = (accepted.load(Relaxed), b().failures);
        let out = nodes[0].remote.write_late(vec![item], &|_| true);
        assert_eq!(out, vec![kvstore::WriteOutcome::Busy]);
        // The background probe (a second connection) reopens the breaker.
        wait_until("the background probe reopens B's breaker", 30, || {
            b_state() == Some("down") && accepted.load(Relaxed) >= connections + 2
        });
        // One failure counted: the background probe's, not the short one's too.
        assert_eq!(b().failures, failures + 1);
    });
}

/// A peer that answers every question and then sends bytes that are not the block it
/// announced: the block is a miss, counted, and never published.
#[test]
fn a_damaged_block_from_a_peer_is_a_miss() {
    use kvtier_cluster::wire;
    use kvtier_proto::cluster::{request::Op, Auth, AuthReply, Block, Hello, Reply, Request};
    use std::io::Write;

    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let liar = l.local_addr().unwrap().to_string();
    let me = "127.0.0.1:1".to_string();
    let fp = ns().fingerprint();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let mut s = s.unwrap();
            wire::write_header(
                &mut s,
                &Hello {
                    version: kvtier_proto::CLUSTER_VERSION,
                    nonce: vec![1; 32],
                    node: String::new(),
                    capacity: 1,
                },
            )
            .unwrap();
            let _: Auth = wire::read_header(&mut s).unwrap();
            wire::write_header(&mut s, &AuthReply::default()).unwrap();
            while let Ok(req) = wire::read_header::<Request>(&mut s) {
                let keys = wire::unpack_keys(&req.keys).unwrap();
                let blocks = keys
                    .iter()
                    .map(|k| Block {
                        key: k.0.to_be_bytes().to_vec(),
                        present: true,
                        len: 8192,
                        checksum: kvstore::checksum(&[7u8; 8192]),
                        fingerprint: wire::fp_bytes(fp),
                        tier: 1,
                    })
                    .collect();
                wire::write_header(
                    &mut s,
                    &Reply {
                        id: req.id,
                        blocks,
                        ..Default::default()
                    },
                )
                .unwrap();
                if req.op == Op::Get as i32 {
                    for _ in &keys {
                        s.write_all(&[8u8; 8192]).unwrap();
                    }
                }
            }
        }
    });
    let remote = Arc::new(
        RemoteTier::new(RemoteConfig {
            me: me.clone(),
            members: vec![Member::new(me, 1e-9), Member::new(liar, 1e9)],
            secret: String::new(),
            timeout: Duration::from_secs(2),
            replicas: 1,
            handoff: Duration::from_secs(600),
        })
        .unwrap(),
    );
    let store = StoreConfig {
        capacity_bytes: 32 << 20,
        segment_bytes: 16 << 20,
        remote: Some(kvstore::SharedTier(remote.clone())),
        ..Default::default()
    }
    .build()
    .unwrap();
    store.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[5; 48], &[]);
    assert_eq!(store.match_prefix(&keys).n, 3, "the liar says it has them");
    let l = store.load(&keys).unwrap();
    assert_eq!(l.len(), 0, "nothing damaged is served");
    drop(l);
    let t = store
        .stats()
        .tiers
        .into_iter()
        .find(|t| t.tier == Some(Tier::Remote))
        .unwrap();
    assert_eq!(t.checksum_failures, 3, "{t:?}");
    assert!(!store.in_host(&keys[0]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_preloads_remote_blocks_into_host_memory() {
    let nodes = cluster(2, &["s"]).await;
    let id = register(&nodes);
    let (keys, data) = blocks(10, 4);
    for (k, d) in keys.iter().zip(&data) {
        nodes[0].store.put(id, *k, d).unwrap();
    }
    tokio::task::block_in_place(|| {
        wait_placed(&nodes, &keys);
        let b = nodes[1].store;
        let far = Instant::now() + Duration::from_secs(30);
        let p = b.prefetch(&keys, 0, far, 7);
        assert_eq!(p.present, keys.len(), "{p:?}");
        let until = Instant::now() + Duration::from_secs(10);
        while !keys.iter().all(|k| b.in_host(k)) {
            assert!(
                Instant::now() < until,
                "not preloaded: {:?}",
                b.stats().prefetch
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let l = b.load(&keys).unwrap();
        assert_eq!(l.len(), keys.len());
        for (i, d) in data.iter().enumerate() {
            assert_eq!(l.block(i), &d[..]);
        }
        let own = keys
            .iter()
            .filter(|k| nodes[1].remote.placement().owner(k) == Some(nodes[1].addr.as_str()))
            .count();
        assert_eq!(
            b.stats().prefetch.in_time as usize,
            keys.len() - own,
            "the remote blocks were read ahead, not at load"
        );
    });
}

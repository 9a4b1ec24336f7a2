//! Issue 35's freeze, as an operator would stress it: engines hint, load and cancel
//! disk-resident prefixes under host-memory pressure, connect and disconnect, while the admin
//! side reads stats and metrics. Every request is answered within its own deadline (each
//! engine connection's reads and writes are bounded; a call past it fails the test), every
//! block served is its own bytes, and the daemon keeps serving and stops on SIGTERM.
//!
//! The run lasts `KVTIER_STRESS_SECS` (default 20; the independent check runs minutes).

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvstore::BlockKey;
use kvtier_ipc::IpcClient;

/// How long any one engine or admin request may take before the test fails: far above what
/// a loaded 2-core machine needs (a load waits at most its 2 s), far below a freeze.
const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// Conversations: each is a chain of 12 blocks; 24 of them (~29 MB) through a 6 MiB host tier.
const CHAINS: u64 = 24;
const CHAIN: u64 = 12;

fn chain(c: u64) -> Vec<u64> {
    (0..CHAIN).map(|j| c * CHAIN + j).collect()
}

fn connect(socket: &Path, name: &str) -> IpcClient {
    let c = IpcClient::connect(socket, name).expect("connect");
    c.set_timeout(REQUEST_DEADLINE).expect("timeout");
    c
}

#[test]
fn hints_loads_and_cancels_under_host_pressure_never_freeze_the_daemon() {
    let secs: u64 = std::env::var("KVTIER_STRESS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    // The operator's setup: a host tier far smaller than the working set, a disk tier that
    // admits everything, preloading on (the defaults).
    let d = Kvtierd::start(
        "stress",
        &[
            "--set",
            "host.capacity=6M",
            "--set",
            "host.segment=1M",
            "--set",
            "disk.admission=always",
        ],
        true,
    );
    {
        let mut c = connect(&d.socket, "saver");
        assert_eq!(c.stats().unwrap().capacity_bytes, 6 << 20, "host tier");
        let ns = c.register_namespace(&namespace()).unwrap();
        for ch in 0..CHAINS {
            let ids = chain(ch);
            put_all(&mut c, ns, ids[0]..ids[0] + CHAIN);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    // Each engine says when it ends (a panic too): the admin loop fails at once if one does
    // before the run is over.
    let (ended_tx, ended) = std::sync::mpsc::channel::<u64>();
    struct Ended(u64, std::sync::mpsc::Sender<u64>);
    impl Drop for Ended {
        fn drop(&mut self) {
            let _ = self.1.send(self.0);
        }
    }
    let engines: Vec<_> = (0..4u64)
        .map(|e| {
            let (socket, stop, served, requests, ended) = (
                d.socket.clone(),
                stop.clone(),
                served.clone(),
                requests.clone(),
                Ended(e, ended_tx.clone()),
            );
            std::thread::spawn(move || {
                let _ended = ended;
                let mut c = connect(&socket, &format!("engine-{e}"));
                let mut rng = e.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut tag = 0u64;
                while !stop.load(Relaxed) {
                    let ch = next() % CHAINS;
                    let len = 1 + (next() % CHAIN) as usize;
                    let ids = &chain(ch)[..len];
                    let keys: Vec<BlockKey> = ids.iter().map(|&i| key(i)).collect();
                    tag += 1;
                    // The scheduler hints the request as it arrives, and a few more behind it.
                    c.prefetch(&keys, (next() % 3) as u8, Duration::from_secs(5), tag)
                        .expect("prefetch answered");
                    let behind = chain((ch + 1) % CHAINS);
                    let bk: Vec<BlockKey> = behind.iter().map(|&i| key(i)).collect();
                    c.prefetch(&bk, 0, Duration::from_secs(5), tag + 1_000_000)
                        .expect("prefetch answered");
                    requests.fetch_add(2, Relaxed);
                    match next() % 4 {
                        // The request was aborted: its hints end.
                        0 => {
                            c.cancel_prefetch(tag).expect("cancel answered");
                            c.cancel_prefetch(tag + 1_000_000).expect("cancel answered");
                            requests.fetch_add(2, Relaxed);
                        }
                        // The engine went away and came back (a disconnect cancels its hints).
                        1 if next() % 8 == 0 => {
                            c = connect(&socket, &format!("engine-{e}"));
                            requests.fetch_add(1, Relaxed);
                        }
                        _ => {
                            let l = c
                                .load(&keys, Duration::from_secs(30), Some(Duration::from_secs(2)))
                                .expect("load answered");
                            for (j, id) in ids.iter().enumerate().take(l.n) {
                                let mut buf = vec![0u8; l.blocks[j].len as usize];
                                c.read(&l, j, &mut buf).expect("a verified block");
                                assert!(buf == data(*id), "block {id} served wrong bytes");
                            }
                            served.fetch_add(l.n as u64, Relaxed);
                            if let Some(lease) = l.lease {
                                c.release(lease).expect("release answered");
                            }
                            c.cancel_prefetch(tag).expect("cancel answered");
                            requests.fetch_add(3, Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    // The admin side: stats over IPC and /metrics keep answering throughout.
    let mut admin = connect(&d.socket, "admin");
    let until = Instant::now() + Duration::from_secs(secs);
    let mut polls = 0u64;
    let mut early = None;
    while Instant::now() < until {
        admin.stats().expect("stats answered");
        assert!(metrics(&d.metrics).contains("kvtier_"), "metrics answered");
        polls += 1;
        // The next poll in 200 ms, unless an engine ended meanwhile (a failure: they run
        // until told to stop).
        if let Ok(e) = ended.recv_timeout(Duration::from_millis(200)) {
            early = Some(e);
            break;
        }
    }
    stop.store(true, Relaxed);
    for e in engines {
        e.join()
            .expect("an engine thread failed (a request past its deadline, or wrong bytes)");
    }
    assert_eq!(early, None, "an engine ended before the run was over");
    let (served, requests) = (served.load(Relaxed), requests.load(Relaxed));
    let m = metrics(&d.metrics);
    let hinted = m
        .lines()
        .find(|l| l.starts_with("kvtier_prefetch_blocks_total{outcome=\"hinted\"}"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    eprintln!(
        "stress: {requests} engine requests, {served} blocks served, {hinted} blocks preloaded, {polls} admin polls"
    );
    assert!(served > 0, "nothing was ever loaded");
    // The pressure was real: blocks were read from disk for hints.
    assert!(hinted > 0.0, "no block was preloaded:\n{m}");
    // Still serving, and a SIGTERM ends it (the frozen daemon logged "shutting down" and never
    // exited).
    let mut c = connect(&d.socket, "after");
    assert_eq!(get_all(&mut c, 0..3), 3);
    drop(c);
    drop(admin);
    let dir = d.dir.clone();
    let status = d.term();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "kvtierd did not stop cleanly: {status:?}");
}

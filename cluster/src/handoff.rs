//! A clean stop hands this node's host blocks over: each goes to its owner under the
//! membership without this node (for every other node, that is the block's next member in
//! rendezvous order, where its loads look once this node stops answering), bounded in
//! bandwidth and in time. Blocks the owner already holds are asked about first (one EXISTS per
//! batch) and not sent again.

use std::time::{Duration, Instant};

use kvstore::io::IoBuf;
use kvstore::{LowerTier, Store, WriteItem, WriteOutcome};

use crate::remote::RemoteTier;

/// Blocks handed over per call to the owners.
const BATCH: usize = 64;

/// What a hand-over did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandOver {
    /// Blocks in host memory when it began.
    pub blocks: u64,
    /// Blocks their new owner stored.
    pub sent: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Blocks the new owner held already.
    pub present: u64,
    /// Blocks not handed over: evicted meanwhile, refused, failed, or the deadline came.
    pub left: u64,
}

/// Hands `store`'s host blocks to their owners without this node, at most `bytes_per_s`
/// (0: unbounded), until `deadline`. This node keeps serving peers meanwhile.
pub fn hand_over(
    store: &Store,
    remote: &RemoteTier,
    bytes_per_s: u64,
    deadline: Instant,
) -> HandOver {
    let others: Vec<_> = remote
        .placement()
        .members()
        .iter()
        .filter(|m| m.addr != remote.me())
        .cloned()
        .collect();
    let keys = store.host_keys();
    let mut r = HandOver {
        blocks: keys.len() as u64,
        ..Default::default()
    };
    if others.is_empty() {
        r.left = r.blocks;
        return r;
    }
    remote.set_members(others);
    let started = Instant::now();
    for batch in keys.chunks(BATCH) {
        if Instant::now() >= deadline {
            break;
        }
        let ks: Vec<_> = batch.iter().map(|(k, _)| *k).collect();
        let held = remote.held_by_owners(&ks);
        let mut items = Vec::new();
        let mut pins = Vec::new();
        for ((k, ns), h) in batch.iter().zip(held) {
            if h.is_some() {
                r.present += 1;
                continue;
            }
            // Pinned until pushed (a block evicted since is simply not handed over).
            let Ok(l) = store.load_local(std::slice::from_ref(k), deadline) else {
                continue;
            };
            if l.is_empty() {
                continue;
            }
            let b = l.arena_block(0);
            items.push(WriteItem {
                key: *k,
                ns: ns.0 as u16,
                // SAFETY: the block's slot stays pinned by `l` (kept in `pins`) until the
                // write returned; the remote tier only reads `len` bytes of it.
                buf: unsafe { IoBuf::from_raw(b.as_ptr() as *mut u8, b.len()) },
                len: b.len() as u32,
                checksum: l.checksum(0),
            });
            pins.push(l);
        }
        if items.is_empty() {
            continue;
        }
        let lens: Vec<u64> = items.iter().map(|it| u64::from(it.len)).collect();
        let out = remote.write(items, &|_| true);
        drop(pins);
        for (o, len) in out.into_iter().zip(lens) {
            match o {
                WriteOutcome::Written => {
                    r.sent += 1;
                    r.bytes += len;
                }
                WriteOutcome::Present => r.present += 1,
                _ => {}
            }
        }
        if bytes_per_s > 0 {
            // Paced: never ahead of the rate. A sleep is the pacing itself (the rate is a
            // promise to the network, not a condition anything signals), never past the
            // deadline; the node keeps serving peers meanwhile from other threads.
            let due = started + Duration::from_secs_f64(r.bytes as f64 / bytes_per_s as f64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep((due.min(deadline)) - now);
            }
        }
    }
    r.left = r.blocks - r.sent - r.present;
    tracing::info!(
        blocks = r.blocks,
        sent = r.sent,
        bytes = r.bytes,
        present = r.present,
        left = r.left,
        "cluster: host blocks handed over to their next owners"
    );
    r
}

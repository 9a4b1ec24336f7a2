//! The real store under a deterministic scheduler. Built with `--cfg kvtier_shuttle`
//! (`scripts/test.sh`), every lock, condition variable and thread of `Store` is shuttle's
//! (`crate::sync`), so these tests run the store's own code — index, allocator, eviction,
//! leases, the writer, the readers, preloading from hints with per-owner quotas, cancels and
//! removals — under thousands of random schedules each, and shuttle fails a run whose threads
//! all block (a deadlock) or that panics. After each run the test checks:
//!
//! - every request was answered (every engine thread returned: no deadlock, no lost wake-up);
//! - no block was served with bytes other than its own (each key's bytes are a pattern of the
//!   key, checked on every load);
//! - pins balance: once the engines are gone and their hints cancelled, no block is pinned and
//!   no preload is held;
//! - bytes balance per owner: the read queue's per-owner counts (in flight, held, waiting)
//!   are all back to zero, and the held bytes agree with the holds;
//! - host bytes balance: `used_bytes` and `blocks` equal what the index holds, and every used
//!   slot of every class belongs to exactly one index entry.
//!
//! The lower tier is an in-memory implementation of the tier seam (`LowerTier`) whose lock is
//! shuttle's too: the disk tier's io_uring completions cannot be scheduled by shuttle.
//!
//! Run on the lock structure before issue 35 (a hint took the per-owner holds' lock, then the
//! queue's; reader 0 the queue's, then the holds'), `hints_loads_and_cancels_never_deadlock`
//! fails with shuttle's "deadlock detected" within its first few hundred schedules.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shuttle::thread;

use crate::key::BlockKey;
use crate::sync::{level, Mutex};
use crate::tier::{
    LowerTier, NsUsage, ReadItem, ReadOutcome, SharedTier, TierStats, WriteItem, WriteOutcome,
};
use crate::types::{BlockInfo, MapKey, NsId, Tier};
use crate::{Fingerprint, PrefetchQuota, StoreConfig};

use super::Store;

/// Schedules per test (`KVTIER_SHUTTLE_ITERS` overrides).
fn iterations() -> usize {
    std::env::var("KVTIER_SHUTTLE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500)
}

const BLOCK: usize = 8192;

fn key(i: u64) -> BlockKey {
    BlockKey(0x5eed_0000_0000_0000_0000_0000_0000_0000 | u128::from(i))
}

/// A block's bytes: a pattern of its key, so a served block can be checked.
fn data(i: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|j| (i as usize * 131 + j * 7 + (j >> 9)) as u8)
        .collect()
}

/// A lower tier in memory, behind a shuttle lock.
struct MemTier {
    blocks: Mutex<HashMap<BlockKey, (Vec<u8>, BlockInfo)>>,
}

impl MemTier {
    fn new() -> Self {
        Self {
            blocks: Mutex::new(level::TIER, "memtier", HashMap::new()),
        }
    }
}

impl LowerTier for MemTier {
    fn kind(&self) -> Tier {
        Tier::Disk
    }
    fn lookup(&self, key: &BlockKey) -> Option<BlockInfo> {
        self.blocks.lock().get(key).map(|b| b.1)
    }
    fn pin(&self, key: &BlockKey) -> bool {
        self.blocks.lock().contains_key(key)
    }
    fn unpin(&self, _key: &BlockKey) {}
    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        items
            .into_iter()
            .map(|it| {
                let b = self.blocks.lock();
                match b.get(&it.key) {
                    Some((bytes, info)) if bytes.len() <= it.buf.cap() => {
                        // SAFETY: the store reserved `buf` (a Promoting slot of at least
                        // `cap` bytes) for this read until it publishes or frees it.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_ptr(),
                                it.buf.as_ptr(),
                                bytes.len(),
                            )
                        };
                        ReadOutcome::Hit(*info)
                    }
                    _ => ReadOutcome::Miss,
                }
            })
            .collect()
    }
    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        items
            .into_iter()
            .map(|it| {
                // SAFETY: the block is committed and pinned for this write until the store
                // settles it.
                let bytes = unsafe { std::slice::from_raw_parts(it.buf.as_ptr(), it.len as usize) }
                    .to_vec();
                if crate::checksum(&bytes) != it.checksum {
                    return WriteOutcome::Corrupt;
                }
                thread::yield_now();
                if !still_wanted(&it.key) {
                    return WriteOutcome::Cancelled;
                }
                let info = BlockInfo {
                    len: it.len,
                    ns: it.ns,
                    checksum: it.checksum,
                };
                self.blocks.lock().insert(it.key, (bytes, info));
                WriteOutcome::Written
            })
            .collect()
    }
    fn remove(&self, key: &BlockKey) -> bool {
        self.blocks.lock().remove(key).is_some()
    }
    fn clear_namespace(&self, ns: u16) -> Vec<BlockKey> {
        let mut b = self.blocks.lock();
        let gone: Vec<BlockKey> = b
            .iter()
            .filter(|(_, v)| v.1.ns == ns)
            .map(|(k, _)| *k)
            .collect();
        for k in &gone {
            b.remove(k);
        }
        gone
    }
    fn namespace_usage(&self) -> Vec<NsUsage> {
        Vec::new()
    }
    fn stats(&self) -> TierStats {
        TierStats {
            tier: Some(Tier::Disk),
            ..Default::default()
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A store of `slots` host slots of one size over a `MemTier` holding keys `0..below`.
fn store(slots: u64, below: u64, held: u64) -> (Arc<Store>, NsId) {
    let tier = MemTier::new();
    let s = StoreConfig {
        capacity_bytes: slots * BLOCK as u64,
        segment_bytes: 2 * BLOCK as u64,
        size_classes: vec![BLOCK],
        shards: 2,
        prefetch_max_inflight_bytes: 2 * BLOCK as u64,
        prefetch_max_held_bytes: held * BLOCK as u64,
        // A put that finds no room gives up soon (timed waits yield until their deadline
        // under shuttle).
        wait: Duration::from_millis(5),
        remote: Some(SharedTier(Arc::new(tier))),
        ..Default::default()
    }
    .build()
    .expect("store");
    let ns = s
        .register_fingerprint(Fingerprint(BlockKey(7)))
        .expect("namespace");
    // The lower tier holds keys 0..below (as if demoted earlier).
    for i in 0..below {
        let d = data(i);
        let t = &s.inner.tiers[0];
        let out = t.write(
            vec![WriteItem {
                key: key(i),
                ns: ns.0 as u16,
                // SAFETY: `d` lives until the write returns, which only reads it.
                buf: unsafe { crate::io::IoBuf::from_raw(d.as_ptr() as *mut u8, BLOCK) },
                len: BLOCK as u32,
                checksum: crate::checksum(&d),
            }],
            &|_| true,
        );
        assert_eq!(out, vec![WriteOutcome::Written]);
    }
    (Arc::new(s), ns)
}

/// Loads `keys` and checks each block served is its key's own bytes.
fn load_checked(s: &Store, keys: &[u64]) -> usize {
    let ks: Vec<BlockKey> = keys.iter().map(|&i| key(i)).collect();
    match s.load(&ks) {
        Ok(l) => {
            for i in 0..l.len() {
                assert_eq!(
                    l.block(i),
                    &data(keys[i])[..],
                    "key {} served wrong bytes",
                    keys[i]
                );
            }
            l.len()
        }
        Err(_) => 0,
    }
}

/// Waits (yielding to the store's threads) until its read and write queues are idle.
fn quiesce(s: &Store) {
    loop {
        let d = s.inner.work.depths();
        let reading = !s.inner.work.reads.lock().reading.is_empty();
        if d.promote_jobs == 0
            && d.prefetch_jobs == 0
            && d.prefetch_bytes == 0
            && !reading
            && !s.inner.work.demote.pending()
        {
            return;
        }
        thread::yield_now();
    }
}

/// The invariants every run ends with (see the module doc).
fn check_balanced(s: &Store, owners: &[u64]) {
    quiesce(s);
    for &o in owners {
        s.cancel_prefetch_of_owner(o);
    }
    s.cancel_prefetch_where_all();
    quiesce(s);
    let inner = &s.inner;
    {
        let q = inner.work.reads.lock();
        for &o in owners {
            assert_eq!(q.held_by_owner.get(o), 0, "owner {o} still holds bytes");
            assert_eq!(
                q.inflight_by_owner.get(o),
                0,
                "owner {o} still has bytes in flight"
            );
            assert_eq!(
                q.waiting_by_owner.get(o),
                0,
                "owner {o} still has keys waiting"
            );
        }
        assert_eq!(q.waiting_keys, 0);
        assert!(q.waiting.is_empty());
    }
    assert_eq!(
        inner.held_bytes.load(Relaxed),
        0,
        "held bytes without holds"
    );
    let mut entries = 0u64;
    let mut ready_bytes = 0u64;
    let mut ready = 0u64;
    let mut per_slot: HashMap<(u8, u32), MapKey> = HashMap::new();
    let mut ready_slots = Vec::new();
    for sh in inner.shards.iter() {
        let sh = sh.lock();
        assert_eq!(sh.pins.len(), 0, "pins left with nobody using a block");
        for (k, e) in sh.map.iter() {
            assert!(
                !e.pinned(),
                "block {:?} still pinned with nobody using it",
                k
            );
            entries += 1;
            if e.ready() {
                ready += 1;
                ready_slots.push(e.slot());
            }
            assert!(
                per_slot.insert((e.class, e.idx), k).is_none(),
                "two blocks in one slot"
            );
        }
    }
    for slot in ready_slots {
        ready_bytes += u64::from(inner.len_of(slot));
    }
    let used: u64 = inner.classes.iter().map(|c| c.lock().used_slots()).sum();
    assert_eq!(used, entries, "used slots vs index entries");
    assert_eq!(inner.stats.blocks.load(Relaxed), ready, "blocks counter");
    assert_eq!(
        inner.stats.used_bytes.load(Relaxed),
        ready_bytes,
        "used_bytes counter"
    );
}

impl Store {
    /// Cancels every hint (tests only).
    fn cancel_prefetch_where_all(&self) -> usize {
        self.inner.cancel_prefetch_where(|_, _| true)
    }
}

fn quota(owner: u64) -> PrefetchQuota {
    PrefetchQuota {
        owner,
        max_bytes: 2 * BLOCK as u64,
        max_waiting_keys: 8,
    }
}

/// Issue 35's freeze (see `hints_loads_and_cancels`).
#[test]
fn hints_loads_and_cancels_never_deadlock() {
    shuttle::check_random(hints_loads_and_cancels, iterations());
}

/// The same under PCT (priority-based schedules that find bugs of a few ordering points with
/// a known probability).
#[test]
fn hints_loads_and_cancels_never_deadlock_pct() {
    shuttle::check_pct(hints_loads_and_cancels, iterations(), 3);
}

/// Two engines hint prefixes that live only below, past their quotas (so hints wait and reader
/// 0 resumes them) while loads use held blocks (room comes back) and cancels end hints.
fn hints_loads_and_cancels() {
    let (s, _ns) = store(8, 8, 4);
    let far = Instant::now() + Duration::from_secs(600);
    let engines: Vec<_> = (1..=2u64)
        .map(|owner| {
            let s = s.clone();
            thread::spawn(move || {
                let base = (owner - 1) * 4;
                let keys: Vec<BlockKey> = (base..base + 4).map(key).collect();
                s.prefetch_as(&keys, 0, far, owner * 10, quota(owner));
                s.prefetch_as(&keys[..2], 1, far, owner * 10 + 1, quota(owner));
                load_checked(&s, &[base, base + 1]);
                s.cancel_prefetch_as(owner * 10, owner);
                s.prefetch_as(&keys[2..], 0, far, owner * 10 + 2, quota(owner));
                load_checked(&s, &[base + 2]);
                s.cancel_prefetch_of_owner(owner);
            })
        })
        .collect();
    for e in engines {
        e.join().expect("engine thread");
    }
    check_balanced(&s, &[1, 2]);
}

/// Puts that evict and demote, loads that promote, leases, removals and hints together.
#[test]
fn puts_loads_leases_removals_and_hints_keep_every_balance() {
    shuttle::check_random(
        || {
            let (s, ns) = store(6, 4, 3);
            let far = Instant::now() + Duration::from_secs(600);
            let writer = {
                let s = s.clone();
                thread::spawn(move || {
                    for i in 4..9 {
                        let _ = s.put(ns, key(i), &data(i));
                    }
                    s.remove(&key(5));
                })
            };
            let loader = {
                let s = s.clone();
                thread::spawn(move || {
                    load_checked(&s, &[0, 1]);
                    let ks = [key(2), key(3)];
                    if let Some(id) = s
                        .lease(&ks, Duration::from_secs(60))
                        .ok()
                        .and_then(|l| l.id)
                    {
                        s.release(id);
                    }
                    load_checked(&s, &[4, 5, 6]);
                })
            };
            let hinter = {
                let s = s.clone();
                thread::spawn(move || {
                    let keys: Vec<BlockKey> = (0..4).map(key).collect();
                    s.prefetch_as(&keys, 0, far, 1, quota(3));
                    s.remove(&key(1));
                    load_checked(&s, &[2, 3]);
                    s.cancel_prefetch_as(1, 3);
                })
            };
            for t in [writer, loader, hinter] {
                t.join().expect("thread");
            }
            check_balanced(&s, &[3]);
        },
        iterations(),
    );
}

/// Retains and demotes (pins taken and dropped, dirty blocks queued for the writer and dropped
/// from host memory once written) among puts that evict, loads that promote and a removal: no
/// deadlock, no wrong bytes, every balance kept once the sessions are demoted.
#[test]
fn retains_and_demotes_among_puts_loads_and_removals() {
    shuttle::check_random(
        || {
            let (s, ns) = store(6, 4, 3);
            let session = {
                let s = s.clone();
                thread::spawn(move || {
                    for i in 10..13 {
                        let _ = s.put(ns, key(i), &data(i));
                    }
                    let ks: Vec<BlockKey> = (10..13).map(key).collect();
                    s.retain(Some("a"), &ks, Duration::from_secs(600), 1);
                    load_checked(&s, &[10, 11, 12]);
                    s.demote(Some("a"), &[]);
                    load_checked(&s, &[10, 11]);
                })
            };
            let other = {
                let s = s.clone();
                thread::spawn(move || {
                    let ks: Vec<BlockKey> = (0..3).map(key).collect();
                    s.retain(Some("b"), &ks, Duration::from_secs(600), 2);
                    for i in 4..8 {
                        let _ = s.put(ns, key(i), &data(i));
                    }
                    s.remove(&key(11));
                    s.demote(None, &[key(0), key(4)]);
                    load_checked(&s, &[0, 1, 2]);
                })
            };
            for t in [session, other] {
                t.join().expect("thread");
            }
            s.demote(Some("b"), &[]);
            s.demote(Some("a"), &[]);
            assert_eq!(s.retention_stats().retentions, 0);
            check_balanced(&s, &[]);
        },
        iterations(),
    );
}

/// A block's host events reach a subscriber in the order of its changes: puts that evict,
/// racing removals of the same blocks, never leave a subscriber believing in a block that is
/// gone (a Removed then a Stored, swapped) or missing one that is there.
#[test]
fn host_events_follow_each_blocks_changes() {
    shuttle::check_pct(
        || {
            let (s, ns) = store(2, 0, 0);
            let sub = s.subscribe(64);
            let putter = {
                let s = s.clone();
                thread::spawn(move || {
                    for i in 0..3 {
                        let _ = s.put(ns, key(i), &data(i));
                    }
                })
            };
            let remover = {
                let s = s.clone();
                thread::spawn(move || {
                    for i in [0, 0, 1, 1] {
                        s.remove(&key(i));
                    }
                })
            };
            for t in [putter, remover] {
                t.join().expect("thread");
            }
            let mut held = HashMap::new();
            for e in sub.try_iter().filter(|e| e.tier == Tier::Host) {
                held.insert(e.key, e.kind == crate::EventKind::Stored);
            }
            for i in 0..3 {
                let k = key(i);
                let in_host = s
                    .inner
                    .shard(k)
                    .lock()
                    .map
                    .get(&MapKey::from(k))
                    .is_some_and(|e| e.ready());
                let said = held.get(&k).copied().unwrap_or(false);
                assert_eq!(
                    said, in_host,
                    "block {i}: its events say held {said}, host memory says {in_host}"
                );
            }
        },
        iterations(),
        3,
    );
}

//! The tiering worker against removals, slow disks and concurrent loads: what is removed never
//! comes back, transient disk states are retried, a promotion is read once for everyone who
//! waits for it, and requests never do I/O they did not ask for. On a real ext4 directory under
//! the build directory, through the io_uring engine with a fault injector in front.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::io::fault::{FaultEngine, FaultPlan};
use kvstore::io::{IoConfig, IoEngine, IoEngineKind};
use kvstore::{
    fill_pattern, Admission, BlockKey, DiskConfig, Namespace, NsId, PolicyKind, Store, StoreConfig,
    Tier, TpShard,
};

const SYNC: Duration = Duration::from_secs(60);

/// A fresh directory under the build directory, removed when the test ends (failed or not).
fn dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("tiering-{name}-"))
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

fn config(d: &std::path::Path, write_through: bool, host_mib: u64) -> StoreConfig {
    StoreConfig {
        capacity_bytes: host_mib << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10],
        shards: 4,
        policy: PolicyKind::Lru,
        disk: Some(DiskConfig {
            dir: d.to_path_buf(),
            capacity_bytes: 64 << 20,
            files: 1,
            io: IoConfig {
                kind: IoEngineKind::Auto,
                queue_depth: 4,
                ..Default::default()
            },
            admission: Admission::Always,
            write_through,
            // Small batches: the queue holds several, so a removal can meet one still queued.
            max_batch_bytes: 128 << 10,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn ns(s: &Store) -> NsId {
    s.register_namespace(&Namespace {
        model: "tiering".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    })
    .unwrap()
}

fn key(i: u32) -> BlockKey {
    BlockKey((u128::from(i) + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn data(i: u32) -> Vec<u8> {
    let mut v = vec![0u8; 50_000 + i as usize % 7 * 1000];
    fill_pattern(&mut v, u64::from(i));
    v
}

fn slow(store: &mut Store, ms: u64) -> Arc<FaultEngine> {
    let mut handle = None;
    store.wrap_disk_engine(|inner| {
        let f = Arc::new(FaultEngine::new(inner));
        handle = Some(f.clone());
        f as Arc<dyn IoEngine>
    });
    let f = handle.unwrap();
    f.set_plan(FaultPlan {
        delay: Duration::from_millis(ms),
        ..Default::default()
    });
    f
}

/// Removed while queued for demotion (its disk entry not made yet) or while being written:
/// it must not appear on disk when the write lands, nor after a restart. Write-back (the
/// eviction path) and write-through (the commit path).
#[test]
fn a_block_removed_while_queued_for_demotion_never_comes_back() {
    for write_through in [false, true] {
        let tmp = dir(&format!("removed-queued-{write_through}"));
        let d = tmp.path();
        let mut store = config(d, write_through, 2).build().unwrap();
        let faults = slow(&mut store, 150);
        let n = ns(&store);
        // 2 MiB of 64 KiB slots = 32 blocks; 60 puts: with write-back, evictions queue the
        // oldest for demotion (in batches of two, written slowly).
        for i in 0..60 {
            store.put(n, key(i), &data(i)).unwrap();
        }
        let st = store.stats();
        assert!(
            st.demote_queue_blocks > 0,
            "nothing is queued: the test would prove nothing ({st:?})"
        );
        // Remove every block now: the queued and the in-flight demotions must all lose.
        for i in 0..60 {
            store.remove(&key(i));
        }
        faults.set_plan(FaultPlan::default());
        assert!(store.sync(SYNC));
        for i in 0..60 {
            assert!(
                !store.contains(&key(i)),
                "block {i} came back (through={write_through})"
            );
        }
        assert_eq!(store.stats().disk().unwrap().blocks, 0);
        drop(store);
        let store = config(d, write_through, 2).build().unwrap();
        assert_eq!(store.stats().disk().unwrap().recovered_blocks, 0);
        for i in 0..60 {
            assert!(
                !store.contains(&key(i)),
                "block {i} recovered after removal"
            );
        }
        drop(store);
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A block whose older disk copy is on its way out (removed while a lease pins it) is "busy"
/// for a while, not unwritable for good: once the old copy is gone, the new one is written.
#[test]
fn a_transient_disk_state_is_retried_not_final() {
    let tmp = dir("transient");
    let d = tmp.path();
    let store = config(d, false, 8).build().unwrap();
    let n = ns(&store);
    store.put(n, key(2), &data(2)).unwrap();
    assert_eq!(store.flush(), 1);
    // Push key 2 out of host memory (the others are written back too).
    for i in 100..240 {
        store.put(n, key(i), &data(i)).unwrap();
    }
    store.flush();
    assert!(!store.in_host(&key(2)), "key 2 should be on disk only");
    // Pin the disk copy, remove it (Doomed while pinned), and put a new host copy of the key.
    let lease = store.lease(&[key(2)], Duration::from_secs(60)).unwrap();
    assert_eq!(lease.tiers, vec![Tier::Disk]);
    assert!(store.remove(&key(2)));
    store.put(n, key(2), &data(2)).unwrap();
    // Its write meets the doomed copy: not written now...
    assert_eq!(store.flush(), 0);
    // ...but retried once the old copy is gone, not marked unwritable for good.
    assert!(store.release(lease.id.unwrap()));
    assert_eq!(store.flush(), 1);
    for i in 300..440 {
        store.put(n, key(i), &data(i)).unwrap();
    }
    assert!(store.sync(SYNC));
    assert!(!store.in_host(&key(2)));
    let b = store
        .get(&key(2))
        .expect("the block was never written to disk");
    assert!(*b == data(2)[..]);
    drop(b);
    drop(store);
    std::fs::remove_dir_all(d).unwrap();
}

/// Two loads of the same disk-only prefix at once: one read from disk, both get the blocks;
/// and a put never waits for a disk write it did not ask for longer than the worker needs.
#[test]
fn concurrent_loads_share_one_promotion() {
    let tmp = dir("shared-promotion");
    let d = tmp.path();
    let store = config(d, true, 8).build().unwrap();
    let n = ns(&store);
    let keys: Vec<BlockKey> = (0..8).map(key).collect();
    for i in 0..8 {
        store.put(n, key(i), &data(i)).unwrap();
    }
    assert!(store.sync(SYNC));
    drop(store);
    // Restart: host memory empty, the blocks on disk only.
    let mut store = config(d, true, 8).build().unwrap();
    let faults = slow(&mut store, 100);
    let reads_before = store.stats().disk().unwrap().reads;
    std::thread::scope(|s| {
        let a = s.spawn(|| store.load(&keys).unwrap().len());
        let b = s.spawn(|| store.load(&keys).unwrap().len());
        assert_eq!(a.join().unwrap(), 8);
        assert_eq!(b.join().unwrap(), 8);
    });
    let reads = store.stats().disk().unwrap().reads - reads_before;
    assert_eq!(
        reads, 8,
        "a shared prefix is read once, whoever waits for it"
    );
    faults.set_plan(FaultPlan::default());
    for i in 0..8 {
        assert!(*store.get(&key(i)).unwrap() == data(i)[..]);
    }
    drop(store);
    std::fs::remove_dir_all(d).unwrap();
}

/// A load that cannot get its promotions within its deadline is a short prefix, not a hang,
/// and leaks nothing: once the reads land, everything can be evicted again.
#[test]
fn a_load_past_its_deadline_is_a_miss_and_leaks_nothing() {
    let tmp = dir("deadline");
    let d = tmp.path();
    let cfg = config(d, true, 8);
    {
        let store = cfg.clone().build().unwrap();
        let n = ns(&store);
        for i in 0..4 {
            store.put(n, key(i), &data(i)).unwrap();
        }
        assert!(store.sync(SYNC));
    }
    let mut cfg = cfg;
    cfg.wait = Duration::from_millis(50);
    let mut store = cfg.build().unwrap();
    // 2 s a read against a 50 ms wait: room for a slow machine on both sides.
    let faults = slow(&mut store, 2000);
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    // (A load that waited for the 2 s reads would hold all four: its deadline ended it.)
    let l = store.load(&keys).unwrap();
    assert_eq!(l.len(), 0);
    drop(l);
    faults.set_plan(FaultPlan::default());
    // The abandoned promotions land (the delays already begun run out: 8 s) and are
    // unpinned: the blocks can be loaded and evicted.
    let until = Instant::now() + Duration::from_secs(30);
    while !keys.iter().all(|k| store.in_host(k)) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(store.stats().leases, 0);
    assert_eq!(store.load(&keys).unwrap().len(), 4);
    let n = ns(&store);
    // (The reader unpins them just after it published them: a put round that comes first
    // evicts others, so try a few rounds.)
    let until = Instant::now() + Duration::from_secs(30);
    for round in 0u32.. {
        for i in 1000 + round * 200..1200 + round * 200 {
            store.put(n, key(i), &data(i)).unwrap();
        }
        assert!(store.sync(SYNC));
        if keys.iter().all(|k| !store.in_host(k)) {
            break;
        }
        assert!(Instant::now() < until, "a promoted block stayed pinned");
    }
    drop(store);
    std::fs::remove_dir_all(d).unwrap();
}

/// A clean shutdown (`flush`, then drop) keeps every block whose commit was acknowledged:
/// several threads race to store, load and re-store the same keys through a host tier far
/// smaller than the data (so blocks go down to disk, come back, are evicted again and keys
/// that live only on disk are written again), then a fresh store on the same directory finds
/// every one of them, byte for byte.
#[test]
fn a_clean_shutdown_keeps_every_acknowledged_block_under_concurrent_traffic() {
    use std::collections::HashSet;
    use std::sync::Mutex;
    let tmp = dir("flush-race");
    let d = tmp.path();
    let acked = Mutex::new(HashSet::new());
    // Mixed sizes in several size classes (which take segments from each other), S3-FIFO.
    let size = |i: u32| [16usize << 10, 64 << 10, 256 << 10, 1 << 20][i as usize % 4];
    let bytes = |i: u32| {
        let mut v = vec![0u8; size(i)];
        fill_pattern(&mut v, u64::from(i));
        v
    };
    let cfg = || {
        let mut c = config(d, false, 24);
        c.segment_bytes = 4 << 20;
        c.size_classes = Vec::new();
        c.policy = PolicyKind::S3Fifo;
        if let Some(k) = c.disk.as_mut() {
            k.capacity_bytes = 512 << 20;
            k.max_batch_bytes = 4 << 20;
        }
        c
    };
    for round in 0..3u64 {
        let store = cfg().build().unwrap();
        let id = ns(&store);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (store, acked) = (&store, &acked);
                s.spawn(move || {
                    let mut x = round * 1000 + t + 1;
                    for _ in 0..400 {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let i = ((x >> 33) % 120) as u32;
                        if (x >> 20) % 3 == 0 {
                            let _ = store.load(&[key(i)]);
                        } else if let Ok(kvstore::Reserve::Slot(mut r)) =
                            store.reserve(id, key(i), size(i))
                        {
                            r.as_mut_slice().copy_from_slice(&bytes(i));
                            if r.commit().unwrap() {
                                acked.lock().unwrap().insert(i);
                            }
                        }
                    }
                });
            }
        });
        store.flush();
        drop(store);
        let store = cfg().build().unwrap();
        let mut missing = Vec::new();
        for &i in acked.lock().unwrap().iter() {
            let l = store.load(&[key(i)]).unwrap();
            if l.len() == 1 {
                assert_eq!(
                    l.block(0),
                    &bytes(i)[..],
                    "block {i} came back with other bytes"
                );
            } else {
                missing.push(i);
            }
        }
        missing.sort_unstable();
        assert!(
            missing.is_empty(),
            "round {round}: acknowledged blocks lost over a clean shutdown: {missing:?}"
        );
    }
}

/// A key committed in a lower tier is present for a writer too: reserving it again (an engine
/// re-saving after a restart, or after host memory evicted it) is `AlreadyPresent`, not a
/// second copy to write.
#[test]
fn a_key_on_disk_is_present_to_a_writer() {
    let tmp = dir("present-below");
    let d = tmp.path();
    let store = config(d, true, 2).build().unwrap();
    let id = ns(&store);
    store.put(id, key(1), &data(1)).unwrap();
    assert!(store.sync(SYNC));
    store.flush();
    drop(store);
    let store = config(d, true, 2).build().unwrap();
    let id = ns(&store);
    assert!(!store.in_host(&key(1)));
    assert!(matches!(
        store.reserve(id, key(1), data(1).len()).unwrap(),
        kvstore::Reserve::AlreadyPresent
    ));
    assert!(matches!(
        store.reserve(id, key(2), data(2).len()).unwrap(),
        kvstore::Reserve::Slot(_)
    ));
}

/// Break-even admission: a lower tier whose measured read speed loses to the engine's stated
/// prefill rate is cut from the answer (host blocks stay); a fast enough one is kept.
#[test]
fn break_even_admission_refuses_a_tier_slower_than_recomputing() {
    let tmp = dir("break-even");
    let d = tmp.path();
    let mut store = config(d, true, 2).build().unwrap();
    let id = ns(&store);
    for i in 0..6 {
        store.put(id, key(i), &data(i)).unwrap();
    }
    assert!(store.sync(SYNC));
    store.flush();
    drop(store);
    store = config(d, true, 2).build().unwrap();
    // Every disk read takes 50 ms: ~1 MB/s for these 50 KB blocks.
    let faults = slow(&mut store, 50);
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    // Not measured yet: trusted, nothing cut.
    let (m, present) = store.match_prefix_priced(&keys, 16, 1000.0);
    assert_eq!((m.n, present), (6, 6));
    // Two promotions measure the tier (keys 0 and 1 end up in host memory).
    assert_eq!(store.load(&keys[..1]).unwrap().len(), 1);
    assert_eq!(store.load(&keys[1..2]).unwrap().len(), 1);
    let bw = store.stats().disk().unwrap().read_bandwidth;
    assert!(bw > 0 && bw < 5_000_000, "{bw}");
    // Prefill at 100k tokens/s: a 16-token block computes in 0.16 ms, far below a 50 ms read:
    // only the host blocks are worth loading.
    let (m, present) = store.match_prefix_priced(&keys, 16, 100_000.0);
    assert_eq!(present, 6);
    assert_eq!(m.n, 2, "{:?}", m.tiers);
    assert!(m.tiers.iter().all(|t| *t == Tier::Host));
    // Prefill at 10 tokens/s: 1.6 s per block, loading wins: all of it.
    let (m, _) = store.match_prefix_priced(&keys, 16, 10.0);
    assert_eq!(m.n, 6);
    let st = store.stats();
    assert_eq!((st.break_even_cuts, st.break_even_blocks_cut), (1, 4));
    assert_eq!(
        st.break_even_prefill_tokens_per_s, 10,
        "the rate the last lookup stated"
    );
    drop(faults);
}

/// A remote peer that stopped answering: each read takes `stall`, then misses (what the
/// remote tier returns when its peer timed out). It claims the keys it was given.
struct StalledPeer {
    keys: Vec<BlockKey>,
    stall: Duration,
    reads_started: std::sync::atomic::AtomicU64,
    reads_done: std::sync::atomic::AtomicU64,
}

impl kvstore::LowerTier for StalledPeer {
    fn kind(&self) -> Tier {
        Tier::Remote
    }
    fn local(&self) -> bool {
        false
    }
    fn lookup(&self, key: &BlockKey) -> Option<kvstore::BlockInfo> {
        self.keys.contains(key).then_some(kvstore::BlockInfo {
            len: 50_000,
            ns: 0,
            checksum: 0,
        })
    }
    fn pin(&self, key: &BlockKey) -> bool {
        self.keys.contains(key)
    }
    fn unpin(&self, _key: &BlockKey) {}
    fn read(&self, items: Vec<kvstore::ReadItem>) -> Vec<kvstore::ReadOutcome> {
        self.reads_started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(self.stall);
        self.reads_done
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        vec![kvstore::ReadOutcome::Miss; items.len()]
    }
    fn write(
        &self,
        items: Vec<kvstore::WriteItem>,
        _still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<kvstore::WriteOutcome> {
        vec![kvstore::WriteOutcome::Failed; items.len()]
    }
    fn remove(&self, _key: &BlockKey) -> bool {
        false
    }
    fn clear_namespace(&self, _ns: u16) -> Vec<BlockKey> {
        Vec::new()
    }
    fn namespace_usage(&self) -> Vec<kvstore::NsUsage> {
        Vec::new()
    }
    fn stats(&self) -> kvstore::TierStats {
        kvstore::TierStats {
            tier: Some(Tier::Remote),
            ..Default::default()
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A load waiting on a peer that stopped answering holds up only that peer's reads: another
/// engine's load from the local disk is served meanwhile (each lower tier has a reader of its
/// own).
#[test]
fn a_stalled_peer_does_not_hold_up_disk_loads() {
    let tmp = dir("stalled-peer");
    let d = tmp.path();
    let store = config(d, true, 4).build().unwrap();
    let id = ns(&store);
    store.put(id, key(1), &data(1)).unwrap();
    assert!(store.sync(SYNC));
    store.flush();
    drop(store);
    let peer = Arc::new(StalledPeer {
        keys: vec![key(100)],
        stall: Duration::from_secs(3),
        reads_started: Default::default(),
        reads_done: Default::default(),
    });
    let mut cfg = config(d, true, 4);
    cfg.remote = Some(kvstore::SharedTier(peer.clone()));
    let store = Arc::new(cfg.build().unwrap());
    let remote_load = {
        let s = store.clone();
        std::thread::spawn(move || s.load(&[key(100)]).map(|l| l.len()))
    };
    // Until the peer's reader is inside its stalled read.
    let until = Instant::now() + Duration::from_secs(10);
    while peer.reads_started.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < until, "the peer's read never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut out = vec![0u8; 64 << 10];
    let n = store.get_into(&key(1), &mut out).unwrap();
    assert_eq!(n, Some(data(1).len()), "the disk block, promoted");
    assert_eq!(&out[..data(1).len()], &data(1)[..]);
    assert_eq!(
        peer.reads_done.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "served while the peer's read was still stalled"
    );
    // The stalled read ends as a miss: nothing is served from it.
    assert_eq!(remote_load.join().unwrap().unwrap(), 0);
}

/// What a [`RefusingOwner`] was asked to write, and whether it holds a write.
#[derive(Default)]
struct OwnerLog {
    writes: Vec<BlockKey>,
    late_writes: Vec<BlockKey>,
    holding: bool,
    released: bool,
}

/// A write-behind tier whose owner refuses one key, takes every other (but `sentinel`, which
/// it cancels: nothing counted) and holds the refused key's fourth ordinary write (its last
/// pinned try) until released: it records the keys of the pusher's writes, the ordinary ones
/// and the late ones apart.
struct RefusingOwner {
    refused: BlockKey,
    sentinel: BlockKey,
    log: std::sync::Mutex<OwnerLog>,
    changed: std::sync::Condvar,
}

impl RefusingOwner {
    fn take(&self, items: Vec<kvstore::WriteItem>, late: bool) -> Vec<kvstore::WriteOutcome> {
        let mut log = self.log.lock().unwrap();
        let keys = items.iter().map(|it| it.key);
        if late {
            log.late_writes.extend(keys);
        } else {
            log.writes.extend(keys);
        }
        let refused = |l: &OwnerLog| l.writes.iter().filter(|k| **k == self.refused).count();
        if !late && items.iter().any(|it| it.key == self.refused) && refused(&log) == 4 {
            log.holding = true;
            self.changed.notify_all();
            let until = Instant::now() + Duration::from_secs(60);
            while !log.released && Instant::now() < until {
                log = self
                    .changed
                    .wait_timeout(log, until - Instant::now())
                    .unwrap()
                    .0;
            }
        }
        self.changed.notify_all();
        items
            .iter()
            .map(|it| match it.key {
                k if k == self.refused => kvstore::WriteOutcome::Failed,
                k if k == self.sentinel => kvstore::WriteOutcome::Cancelled,
                _ => kvstore::WriteOutcome::Written,
            })
            .collect()
    }

    /// Waits (60 s at most) until `done` holds of the log.
    fn wait(&self, what: &str, done: impl Fn(&OwnerLog) -> bool) {
        let until = Instant::now() + Duration::from_secs(60);
        let mut log = self.log.lock().unwrap();
        while !done(&log) {
            let now = Instant::now();
            assert!(now < until, "{what}: not within 60 s");
            log = self.changed.wait_timeout(log, until - now).unwrap().0;
        }
    }

    fn release(&self) {
        self.log.lock().unwrap().released = true;
        self.changed.notify_all();
    }
}

impl kvstore::LowerTier for RefusingOwner {
    fn kind(&self) -> Tier {
        Tier::Remote
    }
    fn local(&self) -> bool {
        false
    }
    fn write_behind(&self) -> bool {
        true
    }
    fn lookup(&self, _key: &BlockKey) -> Option<kvstore::BlockInfo> {
        None
    }
    fn pin(&self, _key: &BlockKey) -> bool {
        false
    }
    fn unpin(&self, _key: &BlockKey) {}
    fn read(&self, items: Vec<kvstore::ReadItem>) -> Vec<kvstore::ReadOutcome> {
        vec![kvstore::ReadOutcome::Miss; items.len()]
    }
    fn write(
        &self,
        items: Vec<kvstore::WriteItem>,
        _still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<kvstore::WriteOutcome> {
        self.take(items, false)
    }
    fn write_late(
        &self,
        items: Vec<kvstore::WriteItem>,
        _still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<kvstore::WriteOutcome> {
        self.take(items, true)
    }
    fn remove(&self, _key: &BlockKey) -> bool {
        false
    }
    fn clear_namespace(&self, _ns: u16) -> Vec<BlockKey> {
        Vec::new()
    }
    fn namespace_usage(&self) -> Vec<kvstore::NsUsage> {
        Vec::new()
    }
    fn stats(&self) -> kvstore::TierStats {
        kvstore::TierStats {
            tier: Some(Tier::Remote),
            ..Default::default()
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A push that keeps failing is tried 3 times more holding its pin, then 3 times late holding
/// only its key, and then given up. Only its late tries go through `LowerTier::write_late`
/// (where the remote tier may first probe an owner whose breaker's pause has ended): the
/// first pushes of blocks saved while its last pinned try was being written, batched with
/// its first late try, are written apart.
#[test]
fn late_push_tries_are_written_apart_as_late() {
    let owner = Arc::new(RefusingOwner {
        refused: key(1),
        sentinel: key(99),
        log: Default::default(),
        changed: Default::default(),
    });
    let store = StoreConfig {
        capacity_bytes: 64 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![4096],
        shards: 4,
        remote: Some(kvstore::SharedTier(owner.clone())),
        // Every try due at once: the pusher's batches alone decide what goes with what.
        push_retry_first: Duration::ZERO,
        ..Default::default()
    }
    .build()
    .unwrap();
    let id = ns(&store);
    store.put(id, key(1), &[1u8; 4096]).unwrap();
    owner.wait("the refused key's last pinned try", |l| l.holding);
    // Queued behind it; its first late try comes due with them.
    for i in 2..=5 {
        store.put(id, key(i), &[2u8; 4096]).unwrap();
    }
    owner.release();
    owner.wait("three late tries", |l| l.late_writes.len() >= 3);
    // One write more: once the owner sees it, the pusher has settled every batch before it.
    store.put(id, key(99), &[3u8; 4096]).unwrap();
    owner.wait("the sentinel's write", |l| l.writes.contains(&key(99)));
    let log = owner.log.lock().unwrap();
    assert_eq!(
        log.late_writes,
        vec![key(1); 3],
        "only the late tries written as late"
    );
    assert_eq!(log.writes.iter().filter(|k| **k == key(1)).count(), 4);
    assert_eq!(log.writes.len(), 4 + 4 + 1, "each other block written once");
    let s = store.stats();
    assert_eq!(
        (s.pushes, s.push_retries, s.push_failed),
        (4, 6, 1),
        "{s:?}"
    );
}

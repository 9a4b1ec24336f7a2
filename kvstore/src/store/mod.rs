//! The store: a sharded index over the host arena, with an ordered chain of lower tiers below
//! it (the disk tier today) and a background tiering worker that moves blocks between them.
//!
//! Module map: `config` (StoreConfig), `index` (entries, shards and their transitions), `slab`
//! (size classes and segments), `alloc` (finding a slot: never I/O), `lease` (the lease table),
//! `write` (reserve/commit), `read` (lookups and the one load-and-pin path), `remove`,
//! `tiering` (the worker: a file per thread, each queue owned by its thread), `shuttle_tests`
//! (the real store under shuttle, `--cfg kvtier_shuttle`).
//!
//! Lock order (`crate::sync::level`, checked in debug builds): registering → namespaces →
//! size class → preload holds → a lower tier's own lock → shard → leaf locks (segment pool,
//! doorkeeper, lease table, each queue, speed, progress, tickets), one leaf at a time. No code
//! holds two class locks or two shard locks at once (the empty-segment step only `try_lock`s
//! other classes), and no store lock is held while calling into a lower tier. A lower tier may
//! call back into the index (`still_wanted`, under the tier's own lock): tier locks come
//! before shard locks, never after.

mod alloc;
mod config;
mod index;
mod lease;
mod prefetch;
mod read;
mod remove;
mod retain;
#[cfg(kvtier_shuttle)]
#[cfg(test)]
mod shuttle_tests;
mod slab;
mod table;
mod tiering;
mod write;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Arc;
use std::time::Duration;

use crate::sync::{level, Condvar, Mutex, RwLock};

use crate::arena::Arena;
use crate::disk::{Admission, DiskTier};
use crate::error::{ConfigError, KeyError};
use crate::events::{BlockEvent, EventKind, Events};
use crate::io::IoEngine;
use crate::key::{BlockKey, Fingerprint, Namespace};
use crate::policy::PolicyKind;
use crate::tier::{LowerTier, TierStats};
use crate::types::{FoldHasher, NsId, Tier};

pub use config::{Populate, StoreConfig};
pub use prefetch::{Prefetch, PrefetchQuota, PrefetchStats, PREFETCH_WAITING_KEYS_MAX};
pub use read::{BlockLoc, BlockRef, Lease, Loaded, PrefixMatch};
pub use retain::{
    Demoted, RetainBound, Retained, RetentionStats, MAX_RETENTIONS, MAX_SESSION_BYTES,
};
pub use write::{PutOutcome, Reservation, Reserve};

use config::PAGE;
use index::Shard;
use lease::Leases;
use slab::Class;
use tiering::Work;

/// Keys remembered by the seen-twice admission doorkeeper (an exact set: a frequency sketch
/// of the same memory admitted one-off blocks through its bloom filter's false positives,
/// 0.7% of 100,000 one-off saves, more once it fills up).
const DOORKEEPER: usize = 1 << 20;

/// Blocks after a request's present prefix that count as seen once (its continuation, see
/// `Inner::continues`). Chosen on the Mooncake and `chat` replays with hints (2: chat 0.900 x
/// the simulation, 4: 0.957, 8: 0.976; docqa's disk writes +30%, +40%, +61% against none;
/// bench/RESULTS.md).
const CONTINUATION: usize = 4;

/// The fingerprint of a freed (reclaimable) namespace id: no namespace hashes to zero.
const FREE_NS: Fingerprint = Fingerprint(BlockKey(0));

/// Counters and gauges of a store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Bytes of host block memory (whole segments).
    pub capacity_bytes: u64,
    /// Bytes of committed block payload in host memory: a block removed while pinned (a load
    /// or lease in progress) counts until its last unpin frees its slot, as its bytes are
    /// still held (`blocks` no longer counts it).
    pub used_bytes: u64,
    /// Committed, visible blocks in host memory.
    pub blocks: u64,
    /// Blocks served by gets and loads (host, or promoted from a lower tier).
    pub hits: u64,
    /// Gets and loads that ended before their last key.
    pub misses: u64,
    /// Blocks dropped from host memory to make room (demoted ones included).
    pub evictions: u64,
    /// Payload bytes committed.
    pub bytes_in: u64,
    /// Payload bytes handed out by gets and loads.
    pub bytes_out: u64,
    /// Leases outstanding.
    pub leases: u64,
    /// Blocks pinned by those leases.
    pub leased_blocks: u64,
    /// Leases that lapsed without release.
    pub leases_expired: u64,
    /// Segments in the free pool.
    pub free_segments: u64,
    /// Segments faulted in and usable (== `total_segments` once population is done).
    pub populated_segments: u64,
    /// Segments of the arena.
    pub total_segments: u64,
    /// Blocks copied from a lower tier into host memory.
    pub promotions: u64,
    /// Blocks served (of `hits`) that their load read from the disk tier itself. A block a
    /// preload brought up first, or another load's promotion, counts as a host hit.
    pub disk_hits: u64,
    /// Blocks served (of `hits`) that their load read from the remote tier itself.
    pub remote_hits: u64,
    /// Blocks written from host memory to a lower tier.
    pub demotions: u64,
    /// Blocks not written to a lower tier because admission refused them.
    pub admission_rejects: u64,
    /// Host blocks whose bytes no longer matched their commit checksum (an engine wrote into a
    /// slot it no longer owned): dropped, served as misses, never as data.
    pub checksum_failures: u64,
    /// Times a request waited for room or for another request's promotion.
    pub waits: u64,
    /// Nanoseconds loads spent waiting for blocks to come up from a lower tier (their own
    /// promotions, or preloads and other loads' promotions they joined): the lower tiers' time
    /// on the engines' critical path.
    pub load_wait_ns: u64,
    /// Blocks queued for the tiering worker to write, and their bytes.
    pub demote_queue_blocks: u64,
    /// See `demote_queue_blocks`.
    pub demote_queue_bytes: u64,
    /// Promotion batches queued for the tiering worker.
    pub promote_queue: u64,
    /// Preload hints: see [`PrefetchStats`].
    pub prefetch: PrefetchStats,
    /// Priced lookups ([`Store::match_prefix_priced`]) that break-even admission cut short.
    pub break_even_cuts: u64,
    /// Blocks those lookups left out.
    pub break_even_blocks_cut: u64,
    /// The prefill rate (tokens/s) the last priced lookup stated: what break-even admission
    /// weighs loads against (0 until an engine states one).
    pub break_even_prefill_tokens_per_s: u64,
    /// The lower tiers' counters, in chain order.
    pub tiers: Vec<TierStats>,
    /// Committed blocks pushed to the remote tier (write-behind) and stored by their owner.
    pub pushes: u64,
    /// Blocks not pushed: the push queue was full (`push_queue_bytes`).
    pub push_dropped: u64,
    /// Pushes that failed (owner unreachable, refused) and were retried later.
    pub push_retries: u64,
    /// Pushes that failed for good (after their retries): the block stays local only.
    pub push_failed: u64,
    /// Bytes queued for pushing (retries waiting included).
    pub push_queue_bytes: u64,
    /// Size classes of the host tier whose policy is a duel and has its recency order (LRU, or
    /// CLOCK in `duel-clock`) choosing victims now (the others' duels, if any, have S3-FIFO).
    pub policy_lru_leading_classes: u64,
}

impl StoreStats {
    /// The disk tier's counters, if there is one.
    pub fn disk(&self) -> Option<&TierStats> {
        self.tiers.iter().find(|t| t.tier == Some(Tier::Disk))
    }
}

/// Blocks and bytes of one namespace per tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceStats {
    /// Namespace id.
    pub id: u16,
    /// Host blocks.
    pub host_blocks: u64,
    /// Host bytes.
    pub host_bytes: u64,
    /// Disk blocks.
    pub disk_blocks: u64,
    /// Disk bytes.
    pub disk_bytes: u64,
    /// Remote blocks.
    pub remote_blocks: u64,
    /// Remote bytes.
    pub remote_bytes: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub used_bytes: AtomicU64,
    pub blocks: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub leases_expired: AtomicU64,
    pub promotions: AtomicU64,
    pub disk_hits: AtomicU64,
    pub remote_hits: AtomicU64,
    pub demotions: AtomicU64,
    pub admission_rejects: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub waits: AtomicU64,
    pub load_wait_ns: AtomicU64,
    pub prefetch_hinted: AtomicU64,
    pub prefetch_in_time: AtomicU64,
    pub prefetch_late: AtomicU64,
    pub prefetch_cancelled: AtomicU64,
    pub prefetch_expired: AtomicU64,
    pub prefetch_dropped: AtomicU64,
    pub prefetch_waited: AtomicU64,
    pub prefetch_wasted_bytes: AtomicU64,
    pub break_even_cuts: AtomicU64,
    pub break_even_prefill: AtomicU64,
    pub break_even_blocks_cut: AtomicU64,
    pub pushes: AtomicU64,
    pub push_dropped: AtomicU64,
    pub push_retries: AtomicU64,
    pub push_failed: AtomicU64,
    pub retains: AtomicU64,
    pub retain_clipped: AtomicU64,
    pub retain_displaced: AtomicU64,
    pub retain_expired: AtomicU64,
    pub demotes: AtomicU64,
    pub demoted_freed: AtomicU64,
    pub demoted_queued: AtomicU64,
}

/// A lower tier's measured read speed (promotion batches), exponentially weighted.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Speed {
    /// Bytes per second (0: not measured yet).
    pub bw: f64,
    /// Seconds per batch beyond its bytes / bw.
    pub latency: f64,
}

impl Speed {
    /// Folds in a batch of `bytes` that took `secs`.
    pub(crate) fn observe(&mut self, bytes: u64, secs: f64) {
        const A: f64 = 0.2;
        if bytes == 0 || secs <= 0.0 {
            return;
        }
        let b = bytes as f64;
        if self.bw == 0.0 {
            self.bw = b / secs;
            return;
        }
        // Large batches measure bandwidth; what a batch took beyond its bytes is latency.
        if bytes >= 1 << 20 {
            self.bw += A * (b / secs - self.bw);
        }
        let lat = (secs - b / self.bw).max(0.0);
        self.latency += A * (lat - self.latency);
    }

    /// Seconds to read `bytes` in one batch (None: not measured yet).
    pub(crate) fn cost(&self, bytes: u64) -> Option<f64> {
        (self.bw > 0.0).then(|| self.latency + bytes as f64 / self.bw)
    }
}

#[derive(Default)]
struct Doorkeeper {
    order: VecDeque<u64>,
    set: HashSet<u64, BuildHasherDefault<FoldHasher>>,
}

/// Wakes whoever waits for the store to change (a slot freed, a block published, a write
/// done, a segment populated). Waiters re-check their condition; one deadline per request. A
/// bump with nobody waiting costs one atomic increment.
pub(crate) struct Progress {
    gen: AtomicU64,
    waiters: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            gen: AtomicU64::new(0),
            waiters: AtomicU64::new(0),
            lock: Mutex::new(level::LEAF, "progress", ()),
            cv: Condvar::default(),
        }
    }
}

impl Progress {
    pub(crate) fn bump(&self) {
        self.gen.fetch_add(1, SeqCst);
        if self.waiters.load(SeqCst) > 0 {
            drop(self.lock.lock());
            self.cv.notify_all();
        }
    }

    pub(crate) fn current(&self) -> u64 {
        self.gen.load(SeqCst)
    }

    /// Waits until something changed after generation `seen`, or `until`.
    pub(crate) fn wait(&self, seen: u64, until: std::time::Instant) {
        let mut g = self.lock.lock();
        self.waiters.fetch_add(1, SeqCst);
        while self.gen.load(SeqCst) == seen {
            if self.cv.wait_until(&mut g, until).timed_out() {
                break;
            }
        }
        self.waiters.fetch_sub(1, SeqCst);
    }
}

/// Everything the store is, shared with its worker threads and its guards.
pub(crate) struct Inner {
    // Fields drop in order: the lower tiers (whose io_uring registered the arena as fixed
    // buffers) go before the arena.
    pub(crate) tiers: Vec<Box<dyn LowerTier>>,
    /// The tier evicted dirty blocks are written to (the first that is not write-behind).
    pub(crate) demote_to: Option<usize>,
    /// The write-behind tier committed blocks are pushed to (the remote tier).
    pub(crate) push_to: Option<usize>,
    pub(crate) push_queue_bytes: u64,
    pub(crate) push_retry_first: Duration,
    pub(crate) arena: Arena,
    pub(crate) seg_pages: u32,
    pub(crate) class_sizes: Vec<usize>,
    pub(crate) classes: Vec<Mutex<Class>>,
    /// Populated segments not held by any class.
    pub(crate) segments: Mutex<Vec<u32>>,
    pub(crate) n_segments: u32,
    pub(crate) populated: AtomicU32,
    pub(crate) shards: Box<[Mutex<Shard>]>,
    /// Per shard, where its table is, read without its lock to prefetch (`table::Hint`).
    pub(crate) hints: Arc<[table::Hint]>,
    shard_bits: u32,
    namespaces: RwLock<Vec<Fingerprint>>,
    registering: Mutex<()>,
    pub(crate) leases: Mutex<Leases>,
    pub(crate) max_leases: usize,
    policy: PolicyKind,
    pub(crate) stats: Counters,
    doorkeeper: Mutex<Doorkeeper>,
    pub(crate) events: Arc<Events>,
    pub(crate) admission: Admission,
    /// Seen-twice admits every block while the lower tier is less full than this fraction.
    admit_all_below: f64,
    /// Whether it is now (updated after each write batch).
    lower_has_room: AtomicBool,
    pub(crate) write_through: bool,
    pub(crate) max_batch_bytes: u64,
    pub(crate) verify_reads: bool,
    pub(crate) prefetch_max_inflight: u64,
    /// Bound on preloads in flight plus held ones.
    pub(crate) prefetch_max_held: u64,
    /// Preloaded blocks no load has used yet: each keeps the promotion's pin (so eviction
    /// leaves it) until a load uses it or its hint's deadline passes.
    pub(crate) preloads: Mutex<prefetch::Holds>,
    /// Their bytes (part of the preload budget; per owner in the read queue).
    pub(crate) held_bytes: AtomicU64,
    /// Retained blocks (sessions the application will come back to), and their bounds.
    pub(crate) retained: Mutex<retain::Retentions>,
    /// Where retentions are kept across a restart (beside the disk tier's journal).
    pub(crate) retain_file: Option<std::path::PathBuf>,
    pub(crate) retain_max_bytes: u64,
    pub(crate) retain_max_ttl: Duration,
    /// Measured read speed of each lower tier.
    pub(crate) speed: Vec<Mutex<Speed>>,
    pub(crate) wait: Duration,
    pub(crate) progress: Progress,
    pub(crate) work: Work,
    /// Recent allocations per size class (halved every 2^16 allocations).
    pub(crate) demand: Vec<AtomicU64>,
    pub(crate) demand_total: AtomicU64,
    pub(crate) warned_classes: std::sync::atomic::AtomicBool,
}

/// The kvtier store: sharded index, host-memory tier, a chain of lower tiers, eviction,
/// leases, and the tiering worker. Cheap to share by reference across threads; guards
/// ([`Reservation`], [`BlockRef`], [`Loaded`]) own a handle to it and may outlive the borrow.
pub struct Store {
    inner: Arc<Inner>,
    threads: tiering::Threads,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("capacity_bytes", &self.capacity_bytes())
            .field("classes", &self.inner.class_sizes.len())
            .field("shards", &self.inner.shards.len())
            .field("tiers", &self.inner.tiers.len())
            .finish()
    }
}

impl Store {
    pub(crate) fn new(mut cfg: StoreConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let class_sizes = cfg.classes()?;
        let n_segments = cfg.capacity_bytes / cfg.segment_bytes;
        let prefetch_max_inflight = match cfg.prefetch_max_inflight_bytes {
            0 => (n_segments * cfg.segment_bytes / 8).max(1),
            b => b,
        };
        let prefetch_max_held = match cfg.prefetch_max_held_bytes {
            // An eighth (as much as may be in flight): tuned on the Mooncake trace and the
            // synthetic traces at queueing arrival rates (bench/RESULTS.md, issue 30). Holding
            // more for requests far back in the queue starves those at its head.
            0 => n_segments * cfg.segment_bytes / 8,
            b => b,
        }
        .max(prefetch_max_inflight);
        let seg_pages = (cfg.segment_bytes / PAGE as u64) as u32;
        let arena = Arena::new(
            n_segments * cfg.segment_bytes,
            cfg.huge_pages,
            cfg.populate == Populate::Now,
        )?;
        let events: Arc<Events> = Arc::default();
        let mut tiers: Vec<Box<dyn LowerTier>> = Vec::new();
        let (mut admission, mut write_through, mut max_batch_bytes) =
            (Admission::Always, false, 256 << 20);
        let mut admit_all_below = 0.0;
        let retain_file = cfg.disk.as_ref().map(|d| d.dir.join(retain::FILE));
        if let Some(mut d) = cfg.disk.take() {
            d.io.fixed_buffers = vec![(arena.base() as usize, arena.len())];
            // Registering the arena with io_uring faults all of it in: with background
            // population that waits until the populator is done.
            d.io.defer_fixed_buffers = cfg.populate == Populate::Background;
            if d.bounce_bytes == 0
                && arena.small_pages()
                && crate::arena::AlignedBuf::huge_pages_available()
            {
                // Reads from disk into 4 KiB pages ran at 0.7 of the device's rate here, 1.0
                // through huge-page bounce buffers (bench/RESULTS.md).
                d.bounce_bytes = crate::disk::BOUNCE_BYTES.min(arena.len() as u64 / 8);
            }
            admission = d.admission;
            admit_all_below = d.admit_all_below;
            write_through = d.write_through;
            max_batch_bytes = d.max_batch_bytes.max(1);
            tiers.push(Box::new(
                DiskTier::open(d, events.clone()).map_err(ConfigError::Disk)?,
            ));
        }
        if let Some(r) = cfg.remote.take() {
            tiers.push(Box::new(r.0));
        }
        let demote_to = tiers.iter().position(|t| !t.write_behind());
        let push_to = tiers.iter().position(|t| t.write_behind());
        let mut namespaces: Vec<Fingerprint> = Vec::new();
        for t in &tiers {
            let ns = t.recovered_namespaces();
            if ns.len() > namespaces.len() {
                namespaces = ns;
            }
        }
        // Tiers that keep no ids of their own learn the recovered ones.
        for t in tiers.iter().filter(|t| !t.local()) {
            for (id, fp) in namespaces.iter().enumerate() {
                if *fp != FREE_NS {
                    let _ = t.note_namespace(id as u16, *fp);
                }
            }
        }
        let n_classes = class_sizes.len();
        let n_tiers = tiers.len();
        let classes = class_sizes
            .iter()
            .map(|&sz| {
                Mutex::new(
                    level::CLASS,
                    "class",
                    Class::new(sz, cfg.segment_bytes, n_segments as u32, cfg.policy.build()),
                )
            })
            .collect();
        let hints = table::new_hints(cfg.shards);
        let shards: Box<[Mutex<Shard>]> = (0..cfg.shards)
            .map(|i| Mutex::new(level::SHARD, "shard", Shard::with_hint(hints.clone(), i)))
            .collect();
        let background = cfg.populate == Populate::Background;
        let pool: Vec<u32> = if background {
            Vec::new()
        } else {
            (0..n_segments as u32).rev().collect()
        };
        tracing::info!(
            capacity = n_segments * cfg.segment_bytes,
            segments = n_segments,
            classes = class_sizes.len(),
            policy = ?cfg.policy,
            tiers = tiers.len(),
            populate = ?cfg.populate,
            "store ready"
        );
        let inner = Arc::new(Inner {
            tiers,
            demote_to,
            push_to,
            // Queued pushes pin their blocks: at most a quarter of the host tier.
            push_queue_bytes: cfg
                .push_queue_bytes
                .min(n_segments * cfg.segment_bytes / 4)
                .max(1),
            push_retry_first: cfg.push_retry_first,
            arena,
            seg_pages,
            class_sizes,
            classes,
            populated: AtomicU32::new(pool.len() as u32),
            segments: Mutex::new(level::LEAF, "segments", pool),
            n_segments: n_segments as u32,
            shards,
            shard_bits: cfg.shards.trailing_zeros(),
            hints,
            namespaces: RwLock::new(level::NAMESPACES, "namespaces", namespaces),
            registering: Mutex::new(level::REGISTERING, "registering", ()),
            leases: Mutex::new(level::LEAF, "leases", Leases::default()),
            max_leases: cfg.max_leases,
            policy: cfg.policy,
            stats: Counters::default(),
            doorkeeper: Mutex::new(level::LEAF, "doorkeeper", Doorkeeper::default()),
            events,
            admission,
            admit_all_below,
            lower_has_room: AtomicBool::new(false),
            write_through,
            max_batch_bytes,
            verify_reads: cfg.verify_reads,
            speed: (0..n_tiers)
                .map(|_| Mutex::new(level::LEAF, "speed", Speed::default()))
                .collect(),
            preloads: Mutex::new(level::HOLDS, "holds", prefetch::Holds::default()),
            held_bytes: AtomicU64::new(0),
            retained: Mutex::new(level::LEAF, "retained", retain::Retentions::default()),
            retain_file,
            // A quarter of the host tier unless said.
            retain_max_bytes: cfg
                .retain_max_bytes
                .unwrap_or(n_segments * cfg.segment_bytes / 4),
            retain_max_ttl: cfg.retain_max_ttl,
            prefetch_max_inflight,
            prefetch_max_held,
            wait: cfg.wait,
            progress: Progress::default(),
            work: Work::default(),
            demand: (0..n_classes).map(|_| AtomicU64::new(0)).collect(),
            demand_total: AtomicU64::new(0),
            warned_classes: std::sync::atomic::AtomicBool::new(false),
        });
        inner.note_lower_fill();
        let threads = tiering::Threads::start(&inner, background)
            .map_err(|e| ConfigError::Thread(e.to_string()))?;
        inner.restore_retentions();
        Ok(Self { inner, threads })
    }

    /// Total bytes of host block memory.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }

    /// Most bytes all hints together may hold in host memory or have in flight.
    pub fn prefetch_max_held_bytes(&self) -> u64 {
        self.inner.prefetch_max_held
    }

    /// The slot sizes in use, ascending.
    pub fn size_classes(&self) -> &[usize] {
        &self.inner.class_sizes
    }

    /// The eviction policy.
    pub fn policy(&self) -> PolicyKind {
        self.inner.policy
    }

    /// The shared arena (for handing its fd to another process).
    pub fn arena(&self) -> &Arena {
        &self.inner.arena
    }

    /// The namespace fingerprint of id `ns`, if registered.
    pub fn fingerprint(&self, ns: NsId) -> Option<Fingerprint> {
        self.inner
            .namespaces
            .read()
            .get(ns.0 as usize)
            .copied()
            .filter(|f| *f != FREE_NS)
    }

    /// Whether a disk tier is configured.
    pub fn has_disk(&self) -> bool {
        self.inner.tiers.iter().any(|t| t.kind() == Tier::Disk)
    }

    /// The lower tiers, in chain order.
    pub fn tiers(&self) -> Vec<Tier> {
        self.inner.tiers.iter().map(|t| t.kind()).collect()
    }

    /// The registered namespaces' fingerprints, by id.
    pub fn namespaces(&self) -> Vec<Fingerprint> {
        self.inner.namespaces.read().clone()
    }

    /// Subscribes to block events through a channel of `capacity`; a subscriber that falls
    /// behind loses events (see [`Store::events_dropped`], and its own
    /// [`crate::Subscription::lost`]). Dropping the subscription unsubscribes.
    pub fn subscribe(&self, capacity: usize) -> crate::Subscription {
        self.inner.events.subscribe(capacity)
    }

    /// Events lost because a subscriber's channel was full.
    pub fn events_dropped(&self) -> u64 {
        self.inner.events.dropped()
    }

    /// Every committed block in host memory: its key and namespace. Scans the index one shard
    /// at a time (for a node handing its blocks over as it leaves, not the hot path); a block
    /// evicted since may be gone when it is loaded.
    pub fn host_keys(&self) -> Vec<(BlockKey, NsId)> {
        let mut out = Vec::new();
        for s in self.inner.shards.iter() {
            out.extend(
                s.lock()
                    .map
                    .iter()
                    .filter(|(_, e)| e.ready())
                    .map(|(k, e)| (BlockKey::from(k), NsId(u32::from(e.ns)))),
            );
        }
        out
    }

    /// Every committed block in host memory and on disk, as the `Stored` event that put it
    /// there, handed to `f` a batch at a time (a shard's host blocks, then the disk tier's in
    /// batches of `batch`), no lock held during `f`; `f` returns `false` to stop. With
    /// [`Store::subscribe`] called first, the batches followed by the subscription's events
    /// tell a watcher where every block is: each block's events after the subscription, in
    /// order (emitted under the lock its change was made under: see [`crate::Events`]), end
    /// in the state the scan saw or a later one, unless the subscriber lost events (its
    /// [`crate::Subscription::lost`] says so, and it must start again). For a watcher's
    /// snapshot (kvtierd's `Watch`), not the hot path.
    pub fn resident_events(&self, batch: usize, mut f: impl FnMut(Vec<BlockEvent>) -> bool) {
        let stored = |key, tier, ns| BlockEvent {
            kind: EventKind::Stored,
            key,
            tier,
            ns,
        };
        for s in self.inner.shards.iter() {
            let host: Vec<BlockEvent> = s
                .lock()
                .map
                .iter()
                .filter(|(_, e)| e.ready())
                .map(|(k, e)| stored(BlockKey::from(k), Tier::Host, e.ns))
                .collect();
            if !host.is_empty() && !f(host) {
                return;
            }
        }
        if let Some(d) = self.disk_tier() {
            for part in d.blocks().chunks(batch.max(1)) {
                let disk = part
                    .iter()
                    .map(|&(k, ns)| stored(k, Tier::Disk, ns))
                    .collect();
                if !f(disk) {
                    return;
                }
            }
        }
    }

    /// Blocks and bytes per namespace and tier. Scans the index: for admin use, not the hot
    /// path.
    pub fn namespace_stats(&self) -> Vec<NamespaceStats> {
        let mut m: BTreeMap<u16, NamespaceStats> = BTreeMap::new();
        let mut ready: Vec<(u8, u32, u16)> = Vec::new();
        for s in self.inner.shards.iter() {
            ready.extend(
                s.lock()
                    .map
                    .values()
                    .filter(|e| e.ready())
                    .map(|e| (e.class, e.idx, e.ns)),
            );
        }
        // The lengths from the classes, one lock each, after the shards' (a class's lock comes
        // first in the order): a snapshot, as the scan is.
        ready.sort_unstable();
        for run in ready.chunk_by(|a, b| a.0 == b.0) {
            let c = self.inner.classes[run[0].0 as usize].lock();
            for &(_, idx, ns) in run {
                let x = m.entry(ns).or_default();
                x.host_blocks += 1;
                x.host_bytes += u64::from(c.lens[idx as usize]);
            }
        }
        for t in &self.inner.tiers {
            for u in t.namespace_usage() {
                let x = m.entry(u.ns).or_default();
                let (b, y) = match t.kind() {
                    Tier::Disk => (&mut x.disk_blocks, &mut x.disk_bytes),
                    _ => (&mut x.remote_blocks, &mut x.remote_bytes),
                };
                *b += u.blocks;
                *y += u.bytes;
            }
        }
        m.into_iter()
            .map(|(id, mut s)| {
                s.id = id;
                s
            })
            .collect()
    }

    /// Wraps the disk tier's I/O engine (fault injection in tests); a no-op without a disk
    /// tier.
    pub fn wrap_disk_engine(&mut self, f: impl FnOnce(Arc<dyn IoEngine>) -> Arc<dyn IoEngine>) {
        if let Some(d) = self.disk_tier() {
            d.wrap_engine(f);
        }
    }

    /// The disk tier, if any.
    fn disk_tier(&self) -> Option<&DiskTier> {
        self.inner
            .tiers
            .iter()
            .find_map(|t| t.as_any().downcast_ref::<DiskTier>())
    }

    /// Installs where the disk tier gets the engine tags of the blocks it writes (see
    /// [`DiskTier::set_tagger`]); a no-op without a disk tier.
    pub fn set_engine_tagger(&self, tagger: crate::tags::Tagger) {
        if let Some(d) = self.disk_tier() {
            d.set_tagger(tagger);
        }
    }

    /// The engine tags the disk tier's journal kept for blocks still on disk (before a tagger
    /// is installed).
    pub fn recovered_engine_tags(&self) -> Vec<(BlockKey, crate::tags::EngineTag)> {
        self.disk_tier()
            .map(DiskTier::recovered_tags)
            .unwrap_or_default()
    }

    /// Emits a `Stored` event for every block of namespace `ns` on disk (after a restart, for
    /// subscribers that know nothing of them), in the order `order` puts them in, waiting up
    /// to `patience` in all per subscriber for room; returns how many blocks.
    ///
    /// Evictions go on meanwhile and publish their `Removed` events as they happen, so a block
    /// listed here may be gone before its `Stored` is sent: each batch is sent only for the
    /// blocks still on disk, and a block found gone once its batch was sent gets a `Removed`
    /// after it (a subscriber never ends up believing an evicted block is stored).
    pub fn announce_disk(
        &self,
        ns: NsId,
        order: impl FnOnce(&mut Vec<BlockKey>),
        patience: Duration,
    ) -> usize {
        /// Blocks checked and sent at a time.
        const BATCH: usize = 1024;
        let Some(d) = self.disk_tier() else {
            return 0;
        };
        let ns = ns.0 as u16;
        let mut keys = d.blocks_of(ns);
        order(&mut keys);
        let deadline = std::time::Instant::now() + patience;
        let event = |kind, key| BlockEvent {
            kind,
            key,
            tier: Tier::Disk,
            ns,
        };
        // Of `ks`, those on disk (`true`) or not (`false`).
        let on_disk = |ks: &[BlockKey], want: bool| -> Vec<BlockKey> {
            ks.iter()
                .zip(d.lookup_batch(ks))
                .filter(|(_, i)| i.is_some() == want)
                .map(|(k, _)| *k)
                .collect()
        };
        let mut sent = 0;
        for batch in keys.chunks(BATCH) {
            let present = on_disk(batch, true);
            let evs: Vec<BlockEvent> = present
                .iter()
                .map(|&k| event(crate::events::EventKind::Stored, k))
                .collect();
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            self.inner.events.emit_all(&evs, left);
            sent += evs.len();
            let gone: Vec<BlockEvent> = on_disk(&present, false)
                .into_iter()
                .map(|k| event(crate::events::EventKind::Removed, k))
                .collect();
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            self.inner.events.emit_all(&gone, left);
        }
        sent
    }

    /// Registers a namespace (idempotent) and returns its id in this store. With a disk tier
    /// the id is durable: the same namespace gets the same id after a restart.
    pub fn register_namespace(&self, ns: &Namespace) -> Result<NsId, KeyError> {
        ns.validate()?;
        self.register_fingerprint(ns.fingerprint())
    }

    /// Registers a namespace known only by its fingerprint (blocks another node of the cluster
    /// stores here: keys are global, only the id is local), like
    /// [`Store::register_namespace`].
    pub fn register_fingerprint(&self, fp: Fingerprint) -> Result<NsId, KeyError> {
        if fp == FREE_NS {
            return Err(KeyError::BadNamespace("zero fingerprint".into()));
        }
        let inner = &self.inner;
        if let Some(i) = inner.namespaces.read().iter().position(|f| *f == fp) {
            return Ok(NsId(i as u32));
        }
        // Registrations are serialised here; readers of the table are not blocked while the
        // id is journaled.
        let _one_at_a_time = inner.registering.lock();
        let v = inner.namespaces.read();
        if let Some(i) = v.iter().position(|f| *f == fp) {
            return Ok(NsId(i as u32));
        }
        // A free id (reclaimed) first, else a new one.
        let id = match v.iter().position(|f| *f == FREE_NS) {
            Some(i) => i as u16,
            None if v.len() <= usize::from(u16::MAX) => v.len() as u16,
            None => {
                return Err(KeyError::TableFull(usize::from(u16::MAX) + 1));
            }
        };
        drop(v);
        for t in &inner.tiers {
            t.note_namespace(id, fp).map_err(|e| {
                KeyError::BadNamespace(format!("cannot record the namespace on disk: {e}"))
            })?;
        }
        let mut v = inner.namespaces.write();
        if usize::from(id) == v.len() {
            v.push(fp);
        } else {
            v[usize::from(id)] = fp;
        }
        Ok(NsId(u32::from(id)))
    }

    /// Frees the ids of namespaces that hold no block in any tier and that `keep` does not
    /// want kept (the daemon keeps those its connections registered); returns how many. A
    /// freed id is reused by the next new namespace. Scans the index: for when the table is
    /// full, not the hot path.
    pub fn reclaim_namespaces(&self, keep: &dyn Fn(NsId) -> bool) -> usize {
        let _one_at_a_time = self.inner.registering.lock();
        let used: HashSet<u16> = self
            .namespace_stats()
            .into_iter()
            .filter(|n| n.host_blocks + n.disk_blocks + n.remote_blocks > 0)
            .map(|n| n.id)
            .collect();
        // Blocks being written count too: an entry exists for them in the index.
        let mut writing: HashSet<u16> = HashSet::new();
        for s in self.inner.shards.iter() {
            writing.extend(s.lock().map.values().map(|e| e.ns));
        }
        let mut v = self.inner.namespaces.write();
        let mut n = 0;
        for (i, f) in v.iter_mut().enumerate() {
            let id = i as u16;
            if *f != FREE_NS
                && !used.contains(&id)
                && !writing.contains(&id)
                && !keep(NsId(u32::from(id)))
            {
                *f = FREE_NS;
                n += 1;
            }
        }
        if n > 0 {
            tracing::info!(freed = n, "namespace ids without blocks reclaimed");
        }
        n
    }

    /// Whether namespace id `ns` is registered.
    pub fn has_namespace(&self, ns: NsId) -> bool {
        self.inner
            .namespaces
            .read()
            .get(ns.0 as usize)
            .is_some_and(|f| *f != FREE_NS)
    }

    /// Writes every dirty, admitted host block to the lower tiers, waits until every queued
    /// write is done and checkpoints them (clean shutdown). Returns how many blocks were
    /// written.
    pub fn flush(&self) -> usize {
        let n = self.inner.flush();
        self.inner.save_retentions();
        n
    }

    /// Waits until the tiering worker has finished every queued write (or `timeout` passed);
    /// true if it has. After a write-through commit, this makes the block durable.
    pub fn sync(&self, timeout: Duration) -> bool {
        self.inner.sync(timeout)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        let s = &inner.stats;
        let (leases, leased_blocks) = {
            let l = inner.leases.lock();
            (l.len() as u64, l.pinned() as u64)
        };
        let q = inner.work.depths();
        // (Read before the literal: a guard taken inside it would live to its end.)
        let free_segments = inner.segments.lock().len() as u64;
        let waiting_keys = inner.work.reads.waiting_keys() as u64;
        let watching_keys = inner.work.reads.watching_keys() as u64;
        let policy_lru_leading_classes = inner
            .classes
            .iter()
            .filter(|c| c.lock().policy.leader().is_some_and(|l| l != "s3fifo"))
            .count() as u64;
        StoreStats {
            policy_lru_leading_classes,
            capacity_bytes: inner.capacity_bytes(),
            used_bytes: s.used_bytes.load(Relaxed),
            blocks: s.blocks.load(Relaxed),
            hits: s.hits.load(Relaxed),
            misses: s.misses.load(Relaxed),
            evictions: s.evictions.load(Relaxed),
            bytes_in: s.bytes_in.load(Relaxed),
            bytes_out: s.bytes_out.load(Relaxed),
            leases,
            leased_blocks,
            leases_expired: s.leases_expired.load(Relaxed),
            free_segments,
            populated_segments: u64::from(inner.populated.load(Relaxed)),
            total_segments: u64::from(inner.n_segments),
            promotions: s.promotions.load(Relaxed),
            disk_hits: s.disk_hits.load(Relaxed),
            remote_hits: s.remote_hits.load(Relaxed),
            demotions: s.demotions.load(Relaxed),
            admission_rejects: s.admission_rejects.load(Relaxed),
            checksum_failures: s.checksum_failures.load(Relaxed),
            waits: s.waits.load(Relaxed),
            load_wait_ns: s.load_wait_ns.load(Relaxed),
            demote_queue_blocks: q.demote_blocks,
            demote_queue_bytes: q.demote_bytes,
            promote_queue: q.promote_jobs,
            prefetch: PrefetchStats {
                hinted: s.prefetch_hinted.load(Relaxed),
                in_time: s.prefetch_in_time.load(Relaxed),
                late: s.prefetch_late.load(Relaxed),
                cancelled: s.prefetch_cancelled.load(Relaxed),
                expired: s.prefetch_expired.load(Relaxed),
                dropped: s.prefetch_dropped.load(Relaxed),
                waited: s.prefetch_waited.load(Relaxed),
                waiting_keys,
                watching_keys,
                wasted_bytes: s.prefetch_wasted_bytes.load(Relaxed),
                inflight_bytes: q.prefetch_bytes,
                held_bytes: inner.held_bytes.load(Relaxed),
                queued_jobs: q.prefetch_jobs,
            },
            tiers: inner
                .tiers
                .iter()
                .zip(&inner.speed)
                .map(|(t, sp)| {
                    let sp = *sp.lock();
                    TierStats {
                        read_bandwidth: sp.bw as u64,
                        read_latency_ns: (sp.latency * 1e9) as u64,
                        ..t.stats()
                    }
                })
                .collect(),
            break_even_cuts: s.break_even_cuts.load(Relaxed),
            break_even_prefill_tokens_per_s: s.break_even_prefill.load(Relaxed),
            break_even_blocks_cut: s.break_even_blocks_cut.load(Relaxed),
            pushes: s.pushes.load(Relaxed),
            push_dropped: s.push_dropped.load(Relaxed),
            push_retries: s.push_retries.load(Relaxed),
            push_failed: s.push_failed.load(Relaxed),
            push_queue_bytes: q.push_bytes,
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.inner.save_retentions();
        self.threads.stop(&self.inner);
    }
}

impl Inner {
    pub(crate) fn capacity_bytes(&self) -> u64 {
        u64::from(self.n_segments) * u64::from(self.seg_pages) * PAGE as u64
    }

    pub(crate) fn shard(&self, key: BlockKey) -> &Mutex<Shard> {
        &self.shards[self.shard_of(table::hash(crate::types::MapKey::from(key)))]
    }

    /// The shard of a key with this [`table::hash`] (its low bits; the table places keys by
    /// the high ones).
    pub(crate) fn shard_of(&self, hash: u32) -> usize {
        (hash & ((1u32 << self.shard_bits) - 1)) as usize
    }

    pub(crate) fn ptr(&self, page: u32) -> *mut u8 {
        // SAFETY: pages come from `Class::page_of`, which only yields offsets of slots inside
        // segments `0..n_segments`, all within the arena mapping.
        unsafe { self.arena.base().add(page as usize * PAGE) }
    }

    /// Whether `ns` is a registered (not freed) namespace id.
    pub(crate) fn namespace_ok(&self, ns: NsId) -> bool {
        self.namespaces
            .read()
            .get(ns.0 as usize)
            .is_some_and(|f| *f != FREE_NS)
    }

    /// Whether a block with this key and access history goes to the lower tiers.
    pub(crate) fn admitted(&self, key: BlockKey, accessed: bool) -> bool {
        if self.demote_to.is_none() {
            return false;
        }
        match self.admission {
            Admission::Always => true,
            Admission::SeenTwice => {
                accessed
                    || self.lower_has_room.load(Relaxed)
                    || self.doorkeeper.lock().set.contains(&(key.0 as u64))
            }
        }
    }

    /// Reads how full the tier demotions go to is, for [`Inner::admitted`]: called once the
    /// tiers are open and after each write batch (writes are what fill it), with no lock held.
    pub(crate) fn note_lower_fill(&self) {
        let room = self
            .demote_to
            .and_then(|i| self.tiers.get(i))
            .and_then(|t| t.fill())
            .is_some_and(|(used, cap)| (used as f64) < self.admit_all_below * cap as f64);
        self.lower_has_room.store(room, Relaxed);
    }

    /// An engine asks for `keys` (a request's blocks in prefix order: a hint, or a lookup
    /// before the request runs) and `present` of them lead in the cache. A request that
    /// continues a cached prefix (the new turn of a conversation, the next step of an agent
    /// loop) is likely the prefix of the request after it: its first `CONTINUATION` blocks
    /// after the present prefix count as seen once, so once the engine saves them seen-twice
    /// admission writes them to disk when they leave host memory.
    pub(crate) fn continues(&self, keys: &[BlockKey], present: usize) {
        if present > 0 {
            self.remember(keys.iter().skip(present).take(CONTINUATION).copied());
        }
    }

    /// Remembers keys seen once (dropped without admission, put again while present, or named
    /// by a hint as the continuation of a cached prefix): seen-twice admission writes them to
    /// the lower tier when they leave host memory (again).
    pub(crate) fn remember(&self, keys: impl IntoIterator<Item = BlockKey>) {
        if self.demote_to.is_none() || self.admission != Admission::SeenTwice {
            return;
        }
        let mut d = self.doorkeeper.lock();
        for key in keys {
            if d.set.insert(key.0 as u64) {
                d.order.push_back(key.0 as u64);
                if d.order.len() > DOORKEEPER {
                    if let Some(old) = d.order.pop_front() {
                        d.set.remove(&old);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;

//! The store: a sharded index over the host arena, with an optional disk tier below it.
//!
//! # Block lifecycle (host tier)
//!
//! ```text
//!  reserve() ──► Writing ──commit()──► Ready ──evict / remove / clear──► gone (slot freed)
//!     │            │ (drop)              │ pins > 0 at removal
//!     ▼            ▼                     ▼
//!   Present /   gone (slot freed)      Doomed (invisible) ──last unpin──► gone (slot freed)
//!   InFlight
//! ```
//!
//! * Only `Ready` blocks are visible to `get`, `match_prefix` and `lease`: a reader never sees a
//!   half-written block.
//! * A block with pins (borrowed by a [`BlockRef`], held by a lease, or being written to disk)
//!   is never evicted; removing it makes it invisible at once and frees its slot when the last
//!   pin goes.
//! * With a disk tier, a Ready block is *dirty* until a copy is durable on disk (*clean*).
//!   Evicting a clean block just drops the host copy. Evicting a dirty block that the admission
//!   policy admits first writes it to disk (write-back, in the allocating thread, batched); with
//!   write-through the write happens at commit. A block whose disk write failed is dropped on
//!   eviction (a later miss, never wrong data).
//! * Lock order: a size-class lock, then a shard lock, then leaf locks (segment pool, demotion
//!   queue, doorkeeper). No code holds two class locks or two shard locks at once, and no
//!   store lock is held across disk I/O.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::arena::Arena;
use crate::disk::{
    Admission, DiskConfig, DiskStats, DiskTier, ReadOutcome, WriteItem, WriteOutcome,
};
use crate::error::{ConfigError, KeyError, StoreError};
use crate::events::{BlockEvent, EventKind, Events};
use crate::io::{IoBuf, IoEngine};
use crate::key::{BlockKey, Fingerprint, Namespace};
use crate::policy::{EvictionPolicy, PolicyKind};

const PAGE: usize = 4096;
/// Keys remembered by the seen-twice admission doorkeeper.
const DOORKEEPER: usize = 1 << 20;

/// Where a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tier {
    /// The shared host-memory arena.
    Host,
    /// The local disk tier.
    Disk,
}

/// Configuration of a [`Store`]; `build()` creates it.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Bytes of host memory for block data. Rounded down to whole segments.
    pub capacity_bytes: u64,
    /// The arena is carved into segments of this size; each segment serves one size class at a
    /// time and returns to the pool when its class gives it up. Multiple of 4096, at least the
    /// largest size class.
    pub segment_bytes: u64,
    /// Slot sizes. Empty: 4 classes per power of two from 64 KiB up to `segment_bytes`.
    /// Each is rounded up to a multiple of 4096.
    pub size_classes: Vec<usize>,
    /// Index shards (power of two).
    pub shards: usize,
    /// Eviction policy (one instance per size class).
    pub policy: PolicyKind,
    /// Back the arena with explicit huge pages (MFD_HUGETLB); fails clearly if none are reserved.
    pub huge_pages: bool,
    /// Fault every arena page in at start so first-touch costs stay out of the hot path.
    pub populate: bool,
    /// Most leases outstanding at once.
    pub max_leases: usize,
    /// The disk tier below the host tier, if any.
    pub disk: Option<DiskConfig>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: 1 << 30,
            segment_bytes: 64 << 20,
            size_classes: Vec::new(),
            shards: 64,
            policy: PolicyKind::default(),
            huge_pages: false,
            populate: true,
            max_leases: 1 << 16,
            disk: None,
        }
    }
}

impl StoreConfig {
    /// Validates the configuration and creates the store (allocating the arena, opening and
    /// recovering the disk tier).
    pub fn build(self) -> Result<Store, ConfigError> {
        Store::new(self)
    }

    fn classes(&self) -> Result<Vec<usize>, ConfigError> {
        let seg = self.segment_bytes as usize;
        let mut classes: Vec<usize> = if self.size_classes.is_empty() {
            let mut v = Vec::new();
            let mut base = 64 << 10;
            while base <= seg {
                for q in [4, 5, 6, 7] {
                    let c = base / 4 * q;
                    if c <= seg {
                        v.push(c);
                    }
                }
                base *= 2;
            }
            v
        } else {
            self.size_classes
                .iter()
                .map(|&c| c.div_ceil(PAGE) * PAGE)
                .collect()
        };
        classes.sort_unstable();
        classes.dedup();
        if classes.is_empty() || classes[0] == 0 {
            return Err(ConfigError::BadSizeClasses(
                "need at least one non-zero class".into(),
            ));
        }
        if classes.len() > 255 {
            return Err(ConfigError::BadSizeClasses(format!(
                "{} classes, at most 255",
                classes.len()
            )));
        }
        if let Some(&max) = classes.last() {
            if max > seg {
                return Err(ConfigError::BadSizeClasses(format!(
                    "class {max} is larger than segment_bytes {seg}"
                )));
            }
        }
        Ok(classes)
    }
}

/// A registered namespace's id inside one store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NsId(pub u32);

/// Result of a longest-prefix lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// How many leading keys are present.
    pub n: usize,
    /// The tier of each of the `n` leading keys (the fastest tier holding it).
    pub tiers: Vec<Tier>,
}

/// A lease id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// Leading present keys pinned until [`Store::release`] or expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lease, or `None` when nothing was found (nothing to release).
    pub id: Option<LeaseId>,
    /// Leading keys found and pinned.
    pub n: usize,
    /// The tier of each pinned key.
    pub tiers: Vec<Tier>,
    /// When the pins lapse on their own.
    pub expires: Instant,
}

/// Outcome of a copying put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored now.
    Stored,
    /// A committed block with this key exists already (keys are content addresses).
    AlreadyPresent,
    /// Another writer is filling this key right now.
    InFlight,
}

/// Outcome of [`Store::reserve`].
pub enum Reserve<'a> {
    /// A slot to fill, then commit.
    Slot(Reservation<'a>),
    /// A committed block with this key exists already.
    AlreadyPresent,
    /// Another writer is filling this key right now.
    InFlight,
}

/// Counters and gauges of a store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Bytes of host block memory (whole segments).
    pub capacity_bytes: u64,
    /// Bytes of committed block payload in host memory.
    pub used_bytes: u64,
    /// Committed, visible blocks in host memory.
    pub blocks: u64,
    /// `get` / `get_into` hits (host, or disk then promoted).
    pub hits: u64,
    /// `get` / `get_into` misses.
    pub misses: u64,
    /// Blocks dropped from host memory to make room (demoted ones included).
    pub evictions: u64,
    /// Payload bytes committed.
    pub bytes_in: u64,
    /// Payload bytes handed out by gets.
    pub bytes_out: u64,
    /// Leases outstanding.
    pub leases: u64,
    /// Leases that lapsed without release.
    pub leases_expired: u64,
    /// Segments in the free pool.
    pub free_segments: u64,
    /// Blocks copied disk → host on a hit or a prefix load.
    pub promotions: u64,
    /// Blocks written host → disk.
    pub demotions: u64,
    /// Blocks not written to disk because admission refused them.
    pub admission_rejects: u64,
    /// The disk tier's counters.
    pub disk: Option<DiskStats>,
}

#[derive(Default)]
struct Counters {
    used_bytes: AtomicU64,
    blocks: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    leases_expired: AtomicU64,
    promotions: AtomicU64,
    demotions: AtomicU64,
    admission_rejects: AtomicU64,
}

// ---------------------------------------------------------------------------------------------
// Index

/// The map key: a `BlockKey` as two words (8-byte aligned, so a map bucket is 32 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct MapKey([u64; 2]);

impl From<BlockKey> for MapKey {
    fn from(k: BlockKey) -> Self {
        MapKey([(k.0 >> 64) as u64, k.0 as u64])
    }
}

impl From<MapKey> for BlockKey {
    fn from(k: MapKey) -> Self {
        BlockKey((u128::from(k.0[0]) << 64) | u128::from(k.0[1]))
    }
}

/// Keys are already uniform hashes: fold the two words instead of hashing again.
#[derive(Default)]
pub(crate) struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = self.0.rotate_left(29) ^ x;
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

pub(crate) type FoldMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

/// Entry flags.
const READY: u8 = 1;
/// A copy is durable on the disk tier.
const CLEAN: u8 = 2;
/// Being written to disk (holds one pin).
const DEMOTING: u8 = 4;
/// Read while in host memory (seen twice).
const ACCESSED: u8 = 8;
/// A disk write failed: drop on eviction.
const NO_DEMOTE: u8 = 16;
/// Removed while being written: its commit aborts instead of publishing it.
const CANCELLED: u8 = 32;

/// Which slot holds a block: size class and dense slot index within the class. The arena
/// address follows from the class's chunk table (see `Class::page_of`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Slot {
    class: u8,
    idx: u32,
}

/// Per-block metadata in the index: 16 bytes, so a map bucket with its key is 32 bytes.
#[derive(Clone, Copy, Debug)]
struct Entry {
    idx: u32,
    len: u32,
    pins: u32,
    ns: u16,
    class: u8,
    flags: u8,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 16);

impl Entry {
    fn slot(&self) -> Slot {
        Slot {
            class: self.class,
            idx: self.idx,
        }
    }
    fn ready(&self) -> bool {
        self.flags & READY != 0
    }
}

#[derive(Default)]
struct Shard {
    map: FoldMap<MapKey, Entry>,
    /// Removed while pinned: slot → pins left. Freed on the last unpin.
    doomed: HashMap<Slot, u32>,
}

/// A host block queued for writing to disk; it holds one pin until written.
struct Demote {
    key: BlockKey,
    slot: Slot,
    page: u32,
    cap: usize,
    len: u32,
    ns: u16,
}

// ---------------------------------------------------------------------------------------------
// Size classes

struct Class {
    slot_bytes: usize,
    per_seg: u32,
    /// Chunk `c` holds slots `c*per_seg .. (c+1)*per_seg`, backed by segment `chunks[c]`.
    chunks: Vec<Option<u32>>,
    free_chunks: Vec<u32>,
    /// Slots in use (reserved or committed) per chunk.
    live: Vec<u32>,
    free: Vec<u32>,
    /// Key of the block in each slot (valid while `used`).
    keys: Vec<BlockKey>,
    used: Vec<bool>,
    policy: Box<dyn EvictionPolicy>,
}

/// Arena page of slot `idx` of a class with the given chunk table.
fn page_of(
    chunks: &[Option<u32>],
    per_seg: u32,
    slot_bytes: usize,
    idx: u32,
    seg_pages: u32,
) -> u32 {
    let seg = chunks[(idx / per_seg) as usize].unwrap_or(0);
    seg * seg_pages + (idx % per_seg) * (slot_bytes / PAGE) as u32
}

impl Class {
    fn page_of(&self, idx: u32, seg_pages: u32) -> u32 {
        page_of(&self.chunks, self.per_seg, self.slot_bytes, idx, seg_pages)
    }

    fn add_segment(&mut self, seg: u32) {
        let chunk = match self.free_chunks.pop() {
            Some(c) => {
                self.chunks[c as usize] = Some(seg);
                c
            }
            None => {
                self.chunks.push(Some(seg));
                self.live.push(0);
                (self.chunks.len() - 1) as u32
            }
        };
        let start = chunk * self.per_seg;
        let end = start + self.per_seg;
        if self.keys.len() < end as usize {
            self.keys.resize(end as usize, BlockKey::default());
            self.used.resize(end as usize, false);
        }
        self.free.extend((start..end).rev());
    }

    fn take(&mut self, idx: u32, key: BlockKey) {
        self.keys[idx as usize] = key;
        self.used[idx as usize] = true;
        self.live[(idx / self.per_seg) as usize] += 1;
    }

    fn release(&mut self, idx: u32) {
        self.policy.remove(idx);
        if std::mem::replace(&mut self.used[idx as usize], false) {
            self.live[(idx / self.per_seg) as usize] -= 1;
            self.free.push(idx);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Leases

#[derive(Clone, Copy)]
enum Pin {
    Host(BlockKey, Slot),
    Disk(BlockKey),
}

#[derive(Default)]
struct Leases {
    next: u64,
    live: HashMap<u64, (Instant, Vec<Pin>)>,
    by_deadline: BTreeMap<(Instant, u64), ()>,
}

#[derive(Default)]
struct Doorkeeper {
    order: VecDeque<u64>,
    set: HashSet<u64, BuildHasherDefault<FoldHasher>>,
}

// ---------------------------------------------------------------------------------------------
// Store

/// The kvtier store: sharded index, host-memory tier, optional disk tier, eviction, leases.
pub struct Store {
    // Fields drop in order: the disk tier (whose io_uring registered the arena as fixed
    // buffers) goes before the arena.
    disk: Option<DiskTier>,
    arena: Arena,
    seg_pages: u32,
    class_sizes: Vec<usize>,
    classes: Vec<Mutex<Class>>,
    segments: Mutex<Vec<u32>>,
    n_segments: u32,
    shards: Box<[Mutex<Shard>]>,
    shard_bits: u32,
    namespaces: RwLock<Vec<Fingerprint>>,
    leases: Mutex<Leases>,
    max_leases: usize,
    policy: PolicyKind,
    stats: Counters,
    registering: Mutex<()>,
    demote: Mutex<Vec<Demote>>,
    doorkeeper: Mutex<Doorkeeper>,
    events: Arc<Events>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("capacity_bytes", &self.capacity_bytes())
            .field("classes", &self.class_sizes.len())
            .field("shards", &self.shards.len())
            .field("disk", &self.disk.is_some())
            .finish()
    }
}

impl Store {
    fn new(mut cfg: StoreConfig) -> Result<Self, ConfigError> {
        if cfg.segment_bytes == 0
            || cfg.segment_bytes % PAGE as u64 != 0
            || cfg.segment_bytes > u64::from(u32::MAX)
        {
            return Err(ConfigError::BadSegment(cfg.segment_bytes));
        }
        if !cfg.shards.is_power_of_two() || cfg.shards > 65536 {
            return Err(ConfigError::BadShards(cfg.shards));
        }
        let class_sizes = cfg.classes()?;
        let n_segments = cfg.capacity_bytes / cfg.segment_bytes;
        if n_segments == 0 {
            return Err(ConfigError::CapacityTooSmall {
                capacity: cfg.capacity_bytes,
                segment: cfg.segment_bytes,
            });
        }
        let seg_pages = (cfg.segment_bytes / PAGE as u64) as u32;
        if n_segments * u64::from(seg_pages) > u64::from(u32::MAX) {
            return Err(ConfigError::BadSegment(cfg.segment_bytes));
        }
        let arena = Arena::new(n_segments * cfg.segment_bytes, cfg.huge_pages, cfg.populate)?;
        let mut namespaces = Vec::new();
        let disk = match cfg.disk.take() {
            None => None,
            Some(mut d) => {
                d.io.fixed_buffers = vec![(arena.base() as usize, arena.len())];
                let (tier, ns) = DiskTier::open(d).map_err(ConfigError::Disk)?;
                namespaces = ns;
                Some(tier)
            }
        };
        let classes = class_sizes
            .iter()
            .map(|&sz| {
                Mutex::new(Class {
                    slot_bytes: sz,
                    per_seg: (cfg.segment_bytes as usize / sz) as u32,
                    chunks: Vec::new(),
                    free_chunks: Vec::new(),
                    live: Vec::new(),
                    free: Vec::new(),
                    keys: Vec::new(),
                    used: Vec::new(),
                    policy: cfg.policy.build(),
                })
            })
            .collect();
        let shards = (0..cfg.shards).map(|_| Mutex::default()).collect();
        let events = disk.as_ref().map(|d| d.events.clone()).unwrap_or_default();
        tracing::info!(
            capacity = n_segments * cfg.segment_bytes,
            segments = n_segments,
            classes = class_sizes.len(),
            policy = ?cfg.policy,
            disk = disk.is_some(),
            "store ready"
        );
        Ok(Self {
            arena,
            seg_pages,
            class_sizes,
            classes,
            segments: Mutex::new((0..n_segments as u32).rev().collect()),
            n_segments: n_segments as u32,
            shards,
            shard_bits: cfg.shards.trailing_zeros(),
            namespaces: RwLock::new(namespaces),
            registering: Mutex::new(()),
            leases: Mutex::default(),
            max_leases: cfg.max_leases,
            policy: cfg.policy,
            stats: Counters::default(),
            disk,
            demote: Mutex::new(Vec::new()),
            doorkeeper: Mutex::default(),
            events,
        })
    }

    /// Total bytes of host block memory.
    pub fn capacity_bytes(&self) -> u64 {
        u64::from(self.n_segments) * u64::from(self.seg_pages) * PAGE as u64
    }

    /// The slot sizes in use, ascending.
    pub fn size_classes(&self) -> &[usize] {
        &self.class_sizes
    }

    /// The eviction policy.
    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// The shared arena (for handing its fd to another process).
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Whether a disk tier is configured.
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    /// The registered namespaces' fingerprints, by id.
    pub fn namespaces(&self) -> Vec<Fingerprint> {
        self.namespaces.read().clone()
    }

    /// Subscribes to block events through a channel of `capacity`; a subscriber that falls
    /// behind loses events (see [`Store::events_dropped`]). Dropping the receiver unsubscribes.
    pub fn subscribe(&self, capacity: usize) -> crossbeam_channel::Receiver<BlockEvent> {
        self.events.subscribe(capacity)
    }

    /// Events lost because a subscriber's channel was full.
    pub fn events_dropped(&self) -> u64 {
        self.events.dropped()
    }

    /// Blocks and bytes per namespace id: (id, host blocks, host bytes, disk blocks, disk
    /// bytes). Scans the index: for admin use, not the hot path.
    pub fn namespace_stats(&self) -> Vec<(u16, u64, u64, u64, u64)> {
        let mut m: BTreeMap<u16, (u64, u64, u64, u64)> = BTreeMap::new();
        for s in self.shards.iter() {
            for e in s.lock().map.values().filter(|e| e.ready()) {
                let x = m.entry(e.ns).or_default();
                x.0 += 1;
                x.1 += u64::from(e.len);
            }
        }
        if let Some(d) = &self.disk {
            for (ns, b, y) in d.namespace_stats() {
                let x = m.entry(ns).or_default();
                x.2 += b;
                x.3 += y;
            }
        }
        m.into_iter()
            .map(|(ns, (a, b, c, d))| (ns, a, b, c, d))
            .collect()
    }

    /// Wraps the disk tier's I/O engine (fault injection in tests). No-op without a disk tier.
    pub fn wrap_disk_engine(&mut self, f: impl FnOnce(Arc<dyn IoEngine>) -> Arc<dyn IoEngine>) {
        if let Some(d) = self.disk.as_mut() {
            d.wrap_engine(f);
        }
    }

    /// Registers a namespace (idempotent) and returns its id in this store. With a disk tier
    /// the id is durable: the same namespace gets the same id after a restart.
    pub fn register_namespace(&self, ns: &Namespace) -> Result<NsId, KeyError> {
        ns.validate()?;
        let fp = ns.fingerprint();
        if let Some(i) = self.namespaces.read().iter().position(|f| *f == fp) {
            return Ok(NsId(i as u32));
        }
        // Registrations are serialised here; readers of the table are not blocked while the
        // id is journaled.
        let _one_at_a_time = self.registering.lock();
        let v = self.namespaces.read();
        if let Some(i) = v.iter().position(|f| *f == fp) {
            return Ok(NsId(i as u32));
        }
        if v.len() > usize::from(u16::MAX) {
            return Err(KeyError::BadNamespace(format!(
                "a store holds at most {} namespaces",
                usize::from(u16::MAX) + 1
            )));
        }
        let id = v.len() as u16;
        drop(v);
        if let Some(d) = &self.disk {
            d.note_namespace(id, fp).map_err(|e| {
                KeyError::BadNamespace(format!("cannot record the namespace on disk: {e}"))
            })?;
        }
        self.namespaces.write().push(fp);
        Ok(NsId(u32::from(id)))
    }

    fn shard(&self, key: BlockKey) -> &Mutex<Shard> {
        let hi = (key.0 >> 64) as u64;
        let i = hi.checked_shr(64 - self.shard_bits).unwrap_or(0) as usize;
        &self.shards[i]
    }

    fn class_for(&self, len: usize) -> Result<usize, StoreError> {
        if len == 0 {
            return Err(StoreError::Empty);
        }
        let max = *self.class_sizes.last().unwrap_or(&0);
        if len > max {
            return Err(StoreError::TooLarge { len, max });
        }
        Ok(self.class_sizes.partition_point(|&c| c < len))
    }

    fn ptr(&self, page: u32) -> *mut u8 {
        // SAFETY: pages come from `Class::page_of`, which only yields offsets of slots inside
        // segments `0..n_segments`, all within the arena mapping.
        unsafe { self.arena.base().add(page as usize * PAGE) }
    }

    // ---- admission -----------------------------------------------------------------------

    fn admitted(&self, key: BlockKey, flags: u8) -> bool {
        match self.disk.as_ref().map(|d| d.cfg.admission) {
            None => false,
            Some(Admission::Always) => true,
            Some(Admission::SeenTwice) => {
                flags & ACCESSED != 0 || self.doorkeeper.lock().set.contains(&(key.0 as u64))
            }
        }
    }

    fn remember(&self, key: BlockKey) {
        let mut d = self.doorkeeper.lock();
        if d.set.insert(key.0 as u64) {
            d.order.push_back(key.0 as u64);
            if d.order.len() > DOORKEEPER {
                if let Some(old) = d.order.pop_front() {
                    d.set.remove(&old);
                }
            }
        }
    }

    // ---- allocation ----------------------------------------------------------------------

    /// Allocates a slot; returns it and its arena page.
    fn alloc(&self, class: usize, key: BlockKey, len: usize) -> Result<(Slot, u32), StoreError> {
        let max_batch = self.disk.as_ref().map_or(0, |d| d.cfg.max_batch_bytes);
        let mut attempts = 0;
        loop {
            let found = {
                let mut c = self.classes[class].lock();
                let c = &mut *c;
                let idx = if let Some(idx) = c.free.pop() {
                    Some(idx)
                } else if let Some(seg) = self.segments.lock().pop() {
                    c.add_segment(seg);
                    c.free.pop()
                } else if let Some(seg) = self.reclaim_segment(class, false, 0) {
                    // An empty segment of another class costs no eviction: take it first.
                    c.add_segment(seg);
                    c.free.pop()
                } else {
                    let Class {
                        policy,
                        keys,
                        chunks,
                        per_seg,
                        slot_bytes,
                        ..
                    } = c;
                    let mut queued = 0u64;
                    policy.evict(&mut |idx| {
                        let page = page_of(chunks, *per_seg, *slot_bytes, idx, self.seg_pages);
                        let victim = (keys[idx as usize], class, idx, page);
                        self.try_evict(victim, &mut queued, max_batch)
                    })
                };
                if let Some(idx) = idx {
                    if c.used[idx as usize] {
                        // An evicted slot is reused directly: it stays counted as live.
                        c.keys[idx as usize] = key;
                    } else {
                        c.take(idx, key);
                    }
                    let slot = Slot {
                        class: class as u8,
                        idx,
                    };
                    Some((slot, c.page_of(idx, self.seg_pages)))
                } else {
                    None
                }
            };
            // Dirty victims met on the way were queued for disk: write them now (outside every
            // lock), so they become clean and can be dropped by the next allocation.
            let demoted = self.run_demotions();
            if let Some(found) = found {
                return Ok(found);
            }
            if demoted > 0 {
                continue;
            }
            attempts += 1;
            if attempts >= 8 {
                return Err(StoreError::NoSpace { len });
            }
            if attempts == 2 {
                self.reap_expired_leases();
            }
            if let Some(seg) = self.reclaim_segment(class, true, max_batch) {
                self.segments.lock().push(seg);
            }
        }
    }

    /// Under the class lock: evicts the block in slot `idx` if it is committed, unpinned, and
    /// either clean, refused by admission, or without a disk tier. A dirty admitted block is
    /// instead queued for writing (pinned), up to `max_batch` bytes per allocation.
    fn try_evict(
        &self,
        (key, class, idx, page): (BlockKey, usize, u32, u32),
        queued: &mut u64,
        max_batch: u64,
    ) -> bool {
        let mut sh = self.shard(key).lock();
        let mk = MapKey::from(key);
        let Some(e) = sh.map.get_mut(&mk) else {
            return false;
        };
        if e.class as usize != class || e.idx != idx || e.pins != 0 || !e.ready() {
            return false;
        }
        if self.disk.is_some() && e.flags & (CLEAN | NO_DEMOTE) == 0 {
            if self.admitted(key, e.flags) {
                if *queued < max_batch {
                    *queued += u64::from(e.len);
                    e.flags |= DEMOTING;
                    e.pins += 1;
                    self.demote.lock().push(Demote {
                        key,
                        slot: e.slot(),
                        page,
                        cap: self.class_sizes[class],
                        len: e.len,
                        ns: e.ns,
                    });
                }
                return false;
            }
            self.stats.admission_rejects.fetch_add(1, Relaxed);
            self.remember(key);
        }
        let (len, ns) = (e.len, e.ns);
        sh.map.remove(&mk);
        drop(sh);
        self.events.emit(EventKind::Removed, key, Tier::Host, ns);
        self.stats.evictions.fetch_add(1, Relaxed);
        self.stats.blocks.fetch_sub(1, Relaxed);
        self.stats.used_bytes.fetch_sub(u64::from(len), Relaxed);
        tracing::trace!(%key, "evicted");
        true
    }

    /// Writes queued demotions to disk; returns how many were processed.
    fn run_demotions(&self) -> usize {
        let items = std::mem::take(&mut *self.demote.lock());
        let Some(disk) = &self.disk else {
            return 0;
        };
        if items.is_empty() {
            return 0;
        }
        let writes = items
            .iter()
            .map(|d| WriteItem {
                key: d.key,
                ns: d.ns,
                // SAFETY: the block is committed and pinned by its DEMOTING pin until the loop
                // below, so its slot is neither freed nor written while the disk reads it.
                buf: unsafe { IoBuf::from_raw(self.ptr(d.page), d.cap) },
                len: d.len,
            })
            .collect();
        let outcomes = disk.write_batch(writes);
        for (d, o) in items.iter().zip(outcomes) {
            if o == WriteOutcome::Written {
                self.stats.demotions.fetch_add(1, Relaxed);
            }
            {
                let mut sh = self.shard(d.key).lock();
                if let Some(e) = sh.map.get_mut(&MapKey::from(d.key)) {
                    if e.slot() == d.slot {
                        e.flags &= !DEMOTING;
                        e.flags |= match o {
                            WriteOutcome::Written | WriteOutcome::Present => CLEAN,
                            // Another batch is writing it: stay dirty until a copy is durable.
                            WriteOutcome::InFlight => 0,
                            WriteOutcome::Failed => NO_DEMOTE,
                        };
                    }
                }
            }
            self.unpin(d.key, d.slot);
        }
        items.len()
    }

    /// Takes a whole segment away from another class for `for_class`: picks the chunk with the
    /// fewest live slots and, if `evict`, evicts them all (else only empty chunks qualify).
    /// Gives up on a chunk as soon as one of its blocks is pinned or being written; dirty
    /// blocks get queued for disk, so a later call can take the chunk (the evicted ones stay
    /// free in their class). Called with `for_class`'s lock held when
    /// `!evict` (class locks are then only tried, never waited for, so two allocators cannot
    /// deadlock).
    fn reclaim_segment(&self, for_class: usize, evict: bool, max_batch: u64) -> Option<u32> {
        let mut queued = 0u64;
        for (ci, cm) in self.classes.iter().enumerate() {
            if ci == for_class {
                continue;
            }
            let mut c = if evict {
                cm.lock()
            } else {
                match cm.try_lock() {
                    Some(c) => c,
                    None => continue,
                }
            };
            let mut order: Vec<u32> = (0..c.chunks.len() as u32)
                .filter(|&ch| c.chunks[ch as usize].is_some())
                .filter(|&ch| evict || c.live[ch as usize] == 0)
                .collect();
            order.sort_by_key(|&ch| c.live[ch as usize]);
            for ch in order {
                let start = ch * c.per_seg;
                let end = start + c.per_seg;
                let mut ok = true;
                for idx in start..end {
                    if !c.used[idx as usize] {
                        continue;
                    }
                    let victim = (
                        c.keys[idx as usize],
                        ci,
                        idx,
                        c.page_of(idx, self.seg_pages),
                    );
                    if self.try_evict(victim, &mut queued, max_batch) {
                        c.release(idx);
                    } else {
                        ok = false;
                        break;
                    }
                }
                if ok {
                    c.free.retain(|&i| i < start || i >= end);
                    let seg = c.chunks[ch as usize].take();
                    c.free_chunks.push(ch);
                    return seg;
                }
            }
        }
        None
    }

    fn free_slot(&self, slot: Slot) {
        self.classes[slot.class as usize].lock().release(slot.idx);
    }

    // ---- writes --------------------------------------------------------------------------

    /// Reserves a slot for `len` bytes under `key`. Fill it through
    /// [`Reservation::as_mut_slice`] and [`Reservation::commit`]; dropping it uncommitted frees
    /// the slot. Until commit the block is invisible.
    pub fn reserve(&self, ns: NsId, key: BlockKey, len: usize) -> Result<Reserve<'_>, StoreError> {
        let class = self.class_for(len)?;
        if ns.0 as usize >= self.namespaces.read().len() {
            return Err(StoreError::UnknownNamespace(ns.0));
        }
        let mk = MapKey::from(key);
        let existing = |sh: &Shard| {
            sh.map.get(&mk).map(|e| {
                if e.ready() {
                    Reserve::AlreadyPresent
                } else {
                    Reserve::InFlight
                }
            })
        };
        if let Some(r) = existing(&self.shard(key).lock()) {
            return Ok(r);
        }
        let (slot, page) = self.alloc(class, key, len)?;
        let mut sh = self.shard(key).lock();
        if let Some(r) = existing(&sh) {
            drop(sh);
            self.free_slot(slot);
            return Ok(r);
        }
        sh.map.insert(
            mk,
            Entry {
                idx: slot.idx,
                len: len as u32,
                ns: ns.0 as u16,
                pins: 0,
                class: slot.class,
                flags: 0,
            },
        );
        Ok(Reserve::Slot(Reservation {
            store: self,
            key,
            slot,
            page,
            len,
            ns: ns.0 as u16,
            from_disk: false,
            done: false,
        }))
    }

    /// Copies `data` into the store under `key` (reserve, copy, commit).
    pub fn put(&self, ns: NsId, key: BlockKey, data: &[u8]) -> Result<PutOutcome, StoreError> {
        match self.reserve(ns, key, data.len())? {
            Reserve::Slot(mut r) => {
                r.as_mut_slice().copy_from_slice(data);
                r.commit()?;
                Ok(PutOutcome::Stored)
            }
            Reserve::AlreadyPresent => Ok(PutOutcome::AlreadyPresent),
            Reserve::InFlight => Ok(PutOutcome::InFlight),
        }
    }

    fn commit(&self, r: &Reservation<'_>) {
        let (key, slot, len) = (r.key, r.slot, r.len);
        let round = len.div_ceil(PAGE) * PAGE;
        if round > len {
            // Zero the tail of the last page, so a disk copy holds no stale bytes of an earlier
            // block. SAFETY: the slot is at least `round` bytes (classes are multiples of 4096)
            // and exclusively ours until commit.
            unsafe { std::ptr::write_bytes(self.ptr(r.page).add(len), 0, round - len) };
        }
        // Into the policy first: an evictor that meets the slot before it is Ready skips it.
        self.classes[slot.class as usize]
            .lock()
            .policy
            .insert(slot.idx, key.0 as u64);
        let mut through = None;
        {
            let mut sh = self.shard(key).lock();
            let mk = MapKey::from(key);
            if sh.map.get(&mk).is_some_and(|e| e.flags & CANCELLED != 0) {
                // Removed while it was being written: the removal wins.
                sh.map.remove(&mk);
                drop(sh);
                self.free_slot(slot);
                return;
            }
            if let Some(e) = sh.map.get_mut(&mk) {
                e.flags |= READY;
                if r.from_disk {
                    e.flags |= CLEAN;
                } else if self.disk.as_ref().is_some_and(|d| d.cfg.write_through)
                    && self.admitted(key, e.flags)
                {
                    e.flags |= DEMOTING;
                    e.pins += 1;
                    through = Some(Demote {
                        key,
                        slot,
                        page: r.page,
                        cap: self.class_sizes[slot.class as usize],
                        len: len as u32,
                        ns: r.ns,
                    });
                }
            }
        }
        self.stats.blocks.fetch_add(1, Relaxed);
        self.stats.used_bytes.fetch_add(len as u64, Relaxed);
        self.stats.bytes_in.fetch_add(len as u64, Relaxed);
        self.events.emit(EventKind::Stored, key, Tier::Host, r.ns);
        if let Some(d) = through {
            self.demote.lock().push(d);
            self.run_demotions();
        }
    }

    fn abort(&self, key: BlockKey, slot: Slot) {
        let mut sh = self.shard(key).lock();
        let mk = MapKey::from(key);
        if sh
            .map
            .get(&mk)
            .is_some_and(|e| !e.ready() && e.slot() == slot)
        {
            sh.map.remove(&mk);
        }
        drop(sh);
        self.free_slot(slot);
    }

    // ---- reads ---------------------------------------------------------------------------

    fn get_host(&self, key: &BlockKey) -> Option<BlockRef<'_>> {
        let (slot, len) = {
            let mut sh = self.shard(*key).lock();
            match sh.map.get_mut(&MapKey::from(*key)) {
                Some(e) if e.ready() => {
                    e.pins += 1;
                    e.flags |= ACCESSED;
                    (e.slot(), e.len as usize)
                }
                _ => return None,
            }
        };
        let page = {
            let mut c = self.classes[slot.class as usize].lock();
            c.policy.access(slot.idx);
            c.page_of(slot.idx, self.seg_pages)
        };
        Some(BlockRef {
            store: self,
            key: *key,
            slot,
            page,
            len,
        })
    }

    /// Pins a committed block and borrows its bytes; `None` is a miss. A block found only on
    /// disk is first promoted into host memory (checksum verified; a failed check is a miss).
    pub fn get(&self, key: &BlockKey) -> Option<BlockRef<'_>> {
        let mut found = self.get_host(key);
        if found.is_none() && self.disk.is_some() {
            for _ in 0..100 {
                match self.promote(key) {
                    Promote::Done => {
                        found = self.get_host(key);
                        if found.is_some() {
                            break;
                        }
                    }
                    Promote::Busy => std::thread::sleep(Duration::from_micros(200)),
                    Promote::Miss => break,
                }
            }
        }
        match found {
            Some(b) => {
                self.stats.hits.fetch_add(1, Relaxed);
                self.stats.bytes_out.fetch_add(b.len as u64, Relaxed);
                Some(b)
            }
            None => {
                self.stats.misses.fetch_add(1, Relaxed);
                None
            }
        }
    }

    /// Copies a committed block into `dst`; `Ok(None)` is a miss, `Ok(Some(len))` a hit.
    pub fn get_into(&self, key: &BlockKey, dst: &mut [u8]) -> Result<Option<usize>, StoreError> {
        let Some(b) = self.get(key) else {
            return Ok(None);
        };
        if dst.len() < b.len() {
            return Err(StoreError::BufferTooSmall {
                need: b.len(),
                got: dst.len(),
            });
        }
        dst[..b.len()].copy_from_slice(&b);
        Ok(Some(b.len()))
    }

    fn host_ready(&self, key: &BlockKey) -> Option<bool> {
        self.shard(*key)
            .lock()
            .map
            .get(&MapKey::from(*key))
            .map(|e| e.ready())
    }

    /// Longest run of leading keys that are present, and the fastest tier of each. No side
    /// effects: no pins, no policy updates, no hit counters.
    pub fn match_prefix(&self, keys: &[BlockKey]) -> PrefixMatch {
        let mut tiers = Vec::new();
        for k in keys {
            let tier = if self.host_ready(k) == Some(true) {
                Tier::Host
            } else if self.disk.as_ref().is_some_and(|d| d.lookup(k).is_some()) {
                Tier::Disk
            } else {
                break;
            };
            tiers.push(tier);
        }
        PrefixMatch {
            n: tiers.len(),
            tiers,
        }
    }

    /// Whether a committed block with this key is present in any tier (no side effects).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.match_prefix(std::slice::from_ref(key)).n == 1
    }

    /// Whether a committed block with this key is in host memory (no side effects).
    pub fn in_host(&self, key: &BlockKey) -> bool {
        self.host_ready(key) == Some(true)
    }

    fn promote(&self, key: &BlockKey) -> Promote {
        let Some(disk) = &self.disk else {
            return Promote::Miss;
        };
        let Some((len, ns)) = disk.lookup(key) else {
            return Promote::Miss;
        };
        match self.reserve(NsId(u32::from(ns)), *key, len as usize) {
            Ok(Reserve::AlreadyPresent) => Promote::Done,
            Ok(Reserve::InFlight) => Promote::Busy,
            Ok(Reserve::Slot(r)) => self.fill_from_disk(vec![r]).pop().unwrap_or(Promote::Miss),
            Err(e) => {
                tracing::debug!(%key, error = %e, "no host slot to promote into");
                Promote::Miss
            }
        }
    }

    /// Reads reserved blocks from disk in one batch and commits the verified ones.
    fn fill_from_disk(&self, mut rs: Vec<Reservation<'_>>) -> Vec<Promote> {
        let Some(disk) = &self.disk else {
            return rs.iter().map(|_| Promote::Miss).collect();
        };
        let items = rs
            .iter_mut()
            .map(|r| {
                let cap = self.class_sizes[r.slot.class as usize];
                // SAFETY: the reservation owns the slot exclusively (invisible, not in any free
                // list) and outlives the batch, which completes before we return.
                (r.key, unsafe { IoBuf::from_raw(r.as_mut_ptr(), cap) })
            })
            .collect();
        let outcomes = disk.read_batch(items);
        rs.into_iter()
            .zip(outcomes)
            .map(|(mut r, o)| match o {
                ReadOutcome::Hit(len) if len as usize == r.len => {
                    r.from_disk = true;
                    if r.commit().is_ok() {
                        self.stats.promotions.fetch_add(1, Relaxed);
                        Promote::Done
                    } else {
                        Promote::Miss
                    }
                }
                _ => Promote::Miss,
            })
            .collect()
    }

    /// Makes the longest present prefix of `keys` resident in host memory, reading the blocks
    /// that are only on disk in one batch at the engine's queue depth. Returns how many leading
    /// keys are now in host memory (a block that fails its checksum ends the prefix).
    pub fn load_prefix(&self, keys: &[BlockKey]) -> usize {
        let m = self.match_prefix(keys);
        // Pin the prefix so that promoting its disk blocks cannot evict its host blocks.
        let lease = self
            .lease(&keys[..m.n], Duration::from_secs(60))
            .ok()
            .and_then(|l| l.id);
        let n = self.load_leased(keys, &m);
        if let Some(id) = lease {
            self.release(id);
        }
        n
    }

    fn load_leased(&self, keys: &[BlockKey], m: &PrefixMatch) -> usize {
        if let Some(disk) = &self.disk {
            let mut rs = Vec::new();
            for (k, t) in keys.iter().zip(&m.tiers) {
                if *t != Tier::Disk {
                    continue;
                }
                let Some((len, ns)) = disk.lookup(k) else {
                    break;
                };
                match self.reserve(NsId(u32::from(ns)), *k, len as usize) {
                    Ok(Reserve::Slot(r)) => rs.push(r),
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            if !rs.is_empty() {
                self.fill_from_disk(rs);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut n = 0;
        for k in &keys[..m.n] {
            loop {
                match self.host_ready(k) {
                    Some(true) => break,
                    // Another thread is promoting it: wait for its commit.
                    Some(false) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    _ => return n,
                }
            }
            n += 1;
        }
        n
    }

    /// Writes every dirty, admitted host block to the disk tier and checkpoints the journal
    /// (clean shutdown). Returns how many blocks were written.
    pub fn flush(&self) -> usize {
        let Some(disk) = &self.disk else {
            return 0;
        };
        let before = self.stats.demotions.load(Relaxed);
        for s in self.shards.iter() {
            let mut queue = Vec::new();
            {
                let mut sh = s.lock();
                for (k, e) in sh.map.iter_mut() {
                    let key = BlockKey::from(*k);
                    if e.ready()
                        && e.flags & (CLEAN | NO_DEMOTE | DEMOTING) == 0
                        && self.admitted(key, e.flags)
                    {
                        e.flags |= DEMOTING;
                        e.pins += 1;
                        queue.push((key, e.slot(), e.len, e.ns));
                    }
                }
            }
            let mut demote = Vec::new();
            for (key, slot, len, ns) in queue {
                let page = self.classes[slot.class as usize]
                    .lock()
                    .page_of(slot.idx, self.seg_pages);
                demote.push(Demote {
                    key,
                    slot,
                    page,
                    cap: self.class_sizes[slot.class as usize],
                    len,
                    ns,
                });
            }
            self.demote.lock().extend(demote);
            self.run_demotions();
        }
        if let Err(e) = disk.checkpoint() {
            tracing::warn!(error = %e, "journal checkpoint failed (the journal stays valid)");
        }
        (self.stats.demotions.load(Relaxed) - before) as usize
    }

    // ---- leases --------------------------------------------------------------------------

    /// Pins the leading present keys (in any tier) until [`Store::release`] or until `ttl`
    /// passes.
    pub fn lease(&self, keys: &[BlockKey], ttl: Duration) -> Result<Lease, StoreError> {
        self.reap_expired_leases();
        let expires = Instant::now() + ttl;
        if self.leases.lock().live.len() >= self.max_leases {
            return Err(StoreError::TooManyLeases(self.max_leases));
        }
        let mut pinned = Vec::new();
        let mut tiers = Vec::new();
        for k in keys {
            let host = {
                let mut sh = self.shard(*k).lock();
                match sh.map.get_mut(&MapKey::from(*k)) {
                    Some(e) if e.ready() => {
                        e.pins += 1;
                        Some(e.slot())
                    }
                    _ => None,
                }
            };
            if let Some(slot) = host {
                pinned.push(Pin::Host(*k, slot));
                tiers.push(Tier::Host);
            } else if self.disk.as_ref().is_some_and(|d| d.pin(k)) {
                pinned.push(Pin::Disk(*k));
                tiers.push(Tier::Disk);
            } else {
                break;
            }
        }
        Ok(self.record_lease(pinned, tiers, expires))
    }

    /// Makes the longest present prefix resident in host memory (see [`Store::load_prefix`])
    /// and pins it with a lease; returns the lease and each pinned block's arena offset and
    /// length, for a process that mapped the arena to copy from.
    pub fn load_and_lease(
        &self,
        keys: &[BlockKey],
        ttl: Duration,
    ) -> Result<(Lease, Vec<(u64, u32)>), StoreError> {
        let n = self.load_prefix(keys);
        self.reap_expired_leases();
        let expires = Instant::now() + ttl;
        if self.leases.lock().live.len() >= self.max_leases {
            return Err(StoreError::TooManyLeases(self.max_leases));
        }
        let mut pinned = Vec::new();
        let mut locs = Vec::new();
        for k in &keys[..n] {
            let found = {
                let mut sh = self.shard(*k).lock();
                match sh.map.get_mut(&MapKey::from(*k)) {
                    Some(e) if e.ready() => {
                        e.pins += 1;
                        e.flags |= ACCESSED;
                        Some((e.slot(), e.len))
                    }
                    _ => None,
                }
            };
            let Some((slot, len)) = found else { break };
            let page = {
                let mut c = self.classes[slot.class as usize].lock();
                c.policy.access(slot.idx);
                c.page_of(slot.idx, self.seg_pages)
            };
            pinned.push(Pin::Host(*k, slot));
            locs.push((u64::from(page) * PAGE as u64, len));
            self.stats.hits.fetch_add(1, Relaxed);
            self.stats.bytes_out.fetch_add(u64::from(len), Relaxed);
        }
        let tiers = vec![Tier::Host; pinned.len()];
        Ok((self.record_lease(pinned, tiers, expires), locs))
    }

    /// Records pins as a lease (none when nothing was pinned).
    fn record_lease(&self, pinned: Vec<Pin>, tiers: Vec<Tier>, expires: Instant) -> Lease {
        let n = pinned.len();
        if n == 0 {
            return Lease {
                id: None,
                n,
                tiers,
                expires,
            };
        }
        let mut l = self.leases.lock();
        l.next += 1;
        let id = l.next;
        l.live.insert(id, (expires, pinned));
        l.by_deadline.insert((expires, id), ());
        Lease {
            id: Some(LeaseId(id)),
            n,
            tiers,
            expires,
        }
    }

    fn drop_pins(&self, pins: Vec<Pin>) {
        for p in pins {
            match p {
                Pin::Host(k, slot) => self.unpin(k, slot),
                Pin::Disk(k) => {
                    if let Some(d) = &self.disk {
                        d.unpin(&k);
                    }
                }
            }
        }
    }

    /// Releases a lease; `false` if it was unknown (already released or expired).
    pub fn release(&self, id: LeaseId) -> bool {
        let rec = {
            let mut l = self.leases.lock();
            let rec = l.live.remove(&id.0);
            if let Some((deadline, _)) = &rec {
                l.by_deadline.remove(&(*deadline, id.0));
            }
            rec
        };
        match rec {
            Some((_, pins)) => {
                self.drop_pins(pins);
                true
            }
            None => false,
        }
    }

    /// Releases every lease whose deadline has passed; returns how many.
    pub fn reap_expired_leases(&self) -> usize {
        self.reap_expired_leases_at(Instant::now())
    }

    /// Releases every lease whose deadline is at or before `now`; returns how many.
    pub fn reap_expired_leases_at(&self, now: Instant) -> usize {
        let expired: Vec<Vec<Pin>> = {
            let mut l = self.leases.lock();
            let mut out = Vec::new();
            while let Some((&(deadline, id), _)) = l.by_deadline.first_key_value() {
                if deadline > now {
                    break;
                }
                l.by_deadline.remove(&(deadline, id));
                if let Some((_, pins)) = l.live.remove(&id) {
                    out.push(pins);
                }
            }
            out
        };
        let n = expired.len();
        for pins in expired {
            self.drop_pins(pins);
        }
        if n > 0 {
            self.stats.leases_expired.fetch_add(n as u64, Relaxed);
            tracing::debug!(n, "leases expired");
        }
        n
    }

    fn unpin(&self, key: BlockKey, slot: Slot) {
        let mut sh = self.shard(key).lock();
        if let Some(e) = sh.map.get_mut(&MapKey::from(key)) {
            if e.slot() == slot {
                e.pins -= 1;
                return;
            }
        }
        let last = match sh.doomed.get_mut(&slot) {
            Some(p) => {
                *p -= 1;
                *p == 0
            }
            None => false,
        };
        if last {
            sh.doomed.remove(&slot);
            drop(sh);
            self.free_slot(slot);
        }
    }

    // ---- removal -------------------------------------------------------------------------

    fn remove_host(&self, key: &BlockKey) -> bool {
        let mut sh = self.shard(*key).lock();
        let mk = MapKey::from(*key);
        if let Some(e) = sh.map.get_mut(&mk).filter(|e| !e.ready()) {
            // Being written (a put or a promotion): its commit will abort.
            e.flags |= CANCELLED;
            return true;
        }
        match sh.map.get(&mk).copied() {
            Some(e) if e.ready() => {
                sh.map.remove(&mk);
                self.stats.blocks.fetch_sub(1, Relaxed);
                self.stats.used_bytes.fetch_sub(u64::from(e.len), Relaxed);
                if e.pins > 0 {
                    sh.doomed.insert(e.slot(), e.pins);
                    drop(sh);
                } else {
                    drop(sh);
                    self.free_slot(e.slot());
                }
                self.events.emit(EventKind::Removed, *key, Tier::Host, e.ns);
                true
            }
            _ => false,
        }
    }

    /// Removes a committed block from every tier; `false` if absent. A pinned block becomes
    /// invisible now and its space is freed when the last pin goes.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let host = self.remove_host(key);
        let disk = self.disk.as_ref().is_some_and(|d| d.remove(key));
        host || disk
    }

    /// Removes every committed block of a namespace from every tier; returns how many distinct
    /// blocks.
    pub fn clear_namespace(&self, ns: NsId) -> usize {
        let mut removed: HashSet<BlockKey> = HashSet::new();
        for s in self.shards.iter() {
            let mut sh = s.lock();
            for e in sh.map.values_mut() {
                if u32::from(e.ns) == ns.0 && !e.ready() {
                    e.flags |= CANCELLED;
                }
            }
            let victims: Vec<(MapKey, Entry)> = sh
                .map
                .iter()
                .filter(|(_, e)| u32::from(e.ns) == ns.0 && e.ready())
                .map(|(k, e)| (*k, *e))
                .collect();
            let mut free = Vec::new();
            for (k, e) in victims {
                sh.map.remove(&k);
                self.stats.blocks.fetch_sub(1, Relaxed);
                self.stats.used_bytes.fetch_sub(u64::from(e.len), Relaxed);
                if e.pins > 0 {
                    sh.doomed.insert(e.slot(), e.pins);
                } else {
                    free.push(e.slot());
                }
                self.events
                    .emit(EventKind::Removed, BlockKey::from(k), Tier::Host, e.ns);
                removed.insert(BlockKey::from(k));
            }
            drop(sh);
            for slot in free {
                self.free_slot(slot);
            }
        }
        if let (Some(d), Ok(id)) = (&self.disk, u16::try_from(ns.0)) {
            removed.extend(d.clear_namespace(id));
        }
        removed.len()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StoreStats {
        let s = &self.stats;
        StoreStats {
            capacity_bytes: self.capacity_bytes(),
            used_bytes: s.used_bytes.load(Relaxed),
            blocks: s.blocks.load(Relaxed),
            hits: s.hits.load(Relaxed),
            misses: s.misses.load(Relaxed),
            evictions: s.evictions.load(Relaxed),
            bytes_in: s.bytes_in.load(Relaxed),
            bytes_out: s.bytes_out.load(Relaxed),
            leases: self.leases.lock().live.len() as u64,
            leases_expired: s.leases_expired.load(Relaxed),
            free_segments: self.segments.lock().len() as u64,
            promotions: s.promotions.load(Relaxed),
            demotions: s.demotions.load(Relaxed),
            admission_rejects: s.admission_rejects.load(Relaxed),
            disk: self.disk.as_ref().map(|d| d.stats()),
        }
    }
}

enum Promote {
    Done,
    Busy,
    Miss,
}

// ---------------------------------------------------------------------------------------------
// Guards

/// A reserved, invisible slot. Write the block, then [`commit`](Reservation::commit); dropping
/// it uncommitted frees the slot.
pub struct Reservation<'a> {
    store: &'a Store,
    key: BlockKey,
    slot: Slot,
    page: u32,
    len: usize,
    ns: u16,
    from_disk: bool,
    done: bool,
}

impl Reservation<'_> {
    /// The key being written.
    pub fn key(&self) -> BlockKey {
        self.key
    }

    /// The slot's bytes. They hold stale data of an earlier block until overwritten: write all
    /// `len` bytes before committing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the slot lies inside the arena and is at least `len` bytes long (its class is
        // >= len). It is owned exclusively by this reservation: it is not in any free list, its
        // index entry is not Ready (invisible to readers and evictors) until commit, and `&mut
        // self` prevents a second mutable borrow. The memory is initialized (zero-filled or
        // earlier block data), so exposing it as `&mut [u8]` is sound.
        unsafe { std::slice::from_raw_parts_mut(self.store.ptr(self.page), self.len) }
    }

    /// Raw pointer to the slot, for a copy engine (DMA, io_uring) that fills it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.store.ptr(self.page)
    }

    /// Byte offset of the slot in the arena (for another process that mapped the arena).
    pub fn arena_offset(&self) -> u64 {
        u64::from(self.page) * PAGE as u64
    }

    /// Length of the block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the reservation is zero-length (never: empty blocks are rejected).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes the block visible (and, with write-through, writes it to disk).
    pub fn commit(mut self) -> Result<(), StoreError> {
        self.done = true;
        self.store.commit(&self);
        Ok(())
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.store.abort(self.key, self.slot);
        }
    }
}

/// A pinned, committed block. Dereferences to its bytes; unpins on drop.
pub struct BlockRef<'a> {
    store: &'a Store,
    key: BlockKey,
    slot: Slot,
    page: u32,
    len: usize,
}

impl BlockRef<'_> {
    /// The block's key.
    pub fn key(&self) -> BlockKey {
        self.key
    }

    /// Byte offset of the block in the arena.
    pub fn arena_offset(&self) -> u64 {
        u64::from(self.page) * PAGE as u64
    }
}

impl std::ops::Deref for BlockRef<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the block is committed and pinned: its slot cannot be freed, evicted or
        // reserved until this guard drops, so nobody writes it, and it lies in the arena.
        unsafe { std::slice::from_raw_parts(self.store.ptr(self.page), self.len) }
    }
}

impl Drop for BlockRef<'_> {
    fn drop(&mut self) {
        self.store.unpin(self.key, self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::TpShard;

    fn ns() -> Namespace {
        Namespace {
            model: "test".into(),
            dtype: "bf16".into(),
            layout: "nhd".into(),
            block_tokens: 16,
            tp: TpShard::Shared,
            tenant: String::new(),
            lora: String::new(),
        }
    }

    fn small(policy: PolicyKind) -> (Store, NsId) {
        let s = StoreConfig {
            capacity_bytes: 4 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![64 << 10, 256 << 10],
            shards: 4,
            policy,
            ..Default::default()
        }
        .build()
        .unwrap();
        let id = s.register_namespace(&ns()).unwrap();
        (s, id)
    }

    fn k(i: u128) -> BlockKey {
        BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1)
    }

    #[test]
    fn default_classes() {
        let c = StoreConfig::default().classes().unwrap();
        assert_eq!(c[0], 64 << 10);
        assert_eq!(c[1], 80 << 10);
        assert_eq!(*c.last().unwrap(), 64 << 20);
        assert!(c.iter().all(|x| x % PAGE == 0));
    }

    #[test]
    fn bad_config_is_rejected() {
        let e = StoreConfig {
            capacity_bytes: 1,
            ..Default::default()
        }
        .build()
        .unwrap_err();
        assert!(e.to_string().contains("capacity"), "{e}");
        assert!(StoreConfig {
            shards: 3,
            ..Default::default()
        }
        .build()
        .is_err());
        assert!(StoreConfig {
            size_classes: vec![2 << 20],
            segment_bytes: 1 << 20,
            ..Default::default()
        }
        .build()
        .is_err());
    }

    #[test]
    fn put_get_roundtrip_and_errors() {
        let (s, n) = small(PolicyKind::Lru);
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        assert_eq!(s.put(n, k(1), &data).unwrap(), PutOutcome::Stored);
        assert_eq!(s.put(n, k(1), &data).unwrap(), PutOutcome::AlreadyPresent);
        assert_eq!(&*s.get(&k(1)).unwrap(), &data[..]);
        assert!(s.get(&k(2)).is_none());
        let mut small_buf = vec![0u8; 10];
        assert!(matches!(
            s.get_into(&k(1), &mut small_buf),
            Err(StoreError::BufferTooSmall { .. })
        ));
        assert_eq!(s.put(n, k(3), &[]), Err(StoreError::Empty));
        assert!(matches!(
            s.put(n, k(3), &vec![0u8; 300 << 10]),
            Err(StoreError::TooLarge { .. })
        ));
        assert_eq!(
            s.put(NsId(9), k(3), &[1]),
            Err(StoreError::UnknownNamespace(9))
        );
        let st = s.stats();
        assert_eq!(st.blocks, 1);
        assert_eq!(st.used_bytes, 100_000);
        assert_eq!(st.hits, 2);
        assert_eq!(st.misses, 1);
    }

    #[test]
    fn uncommitted_is_invisible_and_dropped_frees() {
        let (s, n) = small(PolicyKind::Lru);
        let Reserve::Slot(mut r) = s.reserve(n, k(1), 1000).unwrap() else {
            panic!("expected slot")
        };
        r.as_mut_slice().fill(7);
        assert!(s.get(&k(1)).is_none());
        assert_eq!(s.match_prefix(&[k(1)]).n, 0);
        assert!(matches!(
            s.reserve(n, k(1), 1000).unwrap(),
            Reserve::InFlight
        ));
        drop(r);
        assert!(s.get(&k(1)).is_none());
        // The key can be written again after the abort.
        let Reserve::Slot(mut r) = s.reserve(n, k(1), 1000).unwrap() else {
            panic!("expected slot")
        };
        r.as_mut_slice().fill(9);
        r.commit().unwrap();
        assert_eq!(&*s.get(&k(1)).unwrap(), &[9u8; 1000][..]);
    }

    #[test]
    fn eviction_respects_capacity_and_pins() {
        for policy in [PolicyKind::Lru, PolicyKind::S3Fifo] {
            let (s, n) = small(policy);
            // 4 segments of 1 MiB, 16 slots of 64 KiB each = 64 slots.
            let block = vec![1u8; 60_000];
            s.put(n, k(0), &block).unwrap();
            let lease = s.lease(&[k(0)], Duration::from_secs(60)).unwrap();
            assert_eq!(lease.n, 1);
            for i in 1..200 {
                assert_eq!(s.put(n, k(i), &block).unwrap(), PutOutcome::Stored);
                let st = s.stats();
                assert!(st.blocks <= 64);
                assert!(st.used_bytes <= st.capacity_bytes);
            }
            assert!(s.get(&k(0)).is_some(), "{policy:?}: leased block evicted");
            assert_eq!(s.stats().evictions, 200 - 64);
            assert!(s.release(lease.id.unwrap()));
            assert!(!s.release(lease.id.unwrap()));
        }
    }

    #[test]
    fn segments_move_between_classes() {
        let (s, n) = small(PolicyKind::S3Fifo);
        for i in 0..64 {
            s.put(n, k(i), &[1u8; 1000]).unwrap();
        }
        assert_eq!(s.stats().free_segments, 0);
        // Large class has no segment: one must be reclaimed from the small class.
        s.put(n, k(1000), &vec![2u8; 200_000]).unwrap();
        assert_eq!(s.stats().blocks, 64 - 16 + 1);
        assert_eq!(&*s.get(&k(1000)).unwrap(), &vec![2u8; 200_000][..]);
    }

    #[test]
    fn all_pinned_is_no_space() {
        let s = StoreConfig {
            capacity_bytes: 1 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![512 << 10],
            shards: 1,
            ..Default::default()
        }
        .build()
        .unwrap();
        let n = s.register_namespace(&ns()).unwrap();
        s.put(n, k(1), &[1]).unwrap();
        s.put(n, k(2), &[2]).unwrap();
        let g1 = s.get(&k(1)).unwrap();
        let l = s.lease(&[k(2)], Duration::from_secs(60)).unwrap();
        assert_eq!(s.put(n, k(3), &[3]), Err(StoreError::NoSpace { len: 1 }));
        drop(g1);
        assert_eq!(s.put(n, k(3), &[3]).unwrap(), PutOutcome::Stored);
        assert!(s.contains(&k(2)));
        s.release(l.id.unwrap());
    }

    #[test]
    fn remove_while_borrowed_defers_free() {
        let (s, n) = small(PolicyKind::Lru);
        s.put(n, k(1), &[5u8; 4000]).unwrap();
        let g = s.get(&k(1)).unwrap();
        assert!(s.remove(&k(1)));
        assert!(!s.remove(&k(1)));
        assert!(s.get(&k(1)).is_none());
        // Fill everything: the borrowed slot must not be reused while borrowed.
        for i in 2..200 {
            s.put(n, k(i), &[9u8; 4000]).unwrap();
        }
        assert_eq!(&*g, &[5u8; 4000][..]);
        drop(g);
        s.put(n, k(1), &[6u8; 4000]).unwrap();
        assert_eq!(&*s.get(&k(1)).unwrap(), &[6u8; 4000][..]);
    }

    #[test]
    fn remove_during_write_wins_over_commit() {
        let (s, n) = small(PolicyKind::Lru);
        let Reserve::Slot(mut r) = s.reserve(n, k(1), 1000).unwrap() else {
            panic!("expected slot")
        };
        r.as_mut_slice().fill(3);
        assert!(
            s.remove(&k(1)),
            "an in-flight write counts as present for remove"
        );
        r.commit().unwrap();
        assert!(
            s.get(&k(1)).is_none(),
            "a removed in-flight block became visible"
        );
        assert_eq!(s.stats().blocks, 0);
        // Its slot came back: the whole capacity is usable.
        for i in 2..66 {
            s.put(n, k(i), &[1u8; 60_000]).unwrap();
        }
        assert_eq!(s.stats().evictions, 0);
        // clear_namespace cancels in-flight writes too.
        let Reserve::Slot(r) = s.reserve(n, k(100), 10).unwrap() else {
            panic!("expected slot")
        };
        s.clear_namespace(n);
        r.commit().unwrap();
        assert!(!s.contains(&k(100)));
    }

    #[test]
    fn match_prefix_and_leases() {
        let (s, n) = small(PolicyKind::S3Fifo);
        for i in 0..5 {
            s.put(n, k(i), &[i as u8; 100]).unwrap();
        }
        let chain: Vec<BlockKey> = (0..8).map(k).collect();
        let before = s.stats();
        let m = s.match_prefix(&chain);
        assert_eq!(m.n, 5);
        assert_eq!(m.tiers, vec![Tier::Host; 5]);
        assert_eq!(s.stats(), before, "match_prefix must have no side effects");
        s.remove(&k(2));
        assert_eq!(s.match_prefix(&chain).n, 2);
        let l = s.lease(&chain, Duration::from_millis(1)).unwrap();
        assert_eq!(l.n, 2);
        assert_eq!(s.stats().leases, 1);
        assert_eq!(
            s.reap_expired_leases_at(Instant::now() + Duration::from_secs(1)),
            1
        );
        assert_eq!(s.stats().leases, 0);
        assert_eq!(s.stats().leases_expired, 1);
        assert!(!s.release(l.id.unwrap()));
        let none = s.lease(&[k(99)], Duration::from_secs(1)).unwrap();
        assert_eq!((none.id, none.n), (None, 0));
    }

    #[test]
    fn clear_namespace_only_touches_its_own() {
        let (s, n1) = small(PolicyKind::Lru);
        let mut other = ns();
        other.tenant = "b".into();
        let n2 = s.register_namespace(&other).unwrap();
        assert_eq!(s.register_namespace(&other).unwrap(), n2);
        for i in 0..10 {
            s.put(n1, k(i), &[1]).unwrap();
            s.put(n2, k(100 + i), &[2]).unwrap();
        }
        let g = s.get(&k(0)).unwrap();
        assert_eq!(s.clear_namespace(n1), 10);
        assert_eq!(s.stats().blocks, 10);
        assert!((100..110).all(|i| s.contains(&k(i))));
        assert_eq!(&*g, &[1]);
    }

    #[test]
    fn too_many_leases() {
        let s = StoreConfig {
            capacity_bytes: 1 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![64 << 10],
            max_leases: 2,
            ..Default::default()
        }
        .build()
        .unwrap();
        let n = s.register_namespace(&ns()).unwrap();
        s.put(n, k(1), &[1]).unwrap();
        let ttl = Duration::from_secs(60);
        s.lease(&[k(1)], ttl).unwrap();
        s.lease(&[k(1)], ttl).unwrap();
        assert_eq!(s.lease(&[k(1)], ttl), Err(StoreError::TooManyLeases(2)));
    }
}

//! The disk tier: preallocated data files opened with O_DIRECT, a free-extent allocator, an
//! index journal with checkpoints, a checksum per block verified on every read, and its own
//! eviction policy.
//!
//! Durability order of a write batch: data written (O_DIRECT) → `fdatasync` of the data files →
//! journal records appended → `fdatasync` of the journal → blocks visible. A crash anywhere
//! before the last step leaves the blocks invisible after recovery; a crash after it leaves them
//! whole. Recovery replays the journal only; block data is checked when read.

mod extent;
mod journal;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::arena::AlignedBuf;
use crate::events::{EventKind, Events};
use crate::io::{self as kio, IoBuf, IoConfig, IoEngine, IoKind, IoReq, ALIGN};
use crate::key::{BlockKey, Fingerprint};
use crate::policy::{EvictionPolicy, PolicyKind};
use crate::store::Tier;
use crate::store::{FoldMap, MapKey};

use extent::Extents;
use journal::{Journal, Kind, Record};

const DATA_MAGIC: &[u8; 8] = b"KVTDATA\0";
const PAGE: u64 = ALIGN as u64;

/// Which blocks the host tier writes to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Admission {
    /// Every block leaving the host tier.
    Always,
    /// Only blocks seen at least twice: read while in host memory, or put again after being
    /// dropped once without admission. One-off blocks never cost disk bandwidth.
    #[default]
    SeenTwice,
}

impl Admission {
    /// Parses `always` or `seen-twice`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "always" => Some(Self::Always),
            "seen-twice" | "twice" => Some(Self::SeenTwice),
            _ => None,
        }
    }
}

/// Configuration of the disk tier.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// Directory of the data files and the journal (created if absent).
    pub dir: PathBuf,
    /// Bytes of block data across all files (rounded down to 4096 per file).
    pub capacity_bytes: u64,
    /// Data files to spread blocks over (one per drive, typically).
    pub files: u32,
    /// I/O engine settings.
    pub io: IoConfig,
    /// Eviction policy of the disk tier.
    pub policy: PolicyKind,
    /// Which host blocks get written to disk.
    pub admission: Admission,
    /// Write admitted blocks to disk when they are committed (write-through) instead of when the
    /// host tier evicts them (write-back).
    pub write_through: bool,
    /// Most bytes one write-back batch carries (bounds in-flight demotion).
    pub max_batch_bytes: u64,
}

impl Default for DiskConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("kvtier-data"),
            capacity_bytes: 8 << 30,
            files: 1,
            io: IoConfig::default(),
            policy: PolicyKind::default(),
            admission: Admission::default(),
            write_through: false,
            max_batch_bytes: 256 << 20,
        }
    }
}

/// Errors opening the disk tier.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// File system error on a path.
    #[error("disk tier: {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// Existing files do not match the configuration or each other.
    #[error("disk tier: {0}")]
    Mismatch(String),
    /// Configuration is invalid.
    #[error("disk tier: invalid configuration: {0}")]
    Config(String),
}

/// Disk tier counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// `io_uring`, `psync` or a wrapper's name.
    pub engine: &'static str,
    /// Engine queue depth.
    pub queue_depth: u32,
    /// Bytes of block space.
    pub capacity_bytes: u64,
    /// Bytes of committed blocks (payload).
    pub used_bytes: u64,
    /// Committed blocks.
    pub blocks: u64,
    /// Blocks recovered at open.
    pub recovered_blocks: u64,
    /// Bytes read from / written to the data files.
    pub bytes_read: u64,
    /// See `bytes_read`.
    pub bytes_written: u64,
    /// Read / write operations.
    pub reads: u64,
    /// See `reads`.
    pub writes: u64,
    /// Failed reads / writes (the block was a miss or not stored).
    pub read_errors: u64,
    /// See `read_errors`.
    pub write_errors: u64,
    /// Blocks whose checksum failed on read (served as misses, then dropped).
    pub checksum_failures: u64,
    /// Blocks evicted to make room.
    pub evictions: u64,
    /// Read latency percentiles, microseconds (p50, p99).
    pub read_us: (u64, u64),
    /// Write latency percentiles, microseconds (p50, p99).
    pub write_us: (u64, u64),
}

#[derive(Default)]
struct Counters {
    recovered: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    checksum_failures: AtomicU64,
    evictions: AtomicU64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DState {
    Writing,
    /// Removed while being written: the write batch frees it instead of publishing it.
    Cancelled,
    Ready,
    /// Removed while pinned: invisible, extent freed at the last unpin.
    Doomed,
}

#[derive(Clone, Copy, Debug)]
struct DEntry {
    page: u64,
    checksum: u64,
    len: u32,
    id: u32,
    pins: u32,
    file: u16,
    ns: u16,
    state: DState,
}

impl DEntry {
    fn pages(&self) -> u64 {
        u64::from(self.len).div_ceil(PAGE)
    }
}

struct State {
    index: FoldMap<MapKey, DEntry>,
    extents: Vec<Extents>,
    policy: Box<dyn EvictionPolicy>,
    /// Dense policy id → key.
    ids: Vec<BlockKey>,
    free_ids: Vec<u32>,
    next_file: usize,
    /// Remove records not yet in the journal.
    removes: Vec<Record>,
    seq: u64,
    used_bytes: u64,
    blocks: u64,
}

impl State {
    fn new_id(&mut self, key: BlockKey) -> u32 {
        match self.free_ids.pop() {
            Some(id) => {
                self.ids[id as usize] = key;
                id
            }
            None => {
                self.ids.push(key);
                (self.ids.len() - 1) as u32
            }
        }
    }

    /// Drops an entry from the index (its extent is freed now unless pinned).
    fn drop_entry(&mut self, key: BlockKey, journal: bool) {
        let mk = MapKey::from(key);
        let Some(e) = self.index.get(&mk).copied() else {
            return;
        };
        if e.state == DState::Doomed {
            return;
        }
        if e.state == DState::Ready {
            self.used_bytes -= u64::from(e.len);
            self.blocks -= 1;
            self.policy.remove(e.id);
        }
        if journal {
            self.seq += 1;
            self.removes.push(Record {
                kind: Kind::Remove,
                ns: e.ns,
                key,
                page: e.page,
                len: e.len,
                file: u32::from(e.file),
                checksum: e.checksum,
                seq: self.seq,
            });
        }
        if e.pins > 0 {
            if let Some(x) = self.index.get_mut(&mk) {
                x.state = DState::Doomed;
            }
        } else {
            self.index.remove(&mk);
            self.extents[e.file as usize].free(e.page, e.pages());
            self.free_ids.push(e.id);
        }
    }

    fn unpin(&mut self, key: BlockKey) {
        let mk = MapKey::from(key);
        let Some(e) = self.index.get_mut(&mk) else {
            return;
        };
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 && e.state == DState::Doomed {
            let e = *e;
            self.index.remove(&mk);
            self.extents[e.file as usize].free(e.page, e.pages());
            self.free_ids.push(e.id);
        }
    }
}

/// What happened to one block of a write batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Durable and visible now.
    Written,
    /// Already on disk.
    Present,
    /// Another batch is writing it right now (not durable yet).
    InFlight,
    /// Not stored (no space, I/O error); counted and logged.
    Failed,
}

/// What happened to one block of a read batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The buffer holds the block's `len` bytes, checksum verified.
    Hit(u32),
    /// Not on disk, or unreadable / corrupt (counted and logged): never served.
    Miss,
}

/// One block to write: `buf` holds at least `len` rounded up to 4096 bytes.
pub struct WriteItem {
    /// The block's key.
    pub key: BlockKey,
    /// Its namespace id in the owning store.
    pub ns: u16,
    /// The bytes (at least `len` rounded up to 4096).
    pub buf: IoBuf,
    /// Block length.
    pub len: u32,
}

/// The disk tier.
pub struct DiskTier {
    engine: Arc<dyn IoEngine>,
    state: Mutex<State>,
    journal: Mutex<Journal>,
    files: Vec<File>,
    instance: u64,
    pages_per_file: u64,
    namespaces: Mutex<Vec<Fingerprint>>,
    stats: Counters,
    read_hist: Mutex<Histogram<u64>>,
    write_hist: Mutex<Histogram<u64>>,
    pub(crate) events: Arc<Events>,
    pub(crate) cfg: DiskConfig,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn superblock(index: u32, pages: u64, instance: u64) -> io::Result<AlignedBuf> {
    let mut b = AlignedBuf::new(ALIGN)?;
    b[0..8].copy_from_slice(DATA_MAGIC);
    b[8..12].copy_from_slice(&journal::VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&index.to_le_bytes());
    b[16..24].copy_from_slice(&pages.to_le_bytes());
    b[24..32].copy_from_slice(&instance.to_le_bytes());
    let c = xxh3_64(&b[..56]);
    b[56..64].copy_from_slice(&c.to_le_bytes());
    Ok(b)
}

fn open_direct(path: &Path, create: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

impl DiskTier {
    /// Opens (recovering) or creates the tier; also returns the namespace fingerprints recorded
    /// in the journal, by id. `cfg.io.fixed_buffers` is memory to register with io_uring.
    pub fn open(cfg: DiskConfig) -> Result<(Self, Vec<Fingerprint>), DiskError> {
        if cfg.files == 0 || cfg.files > 64 {
            return Err(DiskError::Config(format!(
                "files = {} must be 1..=64",
                cfg.files
            )));
        }
        let pages_per_file = cfg.capacity_bytes / u64::from(cfg.files) / PAGE;
        if pages_per_file < 2 || pages_per_file > u64::from(u32::MAX) {
            return Err(DiskError::Config(format!(
                "capacity_bytes = {} gives {} pages per file; need 2..=2^32",
                cfg.capacity_bytes, pages_per_file
            )));
        }
        std::fs::create_dir_all(&cfg.dir).map_err(io_err(&cfg.dir))?;
        let jpath = cfg.dir.join("journal.kvj");
        let dpaths: Vec<PathBuf> = (0..cfg.files)
            .map(|i| cfg.dir.join(format!("data-{i}.kvd")))
            .collect();
        let existing: Vec<&PathBuf> = dpaths.iter().filter(|p| p.exists()).collect();
        let fresh = !jpath.exists();
        if fresh && !existing.is_empty() {
            return Err(DiskError::Mismatch(format!(
                "{} exists without {}: remove the data files or use an empty directory",
                existing[0].display(),
                jpath.display()
            )));
        }
        let (journal, instance, records, files) = if fresh {
            let instance = xxh3_64(
                format!(
                    "{:?}{}{:?}",
                    std::time::SystemTime::now(),
                    std::process::id(),
                    cfg.dir
                )
                .as_bytes(),
            );
            let mut files = Vec::new();
            for (i, p) in dpaths.iter().enumerate() {
                let f = open_direct(p, true).map_err(io_err(p))?;
                let bytes = (pages_per_file + 1) * PAGE;
                // SAFETY: fallocate on a valid fd with a valid range; mode 0 allocates blocks.
                let r = unsafe {
                    libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, bytes as i64)
                };
                if r != 0 {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() == Some(libc::ENOSPC) {
                        return Err(DiskError::Io {
                            path: p.clone(),
                            source: io::Error::new(
                                e.kind(),
                                format!("cannot preallocate {bytes} bytes: {e}; lower the disk capacity"),
                            ),
                        });
                    }
                    f.set_len(bytes).map_err(io_err(p))?;
                }
                let sb = superblock(i as u32, pages_per_file, instance).map_err(io_err(p))?;
                f.write_all_at(&sb, 0).map_err(io_err(p))?;
                f.sync_all().map_err(io_err(p))?;
                files.push(f);
            }
            let j = Journal::create(&jpath, instance)
                .map_err(|e| DiskError::Mismatch(e.to_string()))?;
            (j, instance, Vec::new(), files)
        } else {
            let (j, instance, recs) =
                Journal::open(&jpath).map_err(|e| DiskError::Mismatch(e.to_string()))?;
            let mut files = Vec::new();
            for (i, p) in dpaths.iter().enumerate() {
                let f = open_direct(p, false).map_err(io_err(p))?;
                let mut sb = AlignedBuf::new(ALIGN).map_err(io_err(p))?;
                f.read_exact_at(&mut sb, 0).map_err(io_err(p))?;
                let want = superblock(i as u32, pages_per_file, instance).map_err(io_err(p))?;
                if sb[..64] != want[..64] {
                    let got_pages = u64::from_le_bytes(sb[16..24].try_into().unwrap_or_default());
                    let why = if &sb[0..8] != DATA_MAGIC {
                        "not a kvtier data file".to_string()
                    } else if u64::from_le_bytes(sb[24..32].try_into().unwrap_or_default())
                        != instance
                    {
                        "belongs to another journal".to_string()
                    } else if got_pages != pages_per_file {
                        format!(
                            "holds {got_pages} pages but the configuration asks for {pages_per_file}: keep capacity_bytes and files as they were, or use an empty directory"
                        )
                    } else {
                        "superblock does not match".to_string()
                    };
                    return Err(DiskError::Mismatch(format!("{}: {why}", p.display())));
                }
                files.push(f);
            }
            (j, instance, recs, files)
        };

        let mut st = State {
            index: FoldMap::default(),
            extents: (0..cfg.files)
                .map(|_| Extents::new(1, pages_per_file + 1))
                .collect(),
            policy: cfg.policy.build(),
            ids: Vec::new(),
            free_ids: Vec::new(),
            next_file: 0,
            removes: Vec::new(),
            seq: 0,
            used_bytes: 0,
            blocks: 0,
        };
        let mut namespaces: Vec<Fingerprint> = Vec::new();
        // Live extents by (file, page) → key, to resolve overlaps (the later record wins).
        let mut placed: std::collections::BTreeMap<(u16, u64), BlockKey> = Default::default();
        for r in &records {
            st.seq = st.seq.max(r.seq);
            match r.kind {
                Kind::Namespace => {
                    let id = r.page as usize;
                    if namespaces.len() <= id {
                        namespaces.resize(id + 1, Fingerprint(BlockKey(0)));
                    }
                    namespaces[id] = Fingerprint(r.key);
                }
                Kind::Remove => {
                    if let Some(e) = st.index.get(&MapKey::from(r.key)).copied() {
                        placed.remove(&(e.file, e.page));
                        st.drop_entry(r.key, false);
                    }
                }
                Kind::Put => {
                    let file = r.file as u16;
                    let pages = u64::from(r.len).div_ceil(PAGE);
                    if r.file >= cfg.files
                        || r.page == 0
                        || r.page + pages > pages_per_file + 1
                        || r.len == 0
                    {
                        tracing::warn!(key = %r.key, "journal: record out of bounds, skipped");
                        continue;
                    }
                    if let Some(e) = st.index.get(&MapKey::from(r.key)).copied() {
                        placed.remove(&(e.file, e.page));
                        st.drop_entry(r.key, false);
                    }
                    // Drop live blocks overlapping the new extent.
                    // Live extents never overlap each other, so only the one starting before
                    // the new extent and those starting inside it can overlap it.
                    let before = placed
                        .range((file, 0)..(file, r.page))
                        .next_back()
                        .map(|(a, b)| (*a, *b));
                    let overlapping: Vec<((u16, u64), BlockKey)> = before
                        .into_iter()
                        .chain(
                            placed
                                .range((file, r.page)..(file, r.page + pages))
                                .map(|(a, b)| (*a, *b)),
                        )
                        .filter(|&((_, p), k)| {
                            let len = st.index.get(&MapKey::from(k)).map_or(0, |e| e.pages());
                            p + len > r.page
                        })
                        .collect();
                    for (pos, k) in overlapping {
                        placed.remove(&pos);
                        st.drop_entry(k, false);
                    }
                    if !st.extents[file as usize].reserve(r.page, pages) {
                        tracing::warn!(key = %r.key, "journal: extent not free, skipped");
                        continue;
                    }
                    let id = st.new_id(r.key);
                    st.index.insert(
                        MapKey::from(r.key),
                        DEntry {
                            page: r.page,
                            checksum: r.checksum,
                            len: r.len,
                            id,
                            pins: 0,
                            file,
                            ns: r.ns,
                            state: DState::Ready,
                        },
                    );
                    st.policy.insert(id, r.key.0 as u64);
                    st.used_bytes += u64::from(r.len);
                    st.blocks += 1;
                    placed.insert((file, r.page), r.key);
                }
            }
        }
        let io_cfg = cfg.io.clone();
        let engine = kio::open_engine(
            files
                .iter()
                .map(|f| f.try_clone())
                .collect::<io::Result<Vec<_>>>()
                .map_err(io_err(&cfg.dir))?,
            &io_cfg,
        )
        .map_err(io_err(&cfg.dir))?;
        let recovered = st.blocks;
        tracing::info!(
            dir = %cfg.dir.display(),
            blocks = recovered,
            engine = engine.name(),
            "disk tier open"
        );
        let hist = || Histogram::new_with_bounds(1, 60_000_000, 2).map(Mutex::new);
        let tier = Self {
            engine,
            state: Mutex::new(st),
            journal: Mutex::new(journal),
            files,
            instance,
            pages_per_file,
            namespaces: Mutex::new(namespaces.clone()),
            stats: Counters::default(),
            read_hist: hist().map_err(|e| DiskError::Config(e.to_string()))?,
            write_hist: hist().map_err(|e| DiskError::Config(e.to_string()))?,
            events: Arc::default(),
            cfg,
        };
        tier.stats.recovered.store(recovered, Relaxed);
        // Compact at open: the journal then holds only live records.
        tier.checkpoint().map_err(io_err(&jpath))?;
        Ok((tier, namespaces))
    }

    /// Replaces the engine (tests wrap it in a fault injector).
    pub(crate) fn wrap_engine(&mut self, f: impl FnOnce(Arc<dyn IoEngine>) -> Arc<dyn IoEngine>) {
        self.engine = f(self.engine.clone());
    }

    /// Records a namespace id durably.
    pub fn note_namespace(&self, id: u16, fp: Fingerprint) -> io::Result<()> {
        let mut ns = self.namespaces.lock();
        if ns.get(id as usize) == Some(&fp) {
            return Ok(());
        }
        let mut j = self.journal.lock();
        j.append(&[Record {
            kind: Kind::Namespace,
            ns: id,
            key: fp.0,
            page: u64::from(id),
            len: 0,
            file: 0,
            checksum: 0,
            seq: 0,
        }])?;
        j.sync()?;
        if ns.len() <= id as usize {
            ns.resize(id as usize + 1, Fingerprint(BlockKey(0)));
        }
        ns[id as usize] = fp;
        Ok(())
    }

    /// Length and namespace id of a committed block, if present (no side effects).
    pub fn lookup(&self, key: &BlockKey) -> Option<(u32, u16)> {
        self.state
            .lock()
            .index
            .get(&MapKey::from(*key))
            .filter(|e| e.state == DState::Ready)
            .map(|e| (e.len, e.ns))
    }

    /// Pins a committed block against eviction; false if absent.
    pub fn pin(&self, key: &BlockKey) -> bool {
        let mut st = self.state.lock();
        match st.index.get_mut(&MapKey::from(*key)) {
            Some(e) if e.state == DState::Ready => {
                e.pins += 1;
                true
            }
            _ => false,
        }
    }

    /// Drops a pin taken by `pin` or a read.
    pub fn unpin(&self, key: &BlockKey) {
        self.state.lock().unpin(*key);
    }

    /// Removes a block; false if absent.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let mut st = self.state.lock();
        match st.index.get_mut(&MapKey::from(*key)) {
            Some(e) if e.state == DState::Ready => {
                let ns = e.ns;
                st.drop_entry(*key, true);
                self.events.emit(EventKind::Removed, *key, Tier::Disk, ns);
                true
            }
            Some(e) if e.state == DState::Writing => {
                e.state = DState::Cancelled;
                true
            }
            _ => false,
        }
    }

    /// (namespace id, blocks, bytes) of every namespace with blocks on disk.
    pub fn namespace_stats(&self) -> Vec<(u16, u64, u64)> {
        let st = self.state.lock();
        let mut m: std::collections::BTreeMap<u16, (u64, u64)> = Default::default();
        for e in st.index.values().filter(|e| e.state == DState::Ready) {
            let x = m.entry(e.ns).or_default();
            x.0 += 1;
            x.1 += u64::from(e.len);
        }
        m.into_iter().map(|(ns, (b, y))| (ns, b, y)).collect()
    }

    /// Removes every block of namespace `ns`; returns their keys.
    pub fn clear_namespace(&self, ns: u16) -> Vec<BlockKey> {
        let mut st = self.state.lock();
        for e in st.index.values_mut() {
            if e.ns == ns && e.state == DState::Writing {
                e.state = DState::Cancelled;
            }
        }
        let keys: Vec<BlockKey> = st
            .index
            .iter()
            .filter(|(_, e)| e.ns == ns && e.state == DState::Ready)
            .map(|(k, _)| BlockKey::from(*k))
            .collect();
        for k in &keys {
            st.drop_entry(*k, true);
            self.events.emit(EventKind::Removed, *k, Tier::Disk, ns);
        }
        keys
    }

    fn alloc(&self, st: &mut State, len: u32) -> Option<(u16, u64)> {
        let pages = u64::from(len).div_ceil(PAGE);
        if pages > self.pages_per_file {
            return None;
        }
        loop {
            let n = st.extents.len();
            for i in 0..n {
                let f = (st.next_file + i) % n;
                if let Some(p) = st.extents[f].alloc(pages) {
                    st.next_file = (f + 1) % n;
                    return Some((f as u16, p));
                }
            }
            let State {
                policy, ids, index, ..
            } = st;
            let victim = policy.evict(&mut |id| {
                index
                    .get(&MapKey::from(ids[id as usize]))
                    .is_some_and(|e| e.pins == 0 && e.state == DState::Ready)
            })?;
            let key = st.ids[victim as usize];
            let ns = st.index.get(&MapKey::from(key)).map_or(0, |e| e.ns);
            // The policy already forgot the id; drop_entry's policy.remove is a no-op.
            st.drop_entry(key, true);
            self.stats.evictions.fetch_add(1, Relaxed);
            self.events.emit(EventKind::Removed, key, Tier::Disk, ns);
        }
    }

    /// Writes blocks durably (see the module docs for the order); one outcome per item, in order.
    pub fn write_batch(&self, items: Vec<WriteItem>) -> Vec<WriteOutcome> {
        let mut out = vec![WriteOutcome::Failed; items.len()];
        let mut reqs = Vec::new();
        let mut meta = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, it) in items.into_iter().enumerate() {
                let mk = MapKey::from(it.key);
                if let Some(e) = st.index.get(&mk) {
                    out[i] = match e.state {
                        DState::Ready => WriteOutcome::Present,
                        DState::Writing => WriteOutcome::InFlight,
                        DState::Cancelled | DState::Doomed => WriteOutcome::Failed,
                    };
                    continue;
                }
                let Some((file, page)) = self.alloc(&mut st, it.len) else {
                    self.stats.write_errors.fetch_add(1, Relaxed);
                    tracing::warn!(key = %it.key, len = it.len, "disk tier full of pinned blocks: block not written");
                    continue;
                };
                let id = st.new_id(it.key);
                // Filled in once the write completed (the checksum is computed while the rest
                // of the batch is in flight).
                let checksum = 0;
                st.index.insert(
                    mk,
                    DEntry {
                        page,
                        checksum,
                        len: it.len,
                        id,
                        pins: 0,
                        file,
                        ns: it.ns,
                        state: DState::Writing,
                    },
                );
                let io_len = (u64::from(it.len).div_ceil(PAGE) * PAGE) as u32;
                meta.push((i, it.key, file, page, it.len, it.ns));
                reqs.push(IoReq {
                    kind: IoKind::Write,
                    file: u32::from(file),
                    offset: page * PAGE,
                    len: io_len,
                    buf: it.buf,
                    tag: (meta.len() - 1) as u64,
                });
            }
        }
        if reqs.is_empty() {
            return out;
        }
        let mut sums = vec![0u64; meta.len()];
        let done = self.run(reqs, &self.write_hist, |d| {
            let len = meta[d.req.tag as usize].4 as usize;
            // SAFETY: the caller's buffer holds at least `len` bytes; it is only read, by the
            // disk and by us.
            let data = unsafe { std::slice::from_raw_parts(d.req.buf.as_ptr(), len) };
            sums[d.req.tag as usize] = xxh3_64(data);
        });
        let mut ok: Vec<bool> = done.iter().map(|d| d.result.is_ok()).collect();
        for d in &done {
            match &d.result {
                Ok(()) => {
                    self.stats.writes.fetch_add(1, Relaxed);
                    self.stats
                        .bytes_written
                        .fetch_add(u64::from(d.req.len), Relaxed);
                }
                Err(e) => {
                    self.stats.write_errors.fetch_add(1, Relaxed);
                    tracing::warn!(error = %e, offset = d.req.offset, "disk write failed: block not stored");
                }
            }
        }
        // Data durable before the records that point at it.
        let mut synced = vec![false; self.files.len()];
        for (j, m) in meta.iter().enumerate() {
            if ok[j] && !synced[m.2 as usize] {
                synced[m.2 as usize] = true;
                if let Err(e) = self.files[m.2 as usize].sync_data() {
                    tracing::error!(error = %e, "fdatasync of a data file failed: batch not stored");
                    ok.iter_mut().for_each(|x| *x = false);
                    break;
                }
            }
        }
        // Journal, then state, as checkpoint() does; the journal lock is held from building the
        // records until the blocks are Ready, so a checkpoint cannot drop records that are
        // durable but not yet Ready, and records reach the file in sequence order.
        let mut j = self.journal.lock();
        let mut st = self.state.lock();
        let mut records = Vec::new();
        for (k, &(_, key, file, page, len, ns)) in meta.iter().enumerate() {
            if ok[k] {
                st.seq += 1;
                records.push(Record {
                    kind: Kind::Put,
                    ns,
                    key,
                    page,
                    len,
                    file: u32::from(file),
                    checksum: sums[k],
                    seq: st.seq,
                });
            }
        }
        let removes = std::mem::take(&mut st.removes);
        records.splice(0..0, removes.iter().copied());
        drop(st);
        if let Err(e) = j.append(&records).and_then(|()| j.sync()) {
            tracing::error!(error = %e, "journal write failed: batch not stored");
            self.stats.write_errors.fetch_add(1, Relaxed);
            ok.iter_mut().for_each(|x| *x = false);
            // The removals still have to reach the journal: keep them for the next batch.
            let mut st = self.state.lock();
            let later = std::mem::take(&mut st.removes);
            st.removes = removes;
            st.removes.extend(later);
        }
        let mut st = self.state.lock();
        let mut cancelled = Vec::new();
        for (k, &(i, key, ..)) in meta.iter().enumerate() {
            let mk = MapKey::from(key);
            let state = st.index.get(&mk).map(|e| e.state);
            if ok[k] && state == Some(DState::Writing) {
                if let Some(e) = st.index.get_mut(&mk) {
                    e.state = DState::Ready;
                    e.checksum = sums[k];
                    self.events.emit(EventKind::Stored, key, Tier::Disk, e.ns);
                    let (id, len) = (e.id, e.len);
                    st.policy.insert(id, key.0 as u64);
                    st.used_bytes += u64::from(len);
                    st.blocks += 1;
                }
                out[i] = WriteOutcome::Written;
            } else if let Some(e) = st.index.remove(&mk) {
                // Failed, or removed while in flight (Cancelled): never visible. A cancelled
                // block whose Put is already journaled needs its Remove there too.
                if ok[k] {
                    st.seq += 1;
                    cancelled.push(Record {
                        kind: Kind::Remove,
                        ns: e.ns,
                        key,
                        page: e.page,
                        len: e.len,
                        file: u32::from(e.file),
                        checksum: sums[k],
                        seq: st.seq,
                    });
                }
                st.extents[e.file as usize].free(e.page, e.pages());
                st.free_ids.push(e.id);
            }
        }
        if !cancelled.is_empty() {
            if let Err(e) = j.append(&cancelled).and_then(|()| j.sync()) {
                tracing::error!(error = %e, "journal write failed: removal queued again");
                st.removes.extend(cancelled);
            }
        }
        drop(j);
        let live = st.blocks;
        drop(st);
        let jrecs = self.journal.lock().records;
        if jrecs > 2 * live + 4096 {
            if let Err(e) = self.checkpoint() {
                tracing::warn!(error = %e, "journal checkpoint failed (the journal stays valid)");
            }
        }
        out
    }

    /// Reads blocks into the given buffers (each at least `len` rounded up to 4096), verifying
    /// checksums. One outcome per item, in order.
    pub fn read_batch(&self, items: Vec<(BlockKey, IoBuf)>) -> Vec<ReadOutcome> {
        let mut out = vec![ReadOutcome::Miss; items.len()];
        let mut reqs = Vec::new();
        let mut meta = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, (key, buf)) in items.into_iter().enumerate() {
                let Some(e) = st.index.get_mut(&MapKey::from(key)) else {
                    continue;
                };
                if e.state != DState::Ready {
                    continue;
                }
                e.pins += 1;
                let e = *e;
                st.policy.access(e.id);
                meta.push((i, key, e.len, e.checksum));
                reqs.push(IoReq {
                    kind: IoKind::Read,
                    file: u32::from(e.file),
                    offset: e.page * PAGE,
                    len: (e.pages() * PAGE) as u32,
                    buf,
                    tag: (meta.len() - 1) as u64,
                });
            }
        }
        if reqs.is_empty() {
            return out;
        }
        let mut corrupt = Vec::new();
        self.run(reqs, &self.read_hist, |d| {
            let (i, key, len, checksum) = meta[d.req.tag as usize];
            match &d.result {
                Ok(()) => {
                    self.stats.reads.fetch_add(1, Relaxed);
                    self.stats
                        .bytes_read
                        .fetch_add(u64::from(d.req.len), Relaxed);
                    // SAFETY: the read filled at least `len` bytes of this buffer, which the
                    // request still owns.
                    let data =
                        unsafe { std::slice::from_raw_parts(d.req.buf.as_ptr(), len as usize) };
                    if xxh3_64(data) == checksum {
                        out[i] = ReadOutcome::Hit(len);
                    } else {
                        self.stats.checksum_failures.fetch_add(1, Relaxed);
                        tracing::warn!(%key, "disk block failed its checksum: served as a miss and dropped");
                        corrupt.push(key);
                    }
                }
                Err(e) => {
                    self.stats.read_errors.fetch_add(1, Relaxed);
                    tracing::warn!(%key, error = %e, "disk read failed: served as a miss");
                }
            }
        });
        let mut st = self.state.lock();
        for k in corrupt {
            let ns = st.index.get(&MapKey::from(k)).map_or(0, |e| e.ns);
            st.drop_entry(k, true);
            self.events.emit(EventKind::Removed, k, Tier::Disk, ns);
        }
        for &(_, key, ..) in &meta {
            st.unpin(key);
        }
        out
    }

    /// Runs requests, recording each one's latency and calling `each` on every completion as
    /// it arrives (so CPU work overlaps the I/O still in flight); completions sorted by tag.
    fn run(
        &self,
        reqs: Vec<IoReq>,
        hist: &Mutex<Histogram<u64>>,
        mut each: impl FnMut(&kio::IoDone),
    ) -> Vec<kio::IoDone> {
        let n = reqs.len();
        let (tx, rx) = crossbeam_channel::unbounded();
        let start = Instant::now();
        self.engine.submit(reqs, tx);
        let mut out = Vec::with_capacity(n);
        let mut lat = Vec::with_capacity(n);
        for d in rx.iter().take(n) {
            lat.push(start.elapsed().as_micros() as u64);
            each(&d);
            out.push(d);
        }
        {
            let mut h = hist.lock();
            for l in lat {
                let _ = h.record(l.max(1));
            }
        }
        out.sort_by_key(|d| d.req.tag);
        out
    }

    /// Rewrites the journal with only live records.
    pub fn checkpoint(&self) -> io::Result<()> {
        let mut recs = Vec::new();
        {
            let ns = self.namespaces.lock();
            for (i, fp) in ns.iter().enumerate() {
                recs.push(Record {
                    kind: Kind::Namespace,
                    ns: i as u16,
                    key: fp.0,
                    page: i as u64,
                    len: 0,
                    file: 0,
                    checksum: 0,
                    seq: 0,
                });
            }
        }
        // Hold the journal lock across the snapshot so no batch appends in between.
        let mut j = self.journal.lock();
        {
            let mut st = self.state.lock();
            st.removes.clear();
            for (k, e) in st.index.iter() {
                if e.state == DState::Ready {
                    recs.push(Record {
                        kind: Kind::Put,
                        ns: e.ns,
                        key: BlockKey::from(*k),
                        page: e.page,
                        len: e.len,
                        file: u32::from(e.file),
                        checksum: e.checksum,
                        seq: 0,
                    });
                }
            }
        }
        j.rewrite(self.instance, &recs)
    }

    /// Counters.
    pub fn stats(&self) -> DiskStats {
        let s = &self.stats;
        let st = self.state.lock();
        let pct = |h: &Mutex<Histogram<u64>>| {
            let h = h.lock();
            (h.value_at_quantile(0.5), h.value_at_quantile(0.99))
        };
        DiskStats {
            engine: self.engine.name(),
            queue_depth: self.engine.queue_depth(),
            capacity_bytes: self.pages_per_file * PAGE * self.files.len() as u64,
            used_bytes: st.used_bytes,
            blocks: st.blocks,
            recovered_blocks: s.recovered.load(Relaxed),
            bytes_read: s.bytes_read.load(Relaxed),
            bytes_written: s.bytes_written.load(Relaxed),
            reads: s.reads.load(Relaxed),
            writes: s.writes.load(Relaxed),
            read_errors: s.read_errors.load(Relaxed),
            write_errors: s.write_errors.load(Relaxed),
            checksum_failures: s.checksum_failures.load(Relaxed),
            evictions: s.evictions.load(Relaxed),
            read_us: pct(&self.read_hist),
            write_us: pct(&self.write_hist),
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if let Err(e) = self.checkpoint() {
            tracing::warn!(error = %e, "journal checkpoint at close failed (the journal stays valid)");
        }
    }
}

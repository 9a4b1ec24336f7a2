//! The disk tier: preallocated data files opened with O_DIRECT, a free-extent allocator, an
//! index journal with checkpoints, a checksum per block verified on every read, and its own
//! eviction policy. It is a [`LowerTier`]: the store's tiering worker reads and writes it.
//!
//! Durability order of a write batch: data written (O_DIRECT) → `fdatasync` of the data files →
//! journal records appended → `fdatasync` of the journal → blocks visible. A crash anywhere
//! before the last step leaves the blocks invisible after recovery; a crash after it leaves them
//! whole. Recovery replays the journal only; block data is checked when read.
//!
//! Engine tags (an engine's hash of a block, and its parent's) ride in the journal after the
//! block's Put when a [`Tagger`] is installed (the daemon installs one while its KV events are
//! on), so that they survive a restart: [`DiskTier::recovered_tags`] hands them back. Until a
//! tagger is installed the recovered tags are kept (and checkpointed) as found.
//!
//! Modules: `config` (DiskConfig, errors), `state` (the index), `recovery` (creating and
//! recovering the files), `journal`, `extent`.

mod config;
mod extent;
#[cfg(test)]
mod fuzz_tests;
mod journal;
mod recovery;
mod state;

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use hdrhistogram::Histogram;
use parking_lot::Mutex;

use crate::arena::AlignedBuf;
use crate::events::{EventKind, Events};
use crate::io::{self as kio, IoBuf, IoConfig, IoEngine, IoKind, IoReq, ALIGN};
use crate::key::{BlockKey, Fingerprint};
use crate::tags::{EngineTag, Tagger};
use crate::tier::{
    LatencyBuckets, LowerTier, NsUsage, ReadItem, ReadOutcome, TierStats, WriteItem, WriteOutcome,
};
use crate::types::{BlockInfo, FoldMap, MapKey, Tier};

pub use config::{Admission, DiskConfig, DiskError, BOUNCE_BYTES, DEFAULT_ADMIT_ALL_BELOW};
use journal::{Journal, Kind, Record};
use recovery::io_err;
use state::{DEntry, DState, State};

const PAGE: u64 = ALIGN as u64;

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

/// The disk tier.
pub struct DiskTier {
    /// Swappable (tests wrap it in a fault injector while the store runs).
    engine: parking_lot::RwLock<Arc<dyn IoEngine>>,
    /// Huge-page bounce buffers that reads and writes go through when the blocks' memory is in
    /// 4 KiB pages (`DiskConfig::bounce_bytes`); one batch uses them at a time, others go
    /// direct.
    /// Dropped after the engine (declared after it), which may have them registered.
    bounce: Option<Mutex<AlignedBuf>>,
    /// The bounce buffers' address and length (registered with the arena).
    bounce_region: Option<(usize, usize)>,
    /// Set once an engine lost requests that were in the bounce buffers: never used again.
    bounce_lost: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
    journal: Mutex<Journal>,
    files: Vec<File>,
    instance: u64,
    pages_per_file: u64,
    namespaces: Mutex<Vec<Fingerprint>>,
    stats: Counters,
    read_hist: Mutex<Histogram<u64>>,
    write_hist: Mutex<Histogram<u64>>,
    events: Arc<Events>,
    dir: PathBuf,
    /// Where the tags of blocks being written come from (None: written untagged).
    tagger: parking_lot::RwLock<Option<Tagger>>,
    /// The tags the journal kept, until a tagger takes over (then empty).
    recovered_tags: Mutex<FoldMap<MapKey, EngineTag>>,
    /// Held for the tier's life: one process per directory.
    _lock: File,
}

/// Takes the directory's lock file (`kvtier.lock`, flock): two daemons never share a disk
/// directory, whatever their data directories.
fn lock_dir(dir: &std::path::Path) -> Result<File, DiskError> {
    let path = dir.join("kvtier.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    // SAFETY: flock on a valid open fd.
    let r = unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    };
    if r != 0 {
        return Err(DiskError::Locked {
            dir: dir.to_path_buf(),
            lock: path,
        });
    }
    Ok(f)
}

impl DiskTier {
    /// Bytes of block data across all files.
    fn capacity_bytes(&self) -> u64 {
        self.pages_per_file * PAGE * self.files.len() as u64
    }

    /// Opens (recovering) or creates the tier in `cfg.dir`, emitting block events into
    /// `events`. `cfg.io.fixed_buffers` is memory to register with io_uring.
    pub fn open(mut cfg: DiskConfig, events: Arc<Events>) -> Result<Self, DiskError> {
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
        if !(0.0..=1.0).contains(&cfg.admit_all_below) {
            return Err(DiskError::Config(format!(
                "admit_all_below = {} must be within 0..=1",
                cfg.admit_all_below
            )));
        }
        std::fs::create_dir_all(&cfg.dir).map_err(io_err(&cfg.dir))?;
        let lock = lock_dir(&cfg.dir)?;
        let o = recovery::open(&cfg, pages_per_file, cfg.policy.build())?;
        let bounce = Self::bounce_pool(cfg.bounce_bytes);
        let bounce_region = bounce.as_ref().map(|b| (b.as_ptr() as usize, b.len()));
        cfg.io.fixed_buffers.extend(bounce_region);
        let engine = Self::engine(&o.files, &cfg.io).map_err(io_err(&cfg.dir))?;
        tracing::info!(
            dir = %cfg.dir.display(),
            blocks = o.recovered,
            skipped_journal_records = o.skipped_records,
            engine = engine.name(),
            "disk tier open"
        );
        let hist = || Histogram::new_with_bounds(1, 60_000_000, 2).map(Mutex::new);
        let tier = Self {
            engine: parking_lot::RwLock::new(engine),
            bounce: bounce.map(Mutex::new),
            bounce_region,
            bounce_lost: Default::default(),
            state: Mutex::new(o.state),
            journal: Mutex::new(o.journal),
            files: o.files,
            instance: o.instance,
            pages_per_file,
            namespaces: Mutex::new(o.namespaces),
            stats: Counters::default(),
            read_hist: hist().map_err(|e| DiskError::Config(e.to_string()))?,
            write_hist: hist().map_err(|e| DiskError::Config(e.to_string()))?,
            events,
            dir: cfg.dir.clone(),
            tagger: parking_lot::RwLock::new(None),
            recovered_tags: Mutex::new(o.tags),
            _lock: lock,
        };
        tier.stats.recovered.store(o.recovered, Relaxed);
        let found = tier.journal.lock().version;
        if found < journal::VERSION {
            tracing::info!(dir = %cfg.dir.display(), from = found, to = journal::VERSION,
                "disk tier journal in an older format: upgrading it in place (blocks kept)");
        }
        // Compact at open: the journal then holds only live records. A failure here (a full
        // file system) is not fatal: the journal as found is valid.
        if let Err(e) = tier.checkpoint() {
            tracing::warn!(error = %e, "journal checkpoint at open failed (the journal stays valid)");
        }
        Ok(tier)
    }

    /// From now on, the tags of written blocks (and of live blocks at a checkpoint) come from
    /// `tagger`; the recovered tags are dropped (take them first with
    /// [`DiskTier::recovered_tags`]).
    pub fn set_tagger(&self, tagger: Tagger) {
        *self.tagger.write() = Some(tagger);
        *self.recovered_tags.lock() = FoldMap::default();
    }

    /// The engine tags the journal kept for blocks still on disk (empty once a tagger is set).
    pub fn recovered_tags(&self) -> Vec<(BlockKey, EngineTag)> {
        let tags = self.recovered_tags.lock().clone();
        let st = self.state.lock();
        tags.into_iter()
            .filter(|(k, _)| st.index.get(k).is_some_and(|e| e.state == DState::Ready))
            .map(|(k, t)| (BlockKey::from(k), t))
            .collect()
    }

    /// Every block on disk, with its namespace.
    pub fn blocks(&self) -> Vec<(BlockKey, u16)> {
        self.state
            .lock()
            .index
            .iter()
            .filter(|(_, e)| e.state == DState::Ready)
            .map(|(k, e)| (BlockKey::from(*k), e.ns))
            .collect()
    }

    /// The blocks of namespace `ns` on disk.
    pub fn blocks_of(&self, ns: u16) -> Vec<BlockKey> {
        self.blocks()
            .into_iter()
            .filter(|&(_, n)| n == ns)
            .map(|(k, _)| k)
            .collect()
    }

    /// The tags of `keys`, from the tagger, or else from the recovered tags; no lock of the
    /// tier's is taken (the caller may hold the journal lock).
    fn tags_of(&self, keys: &[BlockKey]) -> Vec<Option<EngineTag>> {
        if let Some(t) = self.tagger.read().clone() {
            let mut v = t(keys);
            v.resize(keys.len(), None);
            return v;
        }
        let m = self.recovered_tags.lock();
        if m.is_empty() {
            return vec![None; keys.len()];
        }
        keys.iter()
            .map(|k| m.get(&MapKey::from(*k)).copied())
            .collect()
    }

    /// `put`'s record, then its tag records.
    fn push_tagged(records: &mut Vec<Record>, put: Record, tag: Option<EngineTag>) {
        records.push(put);
        if let Some(t) = tag {
            records.push(Record::tag(Kind::Hash, put.key, t.hash));
            if let Some(p) = t.parent {
                records.push(Record::tag(Kind::Parent, put.key, p));
            }
        }
    }

    /// The bounce buffers: `bytes` rounded up to 2 MiB, in huge pages where the system grants
    /// them (private memory: `transparent_hugepage/enabled` at `madvise` or `always`); none
    /// for less than two 2 MiB slots, or if the memory cannot be had (said, and reads go
    /// direct).
    fn bounce_pool(bytes: u64) -> Option<AlignedBuf> {
        const HUGE: u64 = 2 << 20;
        if bytes < 2 * HUGE {
            return None;
        }
        match AlignedBuf::new_huge(bytes.div_ceil(HUGE).saturating_mul(HUGE) as usize) {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::warn!(bytes, error = %e, "disk tier: no bounce buffers; reads and writes go straight to and from 4 KiB pages");
                None
            }
        }
    }

    fn engine(files: &[File], io: &IoConfig) -> io::Result<Arc<dyn IoEngine>> {
        let clones = files
            .iter()
            .map(|f| f.try_clone())
            .collect::<io::Result<Vec<_>>>()?;
        kio::open_engine(clones, io)
    }

    /// Replaces the engine (tests wrap it in a fault injector); batches already submitted
    /// finish on the old one.
    pub fn wrap_engine(&self, f: impl FnOnce(Arc<dyn IoEngine>) -> Arc<dyn IoEngine>) {
        let mut e = self.engine.write();
        *e = f(e.clone());
    }

    /// Reads blocks into the given buffers (each at least `len` rounded up to 4096), verifying
    /// checksums. One outcome per item, in order.
    pub fn read_batch(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        let mut out = vec![ReadOutcome::Miss; items.len()];
        let mut reqs = Vec::new();
        let mut meta = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, it) in items.into_iter().enumerate() {
                let Some(e) = st.index.get_mut(&MapKey::from(it.key)) else {
                    continue;
                };
                if e.state != DState::Ready || (e.pages() * PAGE) as usize > it.buf.cap() {
                    continue;
                }
                e.pins += 1;
                let e = *e;
                st.policy.access(e.id, it.key.0 as u64);
                meta.push((i, it.key, e));
                reqs.push(IoReq {
                    kind: IoKind::Read,
                    file: u32::from(e.file),
                    offset: e.first_page() * PAGE,
                    len: (e.pages() * PAGE) as u32,
                    buf: it.buf,
                    tag: (meta.len() - 1) as u64,
                });
            }
        }
        if reqs.is_empty() {
            return out;
        }
        let mut corrupt = Vec::new();
        // A completion, and where its bytes are: in its own buffer (None), or in a bounce
        // slot, to be copied into its own buffer (hashed in the same pass).
        let each = |d: &kio::IoDone, bounced: Option<&[u8]>| {
            let (i, key, e) = meta[d.req.tag as usize];
            match &d.result {
                Ok(()) => {
                    self.stats.reads.fetch_add(1, Relaxed);
                    self.stats
                        .bytes_read
                        .fetch_add(u64::from(d.req.len), Relaxed);
                    let len = e.len as usize;
                    let sum = match bounced {
                        Some(src) => {
                            // SAFETY: the request's own buffer holds at least `len` bytes
                            // (checked against its capacity above) and is the holder's alone
                            // until handed back (`IoBuf::from_raw`'s contract); the bounce slot
                            // is other memory.
                            let dst =
                                unsafe { std::slice::from_raw_parts_mut(d.req.buf.as_ptr(), len) };
                            crate::checksum::copy_hashed(dst, &src[..len])
                        }
                        None => {
                            // SAFETY: the read filled at least `len` bytes of this buffer
                            // (checked against its capacity above), which the request still
                            // owns.
                            let data =
                                unsafe { std::slice::from_raw_parts(d.req.buf.as_ptr(), len) };
                            crate::checksum::checksum(data)
                        }
                    };
                    if sum == e.checksum {
                        out[i] = ReadOutcome::Hit(BlockInfo {
                            len: e.len,
                            ns: e.ns,
                            checksum: e.checksum,
                        });
                    } else {
                        self.stats.checksum_failures.fetch_add(1, Relaxed);
                        tracing::warn!(%key, "disk block failed its checksum: served as a miss and dropped");
                        corrupt.push(key);
                    }
                }
                Err(err) => {
                    self.stats.read_errors.fetch_add(1, Relaxed);
                    tracing::warn!(%key, error = %err, "disk read failed: served as a miss");
                }
            }
        };
        // Through the bounce buffers when they are free and hold at least two of the largest
        // read (else straight into the destinations).
        match self.bounce_for(&reqs) {
            Some((mut pool, slot)) => {
                let mut each = each;
                let hist = &self.read_hist;
                self.run_bounced(
                    reqs,
                    &mut pool,
                    slot,
                    hist,
                    |_, _| {},
                    |d, held| each(d, Some(held)),
                );
            }
            _ => {
                let mut each = each;
                self.run(reqs, &self.read_hist, |d| each(d, None));
            }
        }
        let mut st = self.state.lock();
        for k in corrupt {
            let ns = st.index.get(&MapKey::from(k)).map_or(0, |e| e.ns);
            st.drop_entry(k, true);
            self.events.emit(EventKind::Removed, k, Tier::Disk, ns);
        }
        for &(_, key, _) in &meta {
            st.unpin(key);
        }
        out
    }

    /// Finds room for `len` bytes, evicting unpinned disk blocks by the disk policy.
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
                let key = ids[id as usize];
                index
                    .get(&MapKey::from(key))
                    .is_some_and(|e| e.pins == 0 && e.state == DState::Ready)
                    .then_some(key.0 as u64)
            })?;
            let key = st.ids[victim as usize];
            let ns = st.index.get(&MapKey::from(key)).map_or(0, |e| e.ns);
            // The policy already forgot the id; drop_entry's policy.remove is a no-op.
            st.drop_entry(key, true);
            self.stats.evictions.fetch_add(1, Relaxed);
            self.events.emit(EventKind::Removed, key, Tier::Disk, ns);
        }
    }

    /// Writes blocks durably (see the module docs for the order); one outcome per item.
    pub fn write_batch(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        let mut out = vec![WriteOutcome::Failed; items.len()];
        let mut reqs = Vec::new();
        // (item index, key, file, page, len, ns, commit checksum)
        let mut meta = Vec::new();
        {
            let mut st = self.state.lock();
            for (i, it) in items.into_iter().enumerate() {
                let io_len = u64::from(it.len).div_ceil(PAGE) * PAGE;
                if it.len == 0 || io_len as usize > it.buf.cap() {
                    // A buffer smaller than the block: never read past it.
                    self.stats.write_errors.fetch_add(1, Relaxed);
                    tracing::warn!(key = %it.key, len = it.len, cap = it.buf.cap(), "disk write refused: the buffer is smaller than the block");
                    continue;
                }
                let mk = MapKey::from(it.key);
                if let Some(e) = st.index.get(&mk) {
                    out[i] = match e.state {
                        DState::Ready => WriteOutcome::Present,
                        // In flight, or an older copy on its way out: try again later.
                        DState::Writing | DState::Cancelled | DState::Doomed => WriteOutcome::Busy,
                    };
                    continue;
                }
                let Some((file, page)) = self.alloc(&mut st, it.len) else {
                    self.stats.write_errors.fetch_add(1, Relaxed);
                    tracing::warn!(key = %it.key, len = it.len, "disk tier full of pinned blocks: block not written");
                    continue;
                };
                let id = st.new_id(it.key);
                st.index.insert(
                    mk,
                    DEntry {
                        // Below `pages_per_file` ≤ u32::MAX (checked at open).
                        page: page as u32,
                        checksum: it.checksum,
                        len: it.len,
                        id,
                        pins: 0,
                        file,
                        ns: it.ns,
                        state: DState::Writing,
                    },
                );
                meta.push((i, it.key, file, page, it.len, it.ns, it.checksum));
                reqs.push(IoReq {
                    kind: IoKind::Write,
                    file: u32::from(file),
                    offset: page * PAGE,
                    len: io_len as u32,
                    buf: it.buf,
                    tag: (meta.len() - 1) as u64,
                });
            }
        }
        if reqs.is_empty() {
            return out;
        }
        // Each block's checksum is computed as its write completes (overlapping the I/O still
        // in flight) and must equal its commit checksum: otherwise the host copy was damaged
        // after its commit, and nothing is stored.
        let mut sums = vec![0u64; meta.len()];
        // Through the bounce buffers when they are free and hold at least two of the largest
        // write: each block copied into a slot with its checksum in the same pass, right
        // before its write from there (the bytes checked are the bytes written).
        let done = match self.bounce_for(&reqs) {
            Some((mut pool, slot)) => {
                let fill = |r: &IoReq, into: &mut [u8]| {
                    let len = meta[r.tag as usize].4 as usize;
                    let io_len = r.len as usize;
                    // SAFETY: the block's buffer holds at least `io_len` ≥ `len` bytes
                    // (checked above); it is only read meanwhile.
                    let from = unsafe { std::slice::from_raw_parts(r.buf.as_ptr(), io_len) };
                    sums[r.tag as usize] =
                        crate::checksum::copy_hashed(&mut into[..len], &from[..len]);
                    // The rest of the last page goes to disk as it is, unhashed.
                    into[len..io_len].copy_from_slice(&from[len..io_len]);
                };
                self.run_bounced(reqs, &mut pool, slot, &self.write_hist, fill, |_, _| {})
            }
            _ => self.run(reqs, &self.write_hist, |d| {
                let len = meta[d.req.tag as usize].4 as usize;
                // SAFETY: the buffer holds at least `len` bytes (checked above); it is only
                // read, by the disk and by us.
                let data = unsafe { std::slice::from_raw_parts(d.req.buf.as_ptr(), len) };
                sums[d.req.tag as usize] = crate::checksum::checksum(data);
            }),
        };
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
        let mut corrupt = vec![false; meta.len()];
        for (k, m) in meta.iter().enumerate() {
            if ok[k] && sums[k] != m.6 {
                corrupt[k] = true;
                ok[k] = false;
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
        // The written blocks' engine tags, asked before any lock of ours is taken.
        let tagged: Vec<BlockKey> = meta
            .iter()
            .enumerate()
            .filter(|(k, _)| ok[*k])
            .map(|(_, m)| m.1)
            .collect();
        let mut tags = self.tags_of(&tagged).into_iter();
        // Journal, then state, as checkpoint() does; the journal lock is held from building the
        // records until the blocks are Ready, so a checkpoint cannot drop records that are
        // durable but not yet Ready, and records reach the file in sequence order.
        let mut j = self.journal.lock();
        let mut st = self.state.lock();
        let mut records = Vec::new();
        for (k, &(_, key, file, page, len, ns, sum)) in meta.iter().enumerate() {
            if ok[k] {
                st.seq += 1;
                let put = Record {
                    kind: Kind::Put,
                    ns,
                    key,
                    page,
                    len,
                    file: u32::from(file),
                    checksum: sum,
                    seq: st.seq,
                    label: None,
                };
                Self::push_tagged(&mut records, put, tags.next().flatten());
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
        for (k, &(i, key, _, _, _, _, sum)) in meta.iter().enumerate() {
            let mk = MapKey::from(key);
            let state = st.index.get(&mk).map(|e| e.state);
            // Asked under our lock: a removal that reaches the store before this point has
            // its block dropped here; one after it finds the block Ready and removes it.
            let wanted = ok[k] && state == Some(DState::Writing) && still_wanted(&key);
            if wanted {
                if let Some(e) = st.index.get_mut(&mk) {
                    e.state = DState::Ready;
                    let e = *e;
                    st.index.remove(&mk);
                    st.insert_ready(key, e);
                    self.events.emit(EventKind::Stored, key, Tier::Disk, e.ns);
                }
                out[i] = WriteOutcome::Written;
            } else if let Some(e) = st.index.get(&mk).copied() {
                // Failed, damaged, or removed while in flight: never visible. A block whose Put
                // is already journaled needs its Remove there too.
                if ok[k] {
                    st.seq += 1;
                    cancelled.push(Record {
                        kind: Kind::Remove,
                        ns: e.ns,
                        key,
                        page: e.first_page(),
                        len: e.len,
                        file: u32::from(e.file),
                        checksum: sum,
                        seq: st.seq,
                        label: None,
                    });
                }
                st.forget(mk, e);
                out[i] = if corrupt[k] {
                    WriteOutcome::Corrupt
                } else if ok[k] {
                    WriteOutcome::Cancelled
                } else {
                    WriteOutcome::Failed
                };
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
        let (jrecs, per_block) = {
            let j = self.journal.lock();
            (j.records, j.per_block)
        };
        // Compact once dead records outnumber live ones (a live block's Put and tags: records
        // per block as the last rewrite found them).
        if jrecs as f64 > 2.0 * live as f64 * per_block + 4096.0 {
            if let Err(e) = self.checkpoint() {
                tracing::warn!(error = %e, "journal checkpoint failed (the journal stays valid)");
            }
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
        let engine = self.engine.read().clone();
        engine.submit(reqs, tx);
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

    /// The bounce buffers for a batch of `reqs`, and their slot size, if they are free, whole
    /// and hold at least two slots. A slot is the longest request rounded up to a power of
    /// two up to 2 MiB (it then never straddles two huge pages), or to whole 2 MiB above,
    /// where that still leaves two slots.
    fn bounce_for(
        &self,
        reqs: &[IoReq],
    ) -> Option<(parking_lot::MutexGuard<'_, AlignedBuf>, usize)> {
        const HUGE: usize = 2 << 20;
        let longest = reqs.iter().map(|r| r.len as usize).max()?;
        if longest == 0 || self.bounce_lost.load(Relaxed) {
            return None;
        }
        let pool = self.bounce.as_ref()?.try_lock()?;
        let aligned = if longest <= HUGE {
            longest.next_power_of_two()
        } else {
            longest.next_multiple_of(HUGE)
        };
        let slot = if pool.len() / aligned >= 2 {
            aligned
        } else {
            longest
        };
        (pool.len() / slot >= 2).then_some((pool, slot))
    }

    /// [`DiskTier::run`] through `pool`, in slots of `slot` bytes (huge pages: one segment per
    /// request for the device, not one per 4 KiB page). A write's bytes are copied into a free
    /// slot by `fill` (given the request, its own buffer still in it) right before it is
    /// submitted from there; a read lands in a free slot and `each` copies it out. `each` sees
    /// every completion with its own buffer back in it and the slot's bytes; the slot then
    /// takes the next request. At most as many requests are in flight as there are slots
    /// (twice the engine's queue depth at most). The completions, in tag order.
    fn run_bounced(
        &self,
        reqs: Vec<IoReq>,
        pool: &mut AlignedBuf,
        slot: usize,
        hist: &Mutex<Histogram<u64>>,
        mut fill: impl FnMut(&IoReq, &mut [u8]),
        mut each: impl FnMut(&kio::IoDone, &[u8]),
    ) -> Vec<kio::IoDone> {
        let n = reqs.len();
        let engine = self.engine.read().clone();
        let slots = (pool.len() / slot).min(2 * engine.queue_depth().max(1) as usize);
        let base = pool.as_mut_ptr();
        // One channel per submission, its sender given away: an engine that loses requests
        // (its thread gone) drops their senders, and the wait ends as `run`'s does (a read
        // lost is a miss, a write lost not stored), never hangs on a sender kept here.
        let mut rxs: Vec<crossbeam_channel::Receiver<kio::IoDone>> = Vec::new();
        let start = Instant::now();
        // Each request's own buffer and tag while it is in a slot (by position).
        let mut own: Vec<Option<(IoBuf, u64)>> = Vec::with_capacity(n);
        let mut waiting = reqs.into_iter().enumerate();
        // The next requests into the free slots `free` (one engine submission).
        let mut submit =
            |free: &mut dyn Iterator<Item = usize>,
             own: &mut Vec<_>,
             rxs: &mut Vec<crossbeam_channel::Receiver<kio::IoDone>>| {
                let mut batch = Vec::new();
                for s in free {
                    let Some((pos, mut r)) = waiting.next() else {
                        break;
                    };
                    // SAFETY: slot `s` of the pool is free (never used, or its last request
                    // completed and was handled), lies within the pool (`s < slots ≤ len /
                    // slot`), and the pool is borrowed mutably for this whole call: nobody else
                    // touches it until the request submitted below completes.
                    let into = unsafe { std::slice::from_raw_parts_mut(base.add(s * slot), slot) };
                    fill(&r, into);
                    // SAFETY: as above; the request owns the slot until its completion.
                    let b = unsafe { IoBuf::from_raw(base.add(s * slot), slot) };
                    own.push(Some((std::mem::replace(&mut r.buf, b), r.tag)));
                    r.tag = pos as u64;
                    batch.push(r);
                }
                if !batch.is_empty() {
                    let (tx, rx) = crossbeam_channel::unbounded();
                    engine.submit(batch, tx);
                    rxs.push(rx);
                }
            };
        submit(&mut (0..slots), &mut own, &mut rxs);
        let mut lat = Vec::with_capacity(n);
        let mut out = Vec::with_capacity(n);
        while out.len() < n && !rxs.is_empty() {
            let mut sel = crossbeam_channel::Select::new();
            for r in &rxs {
                sel.recv(r);
            }
            let op = sel.select();
            let i = op.index();
            let Ok(mut d) = op.recv(&rxs[i]) else {
                // Every completion of that submission came (or was lost): done with it.
                rxs.swap_remove(i);
                continue;
            };
            lat.push(start.elapsed().as_micros() as u64);
            let pos = d.req.tag as usize;
            let s = (d.req.buf.as_ptr() as usize).wrapping_sub(base as usize) / slot;
            let Some((mine, tag)) = own.get_mut(pos).and_then(Option::take) else {
                continue;
            };
            // An engine hands each request's own buffer back (the `IoEngine` contract).
            debug_assert!(s < slots, "a completion came back with another buffer");
            let len = d.req.len as usize;
            let bounced = std::mem::replace(&mut d.req.buf, mine);
            // SAFETY: the request is done with the slot (`len` ≤ `slot` bytes of it), which
            // lies in the pool this call borrows mutably: nobody else touches it until the
            // next request is submitted into it below.
            let held = unsafe { std::slice::from_raw_parts(bounced.as_ptr(), len) };
            d.req.tag = tag;
            each(&d, held);
            out.push(d);
            if s < slots {
                submit(&mut std::iter::once(s), &mut own, &mut rxs);
            }
        }
        if out.len() < n {
            // Requests lost by the engine may still be in the kernel's hands, their slots
            // too: the pool is never used again (freed with the tier, after its engine).
            self.bounce_lost.store(true, Relaxed);
            tracing::error!(
                lost = n - out.len(),
                "disk I/O engine lost requests: their blocks are misses, and the bounce buffers are retired"
            );
        }
        let mut h = hist.lock();
        for l in lat {
            let _ = h.record(l.max(1));
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
                    label: None,
                });
            }
        }
        // Hold the journal lock across the snapshot so no batch appends in between.
        let mut j = self.journal.lock();
        let pending;
        let mut puts = Vec::new();
        {
            let st = self.state.lock();
            for (k, e) in st.index.iter() {
                if e.state == DState::Ready {
                    puts.push(Record {
                        kind: Kind::Put,
                        ns: e.ns,
                        key: BlockKey::from(*k),
                        page: e.first_page(),
                        len: e.len,
                        file: u32::from(e.file),
                        checksum: e.checksum,
                        seq: 0,
                        label: None,
                    });
                }
            }
            pending = st.removes.len();
        }
        // The tags, asked under the journal lock only (the tagger's lock comes after it).
        let keys: Vec<BlockKey> = puts.iter().map(|r| r.key).collect();
        recs.reserve(puts.len());
        for (put, tag) in puts.into_iter().zip(self.tags_of(&keys)) {
            Self::push_tagged(&mut recs, put, tag);
        }
        j.rewrite(self.instance, &recs)?;
        // The removals the snapshot already reflects need not be journaled any more; those
        // queued after it (evictions and removals take only the state lock) stay queued.
        let mut st = self.state.lock();
        let n = pending.min(st.removes.len());
        st.removes.drain(..n);
        Ok(())
    }

    /// The directory the tier lives in.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl LowerTier for DiskTier {
    fn kind(&self) -> Tier {
        Tier::Disk
    }

    fn lookup(&self, key: &BlockKey) -> Option<BlockInfo> {
        self.state
            .lock()
            .index
            .get(&MapKey::from(*key))
            .filter(|e| e.state == DState::Ready)
            .map(|e| BlockInfo {
                len: e.len,
                ns: e.ns,
                checksum: e.checksum,
            })
    }

    fn pin(&self, key: &BlockKey) -> bool {
        let mut st = self.state.lock();
        match st.index.get_mut(&MapKey::from(*key)) {
            Some(e) if e.state == DState::Ready => match e.pins.checked_add(1) {
                Some(p) => {
                    e.pins = p;
                    true
                }
                None => false,
            },
            _ => false,
        }
    }

    fn unpin(&self, key: &BlockKey) {
        self.state.lock().unpin(*key);
    }

    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        self.read_batch(items)
    }

    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        self.write_batch(items, still_wanted)
    }

    fn remove(&self, key: &BlockKey) -> bool {
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

    fn clear_namespace(&self, ns: u16) -> Vec<BlockKey> {
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

    fn namespace_usage(&self) -> Vec<NsUsage> {
        let st = self.state.lock();
        let mut m: std::collections::BTreeMap<u16, (u64, u64)> = Default::default();
        for e in st.index.values().filter(|e| e.state == DState::Ready) {
            let x = m.entry(e.ns).or_default();
            x.0 += 1;
            x.1 += u64::from(e.len);
        }
        m.into_iter()
            .map(|(ns, (blocks, bytes))| NsUsage { ns, blocks, bytes })
            .collect()
    }

    fn fill(&self) -> Option<(u64, u64)> {
        let used = self.state.lock().used_bytes;
        Some((used, self.capacity_bytes()))
    }

    fn stats(&self) -> TierStats {
        let s = &self.stats;
        let st = self.state.lock();
        let pct = |h: &Mutex<Histogram<u64>>| {
            let h = h.lock();
            (h.value_at_quantile(0.5), h.value_at_quantile(0.99))
        };
        TierStats {
            tier: Some(Tier::Disk),
            engine: self.engine.read().name(),
            queue_depth: self.engine.read().queue_depth(),
            capacity_bytes: self.capacity_bytes(),
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
            read_latency: LatencyBuckets::from_hdr(&self.read_hist.lock()),
            write_latency: LatencyBuckets::from_hdr(&self.write_hist.lock()),
            // Measured by the store's reader (it times whole promotion batches).
            read_bandwidth: 0,
            read_latency_ns: 0,
            policy_leader: st.policy.leader(),
        }
    }

    fn note_namespace(&self, id: u16, fp: Fingerprint) -> io::Result<()> {
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
            label: None,
        }])?;
        j.sync()?;
        if ns.len() <= id as usize {
            ns.resize(id as usize + 1, Fingerprint(BlockKey(0)));
        }
        ns[id as usize] = fp;
        Ok(())
    }

    fn recovered_namespaces(&self) -> Vec<Fingerprint> {
        self.namespaces.lock().clone()
    }

    fn checkpoint(&self) -> io::Result<()> {
        DiskTier::checkpoint(self)
    }

    fn register_memory(&self, mut regions: Vec<(usize, usize)>) {
        regions.extend(self.bounce_region);
        self.engine.read().register_buffers(regions);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if let Err(e) = self.checkpoint() {
            tracing::warn!(error = %e, "journal checkpoint at close failed (the journal stays valid)");
        }
    }
}

//! Moving engine blocks between an engine's memory and kvtier, with one copy, in either mode:
//! embedded (the store in this process) or sidecar (`kvtierd` through its engine socket and
//! shared arena). Saves gather straight into a reserved slot (hashing as they go: the commit
//! carries the block's checksum); loads scatter straight out of a pinned block. This is the one
//! transfer API: the Python package, `kvtier-bench connector` and `kvtier-bench replay` all go
//! through here.
//!
//! Two shapes of engine memory: paged KV tensors ([`PagedKv`], vLLM's layer tensors) with
//! `save`/`load`, and per-page lists of memory segments (SGLang's host pool pages) with
//! `write_segments`/`read_segments`.

use std::sync::Mutex;
use std::time::Duration;

use kvstore::{BlockKey, LeaseId, Namespace, NsId, Reserve, Store, StoreError};
use kvtier_ipc::{IpcClient, IpcError, SlotStatus};

use crate::layout::{LayoutError, PagedKv};

/// Why a transfer failed (as opposed to a miss, which is a short count).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The embedded store refused.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The sidecar connection failed or the daemon refused.
    #[error(transparent)]
    Ipc(#[from] IpcError),
    /// A namespace that does not validate.
    #[error(transparent)]
    Key(#[from] kvstore::KeyError),
    /// Block ids or sizes do not fit the registered layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Arguments that do not match each other.
    #[error("{0}")]
    Input(String),
    /// A previous call panicked while holding the sidecar connection.
    #[error("the kvtierd connection was poisoned by a panic")]
    Poisoned,
}

/// Where blocks go: one API, two modes.
pub enum Backend {
    /// The store lives in this process.
    Embedded(Box<Store>),
    /// A node's `kvtierd`, through its engine socket.
    Sidecar(Mutex<IpcClient>),
}

fn check_pairs(keys: &[BlockKey], block_ids: &[Vec<usize>]) -> Result<(), TransferError> {
    if keys.len() != block_ids.len() {
        return Err(TransferError::Input(format!(
            "{} keys but {} block-id lists",
            keys.len(),
            block_ids.len()
        )));
    }
    if block_ids.iter().any(|ids| ids.is_empty()) {
        return Err(TransferError::Input(
            "every key needs at least one engine block".into(),
        ));
    }
    Ok(())
}

/// How one block gets its bytes into a slot: returns the xxh3-64 of what it wrote.
type Fill<'a> = dyn Fn(usize, &mut [u8]) -> Result<u64, TransferError> + Sync + 'a;

/// What a load does with block `i` (its bytes and commit checksum) while it is pinned: false
/// refuses it (ends the prefix).
pub type Each<'a> = dyn FnMut(usize, &[u8], u64) -> Result<bool, TransferError> + 'a;

/// Copies `src` segments, in order, into `slot` (exactly their total length); returns the
/// checksum of the slot's bytes.
fn gather_segments(src: &[&[u8]], slot: &mut [u8]) -> u64 {
    let mut at = 0;
    let mut h = kvstore::Checksummer::new();
    for s in src {
        for c in s.chunks(kvstore::checksum::CHUNK) {
            kvstore::copy_nt(&mut slot[at..at + c.len()], c);
            h.update(c);
            at += c.len();
        }
    }
    h.finish()
}

/// Copies `block` into the segments, in order; false unless the sizes match (nothing copied)
/// and the bytes match `sum` (checked as they are copied).
fn fill_segments(block: &[u8], segs: &mut [&mut [u8]], sum: u64) -> bool {
    if segs.iter().map(|s| s.len()).sum::<usize>() != block.len() {
        return false;
    }
    let mut at = 0;
    let mut h = kvstore::Checksummer::new();
    for s in segs.iter_mut() {
        for d in s.chunks_mut(kvstore::checksum::CHUNK) {
            d.copy_from_slice(&block[at..at + d.len()]);
            h.update(d);
            at += d.len();
        }
    }
    verified(h.finish(), sum)
}

/// Whether what was copied matches the block's commit checksum; a mismatch (the block was
/// written after its commit) is logged: the copy is a miss, never data.
fn verified(got: u64, want: u64) -> bool {
    if got != want {
        tracing::warn!(
            "kvtier: a loaded block does not match its commit checksum: treated as a miss"
        );
        return false;
    }
    true
}

/// A sidecar lease released when dropped (an early return cannot leak it); `lapsed` tells
/// whether the release found it expired (the copies made under it are void).
struct LeaseGuard<'c> {
    c: &'c mut IpcClient,
    id: Option<LeaseId>,
}

impl LeaseGuard<'_> {
    /// Releases now; false if the lease had lapsed (bytes copied under it may be another
    /// block's).
    fn release(mut self) -> bool {
        match self.id.take() {
            Some(id) => self.c.release(id).is_ok(),
            None => true,
        }
    }
}

impl Drop for LeaseGuard<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.c.release(id);
        }
    }
}

impl Backend {
    /// Connects to a `kvtierd` engine socket.
    pub fn sidecar(socket: &std::path::Path, client: &str) -> Result<Self, TransferError> {
        Self::sidecar_as(socket, client, "")
    }

    /// Connects to a `kvtierd` engine socket presenting a tenant secret (a daemon with
    /// `server.isolation = "tenant"`).
    pub fn sidecar_as(
        socket: &std::path::Path,
        client: &str,
        tenant_secret: &str,
    ) -> Result<Self, TransferError> {
        Ok(Self::Sidecar(Mutex::new(IpcClient::connect_as(
            socket,
            client,
            tenant_secret,
        )?)))
    }

    fn client(m: &Mutex<IpcClient>) -> Result<std::sync::MutexGuard<'_, IpcClient>, TransferError> {
        m.lock().map_err(|_| TransferError::Poisoned)
    }

    /// Registers a namespace; returns its id (in the store or daemon).
    pub fn register_namespace(&self, ns: &Namespace) -> Result<NsId, TransferError> {
        match self {
            Self::Embedded(s) => Ok(s.register_namespace(ns)?),
            Self::Sidecar(c) => Ok(Self::client(c)?.register_namespace(ns)?),
        }
    }

    /// How many leading keys are present in any tier (no side effects).
    pub fn match_prefix(&self, keys: &[BlockKey]) -> Result<usize, TransferError> {
        Ok(self.lookup(keys)?.n)
    }

    /// How many leading keys are present, and the tier of each (no side effects).
    pub fn lookup(&self, keys: &[BlockKey]) -> Result<kvstore::PrefixMatch, TransferError> {
        match self {
            Self::Embedded(s) => Ok(s.match_prefix(keys)),
            Self::Sidecar(c) => {
                let l = Self::client(c)?.lookup(keys, None)?;
                Ok(kvstore::PrefixMatch {
                    n: l.n,
                    tiers: l.tiers,
                })
            }
        }
    }

    /// Saves `keys[i]` as the canonical bytes of engine blocks `block_ids[i]`. Keys already
    /// present (or being written by someone else) are skipped. Returns how many were stored.
    pub fn save(
        &self,
        ns: NsId,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
    ) -> Result<usize, TransferError> {
        check_pairs(keys, block_ids)?;
        // Every id checked before anything is reserved.
        for ids in block_ids {
            paged.check_ids(ids)?;
        }
        let bb = paged.block_bytes();
        let lens: Vec<usize> = block_ids.iter().map(|ids| ids.len() * bb).collect();
        let fill = |i: usize, slot: &mut [u8]| -> Result<u64, TransferError> {
            Ok(paged.gather_hashed(&block_ids[i], slot)?)
        };
        Ok(self
            .store_blocks(ns, keys, &lens, &fill)?
            .iter()
            .filter(|s| **s == Stored::Now)
            .count())
    }

    /// Loads the longest present prefix of `keys` into engine blocks `block_ids[i]`. Returns
    /// how many leading keys were loaded; a block of the wrong size ends the prefix. In sidecar
    /// mode the blocks are pinned by a lease of `ttl` while they are copied; if it lapsed
    /// before release, nothing counts as loaded (the copies may be other blocks' bytes).
    pub fn load(
        &self,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        ttl: Duration,
    ) -> Result<usize, TransferError> {
        check_pairs(keys, block_ids)?;
        for ids in block_ids {
            paged.check_ids(ids)?;
        }
        let bb = paged.block_bytes();
        self.read_with(keys, ttl, &mut |i, block, sum| {
            if block.len() != block_ids[i].len() * bb {
                return Ok(false);
            }
            // Checked as it is copied: a damaged block is reported as not loaded, and the
            // engine recomputes (and overwrites) what was copied.
            Ok(verified(paged.scatter_hashed(&block_ids[i], block)?, sum))
        })
    }

    /// Stores each page's memory segments (in order) under its key, gathered straight into a
    /// reserved slot. One bool per key: true if stored now, already present or being written
    /// by another writer (the same key is the same bytes), false if there was no room.
    pub fn write_segments(
        &self,
        ns: NsId,
        keys: &[BlockKey],
        pages: &[Vec<&[u8]>],
    ) -> Result<Vec<bool>, TransferError> {
        Ok(self
            .store_segments(ns, keys, pages)?
            .into_iter()
            .map(|s| s != Stored::NoRoom)
            .collect())
    }

    /// [`Backend::write_segments`], saying of each block whether this call stored it.
    pub fn store_segments(
        &self,
        ns: NsId,
        keys: &[BlockKey],
        pages: &[Vec<&[u8]>],
    ) -> Result<Vec<Stored>, TransferError> {
        if keys.len() != pages.len() {
            return Err(TransferError::Input(format!(
                "{} keys but {} pages",
                keys.len(),
                pages.len()
            )));
        }
        let lens: Vec<usize> = pages
            .iter()
            .map(|p| p.iter().map(|s| s.len()).sum())
            .collect();
        let fill = |i: usize, slot: &mut [u8]| -> Result<u64, TransferError> {
            Ok(gather_segments(&pages[i], slot))
        };
        self.store_blocks(ns, keys, &lens, &fill)
    }

    /// Copies the longest present prefix of `keys` into the pages' segments. One bool per key:
    /// true only when a block of exactly the page's total size was copied (a page whose size
    /// differs is a miss and ends the prefix: nothing is copied into it).
    pub fn read_segments(
        &self,
        keys: &[BlockKey],
        pages: &mut [Vec<&mut [u8]>],
        ttl: Duration,
    ) -> Result<Vec<bool>, TransferError> {
        if keys.len() != pages.len() {
            return Err(TransferError::Input(format!(
                "{} keys but {} pages",
                keys.len(),
                pages.len()
            )));
        }
        let n = self.read_with(keys, ttl, &mut |i, block, sum| {
            Ok(fill_segments(block, &mut pages[i], sum))
        })?;
        Ok((0..keys.len()).map(|i| i < n).collect())
    }

    /// Reserves, fills (through `fill`) and commits blocks of the given lengths; for sidecar
    /// mode in reservations of at most the daemon's per-connection limit. A fill that fails
    /// aborts its chunk: nothing half-written is ever committed.
    fn store_blocks(
        &self,
        ns: NsId,
        keys: &[BlockKey],
        lens: &[usize],
        fill: &Fill<'_>,
    ) -> Result<Vec<Stored>, TransferError> {
        let mut out = vec![Stored::NoRoom; keys.len()];
        match self {
            Self::Embedded(s) => {
                for (i, k) in keys.iter().enumerate() {
                    out[i] = match s.reserve(ns, *k, lens[i]) {
                        Ok(Reserve::Slot(mut r)) => {
                            let sum = fill(i, r.as_mut_slice())?;
                            if r.commit_with_checksum(sum)? {
                                Stored::Now
                            } else {
                                Stored::Already
                            }
                        }
                        Ok(Reserve::AlreadyPresent | Reserve::InFlight) => Stored::Already,
                        Err(StoreError::NoSpace { .. }) => Stored::NoRoom,
                        Err(e) => return Err(e.into()),
                    };
                }
            }
            Self::Sidecar(c) => {
                let mut c = Self::client(c)?;
                let lens32 = lens
                    .iter()
                    .map(|&l| {
                        u32::try_from(l)
                            .map_err(|_| TransferError::Input(format!("a {l}-byte block")))
                    })
                    .collect::<Result<Vec<u32>, _>>()?;
                let limit = c.max_reserve_bytes().max(1);
                let max_keys = c.max_keys();
                let mut at = 0;
                while at < keys.len() {
                    // Reserve in chunks: the daemon bounds what one connection holds
                    // uncommitted (a block larger than the limit goes alone, and is refused
                    // by the daemon as a clear error).
                    let mut end = at + 1;
                    let mut bytes = u64::from(lens32[at]);
                    while end < keys.len()
                        && end - at < max_keys
                        && bytes + u64::from(lens32[end]) <= limit
                    {
                        bytes += u64::from(lens32[end]);
                        end += 1;
                    }
                    let slots = c.reserve(ns, &keys[at..end], &lens32[at..end])?;
                    let mut tokens = Vec::with_capacity(slots.len());
                    let mut failed = None;
                    for (j, s) in slots.iter().enumerate() {
                        let i = at + j;
                        out[i] = match *s {
                            SlotStatus::Slot { token, .. } => {
                                tokens.push((i, token));
                                if failed.is_none() {
                                    match c.fill_slot_hashed(token, |slot| match fill(i, slot) {
                                        Ok(sum) => (None, sum),
                                        Err(e) => (Some(e), 0),
                                    })? {
                                        None => {}
                                        Some(e) => failed = Some(e),
                                    }
                                }
                                Stored::Now
                            }
                            SlotStatus::Present | SlotStatus::InFlight => Stored::Already,
                            SlotStatus::NoSpace => Stored::NoRoom,
                        };
                    }
                    let toks: Vec<u64> = tokens.iter().map(|(_, t)| *t).collect();
                    if let Some(e) = failed {
                        // Nothing half-written is ever committed.
                        c.abort(&toks)?;
                        return Err(e);
                    }
                    let r = c.commit(&toks)?;
                    for (i, t) in &tokens {
                        if r.expired.contains(t) {
                            out[*i] = Stored::NoRoom;
                        } else if r.cancelled.contains(t) {
                            out[*i] = Stored::Already;
                        }
                    }
                    if !r.expired.is_empty() {
                        tracing::warn!(
                            n = r.expired.len(),
                            "kvtier: reservations expired before their commit: those blocks are not stored"
                        );
                    }
                    at = end;
                }
            }
        }
        Ok(out)
    }

    /// Loads the longest present prefix of `keys` and hands block `i` to `each` while it is
    /// pinned; stops at the first block `each` refuses. Returns how many were accepted (none if
    /// a sidecar lease lapsed before it was released: what `each` copied may be other blocks'
    /// bytes).
    pub fn read_with(
        &self,
        keys: &[BlockKey],
        ttl: Duration,
        each: &mut Each<'_>,
    ) -> Result<usize, TransferError> {
        match self {
            Self::Embedded(s) => {
                let l = s.load(keys)?;
                let mut n = 0;
                while n < l.len().min(keys.len()) {
                    if !each(n, l.block(n), l.checksum(n))? {
                        break;
                    }
                    n += 1;
                }
                Ok(n)
            }
            Self::Sidecar(c) => {
                let mut c = Self::client(c)?;
                let l = c.load(keys, ttl.max(Duration::from_millis(1)), None)?;
                let guard = LeaseGuard {
                    id: l.lease,
                    c: &mut c,
                };
                let mut n = 0;
                // Never past what was asked for, whatever the daemon answered.
                while n < l.blocks.len().min(keys.len()) {
                    let sum = l.blocks[n].checksum;
                    if !guard.c.with_block(&l, n, |b| each(n, b, sum))?? {
                        break;
                    }
                    n += 1;
                }
                if !guard.release() {
                    return Ok(0);
                }
                Ok(n)
            }
        }
    }

    /// The embedded store, if this is one.
    pub fn store(&self) -> Option<&Store> {
        match self {
            Self::Embedded(s) => Some(s),
            Self::Sidecar(_) => None,
        }
    }

    /// Runs `f` on the sidecar connection, if this is one.
    pub fn with_client<R>(
        &self,
        f: impl FnOnce(&mut IpcClient) -> Result<R, IpcError>,
    ) -> Result<Option<R>, TransferError> {
        match self {
            Self::Embedded(_) => Ok(None),
            Self::Sidecar(c) => Ok(Some(f(&mut *Self::client(c)?)?)),
        }
    }
}

/// What became of one block a save asked to store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// Stored by this call.
    Now,
    /// There already (or being written, or removed while written: a removal wins).
    Already,
    /// Not stored: no room (or the reservation expired).
    NoRoom,
}

/// The checksum a commit carries for `data` (XXH3-64).
pub use kvstore::checksum;

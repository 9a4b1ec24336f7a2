//! Moving engine blocks between paged KV tensors and kvtier, with one copy, in either mode:
//! embedded (the store in this process) or sidecar (`kvtierd` through its engine socket and
//! shared arena). Saves gather straight into a reserved slot; loads scatter straight out of a
//! pinned block. The Python package and `kvtier-bench connector` both go through here.

use std::sync::Mutex;
use std::time::Duration;

use kvstore::{BlockKey, Namespace, NsId, Reserve, Store, StoreError};
use kvtier_ipc::{IpcClient, IpcError, SlotStatus};

use crate::layout::{LayoutError, PagedKv};

/// Bytes reserved at once by one sidecar save (the daemon bounds a connection's uncommitted
/// bytes to half its host tier).
const SAVE_CHUNK_BYTES: u64 = 64 << 20;

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

impl Backend {
    /// Connects to a `kvtierd` engine socket.
    pub fn sidecar(socket: &std::path::Path, client: &str) -> Result<Self, TransferError> {
        Ok(Self::Sidecar(Mutex::new(IpcClient::connect(
            socket, client,
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
        match self {
            Self::Embedded(s) => Ok(s.match_prefix(keys).n),
            Self::Sidecar(c) => Ok(Self::client(c)?.lookup(keys, None)?.0),
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
        match self {
            Self::Embedded(s) => save_embedded(s, ns, paged, keys, block_ids),
            Self::Sidecar(c) => save_sidecar(&mut *Self::client(c)?, ns, paged, keys, block_ids),
        }
    }

    /// Loads the longest present prefix of `keys` into engine blocks `block_ids[i]`. Returns
    /// how many leading keys were loaded; a block of the wrong size ends the prefix. In sidecar
    /// mode the blocks are pinned by a lease of `ttl` while they are copied.
    pub fn load(
        &self,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        ttl: Duration,
    ) -> Result<usize, TransferError> {
        match self {
            Self::Embedded(s) => load_embedded(s, paged, keys, block_ids),
            Self::Sidecar(c) => load_sidecar(&mut *Self::client(c)?, paged, keys, block_ids, ttl),
        }
    }
}

/// [`Backend::save`] on an embedded store.
pub fn save_embedded(
    s: &Store,
    ns: NsId,
    paged: &PagedKv,
    keys: &[BlockKey],
    block_ids: &[Vec<usize>],
) -> Result<usize, TransferError> {
    check_pairs(keys, block_ids)?;
    let bb = paged.block_bytes();
    let mut stored = 0;
    for (k, ids) in keys.iter().zip(block_ids) {
        match s.reserve(ns, *k, ids.len() * bb)? {
            Reserve::Slot(mut r) => {
                paged.gather(ids, r.as_mut_slice())?;
                r.commit()?;
                stored += 1;
            }
            Reserve::AlreadyPresent | Reserve::InFlight => {}
        }
    }
    Ok(stored)
}

/// [`Backend::save`] through a `kvtierd` connection: gathered straight into the shared arena.
pub fn save_sidecar(
    c: &mut IpcClient,
    ns: NsId,
    paged: &PagedKv,
    keys: &[BlockKey],
    block_ids: &[Vec<usize>],
) -> Result<usize, TransferError> {
    check_pairs(keys, block_ids)?;
    let bb = paged.block_bytes();
    let lens = block_ids
        .iter()
        .map(|ids| {
            u32::try_from(ids.len() * bb)
                .map_err(|_| TransferError::Input(format!("a {}-byte block", ids.len() * bb)))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    // Reserve in chunks: the daemon bounds what one connection holds uncommitted.
    let mut stored = 0;
    let mut at = 0;
    while at < keys.len() {
        let mut end = at + 1;
        let mut bytes = u64::from(lens[at]);
        while end < keys.len() && bytes + u64::from(lens[end]) <= SAVE_CHUNK_BYTES {
            bytes += u64::from(lens[end]);
            end += 1;
        }
        let slots = c.reserve(ns, &keys[at..end], &lens[at..end])?;
        let mut tokens = Vec::with_capacity(slots.len());
        let mut failed = None;
        for (s, ids) in slots.iter().zip(&block_ids[at..end]) {
            if let SlotStatus::Slot { token, .. } = *s {
                tokens.push(token);
                if failed.is_none() {
                    if let Err(e) = c.fill_slot(token, |slot| paged.gather(ids, slot))? {
                        failed = Some(e);
                    }
                }
            }
        }
        if let Some(e) = failed {
            // Nothing half-written is ever committed.
            c.abort(&tokens)?;
            return Err(e.into());
        }
        stored += c.commit(&tokens)? as usize;
        at = end;
    }
    Ok(stored)
}

/// [`Backend::load`] from an embedded store (promotes from disk first).
pub fn load_embedded(
    s: &Store,
    paged: &PagedKv,
    keys: &[BlockKey],
    block_ids: &[Vec<usize>],
) -> Result<usize, TransferError> {
    check_pairs(keys, block_ids)?;
    let bb = paged.block_bytes();
    let resident = s.load_prefix(keys);
    let mut n = 0;
    while n < resident {
        let Some(b) = s.get(&keys[n]) else { break };
        if b.len() != block_ids[n].len() * bb {
            break;
        }
        paged.scatter(&block_ids[n], &b)?;
        n += 1;
    }
    Ok(n)
}

/// [`Backend::load`] through a `kvtierd` connection: scattered straight out of the shared
/// arena under a lease of `ttl`; if the lease lapsed before release, nothing counts as loaded
/// (what was copied may be another block's bytes, so the engine recomputes).
pub fn load_sidecar(
    c: &mut IpcClient,
    paged: &PagedKv,
    keys: &[BlockKey],
    block_ids: &[Vec<usize>],
    ttl: Duration,
) -> Result<usize, TransferError> {
    check_pairs(keys, block_ids)?;
    let bb = paged.block_bytes();
    let l = c.load(keys, ttl.max(Duration::from_millis(1)))?;
    let mut n = 0;
    let mut failed = None;
    for (i, &(_, len)) in l.blocks.iter().enumerate() {
        if len as usize != block_ids[i].len() * bb {
            break;
        }
        if let Err(e) = c.with_block(&l, i, |b| paged.scatter(&block_ids[i], b))? {
            failed = Some(e);
            break;
        }
        n += 1;
    }
    if let Some(id) = l.lease {
        if c.release(id).is_err() {
            return Ok(0);
        }
    }
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(n),
    }
}

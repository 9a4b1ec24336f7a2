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

use std::time::Duration;

use kvstore::{
    ArenaSlice, BlockKey, LeaseId, Namespace, NsId, Reservation, Reserve, Store, StoreError,
};
use kvtier_ipc::{IpcClient, IpcError, SlotStatus};

use crate::copies::Copies;
use crate::sidecar::Sidecar;

use crate::layout::{LayoutError, PagedKv};

#[cfg(feature = "cuda")]
mod cuda;
mod layer_save;
pub use layer_save::LayerSave;

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
    /// A GPU copy failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaCopyError),
}

/// An engine pin: see [`Backend::pin`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pinned {
    /// Blocks pinned, and their tiers.
    pub n: usize,
    /// See `n`.
    pub tiers: Vec<kvstore::Tier>,
    /// What ends it ([`Backend::unpin`]); `None`: nothing pinned.
    pub lease: Option<PinHandle>,
    /// Keys left out by a bound, and which (kvtierd's configuration keys, or "ttl").
    pub clipped: usize,
    /// See `clipped`.
    pub clipped_by: Vec<String>,
    /// Non-empty: nothing pinned, and why.
    pub refused: String,
    /// The TTL granted.
    pub ttl: Duration,
}

/// A pin's lease, and the daemon connection it lives on (0: embedded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinHandle {
    /// The connection (a pin dies with it).
    pub conn: u64,
    /// The lease.
    pub id: kvstore::LeaseId,
}

/// Where blocks go: one API, two modes; copies of large transfers split across a small pool of
/// copy threads.
pub struct Backend {
    /// The embedded arena's registration with a GPU copier (before `kind`: dropped before the
    /// store).
    #[cfg(feature = "cuda")]
    cuda_pin: std::sync::Mutex<Option<cuda::PinnedArena>>,
    kind: Kind,
    copies: Copies,
}

enum Kind {
    /// The store lives in this process.
    Embedded(Box<Store>),
    /// A node's `kvtierd`, through its engine socket (riding out daemon restarts: while it is
    /// unreachable every call is a miss).
    Sidecar(Box<Sidecar>),
}

/// Blocks reserved (embedded mode) per round of parallel fills.
const EMBEDDED_CHUNK: usize = 64;

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

/// What kvtierd's KV events say of each saved block: the engine's hash, its parent's and its
/// token ids (vLLM's `block_hashes`, `parent_block_hash`, `token_ids`); each list empty or one
/// per key (the parent of a sequence's first block: empty). Sent only to a daemon that
/// publishes events; the embedded store publishes none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tags {
    /// The engine's own hash of each block (at most 32 bytes).
    pub engine_hashes: Vec<Vec<u8>>,
    /// The engine hash of the block before each (empty: none).
    pub parents: Vec<Vec<u8>>,
    /// Each block's token ids.
    pub token_ids: Vec<Vec<u32>>,
}

impl Tags {
    /// Engine hashes only.
    pub fn hashes(engine_hashes: &[Vec<u8>]) -> Self {
        Self {
            engine_hashes: engine_hashes.to_vec(),
            ..Default::default()
        }
    }

    fn check(&self, keys: usize) -> Result<(), TransferError> {
        for (n, what) in [
            (self.engine_hashes.len(), "engine hashes"),
            (self.parents.len(), "parent hashes"),
            (self.token_ids.len(), "token id lists"),
        ] {
            if n != 0 && n != keys {
                return Err(TransferError::Input(format!("{keys} keys but {n} {what}")));
            }
        }
        Ok(())
    }

    /// The tags of keys `from..`.
    pub(super) fn tail(&self, from: usize) -> Self {
        let t = |v: &[Vec<u8>]| v.get(from..).map_or_else(Vec::new, <[_]>::to_vec);
        Self {
            engine_hashes: t(&self.engine_hashes),
            parents: t(&self.parents),
            token_ids: self
                .token_ids
                .get(from..)
                .map_or_else(Vec::new, <[_]>::to_vec),
        }
    }
}

/// Checks a save's arguments (every engine block id before anything is reserved); returns
/// each key's block length.
fn save_lens(
    paged: &PagedKv,
    keys: &[BlockKey],
    block_ids: &[Vec<usize>],
    tags: &Tags,
) -> Result<Vec<usize>, TransferError> {
    check_pairs(keys, block_ids)?;
    tags.check(keys.len())?;
    for ids in block_ids {
        paged.check_ids(ids)?;
    }
    let bb = paged.block_bytes();
    Ok(block_ids.iter().map(|ids| ids.len() * bb).collect())
}

/// Block lengths as the engine protocol carries them.
fn lens_u32(lens: &[usize]) -> Result<Vec<u32>, TransferError> {
    lens.iter()
        .map(|&l| u32::try_from(l).map_err(|_| TransferError::Input(format!("a {l}-byte block"))))
        .collect()
}

/// Reserves the embedded store's slots for keys `range`: each key's outcome into `out`; the
/// slots taken, with their key index.
fn reserve_embedded(
    s: &Store,
    ns: NsId,
    keys: &[BlockKey],
    lens: &[usize],
    range: std::ops::Range<usize>,
    out: &mut [Stored],
) -> Result<Vec<(usize, Reservation)>, TransferError> {
    let mut slots = Vec::new();
    for i in range {
        out[i] = match s.reserve(ns, keys[i], lens[i]) {
            Ok(Reserve::Slot(r)) => {
                slots.push((i, r));
                Stored::Now
            }
            Ok(Reserve::AlreadyPresent | Reserve::InFlight) => Stored::Already,
            Err(StoreError::NoSpace { .. }) => Stored::NoRoom,
            Err(e) => return Err(e.into()),
        };
    }
    Ok(slots)
}

/// The end of the sidecar reservation round that starts at key `at`: as many keys as one
/// request carries and the connection may hold reserved (at least one: a block larger than
/// the limit goes alone, and is refused by the daemon as a clear error).
fn round_end(c: &IpcClient, at: usize, lens32: &[u32]) -> usize {
    let limit = c.max_reserve_bytes().max(1);
    let mut end = at + 1;
    let mut bytes = u64::from(lens32[at]);
    while end < lens32.len() && end - at < c.max_keys() && bytes + u64::from(lens32[end]) <= limit {
        bytes += u64::from(lens32[end]);
        end += 1;
    }
    end
}

/// Records the daemon's answer to a reservation of keys `at..`: each key's outcome into `out`;
/// the slots granted, as `(key index, token)`.
fn granted(slots: &[SlotStatus], at: usize, out: &mut [Stored]) -> Vec<(usize, u64)> {
    let mut tokens = Vec::with_capacity(slots.len());
    for (j, s) in slots.iter().enumerate() {
        let i = at + j;
        out[i] = match *s {
            SlotStatus::Slot { token, .. } => {
                tokens.push((i, token));
                Stored::Now
            }
            SlotStatus::Present | SlotStatus::InFlight => Stored::Already,
            SlotStatus::NoSpace => Stored::NoRoom,
        };
    }
    tokens
}

/// How one block gets its bytes into a slot: returns the xxh3-64 of what it wrote. Called for
/// several blocks at once from the copy threads.
type Fill<'a> = dyn Fn(usize, &mut [u8]) -> Result<u64, TransferError> + Sync + 'a;

/// What a parallel load does with block `i` (its bytes and commit checksum), given its own
/// item (e.g. its destination segments): false refuses it (ends the prefix).
type EachPar<'a, T> =
    dyn Fn(usize, &mut T, ArenaSlice<'_>, u64) -> Result<bool, TransferError> + Sync + 'a;

/// What a layer-by-layer load does with layer `l` of the pinned, verified prefix of blocks
/// (each with its commit checksum).
type EachLayer<'a> = dyn FnMut(usize, &[(ArenaSlice<'_>, u64)]) -> Result<(), TransferError> + 'a;

/// What a load does with block `i` (its bytes in the arena, and its commit checksum) while it
/// is pinned: false refuses it (ends the prefix). The bytes are shared memory other engines
/// may write: copy them out (`ArenaSlice::copy_to_hashed`) and check what was copied.
pub type Each<'a> = dyn FnMut(usize, ArenaSlice<'_>, u64) -> Result<bool, TransferError> + 'a;

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
/// and the bytes copied match `sum`: each piece is hashed from the destination (private)
/// right after it was written there (in cache), so bytes another process writes into the
/// shared `block` meanwhile cannot pass.
fn fill_segments(block: ArenaSlice<'_>, segs: &mut [&mut [u8]], sum: u64) -> bool {
    if segs.iter().map(|s| s.len()).sum::<usize>() != block.len() {
        return false;
    }
    const CHUNK: usize = kvstore::checksum::CHUNK;
    let mut at = 0;
    // (Pages' segments may be short runs: hashed where they lie, no buffering copy.)
    let mut h = kvstore::RunChecksummer::new();
    for s in segs.iter_mut() {
        for d in s.chunks_mut(CHUNK) {
            block.copy_to(at, d);
            at += d.len();
            h.update(d);
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

/// Whether, and when, a layer-by-layer load verifies each block's checksum in the shared slot
/// it copies from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotCheck {
    /// Not here: the caller verifies its own copy (the CPU path hashes the engine's memory).
    Off,
    /// Every block verified before any layer is queued: nothing of a failed block is copied,
    /// and the copies wait for the hashing.
    First,
    /// Every layer queued first, the slots hashed while the copies run (the copy engine and
    /// the cores work at once); a block that failed is copied but not counted as loaded, so
    /// the engine treats it as failed, as when the CPU path's check fails after its copy.
    Beside,
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

/// Whether no engine block id appears twice (then blocks can be scattered in parallel).
fn distinct(block_ids: &[Vec<usize>]) -> bool {
    let mut all: Vec<usize> = block_ids.iter().flatten().copied().collect();
    all.sort_unstable();
    all.windows(2).all(|w| w[0] != w[1])
}

impl Backend {
    fn new(kind: Kind) -> Self {
        Self {
            #[cfg(feature = "cuda")]
            cuda_pin: std::sync::Mutex::new(None),
            kind,
            copies: Copies::default(),
        }
    }

    /// A store in this process.
    pub fn embedded(store: Store) -> Self {
        Self::new(Kind::Embedded(Box::new(store)))
    }

    /// Connects to a `kvtierd` engine socket, now: an error if the daemon is not there.
    pub fn sidecar(socket: &std::path::Path, client: &str) -> Result<Self, TransferError> {
        Ok(Self::new(Kind::Sidecar(Box::new(Sidecar::connect_now(
            socket, client, "",
        )?))))
    }

    /// A handle to a `kvtierd` engine socket that rides out daemon restarts (and a daemon not
    /// started yet), presenting a tenant secret (`""`: none; see `server.isolation`).
    pub fn sidecar_as(socket: &std::path::Path, client: &str, tenant_secret: &str) -> Self {
        Self::new(Kind::Sidecar(Box::new(Sidecar::new(
            socket,
            client,
            tenant_secret,
        ))))
    }

    /// Copies with `threads` threads (0: [`Copies::default_threads`], the cores available to
    /// this process less one in 8, at most 16; 1: on the calling thread). Small transfers stay
    /// on the calling thread whatever this says.
    pub fn set_copy_threads(&mut self, threads: usize) {
        if threads != self.copies.threads() {
            self.copies = Copies::new(threads);
        }
    }

    /// How many threads copies may use.
    pub fn copy_threads(&self) -> usize {
        self.copies.threads()
    }

    /// Registers a namespace; returns its id (the store's, or this handle's in sidecar mode,
    /// stable across daemon restarts).
    pub fn register_namespace(&self, ns: &Namespace) -> Result<NsId, TransferError> {
        self.register_namespace_in(ns, None)
    }

    /// [`Backend::register_namespace`] for a namespace that keys the blocks of the engine's
    /// KV-cache group `group`: kvtierd publishes it with the namespace's KV events (an
    /// embedded store publishes none: it is not told).
    pub fn register_namespace_in(
        &self,
        ns: &Namespace,
        group: Option<kvtier_ipc::KvGroup>,
    ) -> Result<NsId, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => Ok(s.register_namespace(ns)?),
            Kind::Sidecar(c) => c.register_namespace_in(ns, group),
        }
    }

    /// How many leading keys are present in any tier (see [`Backend::lookup`]).
    pub fn match_prefix(&self, keys: &[BlockKey]) -> Result<usize, TransferError> {
        Ok(self.lookup(keys)?.n)
    }

    /// How many leading keys are present, and the tier of each: an engine's lookup for a
    /// request it is about to run. Nothing is pinned or counted; the store learns that the
    /// blocks after a present prefix continue it (seen once, for seen-twice admission; see
    /// `kvstore::Store::match_prefix_priced`), the same embedded or through kvtierd.
    pub fn lookup(&self, keys: &[BlockKey]) -> Result<kvstore::PrefixMatch, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => Ok(s.match_prefix_priced(keys, 0, 0.0).0),
            Kind::Sidecar(c) => Ok(c.call(|c, _| c.lookup(keys, None))?.map_or(
                kvstore::PrefixMatch {
                    n: 0,
                    tiers: Vec::new(),
                    pending: 0,
                },
                |l| kvstore::PrefixMatch {
                    n: l.n,
                    tiers: l.tiers,
                    pending: l.pending,
                },
            )),
        }
    }

    /// [`Backend::lookup`] with break-even admission (see
    /// `kvstore::Store::match_prefix_priced`): the prefix worth loading at the engine's
    /// prefill rate, and the prefix present before that cut.
    pub fn lookup_priced(
        &self,
        keys: &[BlockKey],
        tokens_per_block: u32,
        prefill_tokens_per_s: f64,
    ) -> Result<(kvstore::PrefixMatch, usize), TransferError> {
        match &self.kind {
            Kind::Embedded(s) => {
                Ok(s.match_prefix_priced(keys, tokens_per_block, prefill_tokens_per_s))
            }
            Kind::Sidecar(c) => Ok(c
                .call(|c, _| c.lookup_priced(keys, tokens_per_block, prefill_tokens_per_s))?
                .map_or(
                    (
                        kvstore::PrefixMatch {
                            n: 0,
                            tiers: Vec::new(),
                            pending: 0,
                        },
                        0,
                    ),
                    |l| {
                        (
                            kvstore::PrefixMatch {
                                n: l.n,
                                tiers: l.tiers,
                                pending: l.pending,
                            },
                            l.present,
                        )
                    },
                )),
        }
    }

    /// Hints that `keys` (a prefix) will be loaded soon: blocks found only in a lower tier are
    /// promoted into host memory in the background (see `kvstore::Store::prefetch`); `tag`
    /// names the hint for [`Backend::cancel_prefetch`]. A daemon that is away: nothing done.
    pub fn prefetch(
        &self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Duration,
        tag: u64,
    ) -> Result<kvstore::Prefetch, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => {
                Ok(s.prefetch(keys, priority, std::time::Instant::now() + deadline, tag))
            }
            Kind::Sidecar(c) => Ok(c
                .call(|c, _| c.prefetch(keys, priority, deadline, tag))?
                .map(|r| kvstore::Prefetch {
                    present: r.present as usize,
                    in_host: r.in_host as usize,
                    joined: r.joined as usize,
                    queued: r.queued as usize,
                    dropped: r.dropped as usize,
                    held: r.held as usize,
                    waiting: r.waiting as usize,
                })
                .unwrap_or_default()),
        }
    }

    /// Retains the present prefix of `keys` for `session` (`None`: anonymous) until `ttl`
    /// (zero: the longest allowed), out of eviction's reach: see [`kvstore::Store::retain`].
    /// Through kvtierd, a daemon that is down answers nothing retained, refused with the reason.
    pub fn retain(
        &self,
        keys: &[BlockKey],
        session: Option<&str>,
        ttl: Duration,
        priority: u8,
    ) -> Result<kvstore::Retained, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => {
                let ttl = if ttl.is_zero() { Duration::MAX } else { ttl };
                Ok(s.retain(session, keys, ttl, priority))
            }
            Kind::Sidecar(c) => Ok(c
                .call(|c, _| c.retain(keys, session.unwrap_or(""), ttl, priority))?
                .map(|r| kvstore::Retained {
                    present: r.present as usize,
                    retained: r.retained as usize,
                    clipped: r.clipped as usize,
                    clipped_by: r
                        .clipped_by
                        .iter()
                        .filter_map(|k| kvstore::RetainBound::from_key(k))
                        .collect(),
                    refused: r.refused,
                    ttl: Duration::from_millis(r.ttl_ms),
                    bytes: r.retained_bytes,
                    displaced: r.displaced as usize,
                })
                .unwrap_or_else(|| kvstore::Retained {
                    refused: "kvtierd is not reachable".into(),
                    ..Default::default()
                })),
        }
    }

    /// Ends the retention of `session` (if given) and of `keys`, and moves their host blocks
    /// to disk now: see [`kvstore::Store::demote`]. Through kvtierd, a daemon that is down
    /// answers nothing done.
    pub fn demote(
        &self,
        keys: &[BlockKey],
        session: Option<&str>,
    ) -> Result<kvstore::Demoted, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => Ok(s.demote(session, keys)),
            Kind::Sidecar(c) => Ok(c
                .call(|c, _| c.demote(keys, session.unwrap_or("")))?
                .map(|r| kvstore::Demoted {
                    released: r.released as usize,
                    freed: r.freed as usize,
                    queued: r.queued as usize,
                    busy: r.busy as usize,
                    not_in_host: r.not_in_host as usize,
                    kept: r.kept as usize,
                })
                .unwrap_or_default()),
        }
    }

    /// Pins the leading present keys (any tier, not loaded) for `ttl` (at most an hour): the
    /// engine's Pin hint, bounded per connection through kvtierd as its leases are. Ended by
    /// [`Backend::unpin`], the TTL, or (through kvtierd) the connection's end.
    pub fn pin(&self, keys: &[BlockKey], ttl: Duration) -> Result<Pinned, TransferError> {
        const MAX: Duration = Duration::from_secs(3600);
        match &self.kind {
            Kind::Embedded(s) => {
                let mut out = Pinned {
                    ttl: ttl.min(MAX),
                    ..Default::default()
                };
                if ttl > MAX {
                    out.clipped_by.push("ttl".into());
                }
                let l = s.lease(keys, out.ttl)?;
                out.n = l.n;
                out.tiers = l.tiers;
                out.lease = l.id.map(|id| PinHandle { conn: 0, id });
                Ok(out)
            }
            Kind::Sidecar(c) => Ok(c
                .call(|c, map| {
                    let conn = map.connection();
                    c.pin(keys, ttl).map(|r| Pinned {
                        n: r.n as usize,
                        tiers: r.tiers.iter().map(|t| kvtier_ipc::tier(*t)).collect(),
                        lease: (r.lease_id != 0).then_some(PinHandle {
                            conn,
                            id: kvstore::LeaseId(r.lease_id),
                        }),
                        clipped: r.clipped as usize,
                        clipped_by: r.clipped_by,
                        refused: r.refused,
                        ttl: Duration::from_millis(r.ttl_ms),
                    })
                })?
                .unwrap_or_else(|| Pinned {
                    refused: "kvtierd is not reachable".into(),
                    ..Default::default()
                })),
        }
    }

    /// Ends a pin; false if it had ended already (its TTL, or the daemon connection it was
    /// made on is gone).
    pub fn unpin(&self, h: PinHandle) -> Result<bool, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => Ok(s.release(h.id)),
            Kind::Sidecar(c) => Ok(c
                .call_on(h.conn, |c, _| match c.release(h.id) {
                    Ok(()) => Ok(true),
                    Err(kvtier_ipc::IpcError::Remote(_)) => Ok(false),
                    Err(e) => Err(e),
                })?
                .unwrap_or(false)),
        }
    }

    /// Drops the queued preloads of hint `tag`; returns how many blocks they held.
    pub fn cancel_prefetch(&self, tag: u64) -> Result<usize, TransferError> {
        match &self.kind {
            Kind::Embedded(s) => Ok(s.cancel_prefetch(tag)),
            Kind::Sidecar(c) => Ok(c.call(|c, _| c.cancel_prefetch(tag))?.unwrap_or(0)),
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
        self.save_tagged(ns, paged, keys, block_ids, &[])
    }

    /// [`Backend::save`], with the engine's own hash of each block (`engine_hashes` empty, or
    /// one per key, at most 32 bytes each): kvtierd publishes the blocks' KV events under them
    /// (the embedded store publishes none).
    pub fn save_tagged(
        &self,
        ns: NsId,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        engine_hashes: &[Vec<u8>],
    ) -> Result<usize, TransferError> {
        self.save_described(ns, paged, keys, block_ids, &Tags::hashes(engine_hashes))
    }

    /// [`Backend::save_tagged`], with each block's parent hash and token ids too (see
    /// [`Tags`]): kvtierd's BlockStored events carry them as vLLM's do.
    pub fn save_described(
        &self,
        ns: NsId,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        tags: &Tags,
    ) -> Result<usize, TransferError> {
        let lens = save_lens(paged, keys, block_ids, tags)?;
        let fill = |i: usize, slot: &mut [u8]| -> Result<u64, TransferError> {
            Ok(paged.gather_hashed(&block_ids[i], slot)?)
        };
        Ok(self
            .store_blocks(ns, keys, &lens, &fill, tags)?
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
        // Blocks are scattered in parallel only into distinct engine blocks.
        let one = Copies::new(1);
        let copies = if distinct(block_ids) {
            &self.copies
        } else {
            &one
        };
        let mut items = vec![(); keys.len()];
        self.read_par(keys, ttl, copies, &mut items, &|i, _, block, sum| {
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
        self.store_blocks(ns, keys, &lens, &fill, &Tags::default())
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
        let n = self.read_par(keys, ttl, &self.copies, pages, &|_, page, block, sum| {
            Ok(fill_segments(block, page, sum))
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
        tags: &Tags,
    ) -> Result<Vec<Stored>, TransferError> {
        let mut out = vec![Stored::NoRoom; keys.len()];
        match &self.kind {
            Kind::Embedded(s) => {
                let mut at = 0;
                while at < keys.len() {
                    let end = (at + EMBEDDED_CHUNK).min(keys.len());
                    // Reserve a round of slots, fill them in parallel, commit them.
                    let mut slots = reserve_embedded(s, ns, keys, lens, at..end, &mut out)?;
                    let sizes: Vec<usize> = slots.iter().map(|(i, _)| lens[*i]).collect();
                    let sums = self
                        .copies
                        .map_mut(&mut slots, &sizes, |_, (i, r)| fill(*i, r.as_mut_slice()));
                    // A fill that failed: the round's reservations are dropped (aborted).
                    let sums = sums.into_iter().collect::<Result<Vec<u64>, _>>()?;
                    for ((i, r), sum) in slots.into_iter().zip(sums) {
                        if !r.commit_with_checksum(sum)? {
                            out[i] = Stored::Already;
                        }
                    }
                    at = end;
                }
            }
            Kind::Sidecar(side) => {
                let lens32 = lens_u32(lens)?;
                // None: the daemon is unreachable; nothing was stored (a miss, not an error).
                let saved = side.call(|c, map| {
                    let ns = map.get(c, ns)?;
                    // Connection errors go to `call` (a lost daemon is a miss); the save's own
                    // errors come back to the caller.
                    let tagged = Tagged { keys, tags };
                    match save_chunks(c, ns, tagged, &lens32, fill, &self.copies, &mut out) {
                        Err(TransferError::Ipc(e)) => Err(e),
                        r => Ok(r),
                    }
                })?;
                match saved {
                    Some(r) => r?,
                    None => out.iter_mut().for_each(|o| *o = Stored::NoRoom),
                }
            }
        }
        Ok(out)
    }

    /// [`Backend::read_with`] with the blocks handed to `each` from the copy threads, block `i`
    /// with `items[i]`: every pinned block is handed over (in parallel), and the count is the
    /// leading blocks accepted. `each` for a block after a refused one may have copied bytes
    /// (they are reported as not loaded; the caller recomputes over them).
    fn read_par<T: Send>(
        &self,
        keys: &[BlockKey],
        ttl: Duration,
        copies: &Copies,
        items: &mut [T],
        each: &EachPar<'_, T>,
    ) -> Result<usize, TransferError> {
        // Leading accepted blocks; an error before the first refusal is the call's error.
        fn prefix(results: Vec<Result<bool, TransferError>>) -> Result<usize, TransferError> {
            let mut n = 0;
            for r in results {
                if !r? {
                    break;
                }
                n += 1;
            }
            Ok(n)
        }
        let m = keys.len().min(items.len());
        match &self.kind {
            Kind::Embedded(s) => {
                let l = s.load(&keys[..m])?;
                let m = l.len().min(m);
                let sizes: Vec<usize> = (0..m).map(|i| l.block(i).len()).collect();
                prefix(copies.map_mut(&mut items[..m], &sizes, |i, t| {
                    each(i, t, l.block(i).into(), l.checksum(i))
                }))
            }
            Kind::Sidecar(side) => {
                let got = side.call(|c, _| {
                    let l = c.load(&keys[..m], ttl.max(Duration::from_millis(1)), None)?;
                    let guard = LeaseGuard { id: l.lease, c };
                    // Never past what was asked for, whatever the daemon answered.
                    let k = l.blocks.len().min(m);
                    let sums: Vec<u64> = l.blocks[..k].iter().map(|b| b.checksum).collect();
                    let results = guard.c.with_blocks(&l, |blocks| {
                        let sizes: Vec<usize> = blocks[..k].iter().map(|b| b.len()).collect();
                        copies.map_mut(&mut items[..k], &sizes, |i, t| {
                            each(i, t, blocks[i], sums[i])
                        })
                    })?;
                    let kept = guard.release();
                    Ok((kept, results))
                })?;
                match got {
                    None => Ok(0),
                    Some((kept, results)) => {
                        let n = prefix(results)?;
                        Ok(if kept { n } else { 0 })
                    }
                }
            }
        }
    }

    /// Loads the longest present prefix of `keys` into engine blocks `block_ids[i]` layer by
    /// layer: every block is pinned and its size checked first (a wrong-sized block ends the
    /// prefix before any byte reaches the engine), then layer 0 of every block is copied,
    /// `on_layer(0, n)` called, layer 1, and so on, so the engine may run a layer as soon as
    /// its KV is in. Once every layer is in, each block's checksum is computed from the
    /// engine's own copy (private memory, which no other process writes) and compared with its
    /// commit checksum: the first mismatch ends the loaded prefix there. Returns how many
    /// leading keys were loaded and verified: fewer than `on_layer` reported when a block
    /// failed (bytes written into its slot after its commit), 0 when a sidecar lease lapsed
    /// before release; the engine treats the blocks past it as failed (vLLM's load-failure
    /// policy recomputes them or fails the request), so bytes that do not match their commit
    /// are never kept. (Verifying the shared slot before the copy left a window: a stalled
    /// writer could change the bytes between the check and a layer's copy.)
    pub fn load_layerwise(
        &self,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        ttl: Duration,
        on_layer: &mut dyn FnMut(usize, usize),
    ) -> Result<usize, TransferError> {
        let mut sums: Vec<u64> = Vec::new();
        let copied = self.load_layers_with(
            paged,
            keys,
            block_ids,
            ttl,
            SlotCheck::Off,
            &mut |layer, blocks| {
                if layer == 0 {
                    sums = blocks.iter().map(|(_, sum)| *sum).collect();
                }
                for (i, (b, _)) in blocks.iter().enumerate() {
                    paged.scatter_layer(&block_ids[i], *b, layer)?;
                }
                on_layer(layer, blocks.len());
                Ok(())
            },
            &mut || Ok(()),
        )?;
        // The engine's copy of each block, hashed on the copy threads (a long prefix hashed
        // on one core would dwarf the copies).
        let m = copied.min(sums.len());
        let sizes: Vec<usize> = block_ids[..m]
            .iter()
            .map(|ids| ids.len() * paged.block_bytes())
            .collect();
        let ok = self.copies.map(&sizes, |i| {
            paged
                .checksum_of(&block_ids[i])
                .is_ok_and(|got| verified(got, sums[i]))
        });
        Ok(ok.iter().take_while(|o| **o).count())
    }

    /// The frame of a layer-by-layer load: pins the blocks, keeps the prefix of the right
    /// size, calls `layer(l, prefix)` for every layer in order, then `done()` while the blocks
    /// are still pinned (e.g. to wait for queued copies), and releases them. `check` says
    /// whether and when each shared slot's checksum is verified here ([`SlotCheck`]); the
    /// count returned ends at the first block that failed it. A daemon that is away:
    /// `layer(l, [])` for every layer, 0 loaded.
    #[allow(clippy::too_many_arguments)]
    fn load_layers_with(
        &self,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        ttl: Duration,
        check: SlotCheck,
        layer: &mut EachLayer<'_>,
        done: &mut dyn FnMut() -> Result<(), TransferError>,
    ) -> Result<usize, TransferError> {
        check_pairs(keys, block_ids)?;
        for ids in block_ids {
            paged.check_ids(ids)?;
        }
        let bb = paged.block_bytes();
        let copies = &self.copies;
        let mut layers = |blocks: &[(ArenaSlice<'_>, u64)]| -> Result<usize, TransferError> {
            let m = blocks.len().min(keys.len());
            let sized = (0..m)
                .take_while(|&i| blocks[i].0.len() == block_ids[i].len() * bb)
                .count();
            // Each slot's checksum, on the copy threads (hashing a long prefix on one core
            // would dwarf the copies): the length of the prefix that passed.
            let verify = |n: usize| -> usize {
                let sizes: Vec<usize> = blocks[..n].iter().map(|(b, _)| b.len()).collect();
                let ok = copies.map(&sizes, |i| verified(blocks[i].0.checksum(), blocks[i].1));
                ok.iter().take_while(|o| **o).count()
            };
            let (n, r) = match check {
                SlotCheck::Off => (sized, Ok(())),
                SlotCheck::First => (verify(sized), Ok(())),
                SlotCheck::Beside => {
                    // Every layer queued first; the slots are hashed while the copies run.
                    let r = (0..paged.layers()).try_for_each(|l| layer(l, &blocks[..sized]));
                    (if r.is_ok() { verify(sized) } else { 0 }, r)
                }
            };
            let r = r.and_then(|()| match check {
                SlotCheck::Beside => Ok(()),
                SlotCheck::Off | SlotCheck::First => {
                    (0..paged.layers()).try_for_each(|l| layer(l, &blocks[..n]))
                }
            });
            // Whatever happened, what was queued finishes before the blocks are released.
            let d = done();
            r?;
            d?;
            Ok(n)
        };
        match &self.kind {
            Kind::Embedded(s) => {
                let l = s.load(keys)?;
                let m = l.len().min(keys.len());
                let blocks: Vec<(ArenaSlice<'_>, u64)> =
                    (0..m).map(|i| (l.block(i).into(), l.checksum(i))).collect();
                layers(&blocks)
            }
            Kind::Sidecar(side) => {
                let got = side.call(|c, _| {
                    let l = c.load(keys, ttl.max(Duration::from_millis(1)), None)?;
                    let guard = LeaseGuard { id: l.lease, c };
                    let k = l.blocks.len().min(keys.len());
                    let sums: Vec<u64> = l.blocks[..k].iter().map(|b| b.checksum).collect();
                    let r = guard.c.with_blocks(&l, |blocks| {
                        let pinned: Vec<(ArenaSlice<'_>, u64)> = blocks[..k]
                            .iter()
                            .copied()
                            .zip(sums.iter().copied())
                            .collect();
                        layers(&pinned)
                    })?;
                    let kept = guard.release();
                    Ok((kept, r))
                })?;
                match got {
                    // The daemon is unreachable: nothing loaded; the engine computes.
                    None => {
                        for l in 0..paged.layers() {
                            layer(l, &[])?;
                        }
                        Ok(0)
                    }
                    Some((kept, r)) => {
                        let n = r?;
                        Ok(if kept { n } else { 0 })
                    }
                }
            }
        }
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
        match &self.kind {
            Kind::Embedded(s) => {
                let l = s.load(keys)?;
                let mut n = 0;
                while n < l.len().min(keys.len()) {
                    if !each(n, l.block(n).into(), l.checksum(n))? {
                        break;
                    }
                    n += 1;
                }
                Ok(n)
            }
            Kind::Sidecar(side) => {
                let got = side.call(|c, _| {
                    let l = c.load(keys, ttl.max(Duration::from_millis(1)), None)?;
                    let guard = LeaseGuard { id: l.lease, c };
                    let mut n = 0;
                    let mut failed = None;
                    // Never past what was asked for, whatever the daemon answered.
                    while n < l.blocks.len().min(keys.len()) {
                        let sum = l.blocks[n].checksum;
                        match guard.c.with_block(&l, n, |b| each(n, b, sum))? {
                            Ok(true) => n += 1,
                            Ok(false) => break,
                            Err(e) => {
                                failed = Some(e);
                                break;
                            }
                        }
                    }
                    let kept = guard.release();
                    Ok((if kept { n } else { 0 }, failed))
                })?;
                match got {
                    None => Ok(0),
                    Some((_, Some(e))) => Err(e),
                    Some((n, None)) => Ok(n),
                }
            }
        }
    }

    /// The embedded store, if this is one.
    pub fn store(&self) -> Option<&Store> {
        match &self.kind {
            Kind::Embedded(s) => Some(s),
            Kind::Sidecar(_) => None,
        }
    }

    /// Runs `f` on the sidecar connection, if this is one and the daemon is reachable.
    pub fn with_client<R>(
        &self,
        f: impl FnOnce(&mut IpcClient) -> Result<R, IpcError>,
    ) -> Result<Option<R>, TransferError> {
        match &self.kind {
            Kind::Embedded(_) => Ok(None),
            Kind::Sidecar(c) => c.call(|c, _| f(c)),
        }
    }

    /// Counters of the sidecar connection (outages, calls missed, reconnections).
    pub fn sidecar_stats(&self) -> Option<crate::sidecar::SidecarStats> {
        match &self.kind {
            Kind::Embedded(_) => None,
            Kind::Sidecar(c) => Some(c.stats()),
        }
    }
}

/// Keys to save, with what the KV events say of them.
#[derive(Clone, Copy)]
struct Tagged<'a> {
    keys: &'a [BlockKey],
    tags: &'a Tags,
}

/// A save through a live connection, in reservations of at most the daemon's per-connection
/// limit; fills `out`. The outer error is the connection's (it is gone); the inner one the
/// save's own (a fill that failed: its chunk was aborted, nothing half-written committed).
fn save_chunks(
    c: &mut IpcClient,
    ns: NsId,
    Tagged { keys, tags }: Tagged<'_>,
    lens32: &[u32],
    fill: &Fill<'_>,
    copies: &Copies,
    out: &mut [Stored],
) -> Result<(), TransferError> {
    let mut at = 0;
    while at < keys.len() {
        // Reserve in rounds: the daemon bounds what one connection holds uncommitted.
        let end = round_end(c, at, lens32);
        let slots = c.reserve(ns, &keys[at..end], &lens32[at..end])?;
        let tokens = granted(&slots, at, out);
        let toks: Vec<u64> = tokens.iter().map(|(_, t)| *t).collect();
        // Every slot of the round filled at once, in parallel when large enough.
        let failed = c.fill_slots_hashed(&toks, |slots| {
            let sizes: Vec<usize> = slots.iter().map(|s| s.len()).collect();
            let results = copies.map_mut(slots, &sizes, |j, slot| fill(tokens[j].0, slot));
            let mut failed = None;
            let sums = results
                .into_iter()
                .map(|r| match r {
                    Ok(sum) => Some(sum),
                    Err(e) => {
                        failed.get_or_insert(e);
                        None
                    }
                })
                .collect();
            (failed, sums)
        })?;
        if let Some(e) = failed {
            // Nothing half-written is ever committed.
            c.abort(&toks)?;
            for (i, _) in &tokens {
                out[*i] = Stored::NoRoom;
            }
            return Err(e);
        }
        commit_tokens(c, &tokens, tags, out)?;
        at = end;
    }
    Ok(())
}

/// Commits filled slots (`(key index, token)`), tagged with the keys' engine hashes if any;
/// marks in `out` the ones whose reservation expired (not stored) or was cancelled by a
/// removal (`Already`).
fn commit_tokens(
    c: &mut IpcClient,
    tokens: &[(usize, u64)],
    tags: &Tags,
    out: &mut [Stored],
) -> Result<(), IpcError> {
    let toks: Vec<u64> = tokens.iter().map(|(_, t)| *t).collect();
    let r = if tags.engine_hashes.is_empty() {
        c.commit(&toks)?
    } else {
        // The parents and token ids go only to a daemon that publishes events.
        let pick = |v: &[Vec<u8>]| -> Vec<Vec<u8>> {
            if v.is_empty() || !c.events() {
                return Vec::new();
            }
            tokens.iter().map(|(i, _)| v[*i].clone()).collect()
        };
        let hashes: Vec<Vec<u8>> = tokens
            .iter()
            .map(|(i, _)| tags.engine_hashes[*i].clone())
            .collect();
        let parents = pick(&tags.parents);
        let ids: Vec<Vec<u32>> = if tags.token_ids.is_empty() || !c.events() {
            Vec::new()
        } else {
            tokens
                .iter()
                .map(|(i, _)| tags.token_ids[*i].clone())
                .collect()
        };
        c.commit_described(&toks, &hashes, &parents, &ids)?
    };
    for (i, t) in tokens {
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
    Ok(())
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

#[cfg(test)]
mod slot_check_tests;

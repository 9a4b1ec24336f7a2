//! KV events for cache-aware routers, published as vLLM's `ZmqEventPublisher` publishes them
//! (`vllm/distributed/kv_events.py`), so that vLLM's own subscribers, llm-d's indexer, Dynamo's
//! router or Ray Serve read kvtierd's events unchanged:
//!
//! - a PUB socket sends `[topic, sequence (8 bytes, big-endian), payload]`;
//! - the payload is a msgpack `KVEventBatch`: `[ts, [events], data_parallel_rank]`, each event
//!   a tagged map (`{"type": "BlockStored", "block_hashes": [...], ...}`, current vLLM) or a
//!   tagged array (`["BlockStored", [...], ...]`, `events.encoding = "array"`, older ones);
//! - a ROUTER socket answers a replay request (`[start sequence]` from a REQ socket) with every
//!   buffered batch from that sequence on, `[topic, sequence, payload]` each, then
//!   `[b"", -1, b""]`.
//!
//! The first batch of a run (sequence 0) is `AllBlocksCleared`: a subscriber that knew this
//! node from an earlier run of the daemon forgets it (host memory starts empty). The blocks the
//! disk tier kept are announced again (`BlockStored`, `STORAGE`) when the first engine since
//! the start registers their namespace (its tokens per block and KV-cache group are known
//! then), under the engine hashes they were stored with: the disk tier's journal keeps each
//! block's engine hash and parent's (not its token ids) while events are on. Later events come
//! from the store's event channel: `BlockStored` / `BlockRemoved` with `medium`
//! `CPU` (host tier) or `STORAGE` (disk tier) and `locality` `LOCAL`, and `BlockStored` with
//! `medium` `CPU` and `locality` `REMOTE` once a block's push to the remote tier (its owner
//! node, or Redis) was acknowledged: this node can load it from there too (vLLM 0.32's form for
//! a copy in another instance's tier; `events.remote_medium = true` sends kvtier's earlier
//! `medium` `REMOTE` instead, for consumers built on it). Every event (map encoding) carries
//! `ownership` `kvtier`, as vLLM's secondary offloading tiers name themselves (its KVCR tier:
//! "kvcr"); the array encoding keeps older vLLM's eight fields. No `BlockRemoved` follows for a
//! remote copy: the copy is the owner's,
//! which publishes it, and its removal, as its own `CPU`/`STORAGE` (a Redis copy's TTL expiry
//! is seen by no one); a router that finds it gone counts a miss, never wrong bytes. A block
//! committed with the engine's own hash (the vLLM connector sends vLLM's block hashes with its
//! commits) is published under that hash, as vLLM's publisher would; the daemon keeps it in
//! [`EngineHashes`] (outside the store's per-block metadata, only while events are on) until
//! the block has left every local tier. A block
//! without one (raw IPC keys, SGLang, blocks a disk tier kept from a run without events) is
//! published under its 16-byte kvtier key. With `events.int_hashes` a hash goes as vLLM's integer form (its
//! low 64 bits, big-endian). A block whose commit also carried its parent's hash and its token
//! ids (the vLLM connector sends them when the daemon says, in Hello, that it publishes events)
//! is published with them, as vLLM's `parent_block_hash` and `token_ids`: a run of such blocks
//! is a chain (each block's parent the one before it), its parent the first block's and its
//! token ids all of theirs. They are kept beside the engine hash, only while events are on, at
//! about 70 bytes plus 4 per token a block (an Arc'd token list and the parent's hash: 134 bytes
//! at 16 tokens a block, 198 at 32) until the block leaves its last local tier; otherwise
//! `parent_block_hash` is nil and `token_ids` empty. `block_size` is
//! the tokens per block of the block's namespace as its engine registered it (0 if none has
//! since the daemon started), and `group_idx` (`BlockStored` also `kv_cache_spec_kind` and
//! `kv_cache_spec_sliding_window`) the engine's KV-cache group the namespace keys, when the
//! engine registered it with one (the vLLM connector does, for every group; absent otherwise,
//! as vLLM's msgspec structs omit a None). Consecutive events of one kind and tier become one event with
//! several hashes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use kvstore::{BlockEvent, EventKind, Store, Tier};
use parking_lot::Mutex;

use crate::config::EventsSection;

/// Most block events in one batch.
const MAX_EVENTS_PER_BATCH: usize = 4096;

/// How long the first event of a batch waits for others (vLLM's own publisher sends one batch
/// per scheduler step, tens of milliseconds apart).
const GATHER: Duration = Duration::from_millis(2);

/// Most bytes of batches queued for the publisher, and kept for replay: `hwm` and
/// `buffer_steps` count batches, and a batch holds up to 4096 events (~80 KiB), so saves
/// from engines alone must not make the daemon hold gigabytes of events.
const MAX_QUEUED_BYTES: u64 = 64 << 20;
const MAX_RING_BYTES: usize = 64 << 20;

/// Counters of the publisher.
#[derive(Default)]
pub struct EventStats {
    /// Batches published (and buffered for replay).
    pub batches: AtomicU64,
    /// Block events published.
    pub events: AtomicU64,
    /// Batches dropped because `events.hwm` batches (or 64 MiB) were queued.
    pub dropped_batches: AtomicU64,
    /// Block events the stores dropped: a store ran more than `events.backlog` events ahead
    /// of its publisher thread.
    pub lost_events: AtomicU64,
    /// Resets of subscribers' view after a loss (an `AllBlocksCleared`, then every block
    /// held; see [`Feed`]).
    pub resets: AtomicU64,
    /// The PUB socket's: subscribers, batches not sent to a slow one, subscribers cut off.
    pub socket: Arc<crate::zmtp::PubStats>,
    /// The replay socket's: replays served, requesters cut off in one.
    pub replay: Arc<crate::zmtp::ReplayStats>,
}

/// Batches kept for replay, newest last; shared by the publishing loop (which appends) and
/// the replay task (which copies references out).
#[derive(Default)]
struct Ring {
    batches: VecDeque<(u64, bytes::Bytes)>,
    bytes: usize,
}

/// What the events say of a namespace's blocks, as its engine registered it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NsInfo {
    /// Tokens per block.
    pub block_tokens: u32,
    /// The engine's KV-cache group the namespace keys, if it said (vLLM's connector does).
    pub group: Option<KvGroup>,
}

/// An engine's KV-cache group, as vLLM's events name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroup {
    /// `group_idx`.
    pub idx: u32,
    /// `kv_cache_spec_kind` (checked: `kvtier_ipc::check_kv_group`); empty: not said.
    pub spec_kind: String,
    /// `kv_cache_spec_sliding_window` in tokens; 0: none.
    pub sliding_window: u32,
}

/// [`NsInfo`] of each namespace id, per store.
pub type NsInfos = Arc<Mutex<HashMap<(usize, u16), NsInfo>>>;

/// How events are encoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Encoding {
    /// Tagged arrays (older vLLM) instead of tagged maps.
    pub array: bool,
    /// Hashes as the key's low 64 bits (an integer) instead of its 16 bytes.
    pub int_hashes: bool,
    /// A pushed copy announced with `medium` "REMOTE" (kvtier's earlier form) instead of the
    /// medium it lives in with `locality` "REMOTE" (vLLM 0.32's).
    pub remote_medium: bool,
}

/// `ownership` of every event kvtierd publishes: vLLM's "secondary offloading tier
/// identifier" (its KVCR tier says "kvcr").
pub const OWNERSHIP: &str = "kvtier";

/// Most blocks whose engine hash is kept (a 128-byte entry each with its key, ~150–295 bytes
/// with the hash table's load): past it, new blocks are published under their kvtier keys
/// (counted in `EngineHashes::refused`).
const MAX_ENGINE_HASHES: usize = 8 << 20;

pub use kvstore::{EngineHash, EngineTag};

struct Held {
    hash: EngineHash,
    /// Tiers the block is in, one bit per [`Tier`] (0 while its commit is in progress).
    tiers: u8,
    /// The engine hash of the block before it in its sequence, if the engine said.
    parent: Option<EngineHash>,
    /// Its token ids, if the engine said (empty: not said).
    tokens: Arc<[u32]>,
    /// The last snapshot of its store that saw it ([`EngineHashes::sweep`]).
    seen: u32,
    /// Noted (or recovered) since its store's last sweep.
    fresh: bool,
}

/// Most token ids kept for one block (more: none are kept for it).
pub const MAX_BLOCK_TOKENS: usize = 1024;

/// What a commit says of one block for the KV events: its kvtier key, the engine's hash, and
/// optionally its parent's hash and its token ids.
pub struct Described<'a> {
    /// The kvtier key.
    pub key: u128,
    /// The engine's hash of the block.
    pub hash: &'a [u8],
    /// The engine's hash of the block before it (None or empty: not said / the first block).
    pub parent: Option<&'a [u8]>,
    /// The block's token ids (None or empty: not said).
    pub tokens: Option<&'a [u32]>,
}

/// A block as published: its hash, and (BlockStored) its parent and token ids when known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// What the block is published under.
    pub hash: Hash,
    /// Its parent's engine hash.
    pub parent: Option<EngineHash>,
    /// Its token ids (None: not known).
    pub tokens: Option<Arc<[u32]>>,
}

impl Resolved {
    /// A block known by its kvtier key only.
    pub fn key(k: u128) -> Self {
        Self {
            hash: Hash::Key(k),
            parent: None,
            tokens: None,
        }
    }
}

/// How [`EngineHashes::resolve_all_in`] tracks the events it resolves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Track {
    /// As they come.
    Live,
    /// Snapshot number `n` of the store: the tiers each block is found in replace what was
    /// tracked for it (a lost `Removed` left a tier's bit set), and it is marked seen.
    Snapshot(u32),
    /// Live, after snapshot `n` (the events its store queued while it ran, before its sweep):
    /// a stored block is marked seen by it too (the scan may have missed a block that moved
    /// between tiers meanwhile).
    After(u32),
}

fn tier_bit(t: Tier) -> u8 {
    1 << (t as u8 & 7)
}

/// The engine hash of every block stored with one, per store, from its commit until it left
/// its last tier; kept only while KV events are on.
#[derive(Default)]
pub struct EngineHashes {
    map: Mutex<HashMap<(usize, u128), Held>>,
    /// Hashes not kept because [`MAX_ENGINE_HASHES`] blocks had one.
    pub refused: AtomicU64,
    /// Hashes forgotten by sweeps after lost events ([`EngineHashes::sweep`]).
    pub swept: AtomicU64,
}

impl EngineHashes {
    /// Notes each block of store `t` (its engine hash, and its parent's and its token ids when
    /// given) before their commit (the commit's `Stored` events may be handled at once by the
    /// events thread); one lock for the commit. A parent that is not an engine hash, or more
    /// than [`MAX_BLOCK_TOKENS`] token ids, is left out (the block is published without it).
    pub fn note<'a>(&self, t: usize, blocks: impl IntoIterator<Item = Described<'a>>) {
        let mut m = self.map.lock();
        for b in blocks {
            let Some(hash) = EngineHash::new(b.hash) else {
                continue;
            };
            let parent = b.parent.and_then(EngineHash::new);
            let tokens: Arc<[u32]> = match b.tokens {
                Some(t) if t.len() <= MAX_BLOCK_TOKENS => Arc::from(t),
                _ => Arc::from(Vec::new()),
            };
            if let Some(h) = m.get_mut(&(t, b.key)) {
                h.fresh = true;
                h.hash = hash;
                if parent.is_some() {
                    h.parent = parent;
                }
                if !tokens.is_empty() {
                    h.tokens = tokens;
                }
            } else if m.len() < MAX_ENGINE_HASHES {
                m.insert(
                    (t, b.key),
                    Held {
                        hash,
                        tiers: 0,
                        parent,
                        tokens,
                        seen: 0,
                        fresh: true,
                    },
                );
            } else {
                self.refused.fetch_add(1, Relaxed);
            }
        }
    }

    /// Notes the blocks of store `t` the disk tier recovered with their engine tags (after a
    /// restart): held as on disk, published under their engine hashes from now on.
    pub fn seed(&self, t: usize, tags: Vec<(kvstore::BlockKey, EngineTag)>) {
        let mut m = self.map.lock();
        for (k, tag) in tags {
            if m.len() >= MAX_ENGINE_HASHES {
                self.refused.fetch_add(1, Relaxed);
                continue;
            }
            let h = m.entry((t, k.0)).or_insert_with(|| Held {
                hash: tag.hash,
                tiers: 0,
                parent: tag.parent,
                tokens: Arc::from(Vec::new()),
                seen: 0,
                fresh: true,
            });
            h.tiers |= tier_bit(Tier::Disk);
        }
    }

    /// The engine tags of `keys` of store `t` (what the disk tier journals with them); one
    /// lock per 4,096 keys (a checkpoint asks for every block on disk at once: commits and
    /// the events thread take their turns in between).
    pub fn tags_of(&self, t: usize, keys: &[kvstore::BlockKey]) -> Vec<Option<EngineTag>> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(4096) {
            let m = self.map.lock();
            if m.is_empty() {
                out.resize(out.len() + chunk.len(), None);
                continue;
            }
            out.extend(chunk.iter().map(|k| {
                m.get(&(t, k.0)).map(|h| EngineTag {
                    hash: h.hash,
                    parent: h.parent,
                })
            }));
        }
        out
    }

    /// Puts `keys` (of store `t`) in chain order: each block whose parent is among them right
    /// after that parent (one child per parent; the others start chains of their own), so an
    /// announcement of them becomes one event per chain instead of one per block. Blocks
    /// without an engine hash, and any cycle a hostile engine's hashes made, go last.
    pub fn chain_order(&self, t: usize, keys: &mut Vec<kvstore::BlockKey>) {
        let tags = self.tags_of(t, keys);
        let n = keys.len();
        let mut by_hash: HashMap<EngineHash, usize> = HashMap::with_capacity(n);
        for (i, tag) in tags.iter().enumerate() {
            if let Some(tag) = tag {
                by_hash.entry(tag.hash).or_insert(i);
            }
        }
        let mut next: Vec<Option<usize>> = vec![None; n];
        let mut has_prev = vec![false; n];
        for (i, tag) in tags.iter().enumerate() {
            let Some(p) = tag.and_then(|t| t.parent) else {
                continue;
            };
            if let Some(&j) = by_hash.get(&p) {
                if j != i && next[j].is_none() {
                    next[j] = Some(i);
                    has_prev[i] = true;
                }
            }
        }
        let mut out = Vec::with_capacity(n);
        let mut seen = vec![false; n];
        for i in (0..n).filter(|&i| !has_prev[i] && tags[i].is_some()) {
            let mut at = Some(i);
            while let Some(j) = at.filter(|&j| !seen[j]) {
                seen[j] = true;
                out.push(keys[j]);
                at = next[j];
            }
        }
        out.extend((0..n).filter(|&i| !seen[i]).map(|i| keys[i]));
        *keys = out;
    }

    /// Forgets `key` if its commit did not store it (and no tier holds it).
    pub fn abandon(&self, t: usize, key: u128) {
        let mut m = self.map.lock();
        if m.get(&(t, key)).is_some_and(|h| h.tiers == 0) {
            m.remove(&(t, key));
        }
    }

    /// How to publish each of `events` (of store `t`), in order: one lock for the batch.
    fn resolve_all(&self, t: usize, events: &[BlockEvent]) -> Vec<Resolved> {
        self.resolve_all_in(t, events, Track::Live)
    }

    /// [`EngineHashes::resolve_all`], tracked as `track` says (for [`EngineHashes::sweep`]).
    fn resolve_all_in(&self, t: usize, events: &[BlockEvent], track: Track) -> Vec<Resolved> {
        let mut m = self.map.lock();
        if m.is_empty() {
            return events.iter().map(|e| Resolved::key(e.key.0)).collect();
        }
        events
            .iter()
            .map(|e| Self::resolve_in(&mut m, t, e, track))
            .collect()
    }

    /// After snapshot `snapshot` of store `t` (every event of which went through
    /// [`EngineHashes::resolve_all_in`], then those its store queued while it ran, as
    /// [`Track::After`]): forgets the blocks neither saw stored, unless noted since the last
    /// sweep (a commit under way). What lost events left behind (a block no tier holds any
    /// more) so goes, instead of holding its slot of [`MAX_ENGINE_HASHES`] for good. One pass
    /// over the table under its lock (tens of ms at millions of blocks): only after a loss.
    /// Returns how many were forgotten.
    fn sweep(&self, t: usize, snapshot: u32) -> usize {
        let mut m = self.map.lock();
        let before = m.len();
        m.retain(|&(s, _), h| {
            if s != t {
                return true;
            }
            let keep = h.seen == snapshot || h.fresh;
            h.fresh = false;
            keep
        });
        let gone = before - m.len();
        self.swept.fetch_add(gone as u64, Relaxed);
        gone
    }

    /// The hash to publish event `e` of store `t` under, tracking where the block is.
    #[cfg(test)]
    fn resolve(&self, t: usize, e: &BlockEvent) -> Hash {
        Self::resolve_in(&mut self.map.lock(), t, e, Track::Live).hash
    }

    fn resolve_in(
        m: &mut HashMap<(usize, u128), Held>,
        t: usize,
        e: &BlockEvent,
        track: Track,
    ) -> Resolved {
        let k = (t, e.key.0);
        let Some(h) = m.get_mut(&k) else {
            return Resolved::key(e.key.0);
        };
        match track {
            Track::Snapshot(g) if h.seen != g => {
                h.seen = g;
                h.tiers = 0;
            }
            Track::After(g) if e.kind == EventKind::Stored && e.tier != Tier::Remote => h.seen = g,
            _ => {}
        }
        let stored = |h: &Held| Resolved {
            hash: Hash::Engine(h.hash),
            parent: h.parent,
            tokens: (!h.tokens.is_empty()).then(|| h.tokens.clone()),
        };
        if e.tier == Tier::Remote {
            // A pushed copy is another node's: its removal is never seen here, so it does not
            // keep the hash (the host copy, pinned while it is pushed, does).
            return stored(h);
        }
        match e.kind {
            EventKind::Stored => {
                h.tiers |= tier_bit(e.tier);
                stored(h)
            }
            EventKind::Removed => {
                let hash = Hash::Engine(h.hash);
                h.tiers &= !tier_bit(e.tier);
                if h.tiers == 0 {
                    m.remove(&k);
                }
                Resolved {
                    hash,
                    parent: None,
                    tokens: None,
                }
            }
        }
    }

    /// Blocks whose engine hash is kept.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }
}

/// What a block is published under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    /// Its 16-byte kvtier key.
    Key(u128),
    /// The engine's own hash.
    Engine(EngineHash),
}

/// One vLLM KV event over a run of blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// Stored or removed.
    pub kind: EventKind,
    /// Where.
    pub tier: Tier,
    /// Tokens per block (BlockStored).
    pub block_size: u32,
    /// The KV-cache group of the blocks' namespace, if its engine said.
    pub group: Option<KvGroup>,
    /// The blocks' hashes.
    pub keys: Vec<Hash>,
    /// BlockStored: the first block's parent (None: not known, or the first of its sequence).
    pub parent: Option<EngineHash>,
    /// BlockStored: every block's token ids, in order, when each block's are known (a run
    /// with them is a chain: each block's parent is the block before it).
    pub tokens: Option<Vec<u32>>,
}

/// vLLM's `medium` of a tier: `CPU`, `STORAGE`; a copy pushed to another node (or Redis)
/// lives in its memory: `CPU` (the owner's own events say when it moves to its disk), or
/// `REMOTE` with `events.remote_medium`.
fn medium(t: Tier, enc: Encoding) -> &'static str {
    match t {
        Tier::Host => "CPU",
        Tier::Disk => "STORAGE",
        _ if enc.remote_medium => "REMOTE",
        _ => "CPU",
    }
}

/// vLLM's `locality` (relative to the publisher): "REMOTE" for a pushed copy, else "LOCAL".
fn locality(t: Tier) -> &'static str {
    match t {
        Tier::Host | Tier::Disk => "LOCAL",
        _ => "REMOTE",
    }
}

/// Groups events into runs of one kind, tier, block size and KV-cache group (from `info` of
/// the block's namespace; none known: 0 tokens, no group), each block as `resolve(event)`
/// says. Stored blocks with token ids join a run only as the next block of its chain (their
/// parent is the run's last block), so a run's `parent_block_hash` and `token_ids` describe
/// all of it, as vLLM's do; blocks without them never join blocks with them.
pub fn runs<'a>(
    events: &[BlockEvent],
    info: impl Fn(u16) -> Option<&'a NsInfo>,
    mut resolve: impl FnMut(&BlockEvent) -> Resolved,
) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    // Whether each run's blocks all came without a parent (then a block without one may join).
    let mut unparented: Vec<bool> = Vec::new();
    for e in events {
        let i = info(e.ns);
        let bs = i.map_or(0, |i| i.block_tokens);
        let group = i.and_then(|i| i.group.as_ref());
        let res = resolve(e);
        let stored = e.kind == EventKind::Stored;
        let tokens = if stored { res.tokens.clone() } else { None };
        // A block whose parent is known joins a run only as the next block of its chain.
        let follows = |r: &Run| {
            r.keys
                .last()
                .is_some_and(|last| res.parent.map(Hash::Engine).as_ref() == Some(last))
        };
        let free = res.parent.is_none() && unparented.last() == Some(&true);
        let chained = |r: &Run| match (&r.tokens, &tokens) {
            (None, None) => free || follows(r),
            (Some(_), Some(_)) => follows(r),
            _ => false,
        };
        match out.last_mut() {
            Some(r)
                if r.kind == e.kind
                    && r.tier == e.tier
                    && r.block_size == bs
                    && r.group.as_ref() == group
                    && chained(r) =>
            {
                r.keys.push(res.hash);
                if let (Some(all), Some(t)) = (r.tokens.as_mut(), tokens) {
                    all.extend_from_slice(&t);
                }
                if let Some(u) = unparented.last_mut() {
                    *u &= res.parent.is_none();
                }
            }
            _ => {
                unparented.push(res.parent.is_none());
                out.push(Run {
                    kind: e.kind,
                    tier: e.tier,
                    block_size: bs,
                    group: group.cloned(),
                    keys: vec![res.hash],
                    parent: if stored { res.parent } else { None },
                    tokens: tokens.map(|t| t.to_vec()),
                })
            }
        }
    }
    out
}

/// One hash (a parent's) as `hashes` writes each.
fn one_hash(b: &mut Vec<u8>, h: Option<EngineHash>, enc: Encoding) {
    match h {
        None => nil(b),
        Some(h) if enc.int_hashes => {
            let _ = rmp::encode::write_uint(b, h.low64());
        }
        Some(h) => {
            let _ = rmp::encode::write_bin(b, h.as_bytes());
        }
    }
}

fn token_ids(b: &mut Vec<u8>, t: Option<&Vec<u32>>) {
    let t = t.map_or(&[][..], |t| &t[..]);
    let _ = rmp::encode::write_array_len(b, t.len() as u32);
    for id in t {
        let _ = rmp::encode::write_uint(b, u64::from(*id));
    }
}

/// vLLM 0.32's group fields of a BlockStored (`removed`: BlockRemoved's, `group_idx` only):
/// how many map entries, and writing them. vLLM's msgspec structs omit a None field.
fn group_fields(g: Option<&KvGroup>, removed: bool) -> u32 {
    match g {
        None => 0,
        Some(_) if removed => 1,
        Some(g) => 1 + u32::from(!g.spec_kind.is_empty()) + u32::from(g.sliding_window > 0),
    }
}

fn write_group(b: &mut Vec<u8>, g: Option<&KvGroup>, removed: bool) {
    let Some(g) = g else {
        return;
    };
    str_(b, "group_idx");
    let _ = rmp::encode::write_uint(b, u64::from(g.idx));
    if removed {
        return;
    }
    if !g.spec_kind.is_empty() {
        str_(b, "kv_cache_spec_kind");
        str_(b, &g.spec_kind);
    }
    if g.sliding_window > 0 {
        str_(b, "kv_cache_spec_sliding_window");
        let _ = rmp::encode::write_uint(b, u64::from(g.sliding_window));
    }
}

// msgpack writes into a Vec cannot fail: the results of rmp's writers are ignored below.
fn str_(b: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(b, s);
}

fn nil(b: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(b);
}

fn hashes(b: &mut Vec<u8>, keys: &[Hash], enc: Encoding) {
    let _ = rmp::encode::write_array_len(b, keys.len() as u32);
    for k in keys {
        match (k, enc.int_hashes) {
            (Hash::Key(k), true) => {
                let _ = rmp::encode::write_uint(b, *k as u64);
            }
            (Hash::Key(k), false) => {
                let _ = rmp::encode::write_bin(b, &k.to_be_bytes());
            }
            (Hash::Engine(h), true) => {
                let _ = rmp::encode::write_uint(b, h.low64());
            }
            (Hash::Engine(h), false) => {
                let _ = rmp::encode::write_bin(b, h.as_bytes());
            }
        }
    }
}

/// One event, as vLLM's `BlockStored` / `BlockRemoved` (msgspec, `tag=True`, `omit_defaults`).
fn event(b: &mut Vec<u8>, r: &Run, enc: Encoding) {
    match (r.kind, enc.array) {
        (EventKind::Stored, false) => {
            let _ = rmp::encode::write_map_len(b, 10 + group_fields(r.group.as_ref(), false));
            str_(b, "type");
            str_(b, "BlockStored");
            str_(b, "block_hashes");
            hashes(b, &r.keys, enc);
            str_(b, "parent_block_hash");
            one_hash(b, r.parent, enc);
            str_(b, "token_ids");
            token_ids(b, r.tokens.as_ref());
            str_(b, "block_size");
            let _ = rmp::encode::write_uint(b, u64::from(r.block_size));
            str_(b, "lora_id");
            nil(b);
            str_(b, "medium");
            str_(b, medium(r.tier, enc));
            str_(b, "lora_name");
            nil(b);
            write_group(b, r.group.as_ref(), false);
            str_(b, "locality");
            str_(b, locality(r.tier));
            str_(b, "ownership");
            str_(b, OWNERSHIP);
        }
        (EventKind::Stored, true) => {
            let _ = rmp::encode::write_array_len(b, 8);
            str_(b, "BlockStored");
            hashes(b, &r.keys, enc);
            one_hash(b, r.parent, enc);
            token_ids(b, r.tokens.as_ref());
            let _ = rmp::encode::write_uint(b, u64::from(r.block_size));
            nil(b);
            str_(b, medium(r.tier, enc));
            nil(b);
        }
        (EventKind::Removed, false) => {
            let _ = rmp::encode::write_map_len(b, 5 + group_fields(r.group.as_ref(), true));
            str_(b, "type");
            str_(b, "BlockRemoved");
            str_(b, "block_hashes");
            hashes(b, &r.keys, enc);
            str_(b, "medium");
            str_(b, medium(r.tier, enc));
            write_group(b, r.group.as_ref(), true);
            str_(b, "locality");
            str_(b, locality(r.tier));
            str_(b, "ownership");
            str_(b, OWNERSHIP);
        }
        (EventKind::Removed, true) => {
            let _ = rmp::encode::write_array_len(b, 3);
            str_(b, "BlockRemoved");
            hashes(b, &r.keys, enc);
            str_(b, medium(r.tier, enc));
        }
    }
}

/// A `KVEventBatch` payload: `[ts, [events], data_parallel_rank]`.
pub fn batch(ts: f64, runs: &[Run], enc: Encoding) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + runs.iter().map(|r| 36 * r.keys.len()).sum::<usize>());
    let _ = rmp::encode::write_array_len(&mut b, 3);
    let _ = rmp::encode::write_f64(&mut b, ts);
    let _ = rmp::encode::write_array_len(&mut b, runs.len() as u32);
    for r in runs {
        event(&mut b, r, enc);
    }
    let _ = rmp::encode::write_uint(&mut b, 0);
    b
}

/// The batch a daemon publishes first: `[ts, [AllBlocksCleared], 0]`. A subscriber that knew
/// this node's blocks from an earlier run of the daemon (ZMQ reconnects it on its own; the
/// sequence starts again at 0) forgets them: host memory starts empty, and the blocks the disk
/// tier kept are announced again as their namespaces are registered.
pub fn cleared_batch(ts: f64, enc: Encoding) -> Vec<u8> {
    let mut b = Vec::with_capacity(40);
    let _ = rmp::encode::write_array_len(&mut b, 3);
    let _ = rmp::encode::write_f64(&mut b, ts);
    let _ = rmp::encode::write_array_len(&mut b, 1);
    if enc.array {
        let _ = rmp::encode::write_array_len(&mut b, 1);
    } else {
        let _ = rmp::encode::write_map_len(&mut b, 1);
        str_(&mut b, "type");
    }
    str_(&mut b, "AllBlocksCleared");
    let _ = rmp::encode::write_uint(&mut b, 0);
    b
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs_f64()
}

/// `tcp://*:P` → `tcp://0.0.0.0:P` (the pure-Rust ZMQ binds an address).
fn bind_addr(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// What the stores' event threads share: the publisher's queue, and the resets of the
/// subscribers' view after events were lost.
///
/// Events are lost when a store changes faster than its thread encodes (more than
/// `events.backlog` events behind: the store never waits) or when `events.hwm` batches (or
/// 64 MiB) wait for the socket. Sequence numbers are given at publishing, so a subscriber
/// sees no gap for them and would keep a view of the node that is wrong for good: a block
/// whose `BlockRemoved` was lost stays "held" in it. So a loss is answered with a reset: an
/// `AllBlocksCleared` (the subscriber forgets the node; what it learns after is a subset of
/// what the node holds, never more), then each store's snapshot (every block it holds, as
/// `BlockStored`), sent by the store's own thread before its next batch, so each block's later
/// events follow it in order and the view converges to the node's. The events the store had
/// queued before its snapshot are not published (the snapshot covers them; after it, one older
/// than a lost event could undo the snapshot for good). A store announces itself again at most
/// once per [`RESYNC_GAP`] (or 4 × its last snapshot's time) after its last snapshot ended: a
/// store that keeps outrunning its publisher leaves subscribers with a subset of its blocks in
/// between, not a snapshot's worth of events on every loss.
struct Feed {
    tx: tokio::sync::mpsc::Sender<Vec<u8>>,
    /// Bytes of the batches in `tx`'s queue.
    queued: Arc<AtomicU64>,
    stats: Arc<EventStats>,
    enc: Encoding,
    infos: NsInfos,
    engine: Arc<EngineHashes>,
    /// Resets queued so far, counted once the reset is in the queue: a thread that reads a new
    /// count queues its snapshot after that reset. (No lock: the reset's send may wait for
    /// room, and no thread waits on another's.)
    resets: AtomicU64,
    /// Events were lost since the last reset.
    owed: AtomicBool,
}

/// Least time between two snapshots of one store sent after losses (see [`Feed`]).
const RESYNC_GAP: Duration = Duration::from_secs(5);

/// How often an idle events thread looks for a reset to answer (another store's loss) and
/// for the publisher's end.
const IDLE_CHECK: Duration = Duration::from_millis(200);

impl Feed {
    /// Queues `payload` (of `events` block events) if there is room; else drops it, counted,
    /// and owes a reset. False: dropped.
    fn try_send(&self, payload: Vec<u8>, events: usize) -> bool {
        let len = payload.len() as u64;
        if self.queued.load(Relaxed) + len > MAX_QUEUED_BYTES {
            self.lost_batch();
            return false;
        }
        self.queued.fetch_add(len, Relaxed);
        match self.tx.try_send(payload) {
            Ok(()) => {
                self.stats.events.fetch_add(events as u64, Relaxed);
                true
            }
            Err(_) => {
                // Full, or closed (the daemon stops: nothing is read any more).
                self.queued.fetch_sub(len, Relaxed);
                self.lost_batch();
                false
            }
        }
    }

    fn lost_batch(&self) {
        self.stats.dropped_batches.fetch_add(1, Relaxed);
        self.owed.store(true, SeqCst);
    }

    /// Queues `payload`, waiting for room: `events.hwm` batches and 64 MiB (a reset's
    /// batches: dropping one would owe another reset). False: the publisher is gone.
    fn send_waiting(&self, payload: Vec<u8>, events: usize) -> bool {
        let len = payload.len() as u64;
        // The 64 MiB bound is a byte count beside the channel, so there is nothing to wait on
        // but time: a 1 ms pause, only in a reset (rare), only while the publishing task
        // drains the queue (it waits on no socket, so the wait is a moment's).
        while self.queued.load(Relaxed) + len > MAX_QUEUED_BYTES {
            if self.tx.is_closed() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.queued.fetch_add(len, Relaxed);
        if self.tx.blocking_send(payload).is_err() {
            self.queued.fetch_sub(len, Relaxed);
            return false;
        }
        self.stats.events.fetch_add(events as u64, Relaxed);
        true
    }

    /// Queues an `AllBlocksCleared` if events were lost since the last one. False: the
    /// publisher is gone.
    fn reset_if_owed(&self) -> bool {
        if !self.owed.load(SeqCst) {
            return true;
        }
        // Cleared first, by one thread: a loss from here on owes the next reset.
        if !self.owed.swap(false, SeqCst) {
            return true;
        }
        if !self.send_waiting(cleared_batch(now_secs(), self.enc), 1) {
            return false;
        }
        self.resets.fetch_add(1, SeqCst);
        self.stats.resets.fetch_add(1, Relaxed);
        true
    }

    /// The batch of `events` of store `t`.
    fn encode(&self, t: usize, events: &[BlockEvent], track: Track) -> Vec<u8> {
        let resolved = self.engine.resolve_all_in(t, events, track);
        let rs = {
            let m = self.infos.lock();
            let mut next = resolved.into_iter();
            runs(
                events,
                |ns| m.get(&(t, ns)),
                |e| next.next().unwrap_or(Resolved::key(e.key.0)),
            )
        };
        batch(now_secs(), &rs, self.enc)
    }

    /// Every block store `t` holds, as `BlockStored` batches (snapshot number `n` of the
    /// store, for [`EngineHashes::sweep`]). False: the publisher is gone.
    fn snapshot(&self, t: usize, store: &Store, n: u32) -> bool {
        let mut open = true;
        store.resident_events(MAX_EVENTS_PER_BATCH, |events| {
            open = events.chunks(MAX_EVENTS_PER_BATCH).all(|part| {
                self.send_waiting(self.encode(t, part, Track::Snapshot(n)), part.len())
            });
            open
        });
        open
    }

    /// [`EngineHashes::sweep`] after snapshot `n` of store `t`, logged.
    fn sweep(&self, t: usize, n: u32) {
        let gone = self.engine.sweep(t, n);
        if gone > 0 {
            tracing::info!(
                store = t,
                gone,
                "events: engine hashes of blocks no tier holds, left by lost events, forgotten"
            );
        }
    }

    /// The thread of store `t`: its events (`sub`) in batches, resets when events were lost,
    /// until the publisher is gone.
    fn run(&self, t: usize, store: &Store, sub: kvstore::Subscription) {
        let mut buf = Vec::with_capacity(MAX_EVENTS_PER_BATCH);
        let mut backlog = false;
        let (mut seen_lost, mut seen_resets) = (0u64, 0u64);
        let mut snapshot_owed = false;
        let mut last_snapshot: Option<Instant> = None;
        let mut gap = RESYNC_GAP;
        let mut snapshots = 0u32;
        // After a snapshot: its number, and how many events its store queued while it ran
        // (handled before its sweep).
        let mut sweep: Option<(u32, usize)> = None;
        let mut withheld = Vec::new();
        loop {
            let first = match sub.recv_timeout(IDLE_CHECK) {
                Ok(e) => Some(e),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
            };
            if self.tx.is_closed() {
                return;
            }
            let lost = sub.lost();
            if lost > seen_lost {
                self.stats.lost_events.fetch_add(lost - seen_lost, Relaxed);
                tracing::warn!(
                    lost = lost - seen_lost,
                    backlog = sub.capacity().unwrap_or(0),
                    "events: the store changed faster than its events were published; \
                     subscribers' view is reset (AllBlocksCleared, then every block held)"
                );
                seen_lost = lost;
                self.owed.store(true, SeqCst);
            }
            if !self.reset_if_owed() {
                return;
            }
            let resets = self.resets.load(SeqCst);
            if resets != seen_resets {
                seen_resets = resets;
                snapshot_owed = true;
            }
            if snapshot_owed {
                // (A sweep still waiting for the last snapshot's events waits for the next
                // snapshot's instead: the events withheld here are not counted.)
                sweep = None;
                // Every event queued now happened before the snapshot owed, which covers it.
                // Published after the snapshot, one older than an event this store lost
                // would undo what the snapshot says, for good: a block's `BlockStored` whose
                // `BlockRemoved` was lost would make it "held" again. So until the snapshot
                // this store's events go unpublished (subscribers know a subset of its
                // blocks meanwhile), though still tracked for their engine hashes.
                withheld.clear();
                withheld.extend(first);
                withheld.extend(sub.try_iter().take(sub.capacity().unwrap_or(1 << 16)));
                let _ = self.engine.resolve_all(t, &withheld);
                if last_snapshot.is_none_or(|at| at.elapsed() >= gap) {
                    snapshot_owed = false;
                    let started = Instant::now();
                    snapshots += 1;
                    if !self.snapshot(t, store, snapshots) {
                        return;
                    }
                    sweep = match sub.len() {
                        0 => {
                            self.sweep(t, snapshots);
                            None
                        }
                        left => Some((snapshots, left)),
                    };
                    // Measured from its end, and at least 4 × what it took: a store whose
                    // snapshot outlasts the gap and loses events meanwhile still publishes
                    // more than it withholds.
                    gap = RESYNC_GAP.max(started.elapsed() * 4);
                    last_snapshot = Some(Instant::now());
                }
                continue;
            }
            let Some(first) = first else { continue };
            // Let a stream of saves gather for a moment unless a backlog waits: the store's
            // emit then finds no parked receiver to wake (a futex call per event otherwise),
            // and batches come out fuller.
            if !backlog {
                std::thread::sleep(GATHER);
            }
            buf.clear();
            buf.push(first);
            buf.extend(sub.try_iter().take(MAX_EVENTS_PER_BATCH - 1));
            backlog = buf.len() == MAX_EVENTS_PER_BATCH;
            let track = sweep.map_or(Track::Live, |(n, _)| Track::After(n));
            self.try_send(self.encode(t, &buf, track), buf.len());
            if let Some((n, left)) = sweep {
                let left = left.saturating_sub(buf.len());
                sweep = Some((n, left));
                if left == 0 {
                    self.sweep(t, n);
                    sweep = None;
                }
            }
        }
    }
}

/// The bound publisher: where it listens, and the task that runs it.
pub struct Publisher {
    /// The PUB endpoint as bound (the port filled in).
    pub endpoint: String,
    /// The ROUTER endpoint as bound, if any.
    pub replay_endpoint: Option<String>,
}

/// Binds the sockets and starts publishing the events of `stores` (each `(index, store)`)
/// until `stop` turns true.
pub async fn start(
    cfg: &EventsSection,
    stores: Vec<(usize, &'static Store)>,
    ns_info: NsInfos,
    engine_hashes: Arc<EngineHashes>,
    stats: Arc<EventStats>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Publisher> {
    let topic = bytes::Bytes::from(cfg.topic.clone().into_bytes());
    let publ = crate::zmtp::PubSocket::bind(
        bind_addr(&cfg.endpoint).trim_start_matches("tcp://"),
        topic.clone(),
        stats.socket.clone(),
    )
    .await
    .with_context(|| format!("binding events.endpoint = {}", cfg.endpoint))?;
    let ep = format!("tcp://{}", publ.local);
    let enc = Encoding {
        array: cfg.encoding == "array",
        int_hashes: cfg.int_hashes,
        remote_medium: cfg.remote_medium,
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(cfg.hwm);
    let queued = Arc::new(AtomicU64::new(0));
    let feed = Arc::new(Feed {
        tx,
        queued: queued.clone(),
        stats: stats.clone(),
        enc,
        infos: ns_info,
        engine: engine_hashes,
        resets: AtomicU64::new(0),
        owed: AtomicBool::new(false),
    });
    // Sequence 0: whatever a subscriber knew of this node is void.
    if !feed.try_send(cleared_batch(now_secs(), enc), 1) {
        anyhow::bail!("events: the publisher's queue refused its first batch");
    }
    // One thread per store turns its events into encoded batches.
    for (t, store) in stores {
        let sub = store.subscribe(cfg.backlog);
        let feed = feed.clone();
        std::thread::Builder::new()
            .name(format!("kvtierd-events-{t}"))
            .spawn(move || feed.run(t, store, sub))
            .context("starting an events thread")?;
    }
    drop(feed);
    let buffer_steps = cfg.buffer_steps;
    let ring = Arc::new(Mutex::new(Ring::default()));
    // Replays, apart (`zmtp::ReplaySocket`: a task per requester, each write with a
    // deadline): the live stream never waits on a replay, nor one requester on another.
    let mut replay_endpoint = None;
    if !cfg.replay_endpoint.is_empty() {
        let ring = ring.clone();
        let replayer: crate::zmtp::Replayer = Arc::new(move |start| {
            let r = ring.lock();
            let i = r.batches.partition_point(|(s, _)| *s < start);
            let newest = r.batches.back()?.0;
            r.batches.get(i).map(|(s, p)| (*s, p.clone(), newest))
        });
        let r = crate::zmtp::ReplaySocket::bind(
            bind_addr(&cfg.replay_endpoint).trim_start_matches("tcp://"),
            topic.clone(),
            replayer,
            stats.replay.clone(),
        )
        .await
        .with_context(|| format!("binding events.replay_endpoint = {}", cfg.replay_endpoint))?;
        replay_endpoint = Some(format!("tcp://{}", r.local));
    }
    // Publishing: the live stream never waits on a replay.
    {
        let (ring, stats) = (ring.clone(), stats.clone());
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let mut seq: u64 = 0;
            loop {
                tokio::select! {
                    m = rx.recv() => {
                        let Some(payload) = m else { break };
                        queued.fetch_sub(payload.len() as u64, Relaxed);
                        let payload = bytes::Bytes::from(payload);
                        publ.send(&[
                            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                            payload.clone(),
                        ]);
                        stats.batches.fetch_add(1, Relaxed);
                        let mut r = ring.lock();
                        r.bytes += payload.len();
                        r.batches.push_back((seq, payload));
                        while r.batches.len() > buffer_steps || r.bytes > MAX_RING_BYTES {
                            match r.batches.pop_front() {
                                Some((_, p)) => r.bytes -= p.len(),
                                None => break,
                            }
                        }
                        drop(r);
                        seq += 1;
                    }
                    _ = stop.changed() => break,
                }
            }
        });
    }
    Ok(Publisher {
        endpoint: ep,
        replay_endpoint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstore::BlockKey;

    fn ev(kind: EventKind, key: u128, tier: Tier, ns: u16) -> BlockEvent {
        BlockEvent {
            kind,
            key: BlockKey(key),
            tier,
            ns,
        }
    }

    fn group(idx: u32, kind: &str, window: u32) -> Option<KvGroup> {
        Some(KvGroup {
            idx,
            spec_kind: kind.into(),
            sliding_window: window,
        })
    }

    #[test]
    fn runs_group_consecutive_events_of_one_kind_tier_block_size_and_group() {
        let evs = [
            ev(EventKind::Stored, 1, Tier::Host, 0),
            ev(EventKind::Stored, 2, Tier::Host, 0),
            ev(EventKind::Stored, 3, Tier::Disk, 0),
            ev(EventKind::Removed, 1, Tier::Host, 0),
            ev(EventKind::Stored, 4, Tier::Host, 1),
            // Same block size, another KV-cache group; then a namespace nobody described.
            ev(EventKind::Stored, 5, Tier::Host, 2),
            ev(EventKind::Stored, 6, Tier::Host, 9),
        ];
        let infos = [
            NsInfo {
                block_tokens: 16,
                group: None,
            },
            NsInfo {
                block_tokens: 32,
                group: group(0, "full_attention", 0),
            },
            NsInfo {
                block_tokens: 32,
                group: group(1, "sliding_window", 128),
            },
        ];
        let rs = runs(
            &evs,
            |ns| infos.get(ns as usize),
            |e| Resolved::key(e.key.0),
        );
        let shape: Vec<(EventKind, Tier, u32, Option<u32>, usize)> = rs
            .iter()
            .map(|r| {
                let g = r.group.as_ref().map(|g| g.idx);
                (r.kind, r.tier, r.block_size, g, r.keys.len())
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                (EventKind::Stored, Tier::Host, 16, None, 2),
                (EventKind::Stored, Tier::Disk, 16, None, 1),
                (EventKind::Removed, Tier::Host, 16, None, 1),
                (EventKind::Stored, Tier::Host, 32, Some(0), 1),
                (EventKind::Stored, Tier::Host, 32, Some(1), 1),
                (EventKind::Stored, Tier::Host, 0, None, 1),
            ]
        );
    }

    #[test]
    fn parents_and_token_ids_are_published_for_chains_as_vllm_does() {
        let hs = EngineHashes::default();
        let h = |i: u8| vec![i; 32];
        let toks = |i: u32| (i * 16..i * 16 + 16).collect::<Vec<u32>>();
        let (t0, t1, t2, t3) = (toks(0), toks(1), toks(2), toks(3));
        let (h0, h1, h2, h3, h4, h9) = (h(10), h(11), h(12), h(13), h(14), h(99));
        // Blocks 1, 2, 3 chain after block 0 (saved earlier); block 4 continues another
        // sequence; block 5 has no token ids.
        hs.note(
            0,
            [
                (1, &h1, &h0, &t1[..]),
                (2, &h2, &h1, &t2[..]),
                (3, &h3, &h2, &t3[..]),
                (4, &h4, &h9, &t0[..]),
            ]
            .map(|(key, hash, parent, tokens)| Described {
                key,
                hash,
                parent: Some(parent),
                tokens: Some(tokens),
            }),
        );
        let h5 = h(15);
        hs.note(
            0,
            [Described {
                key: 5,
                hash: &h5,
                parent: None,
                tokens: None,
            }],
        );
        let evs: Vec<BlockEvent> = (1..=5)
            .map(|k| ev(EventKind::Stored, k, Tier::Host, 0))
            .collect();
        let info = NsInfo {
            block_tokens: 16,
            group: None,
        };
        let mut resolved = hs.resolve_all(0, &evs).into_iter();
        let rs = runs(
            &evs,
            |_| Some(&info),
            |e| resolved.next().unwrap_or(Resolved::key(e.key.0)),
        );
        let eng = |v: &[u8]| EngineHash::new(v).unwrap();
        assert_eq!(rs.len(), 3, "{rs:?}");
        assert_eq!(rs[0].keys.len(), 3);
        assert_eq!(rs[0].parent, Some(eng(&h0)));
        assert_eq!(rs[0].tokens, Some([t1.clone(), t2, t3].concat()));
        assert_eq!(
            (rs[1].parent, rs[1].tokens.clone()),
            (Some(eng(&h9)), Some(t0))
        );
        assert_eq!((rs[2].parent, rs[2].tokens.clone()), (None, None));
        // As msgpack: the parent's bytes and the 48 token ids, in vLLM's field order.
        let b = batch(0.0, &rs[..1], Encoding::default());
        let at = b
            .windows(9)
            .position(|w| w == b"token_ids")
            .expect("token_ids");
        let mut rd = &b[at + 9..];
        assert_eq!(rmp::decode::read_array_len(&mut rd).unwrap(), 48);
        assert_eq!(rmp::decode::read_int::<u32, _>(&mut rd).unwrap(), 16);
        let at = b
            .windows(17)
            .position(|w| w == b"parent_block_hash")
            .expect("parent_block_hash");
        let mut rd = &b[at + 17..];
        assert_eq!(rmp::decode::read_bin_len(&mut rd).unwrap(), 32);
        assert_eq!(&rd[..32], &h0[..]);
        // Removed events carry neither.
        let gone = ev(EventKind::Removed, 1, Tier::Host, 0);
        let r = hs.resolve_all(0, std::slice::from_ref(&gone));
        assert_eq!((r[0].parent, r[0].tokens.is_none()), (None, true));
    }

    #[test]
    fn tags_recovered_from_disk_are_published_and_journaled_again() {
        let hs = EngineHashes::default();
        let eng = |i: u8| EngineHash::new(&[i; 32]).unwrap();
        let tag = |h: u8, p: Option<u8>| EngineTag {
            hash: eng(h),
            parent: p.map(eng),
        };
        // A chain 1 → 2 → 3 (block 1 the first of its sequence), block 4 of another chain,
        // block 5 with no parent: as the journal gave them back, in no order.
        hs.seed(
            0,
            [
                (3, tag(13, Some(12))),
                (1, tag(11, None)),
                (4, tag(14, Some(99))),
                (2, tag(12, Some(11))),
                (5, tag(15, None)),
            ]
            .map(|(k, t)| (kvstore::BlockKey(k), t))
            .to_vec(),
        );
        let keys: Vec<kvstore::BlockKey> = [2, 7, 4].map(kvstore::BlockKey).to_vec();
        assert_eq!(
            hs.tags_of(0, &keys),
            vec![Some(tag(12, Some(11))), None, Some(tag(14, Some(99)))],
            "what the disk tier journals again"
        );
        assert_eq!(hs.tags_of(1, &keys), vec![None; 3], "another store's");
        // Put in chain order (the disk tier lists them in any order; untagged ones last)...
        let mut order: Vec<kvstore::BlockKey> = [7, 3, 5, 2, 4, 1].map(kvstore::BlockKey).to_vec();
        hs.chain_order(0, &mut order);
        let pos = |k: u128| order.iter().position(|x| x.0 == k).unwrap();
        assert!(pos(1) + 1 == pos(2) && pos(2) + 1 == pos(3), "{order:?}");
        assert_eq!(pos(7), 5, "untagged last");
        assert_eq!(order.len(), 6);
        // ... and announced so: one run for the chain, one for block 4, one for 5; a block
        // without a parent never joins a run whose blocks have one.
        let evs: Vec<BlockEvent> = [1, 2, 3, 4, 5]
            .map(|k| ev(EventKind::Stored, k, Tier::Disk, 0))
            .to_vec();
        let mut resolved = hs.resolve_all(0, &evs).into_iter();
        let rs = runs(
            &evs,
            |_| None,
            |e| resolved.next().unwrap_or(Resolved::key(e.key.0)),
        );
        let hashes = |r: &Run| r.keys.clone();
        assert_eq!(rs.len(), 3, "{rs:?}");
        assert_eq!(
            hashes(&rs[0]),
            [11, 12, 13].map(|i| Hash::Engine(eng(i))).to_vec()
        );
        assert_eq!((rs[0].parent, rs[0].tokens.clone()), (None, None));
        assert_eq!(
            (hashes(&rs[1]), rs[1].parent),
            (vec![Hash::Engine(eng(14))], Some(eng(99)))
        );
        assert_eq!(
            (hashes(&rs[2]), rs[2].parent),
            (vec![Hash::Engine(eng(15))], None)
        );
        // Blocks without tags (kvtier keys) still run together.
        let plain: Vec<BlockEvent> = [20, 21, 22]
            .map(|k| ev(EventKind::Stored, k, Tier::Disk, 0))
            .to_vec();
        let mut resolved = hs.resolve_all(0, &plain).into_iter();
        let rs = runs(
            &plain,
            |_| None,
            |e| resolved.next().unwrap_or(Resolved::key(e.key.0)),
        );
        assert_eq!(rs.len(), 1);
        // Hashes that loop (a hostile engine's): every block still announced, once.
        let loop_hs = EngineHashes::default();
        loop_hs.seed(
            0,
            vec![
                (kvstore::BlockKey(1), tag(1, Some(2))),
                (kvstore::BlockKey(2), tag(2, Some(1))),
            ],
        );
        let mut ks = vec![kvstore::BlockKey(1), kvstore::BlockKey(2)];
        loop_hs.chain_order(0, &mut ks);
        ks.sort();
        assert_eq!(ks, vec![kvstore::BlockKey(1), kvstore::BlockKey(2)]);
        // Held as on disk: gone from the map when the disk tier drops the block.
        let before = hs.len();
        hs.resolve_all(0, &[ev(EventKind::Removed, 4, Tier::Disk, 0)]);
        assert_eq!(hs.len(), before - 1);
    }

    #[test]
    fn a_group_is_published_as_vllm_names_it_and_counted_in_the_map() {
        let mut r = Run {
            kind: EventKind::Stored,
            tier: Tier::Host,
            block_size: 32,
            group: group(1, "sliding_window", 128),
            keys: vec![Hash::Key(3)],
            parent: None,
            tokens: None,
        };
        let has = |b: &[u8], s: &str| b.windows(s.len()).any(|w| w == s.as_bytes());
        for (kind, entries) in [(EventKind::Stored, 13), (EventKind::Removed, 6)] {
            r.kind = kind;
            let b = batch(0.0, std::slice::from_ref(&r), Encoding::default());
            let mut rd = b.as_slice();
            rmp::decode::read_array_len(&mut rd).unwrap();
            rmp::decode::read_f64(&mut rd).unwrap();
            rmp::decode::read_array_len(&mut rd).unwrap();
            assert_eq!(rmp::decode::read_map_len(&mut rd).unwrap(), entries);
            assert!(has(&b, "group_idx"));
            let spec = kind == EventKind::Stored;
            assert_eq!(
                has(&b, "kv_cache_spec_kind") && has(&b, "sliding_window"),
                spec
            );
            assert_eq!(has(&b, "kv_cache_spec_sliding_window"), spec);
        }
        // A group with no kind or window said: group_idx only.
        r.kind = EventKind::Stored;
        r.group = group(0, "", 0);
        let b = batch(0.0, std::slice::from_ref(&r), Encoding::default());
        assert!(has(&b, "group_idx") && !has(&b, "kv_cache_spec"));
    }

    #[test]
    fn a_batch_is_an_array_of_ts_events_and_rank() {
        let r = Run {
            kind: EventKind::Stored,
            tier: Tier::Disk,
            block_size: 16,
            group: None,
            keys: vec![Hash::Key(u128::MAX - 1)],
            parent: None,
            tokens: None,
        };
        for (array, int_hashes) in [(false, false), (true, true)] {
            let enc = Encoding {
                array,
                int_hashes,
                remote_medium: false,
            };
            let b = batch(1.5, std::slice::from_ref(&r), enc);
            let mut rd = b.as_slice();
            assert_eq!(rmp::decode::read_array_len(&mut rd).unwrap(), 3);
            assert_eq!(rmp::decode::read_f64(&mut rd).unwrap(), 1.5);
            assert_eq!(rmp::decode::read_array_len(&mut rd).unwrap(), 1);
            if array {
                // Older vLLM's eight positional fields: a longer array would not decode there.
                assert_eq!(rmp::decode::read_array_len(&mut rd).unwrap(), 8);
            } else {
                // vLLM 0.32's fields kvtierd fills: its 8 and `locality`, `ownership`.
                assert_eq!(rmp::decode::read_map_len(&mut rd).unwrap(), 10);
            }
        }
        // The bytes form: the key's 16 bytes, big-endian.
        let enc = Encoding {
            array: false,
            int_hashes: false,
            remote_medium: false,
        };
        let b = batch(0.0, &[r], enc);
        let key = (u128::MAX - 1).to_be_bytes();
        assert!(b.windows(16).any(|w| w == key));
        assert!(b.windows(7).any(|w| w == b"STORAGE"));
        assert!(b.windows(5).any(|w| w == b"LOCAL"));
        assert!(b.windows(6).any(|w| w == b"kvtier"));
    }

    #[test]
    fn a_pushed_copy_is_cpu_and_remote_or_medium_remote_when_asked() {
        let r = Run {
            kind: EventKind::Stored,
            tier: Tier::Remote,
            block_size: 16,
            group: None,
            keys: vec![Hash::Key(5)],
            parent: None,
            tokens: None,
        };
        let has = |b: &[u8], s: &str| b.windows(s.len()).any(|w| w == s.as_bytes());
        let mut enc = Encoding::default();
        let b = batch(0.0, std::slice::from_ref(&r), enc);
        assert!(has(&b, "CPU") && has(&b, "REMOTE") && !has(&b, "LOCAL"));
        enc.remote_medium = true;
        let b = batch(0.0, std::slice::from_ref(&r), enc);
        assert!(!has(&b, "CPU") && has(&b, "REMOTE"));
        assert_eq!(medium(Tier::Remote, enc), "REMOTE");
        assert_eq!(locality(Tier::Remote), "REMOTE");
        assert_eq!(locality(Tier::Disk), "LOCAL");
    }

    /// A block whose `BlockRemoved` was lost keeps its engine hash until a snapshot of its
    /// store sweeps the map: the snapshot's view of each block's tiers replaces what was
    /// tracked, a block it did not see is forgotten unless noted since the last sweep (a
    /// commit under way), and that grace lasts one sweep.
    #[test]
    fn a_snapshot_sweeps_the_engine_hashes_that_lost_events_left() {
        let hs = EngineHashes::default();
        let hash: Vec<u8> = (0..32).collect();
        let note = |keys: &[u128]| {
            hs.note(
                0,
                keys.iter().map(|&key| Described {
                    key,
                    hash: &hash,
                    parent: None,
                    tokens: None,
                }),
            )
        };
        note(&[1, 2]);
        hs.note(
            1,
            [Described {
                key: 1,
                hash: &hash,
                parent: None,
                tokens: None,
            }],
        );
        for k in [1, 2] {
            hs.resolve(0, &ev(EventKind::Stored, k, Tier::Host, 0));
            hs.resolve(0, &ev(EventKind::Stored, k, Tier::Disk, 0));
        }
        hs.resolve(1, &ev(EventKind::Stored, 1, Tier::Host, 0));
        // Block 1 left both tiers and block 2 its host copy: those events were lost. A first
        // sweep spares every block noted since the start.
        assert_eq!(hs.sweep(0, 1), 0);
        note(&[3]); // a commit under way
        let snap = hs.resolve_all_in(
            0,
            &[ev(EventKind::Stored, 2, Tier::Disk, 0)],
            Track::Snapshot(2),
        );
        assert!(matches!(snap[0].hash, Hash::Engine(_)));
        assert_eq!(hs.sweep(0, 2), 1, "block 1 forgotten");
        assert_eq!(hs.len(), 3, "2 and 3 of store 0, 1 of store 1");
        // Block 2's tiers are the snapshot's: its disk copy's removal forgets it.
        hs.resolve(0, &ev(EventKind::Removed, 2, Tier::Disk, 0));
        assert_eq!(hs.len(), 2);
        // Block 3's commit never stored it (its events lost too): gone at the next sweep.
        assert_eq!(hs.sweep(0, 3), 1);
        assert_eq!(hs.len(), 1);
        assert_eq!(hs.swept.load(Relaxed), 2);
        // A block the scan missed (it moved between tiers while the scan ran) but whose
        // `Stored` its store queued meanwhile is kept.
        note(&[4]);
        hs.resolve(0, &ev(EventKind::Stored, 4, Tier::Host, 0));
        assert_eq!(hs.sweep(0, 4), 0, "noted since the last sweep");
        hs.resolve_all_in(
            0,
            &[ev(EventKind::Stored, 4, Tier::Disk, 0)],
            Track::After(5),
        );
        assert_eq!(hs.sweep(0, 5), 0);
        assert_eq!(
            hs.sweep(0, 6),
            1,
            "seen by neither snapshot 6 nor what followed it"
        );
        assert_eq!(
            hs.resolve(1, &ev(EventKind::Removed, 1, Tier::Host, 0)),
            Hash::Engine(EngineHash::new(&hash).unwrap()),
            "another store's block untouched"
        );
    }

    #[test]
    fn blocks_committed_with_engine_hashes_are_published_under_them_until_gone() {
        let hs = EngineHashes::default();
        let vllm: Vec<u8> = (0..32).collect();
        // Key 8's is too long: not kept.
        hs.note(
            0,
            [(7, &vllm[..]), (8, &[9; 40][..]), (9, &[1, 2, 3][..])].map(|(key, hash)| Described {
                key,
                hash,
                parent: None,
                tokens: None,
            }),
        );
        hs.abandon(0, 9); // its commit stored nothing
        let resolve = |kind, key, tier| hs.resolve(0, &ev(kind, key, tier, 0));
        let engine = Hash::Engine(EngineHash::new(&vllm).unwrap());
        assert_eq!(resolve(EventKind::Stored, 7, Tier::Host), engine);
        assert_eq!(resolve(EventKind::Stored, 8, Tier::Host), Hash::Key(8));
        assert_eq!(resolve(EventKind::Stored, 9, Tier::Host), Hash::Key(9));
        // Another store's block of the same key is not this one.
        assert_eq!(
            hs.resolve(1, &ev(EventKind::Stored, 7, Tier::Host, 0)),
            Hash::Key(7)
        );
        // Pushed to its owner, written below, then evicted from host: still known until it
        // leaves the disk too. The remote copy (whose removal is never seen here) keeps
        // nothing.
        assert_eq!(resolve(EventKind::Stored, 7, Tier::Remote), engine);
        assert_eq!(resolve(EventKind::Stored, 7, Tier::Disk), engine);
        assert_eq!(resolve(EventKind::Removed, 7, Tier::Host), engine);
        assert_eq!(hs.len(), 1);
        assert_eq!(resolve(EventKind::Removed, 7, Tier::Disk), engine);
        assert_eq!(hs.len(), 0);
        assert_eq!(resolve(EventKind::Stored, 7, Tier::Host), Hash::Key(7));
        // Bytes as given, and vLLM's integer form (low 64 bits, big-endian).
        let r = Run {
            kind: EventKind::Removed,
            tier: Tier::Host,
            block_size: 16,
            group: None,
            keys: vec![engine],
            parent: None,
            tokens: None,
        };
        let b = batch(0.0, std::slice::from_ref(&r), Encoding::default());
        assert!(b.windows(32).any(|w| w == vllm.as_slice()));
        assert_eq!(
            EngineHash::new(&vllm).unwrap().low64(),
            u64::from_be_bytes(vllm[24..].try_into().unwrap())
        );
        let b = batch(
            0.0,
            &[r],
            Encoding {
                array: true,
                int_hashes: true,
                remote_medium: false,
            },
        );
        let low = u64::from_be_bytes(vllm[24..].try_into().unwrap());
        let mut want = Vec::new();
        rmp::encode::write_uint(&mut want, low).unwrap();
        assert!(b.windows(want.len()).any(|w| w == want.as_slice()));
    }

    /// The block keys a batch stores and removes, and whether it clears every block (array
    /// encoding, integer hashes: what this test's feed publishes).
    fn decode(b: &[u8]) -> (bool, Vec<u64>, Vec<u64>) {
        use rmp::decode::{read_array_len, read_f64, read_int, read_marker, read_str_from_slice};
        let mut rd = b;
        assert_eq!(read_array_len(&mut rd).unwrap(), 3);
        read_f64(&mut rd).unwrap();
        let (mut cleared, mut stored, mut removed) = (false, Vec::new(), Vec::new());
        for _ in 0..read_array_len(&mut rd).unwrap() {
            let n = read_array_len(&mut rd).unwrap();
            let (kind, rest) = read_str_from_slice(rd).unwrap();
            rd = rest;
            let keys = |rd: &mut &[u8]| -> Vec<u64> {
                let k = read_array_len(rd).unwrap();
                (0..k).map(|_| read_int(rd).unwrap()).collect()
            };
            let skip_nil = |rd: &mut &[u8]| assert_eq!(read_marker(rd).unwrap(), rmp::Marker::Null);
            match (kind, n) {
                ("AllBlocksCleared", 1) => cleared = true,
                ("BlockStored", 8) => {
                    stored.extend(keys(&mut rd));
                    skip_nil(&mut rd); // parent
                                       // Token ids: none known here.
                    assert!(matches!(
                        read_marker(&mut rd).unwrap(),
                        rmp::Marker::Null | rmp::Marker::FixArray(0)
                    ));
                    read_int::<u64, _>(&mut rd).unwrap();
                    skip_nil(&mut rd);
                    rd = read_str_from_slice(rd).unwrap().1;
                    skip_nil(&mut rd);
                }
                ("BlockRemoved", 3) => {
                    removed.extend(keys(&mut rd));
                    rd = read_str_from_slice(rd).unwrap().1;
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
        (cleared, stored, removed)
    }

    /// A store that lost events (its channel full) queued, before the loss, a block's
    /// `BlockStored` whose `BlockRemoved` was the event lost. Published after the reset's
    /// snapshot it would make the removed block "held" for good in every subscriber's view;
    /// the view rebuilt from what the feed publishes must end as the store's.
    #[test]
    fn events_queued_before_a_loss_are_not_published_over_the_snapshot() {
        let store: &'static Store = Box::leak(Box::new(
            kvstore::StoreConfig {
                capacity_bytes: 4 << 20,
                segment_bytes: 1 << 20,
                size_classes: vec![4096],
                ..Default::default()
            }
            .build()
            .unwrap(),
        ));
        let ns = store
            .register_fingerprint(kvstore::Fingerprint(BlockKey(7)))
            .unwrap();
        // Room for 4 events: blocks 1-4 stored fill it; block 1's removal is lost.
        let sub = store.subscribe(4);
        for k in 1..=4u128 {
            store.put(ns, BlockKey(k), &[1u8; 4096]).unwrap();
        }
        assert!(store.remove(&BlockKey(1)));
        assert_eq!(sub.lost(), 1);
        let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
        let feed = Arc::new(Feed {
            tx,
            queued: Arc::default(),
            stats: Arc::default(),
            enc: Encoding {
                array: true,
                int_hashes: true,
                remote_medium: false,
            },
            infos: NsInfos::default(),
            engine: Arc::default(),
            resets: AtomicU64::new(0),
            owed: AtomicBool::new(false),
        });
        let f = feed.clone();
        std::thread::spawn(move || f.run(0, store, sub));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        // The view a router keeps, until it holds block 9, stored after all of the above.
        let mut view = std::collections::BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut sentinel = false;
        while !view.contains(&9) {
            let left = deadline.saturating_duration_since(Instant::now());
            let b = rt
                .block_on(async { tokio::time::timeout(left, rx.recv()).await })
                .ok()
                .flatten()
                .expect("the feed publishes block 9 within 60 s");
            let (cleared, stored, removed) = decode(&b);
            if cleared {
                view.clear();
            }
            view.extend(stored);
            for k in removed {
                view.remove(&k);
            }
            if !sentinel && view == [2, 3, 4].into() {
                sentinel = true;
                store.put(ns, BlockKey(9), &[1u8; 4096]).unwrap();
            }
        }
        assert_eq!(view, [2, 3, 4, 9].into(), "the view after the reset");
        assert_eq!(feed.stats.lost_events.load(Relaxed), 1);
        assert_eq!(feed.stats.resets.load(Relaxed), 1);
    }
}

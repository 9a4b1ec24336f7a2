//! Retention and demotion: what an application knows about a session that an eviction policy
//! cannot (SGLang's Retain/Demote hints, vLLM's and Dynamo's agent hints).
//!
//! - [`Store::retain`] keeps the present prefix of `keys` where it is (host memory, or a
//!   lower local tier) until a TTL: each block holds one pin per retention, so eviction
//!   leaves it. Retentions are named by a session (a later Retain of the same session adds
//!   its blocks and sets the TTL and priority anew) or anonymous. They are bounded in bytes
//!   over the whole store (`StoreConfig::retain_max_bytes`, any tier counted) and in TTL
//!   (`retain_max_ttl`); a retain past the bytes bound first ends retentions of lower
//!   priority, then those of equal priority that would end before it (earliest deadline first:
//!   the sessions the application came back to least recently), then keeps the leading blocks
//!   that fit and says it was clipped. A retention of higher priority, or of equal priority
//!   ending later, is never ended by it. Retentions are not owned by a connection: a session outlives the engine that
//!   started it (its next turn may go to another engine), so only the TTL, a Demote or a
//!   higher-priority retain ends one.
//! - [`Store::demote`] ends the retention of a session (or of keys) and moves their host
//!   blocks down now: a block with a copy below leaves host memory at once; a dirty one is
//!   queued for the writer, whatever admission says (the application asked), and leaves host
//!   memory once written. Blocks in use (pinned by a load, a lease, a preload hold, another
//!   retention) stay, counted as busy.
//!
//! - Across a restart (with a disk tier): [`Store::flush`] (kvtierd's clean shutdown) writes
//!   retained dirty host blocks to disk whatever admission says; flushing or closing the store
//!   writes its live retentions (session, priority, the wall-clock end of the TTL, the keys in
//!   retain order) to [`FILE`] in the disk tier's directory, checksummed, through a temporary
//!   file and a rename. The next open reads it once, removes it, and retains each again for
//!   what is left of its TTL: the present prefix of its keys, among the blocks the disk tier
//!   kept (host copies die with the process). A missing or unreadable file restores nothing
//!   (logged); after a crash, the file of the last flush, if any.
//!
//! The retention table's lock is a leaf: retain pins blocks first (shard and tier locks, none
//! held together), then records them under the table's lock; pins to drop (clipped, replaced,
//! displaced, expired) are dropped after it is released.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::events::EventKind;
use crate::key::BlockKey;
use crate::types::{FoldMap, MapKey, Tier};

use super::index::{Copy, Slot};
use super::lease::Pin;
use super::tiering::Demote;
use super::{Inner, Store};

/// Most retentions (sessions and anonymous ones) at once.
pub const MAX_RETENTIONS: usize = 1 << 16;
/// Longest session name, in bytes.
pub const MAX_SESSION_BYTES: usize = 256;

/// Which bound clipped a retain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetainBound {
    /// The store's bound on retained bytes (`StoreConfig::retain_max_bytes`).
    Bytes,
    /// The longest TTL (`StoreConfig::retain_max_ttl`): the TTL was shortened.
    Ttl,
}

impl RetainBound {
    /// The bound's name as kvtierd's configuration spells it (what replies say).
    pub fn key(self) -> &'static str {
        match self {
            RetainBound::Bytes => "preload.max_retained_bytes",
            RetainBound::Ttl => "preload.max_retain_ms",
        }
    }

    /// The bound a reply names ([`RetainBound::key`]).
    pub fn from_key(k: &str) -> Option<Self> {
        [RetainBound::Bytes, RetainBound::Ttl]
            .into_iter()
            .find(|b| b.key() == k)
    }
}

/// What one retain did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retained {
    /// Leading keys present in some local tier (the prefix the retain covers).
    pub present: usize,
    /// Of those, retained now by this retention (this call's blocks and the session's
    /// earlier ones it already held).
    pub retained: usize,
    /// Present blocks left out by a bound (see `clipped_by`).
    pub clipped: usize,
    /// The bounds that clipped the request.
    pub clipped_by: Vec<RetainBound>,
    /// Non-empty: nothing was retained, and why.
    pub refused: String,
    /// The TTL granted.
    pub ttl: Duration,
    /// Bytes this retention holds now.
    pub bytes: u64,
    /// Blocks of lower-priority retentions ended to make room.
    pub displaced: usize,
}

/// What one demote did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demoted {
    /// Retained blocks released (the session's, or the keys').
    pub released: usize,
    /// Host copies dropped now (a copy below exists).
    pub freed: usize,
    /// Dirty host blocks queued for the writer: they leave host memory once written.
    pub queued: usize,
    /// In use (a load, a lease, a preload hold or another retention pins them): left.
    pub busy: usize,
    /// Not in host memory (below only, or absent).
    pub not_in_host: usize,
    /// In host memory with nowhere to go (no tier to write to, or its write failed for good):
    /// kept, and made the first its policy evicts when room is needed.
    pub kept: usize,
}

/// Counters of retention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionStats {
    /// Retentions live now.
    pub retentions: u64,
    /// Blocks and bytes they hold.
    pub blocks: u64,
    /// See `blocks`.
    pub bytes: u64,
    /// The bound on `bytes`.
    pub max_bytes: u64,
    /// Retains answered (refused ones included), and blocks they left out for a bound.
    pub retains: u64,
    /// See `retains`.
    pub clipped_blocks: u64,
    /// Retentions ended by a higher-priority retain, and by their TTL.
    pub displaced: u64,
    /// See `displaced`.
    pub expired: u64,
    /// Demotes answered; blocks they dropped from host memory at once and queued for writing.
    pub demotes: u64,
    /// See `demotes`.
    pub demoted_freed: u64,
    /// See `demotes`.
    pub demoted_queued: u64,
}

/// The file, in the disk tier's directory, that keeps retentions across a restart.
pub(crate) const FILE: &str = "retained";
const MAGIC: &[u8; 8] = b"KVRETAIN";
const FILE_VERSION: u32 = 1;

/// A retention as the file keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Saved {
    /// `None`: an anonymous retention.
    session: Option<String>,
    priority: u8,
    /// The end of its TTL, in milliseconds since the Unix epoch.
    until_ms: u64,
    /// In retain order.
    keys: Vec<BlockKey>,
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The file's bytes: magic, version, count, the retentions, then the XXH3-64 of all before.
fn encode(v: &[Saved]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&FILE_VERSION.to_le_bytes());
    b.extend_from_slice(&(v.len() as u32).to_le_bytes());
    for s in v {
        b.push(s.priority);
        let name = s.session.as_deref().unwrap_or("");
        b.push(u8::from(s.session.is_some()));
        b.extend_from_slice(&(name.len() as u16).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&s.until_ms.to_le_bytes());
        b.extend_from_slice(&(s.keys.len() as u32).to_le_bytes());
        for k in &s.keys {
            b.extend_from_slice(&k.0.to_le_bytes());
        }
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// Reads [`encode`]'s bytes; an error names what is wrong.
fn decode(b: &[u8]) -> Result<Vec<Saved>, String> {
    if b.len() < MAGIC.len() + 16 || &b[..MAGIC.len()] != MAGIC {
        return Err("not a retentions file".into());
    }
    let (body, sum) = b.split_at(b.len() - 8);
    let sum = u64::from_le_bytes(sum.try_into().map_err(|_| "short")?);
    if xxhash_rust::xxh3::xxh3_64(body) != sum {
        return Err("checksum mismatch (torn or damaged)".into());
    }
    let mut at = MAGIC.len();
    let mut take = |n: usize| -> Result<&[u8], String> {
        let s = body.get(at..at + n).ok_or("truncated")?;
        at += n;
        Ok(s)
    };
    let u32_ = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let version = u32_(take(4)?);
    if version != FILE_VERSION {
        return Err(format!(
            "version {version}, this build reads {FILE_VERSION}"
        ));
    }
    let n = u32_(take(4)?) as usize;
    let mut out = Vec::with_capacity(n.min(MAX_RETENTIONS));
    for _ in 0..n {
        let head = take(4)?;
        let (priority, is_session) = (head[0], head[1] != 0);
        let name_len = usize::from(u16::from_le_bytes([head[2], head[3]]));
        let name = std::str::from_utf8(take(name_len)?)
            .map_err(|_| "a session name is not UTF-8")?
            .to_string();
        let until_ms = u64::from_le_bytes(take(8)?.try_into().map_err(|_| "short")?);
        let n_keys = u32_(take(4)?) as usize;
        let keys = take(n_keys.checked_mul(16).ok_or("too many keys")?)?
            .chunks_exact(16)
            .map(|c| BlockKey(u128::from_le_bytes(c.try_into().unwrap_or([0; 16]))))
            .collect();
        out.push(Saved {
            session: is_session.then_some(name),
            priority,
            until_ms,
            keys,
        });
    }
    Ok(out)
}

/// Who a retention is: a session, or an anonymous retain (its own, never added to).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Name {
    Session(String),
    Anon(u64),
}

struct Retention {
    /// Pins in retain order, with each block's bytes.
    pins: Vec<(Pin, u64)>,
    keys: FoldMap<MapKey, ()>,
    bytes: u64,
    deadline: Instant,
    priority: u8,
}

/// The retention table.
#[derive(Default)]
pub(crate) struct Retentions {
    live: HashMap<Name, Retention>,
    bytes: u64,
    blocks: u64,
    next_anon: u64,
    earliest: Option<Instant>,
}

impl Retentions {
    fn take(&mut self, name: &Name) -> Option<Retention> {
        let r = self.live.remove(name)?;
        self.bytes -= r.bytes;
        self.blocks -= r.pins.len() as u64;
        Some(r)
    }

    fn recompute_earliest(&mut self) {
        self.earliest = self.live.values().map(|r| r.deadline).min();
    }
}

fn pin_key(p: &Pin) -> BlockKey {
    match p {
        Pin::Host(k, _) | Pin::Lower(_, k) => *k,
    }
}

impl Store {
    /// Retains the present prefix of `keys` (in any local tier) until `ttl`, under `session`
    /// (added to what the session holds; `None`: an anonymous retention). Bounded; see the
    /// module's documentation. Never waits and never does I/O.
    pub fn retain(
        &self,
        session: Option<&str>,
        keys: &[BlockKey],
        ttl: Duration,
        priority: u8,
    ) -> Retained {
        self.inner.retain(session, keys, ttl, priority)
    }

    /// Ends the retention of `session` (if given) and of `keys`, and moves the host blocks of
    /// both down: see the module's documentation. Never waits and never does I/O.
    pub fn demote(&self, session: Option<&str>, keys: &[BlockKey]) -> Demoted {
        self.inner.demote(session, keys)
    }

    /// Retention counters.
    pub fn retention_stats(&self) -> RetentionStats {
        let i = &self.inner;
        let t = i.retained.lock();
        RetentionStats {
            retentions: t.live.len() as u64,
            blocks: t.blocks,
            bytes: t.bytes,
            max_bytes: i.retain_max_bytes,
            retains: i.stats.retains.load(Relaxed),
            clipped_blocks: i.stats.retain_clipped.load(Relaxed),
            displaced: i.stats.retain_displaced.load(Relaxed),
            expired: i.stats.retain_expired.load(Relaxed),
            demotes: i.stats.demotes.load(Relaxed),
            demoted_freed: i.stats.demoted_freed.load(Relaxed),
            demoted_queued: i.stats.demoted_queued.load(Relaxed),
        }
    }
}

impl Inner {
    /// The keys of every live retention.
    pub(crate) fn retained_keys(&self) -> FoldMap<MapKey, ()> {
        let t = self.retained.lock();
        t.live
            .values()
            .flat_map(|r| r.keys.keys().map(|k| (*k, ())))
            .collect()
    }

    /// Writes the live retentions to [`FILE`] (a store with a disk tier, closing).
    pub(crate) fn save_retentions(&self) {
        let Some(path) = &self.retain_file else {
            return;
        };
        let now = Instant::now();
        let now_ms = unix_ms(std::time::SystemTime::now());
        let saved: Vec<Saved> = {
            let t = self.retained.lock();
            let mut v: Vec<(Instant, Saved)> = t
                .live
                .iter()
                .filter(|(_, r)| r.deadline > now)
                .map(|(name, r)| {
                    let left = r.deadline.duration_since(now).as_millis() as u64;
                    let s = Saved {
                        session: match name {
                            Name::Session(s) => Some(s.clone()),
                            Name::Anon(_) => None,
                        },
                        priority: r.priority,
                        until_ms: now_ms.saturating_add(left),
                        keys: r.pins.iter().map(|(p, _)| pin_key(p)).collect(),
                    };
                    (r.deadline, s)
                })
                .collect();
            // Restored in this order: lower priorities and earlier ends first, as the bounds
            // would have them give way.
            v.sort_by_key(|(d, s)| (s.priority, *d));
            v.into_iter().map(|(_, s)| s).collect()
        };
        if saved.is_empty() {
            let _ = std::fs::remove_file(path);
            return;
        }
        let tmp = path.with_extension("tmp");
        let written = (|| -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&encode(&saved))?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        match written {
            Ok(()) => tracing::info!(
                retentions = saved.len(),
                path = %path.display(),
                "retentions kept for the next start"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                path = %path.display(),
                "retentions could not be kept for the next start"
            ),
        }
    }

    /// Reads [`FILE`] once (removing it) and retains each saved retention again for what is
    /// left of its TTL.
    pub(crate) fn restore_retentions(&self) {
        let Some(path) = &self.retain_file else {
            return;
        };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "retentions file unreadable: none restored");
                return;
            }
        };
        // Once: a crash later in this run must not bring back what this run ends.
        let _ = std::fs::remove_file(path);
        let saved = match decode(&bytes) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "retentions file unreadable: none restored");
                return;
            }
        };
        let (restored, expired) = self.retain_saved(saved, unix_ms(std::time::SystemTime::now()));
        tracing::info!(restored, expired, "retentions restored after a restart");
    }

    /// Retains each of `saved` whose TTL has not ended at `now_ms`; (restored, expired).
    fn retain_saved(&self, saved: Vec<Saved>, now_ms: u64) -> (usize, usize) {
        let (mut restored, mut expired) = (0, 0);
        for s in saved {
            if s.until_ms <= now_ms {
                expired += 1;
                continue;
            }
            let ttl = Duration::from_millis(s.until_ms - now_ms);
            let r = self.retain(s.session.as_deref(), &s.keys, ttl, s.priority);
            if r.refused.is_empty() && r.retained > 0 {
                restored += 1;
            }
        }
        (restored, expired)
    }

    /// Ends the retentions whose TTL passed; returns how many.
    pub(crate) fn reap_retained(&self, now: Instant) -> usize {
        let gone: Vec<Retention> = {
            let mut t = self.retained.lock();
            if t.earliest.is_none_or(|e| e > now) {
                return 0;
            }
            let names: Vec<Name> = t
                .live
                .iter()
                .filter(|(_, r)| r.deadline <= now)
                .map(|(n, _)| n.clone())
                .collect();
            let gone = names.iter().filter_map(|n| t.take(n)).collect();
            t.recompute_earliest();
            gone
        };
        let n = gone.len();
        self.stats.retain_expired.fetch_add(n as u64, Relaxed);
        for r in gone {
            self.drop_pins(r.pins.into_iter().map(|(p, _)| p).collect());
        }
        n
    }

    fn retain(
        &self,
        session: Option<&str>,
        keys: &[BlockKey],
        ttl: Duration,
        priority: u8,
    ) -> Retained {
        let now = Instant::now();
        self.reap_retained(now);
        self.stats.retains.fetch_add(1, Relaxed);
        let mut out = Retained::default();
        if self.retain_max_bytes == 0 {
            out.refused = "retention is off (its bound on retained bytes is 0)".into();
            return out;
        }
        if session.is_some_and(|s| s.is_empty() || s.len() > MAX_SESSION_BYTES) {
            out.refused = format!("a session name is 1 to {MAX_SESSION_BYTES} bytes");
            return out;
        }
        out.ttl = ttl.min(self.retain_max_ttl);
        if out.ttl < ttl {
            out.clipped_by.push(RetainBound::Ttl);
        }
        // Pin the present prefix first (no table lock held), then record it.
        let mut pinned: Vec<(Pin, u64)> = Vec::new();
        let mut seen = FoldMap::default();
        for k in keys {
            let mk = MapKey::from(*k);
            if seen.insert(mk, ()).is_some() {
                break;
            }
            let host = self.shard(*k).lock().pin(mk);
            match host {
                Ok(Some(e)) => {
                    // Pinned: its slot (and the length its class keeps for it) stays.
                    let len = self.len_of(e.slot());
                    pinned.push((Pin::Host(*k, e.slot()), u64::from(len)));
                    continue;
                }
                Ok(None) => {}
                Err(_) => break,
            }
            let below = self.tiers.iter().enumerate().find_map(|(i, t)| {
                if !t.local() {
                    return None;
                }
                let info = t.lookup(k)?;
                t.pin(k).then_some((i, u64::from(info.len)))
            });
            match below {
                Some((i, len)) => pinned.push((Pin::Lower(i as u8, *k), len)),
                None => break,
            }
        }
        out.present = pinned.len();
        let mut unpin: Vec<Pin> = Vec::new();
        let mut displaced: Vec<Retention> = Vec::new();
        {
            let mut t = self.retained.lock();
            let name = match session {
                Some(s) => Name::Session(s.to_string()),
                None => {
                    t.next_anon += 1;
                    Name::Anon(t.next_anon)
                }
            };
            let mut mine = match t.take(&name) {
                Some(r) => r,
                None if t.live.len() >= MAX_RETENTIONS => {
                    drop(t);
                    self.drop_pins(pinned.into_iter().map(|(p, _)| p).collect());
                    out.refused = format!(
                        "{MAX_RETENTIONS} retentions are live: demote finished sessions first"
                    );
                    out.present = 0;
                    return out;
                }
                None => Retention {
                    pins: Vec::new(),
                    keys: FoldMap::default(),
                    bytes: 0,
                    deadline: now,
                    priority,
                },
            };
            // Blocks the session holds already keep their one pin.
            let mut fresh = Vec::new();
            for (p, len) in pinned {
                if mine.keys.contains_key(&MapKey::from(pin_key(&p))) {
                    unpin.push(p);
                } else {
                    fresh.push((p, len));
                }
            }
            let need: u64 = fresh.iter().map(|(_, l)| l).sum();
            // Room: first what is free, then lower-priority retentions, earliest deadline
            // first.
            let free = |t: &Retentions| self.retain_max_bytes.saturating_sub(t.bytes + mine.bytes);
            // A TTL too far for the clock (a huge preload.max_retain_ms): a century.
            let deadline = now
                .checked_add(out.ttl)
                .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
                .unwrap_or(now);
            if need > free(&t) {
                // Lower priorities first; then, of equal priority, those that would end before
                // this one (the session the application came back to least recently).
                let mut lower: Vec<(u8, Instant, Name)> = t
                    .live
                    .iter()
                    .filter(|(_, r)| {
                        r.priority < priority || (r.priority == priority && r.deadline < deadline)
                    })
                    .map(|(n, r)| (r.priority, r.deadline, n.clone()))
                    .collect();
                lower.sort();
                for (_, _, n) in lower {
                    if need <= free(&t) {
                        break;
                    }
                    if let Some(r) = t.take(&n) {
                        out.displaced += r.pins.len();
                        displaced.push(r);
                    }
                }
            }
            // Keep the leading blocks that fit.
            let mut room = free(&t);
            for (p, len) in fresh {
                if len <= room {
                    room -= len;
                    mine.keys.insert(MapKey::from(pin_key(&p)), ());
                    mine.bytes += len;
                    mine.pins.push((p, len));
                } else {
                    out.clipped += 1;
                    unpin.push(p);
                }
            }
            if out.clipped > 0 {
                out.clipped_by.push(RetainBound::Bytes);
                // Past the first block left out the rest is no longer a prefix for this
                // retention: still held (pins are per block), and reported.
            }
            mine.deadline = deadline;
            mine.priority = priority;
            out.retained = mine.pins.len();
            out.bytes = mine.bytes;
            if mine.pins.is_empty() {
                // Nothing held: no entry (a session with nothing retained is no session).
            } else {
                t.bytes += mine.bytes;
                t.blocks += mine.pins.len() as u64;
                t.earliest = Some(t.earliest.map_or(mine.deadline, |e| e.min(mine.deadline)));
                t.live.insert(name, mine);
            }
            if !displaced.is_empty() {
                t.recompute_earliest();
            }
        }
        self.stats
            .retain_clipped
            .fetch_add(out.clipped as u64, Relaxed);
        self.stats
            .retain_displaced
            .fetch_add(displaced.len() as u64, Relaxed);
        self.drop_pins(unpin);
        for r in displaced {
            self.drop_pins(r.pins.into_iter().map(|(p, _)| p).collect());
        }
        out
    }

    fn demote(&self, session: Option<&str>, keys: &[BlockKey]) -> Demoted {
        self.reap_retained(Instant::now());
        self.stats.demotes.fetch_add(1, Relaxed);
        let mut out = Demoted::default();
        // The blocks to move: the session's (in retain order), then the keys given.
        let mut targets: Vec<BlockKey> = Vec::new();
        let mut released: Vec<Pin> = Vec::new();
        {
            let mut t = self.retained.lock();
            if let Some(s) = session {
                if let Some(r) = t.take(&Name::Session(s.to_string())) {
                    targets.extend(r.pins.iter().map(|(p, _)| pin_key(p)));
                    released.extend(r.pins.into_iter().map(|(p, _)| p));
                }
            }
            if !keys.is_empty() {
                let wanted: FoldMap<MapKey, ()> =
                    keys.iter().map(|k| (MapKey::from(*k), ())).collect();
                let (mut bytes, mut blocks) = (0u64, 0u64);
                for r in t.live.values_mut() {
                    if !r.keys.keys().any(|k| wanted.contains_key(k)) {
                        continue;
                    }
                    let before = r.pins.len();
                    let mut keep = Vec::with_capacity(before);
                    for (p, len) in r.pins.drain(..) {
                        let mk = MapKey::from(pin_key(&p));
                        if wanted.contains_key(&mk) {
                            r.keys.remove(&mk);
                            r.bytes -= len;
                            bytes += len;
                            released.push(p);
                        } else {
                            keep.push((p, len));
                        }
                    }
                    blocks += (before - keep.len()) as u64;
                    r.pins = keep;
                }
                t.bytes -= bytes;
                t.blocks -= blocks;
                t.live.retain(|_, r| !r.pins.is_empty());
                t.recompute_earliest();
            }
        }
        out.released = released.len();
        // Released before moving: a block this demote released is no longer busy for it.
        self.drop_pins(released);
        let mut seen = FoldMap::default();
        targets.extend_from_slice(keys);
        let mut queue: Vec<Demote> = Vec::new();
        let mut cool: Vec<(BlockKey, Slot)> = Vec::new();
        for k in targets {
            let mk = MapKey::from(k);
            if seen.insert(mk, ()).is_some() {
                continue;
            }
            let mut sh = self.shard(k).lock();
            let super::index::Shard { map, pins } = &mut *sh;
            let Some(mut e) = map.get_mut(&mk).filter(|e| e.ready()) else {
                out.not_in_host += 1;
                continue;
            };
            match e.copy() {
                _ if e.pinned() && e.copy() != Copy::Demoting => out.busy += 1,
                Copy::Clean => {
                    let (slot, ns) = (e.slot(), e.ns);
                    drop(e);
                    map.remove(&mk);
                    self.events.emit(EventKind::Removed, k, Tier::Host, ns);
                    drop(sh);
                    self.free_published(slot);
                    self.stats.blocks.fetch_sub(1, Relaxed);
                    out.freed += 1;
                }
                Copy::Demoting => {
                    e.set_drop_when_written(true);
                    out.queued += 1;
                }
                Copy::Dirty if self.demote_to.is_some() => {
                    // Unpinned (above): the first pin cannot overflow.
                    if pins.add(&mut e).is_err() {
                        out.busy += 1;
                        continue;
                    }
                    e.set_copy(Copy::Demoting);
                    e.set_drop_when_written(true);
                    let (slot, ns) = (e.slot(), e.ns);
                    drop(e);
                    drop(sh);
                    let class = slot.class as usize;
                    // Pinned for the writer: its slot and length stay.
                    let (page, len) = {
                        let c = self.classes[class].lock();
                        (
                            c.page_of(slot.idx, self.seg_pages),
                            c.lens[slot.idx as usize],
                        )
                    };
                    queue.push(Demote {
                        key: k,
                        slot,
                        page,
                        cap: self.class_sizes[class],
                        len,
                        ns,
                    });
                    out.queued += 1;
                }
                Copy::Dirty | Copy::Unwritable => {
                    cool.push((k, e.slot()));
                    out.kept += 1;
                }
            }
        }
        if !queue.is_empty() {
            self.enqueue_demotions(queue);
        }
        // Kept (nowhere to write them): their policy evicts them first when room is needed.
        // Under the class lock only (it comes before the shards); a slot freed and taken by
        // another block meanwhile is left alone.
        cool.sort_by_key(|(_, s)| s.class);
        for run in cool.chunk_by(|a, b| a.1.class == b.1.class) {
            let mut c = self.classes[run[0].1.class as usize].lock();
            for (k, s) in run {
                let i = s.idx as usize;
                // The slot still holds this key's block (by its index hash: a 32-bit
                // collision would only cool another block, and cooling is a hint).
                if c.is_used(s.idx) && c.hashes[i] == super::table::hash(MapKey::from(*k)) {
                    c.policy.cool(s.idx);
                }
            }
        }
        self.stats
            .demoted_freed
            .fetch_add(out.freed as u64, Relaxed);
        self.stats
            .demoted_queued
            .fetch_add(out.queued as u64, Relaxed);
        out
    }
}

#[cfg(test)]
#[path = "retain_tests.rs"]
mod tests;

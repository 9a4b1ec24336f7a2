//! Preloading from hints: an engine's scheduler says which blocks a request will load (in
//! prefix order) as soon as the request arrives, and the tiering worker's reader promotes the
//! ones found only in a lower tier into host memory while the request waits in the queue, so
//! the load that follows reads host memory only.
//!
//! - A hint reserves host slots (without waiting for room) and queues one preload job per
//!   lower tier; blocks already being promoted are counted, not queued again (a shared prefix
//!   is read once, however many requests hint it); blocks in host memory are held for the load
//!   (below), so that a request far back in the queue still finds them when its turn comes.
//! - Bytes of preloads queued or being read are bounded (`prefetch_max_inflight_bytes`). The
//!   rest of a hint that does not fit (or finds no host room without waiting) waits, in arrival
//!   order, in a bounded list: the reader resumes waiting hints as room comes back (a load uses
//!   a held block, a preload finishes, a hold lapses), so the requests at the head of the
//!   engine's queue get their blocks first however long the queue is. Once a hint waits, later
//!   hints wait behind it.
//! - Real loads go first: the reader takes every load's promotion before any preload, and a
//!   load that waits for a block a queued preload holds moves that job to the front. A hint's
//!   blocks are read in jobs of at most `PRELOAD_JOB_BYTES` (1 MiB), so a load that arrives
//!   while a preload is read waits for one such job, not for a whole request's blocks.
//! - A preload whose deadline passed before the reader reached it is dropped unread; `cancel`
//!   drops the queued preloads of a tag (an aborted or finished request) and ends the holds it
//!   made; an engine's disconnect cancels all its hints.
//! - A preloaded block is held in host memory (it keeps the promotion's pin: eviction leaves it)
//!   until a load uses it or its hint's deadline passes; then it is an ordinary clean block.
//!   One hold per block, however many hints name it: the first load ends it.
//!   Held bytes and those in flight together are bounded too (`prefetch_max_held_bytes`, by
//!   default an eighth of the host tier), so hints can never take more host memory than
//!   that. Bytes a preload read and no load used before its hint ended (deadline or cancel)
//!   are counted as wasted. An engine ends a hint once its request's load is done (the vLLM
//!   connector: its load finished, or it was scheduled with nothing to load), so what the hint
//!   still holds or has waiting does not take the room of the requests behind it.
//! - A tagged hint whose prefix ends at a block not stored yet (absent, or being written) keeps
//!   its rest until that block is committed (bounded like the waiting list): a request further
//!   back in the queue often shares blocks that an earlier one is computing, and once saved
//!   they are held for it as they arrive, so they do not go down to disk before its load
//!   (issue 30: most disk reads left on the critical path were of such blocks).
//! - A hint whose prefix is cached (partly) tells the store which blocks continue it: the
//!   first 4 blocks (`CONTINUATION`) after the present prefix count as seen once (seen-twice
//!   admission's doorkeeper), so they go to disk once the engine has saved them and they leave
//!   host memory (a conversation's new turn is the next turn's prefix).
//! - Per client ([`PrefetchQuota`], [`Store::prefetch_as`]): the bytes one owner's hints hold
//!   or have in flight, and the keys it has waiting, are bounded by its quota (the daemon gives
//!   each engine connection its share), so one engine cannot take the preload room of the
//!   others; the reader resumes the first waiting hint whose owner has room.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use crate::key::BlockKey;
use crate::types::{FoldMap, MapKey};

use super::index::{Life, Slot};
use super::tiering::{Hint, Promote};
use super::{Inner, Store};

/// Counters of preload hints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Blocks queued for preloading by hints.
    pub hinted: u64,
    /// Preloaded blocks a load found in host memory (the preload finished in time).
    pub in_time: u64,
    /// Preloaded blocks a load had to wait for (the preload was still queued or being read).
    pub late: u64,
    /// Preloads cancelled before they were read, and holds ended, because their request (or
    /// its engine) went away.
    pub cancelled: u64,
    /// Preloads dropped unread because their deadline passed first.
    pub expired: u64,
    /// Blocks a hint found below and gave up on: the list of hints waiting for room was full,
    /// or another hint took the room it had planned on.
    pub dropped: u64,
    /// Hints (or their rest) that waited for room (the preload bounds or host memory) and
    /// resumed, in order, as room came back.
    pub waited: u64,
    /// Keys of hints waiting for room now.
    pub waiting_keys: u64,
    /// Keys of hints whose prefix ended at a block not stored yet, until it is (then they
    /// wait for room like the others).
    pub watching_keys: u64,
    /// Bytes of preloaded blocks no load used before their hint ended (its deadline passed,
    /// or it was cancelled).
    pub wasted_bytes: u64,
    /// Bytes of preloads queued or being read now.
    pub inflight_bytes: u64,
    /// Bytes of preloaded blocks held in host memory for the load they were hinted for.
    pub held_bytes: u64,
    /// Preload jobs queued now.
    pub queued_jobs: u64,
}

/// What one hint did, along the prefix of its keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prefetch {
    /// Leading keys present in some tier (the prefix the hint covers).
    pub present: usize,
    /// Of those, in host memory already.
    pub in_host: usize,
    /// Being promoted already (by a load or an earlier hint): joined, not read twice.
    pub joined: usize,
    /// Queued for preloading by this hint.
    pub queued: usize,
    /// Found below but given up on (see [`PrefetchStats::dropped`]).
    pub dropped: usize,
    /// Keys from the first one that did not fit on, left waiting for room: the hint resumes
    /// there, behind earlier waiting hints, as room comes back (before its deadline).
    pub waiting: usize,
    /// Of those in host memory, held for the load by this hint.
    pub held: usize,
}

/// What one client's hints may take: bytes held or in flight, and keys waiting for room.
/// Owner 0 is not accounted (the embedded store's own engine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchQuota {
    /// Who hints (the daemon: one id per engine connection).
    pub owner: u64,
    /// Most bytes its hints may hold in host memory or have queued or being read.
    pub max_bytes: u64,
    /// Most keys of its hints waiting for room.
    pub max_waiting_keys: usize,
}

impl PrefetchQuota {
    /// No per-client bound (the store's own bounds still apply).
    pub const NONE: PrefetchQuota = PrefetchQuota {
        owner: 0,
        max_bytes: u64::MAX,
        max_waiting_keys: usize::MAX,
    };
}

/// A count per owner (owner 0 is not counted); entries at zero are dropped.
#[derive(Default)]
pub(crate) struct PerOwner(std::collections::HashMap<u64, u64>);

impl PerOwner {
    pub(crate) fn add(&mut self, owner: u64, n: u64) {
        if owner != 0 && n > 0 {
            *self.0.entry(owner).or_default() += n;
        }
    }

    pub(crate) fn sub(&mut self, owner: u64, n: u64) {
        if let Some(v) = self.0.get_mut(&owner) {
            *v = v.saturating_sub(n);
            if *v == 0 {
                self.0.remove(&owner);
            }
        }
    }

    pub(crate) fn get(&self, owner: u64) -> u64 {
        self.0.get(&owner).copied().unwrap_or(0)
    }

    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

impl Store {
    /// Hints that `keys` (a prefix, in order) will be loaded soon: blocks found only in a
    /// lower tier are promoted into host memory in the background, in `priority` order (higher
    /// first, after every real load), unless `deadline` passes before the worker gets to them.
    /// `tag` names the hint for [`Store::cancel_prefetch`]. Never waits and never does I/O
    /// itself.
    pub fn prefetch(
        &self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Instant,
        tag: u64,
    ) -> Prefetch {
        self.prefetch_as(keys, priority, deadline, tag, PrefetchQuota::NONE)
    }

    /// [`Store::prefetch`] on behalf of one client, within its quota: what does not fit the
    /// quota waits for the client's own holds to end (or is dropped when its waiting keys are
    /// at their bound).
    pub fn prefetch_as(
        &self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Instant,
        tag: u64,
        quota: PrefetchQuota,
    ) -> Prefetch {
        self.inner.prefetch(keys, priority, deadline, tag, quota)
    }

    /// Cancels the hint `tag` (its request was aborted or finished): its preloads that have
    /// not started, its rest still waiting for room, and the holds it made on blocks for its
    /// load (they become ordinary cached blocks). Returns how many blocks that was. Preloads
    /// being read finish, and their blocks are held until the hint's deadline.
    pub fn cancel_prefetch(&self, tag: u64) -> usize {
        self.inner.cancel_prefetch_where(|t, _| t == tag)
    }

    /// [`Store::cancel_prefetch`] on behalf of one client ([`PrefetchQuota::owner`]): only its
    /// own hints, whatever tag another client chose (a client of the daemon's socket cannot
    /// cancel another's preloads or end its holds).
    pub fn cancel_prefetch_as(&self, tag: u64, owner: u64) -> usize {
        self.inner
            .cancel_prefetch_where(|t, o| t == tag && o == owner)
    }

    /// [`Store::cancel_prefetch`] for every hint of one client ([`PrefetchQuota::owner`]): the
    /// daemon calls it when an engine disconnects.
    pub fn cancel_prefetch_of_owner(&self, owner: u64) -> usize {
        if owner == 0 {
            return 0;
        }
        self.inner.cancel_prefetch_where(|_, o| o == owner)
    }
}

/// Most bytes of one preload job (a hint's blocks of one tier are read in jobs of this size,
/// in prefix order; a block larger than this is a job of its own): what a real load waits for
/// at most when it arrives while its tier's reader reads a preload.
pub const PRELOAD_JOB_BYTES: u64 = 1 << 20;

/// Most keys of hints waiting for room, all together (16 bytes each).
pub const PREFETCH_WAITING_KEYS_MAX: usize = 1 << 18;
use PREFETCH_WAITING_KEYS_MAX as WAITING_KEYS_MAX;

/// The rest of a hint waiting for room.
pub(crate) struct Waiting {
    pub keys: Vec<BlockKey>,
    pub priority: u8,
    pub deadline: Instant,
    pub tag: u64,
    pub quota: PrefetchQuota,
    /// Its owner's bytes held or in flight when the owner's quota (not the store's room) cut
    /// the hint: it resumes once they are fewer.
    pub owner_full_at: Option<u64>,
}

/// A preloaded block held for its load: the slot the promotion's pin is on, until when, its
/// bytes.
#[derive(Clone, Copy)]
pub(crate) struct Held {
    pub slot: super::index::Slot,
    pub deadline: Instant,
    pub bytes: u64,
    /// Read from a lower tier by the preload (else it was in host memory at the hint, held
    /// so that eviction leaves it until its load).
    pub read: bool,
    /// The hint's owner ([`PrefetchQuota::owner`]).
    pub owner: u64,
    /// The tag of the hint that made the hold (one hold per block: the first hint's).
    pub tag: u64,
}

/// The preloaded blocks held for their loads, and the earliest deadline among them (so a
/// reap that finds nothing due costs one comparison).
#[derive(Default)]
pub(crate) struct Holds {
    map: std::collections::HashMap<MapKey, Held>,
    earliest: Option<Instant>,
}

impl Holds {
    /// Records a hold; returns the one it replaces (of a block removed while held), whose pin
    /// the caller drops.
    pub(crate) fn insert(&mut self, key: MapKey, h: Held) -> Option<Held> {
        self.earliest = Some(self.earliest.map_or(h.deadline, |e| e.min(h.deadline)));
        self.map.insert(key, h)
    }

    pub(crate) fn contains(&self, key: &MapKey) -> bool {
        self.map.contains_key(key)
    }

    pub(crate) fn remove(&mut self, key: &MapKey) -> Option<Held> {
        self.map.remove(key)
    }
}

impl Inner {
    /// Bytes preloads may still take: the in-flight bound less those queued or being read,
    /// and the held bound less those and the ones held.
    pub(crate) fn prefetch_room(&self) -> u64 {
        let inflight = self.work.reads.prefetch_bytes();
        let held = self.held_bytes.load(Relaxed);
        self.prefetch_max_inflight
            .saturating_sub(inflight)
            .min(self.prefetch_max_held.saturating_sub(inflight + held))
    }

    /// A load just pinned `key`, which a hint held: the hold ends. True if the hint's preload
    /// read it from a lower tier (a preload in time), false if it was held in host memory.
    pub(crate) fn release_preload(&self, key: BlockKey) -> bool {
        let held = self.preloads.lock().remove(&MapKey::from(key));
        match held {
            Some(h) => {
                self.drop_hold(key, h);
                h.read
            }
            None => false,
        }
    }

    /// Bytes `owner`'s hints hold or have in flight.
    pub(crate) fn owner_bytes(&self, owner: u64) -> u64 {
        // One lock: the read queue keeps both counts (they were behind two locks taken in
        // opposite orders by a hint and by reader 0: issue 35's deadlock).
        self.work.reads.owner_bytes(owner)
    }

    /// Counts a new hold.
    pub(crate) fn add_hold_bytes(&self, owner: u64, bytes: u64) {
        self.held_bytes.fetch_add(bytes, Relaxed);
        self.work.reads.add_held(owner, bytes);
    }

    /// Drops a hold's pin and bytes.
    pub(crate) fn drop_hold(&self, key: BlockKey, h: Held) {
        self.held_bytes.fetch_sub(h.bytes, Relaxed);
        self.work.reads.sub_held(h.owner, h.bytes);
        self.unpin(key, h.slot);
        self.work.reads.room_changed();
    }

    /// Holds `key`, Ready in host memory in `slot` with `bytes` bytes, for the hint's load
    /// until `deadline` (one pin, so eviction leaves it); false if it is held already, no
    /// longer Ready, or no longer in that slot. Lock order: the holds, then the shard (nothing
    /// takes them the other way round).
    fn hold_in_host(
        &self,
        key: BlockKey,
        (slot, bytes): (Slot, u64),
        deadline: Instant,
        owner: u64,
        tag: u64,
    ) -> bool {
        let mk = MapKey::from(key);
        let mut holds = self.preloads.lock();
        if holds.contains(&mk) {
            return false;
        }
        let e = {
            let mut sh = self.shard(key).lock();
            match sh.map.get(&mk) {
                Some(e) if e.slot() == slot => {}
                _ => return false,
            }
            let Ok(Some(e)) = sh.pin(mk) else {
                return false;
            };
            if let Some(mut x) = sh.map.get_mut(&mk) {
                x.set_preloaded(true);
            }
            e
        };
        holds.insert(
            mk,
            Held {
                slot: e.slot(),
                deadline,
                bytes,
                read: false,
                owner,
                tag,
            },
        );
        self.add_hold_bytes(owner, bytes);
        true
    }

    /// Ends the holds whose deadline passed (their blocks were never used: wasted).
    pub(crate) fn reap_preloads(&self, now: Instant) {
        if self.preloads.lock().earliest.is_none_or(|e| e > now) {
            return;
        }
        self.end_holds_where(|h| h.deadline <= now, true);
    }

    /// Ends the holds `end` picks: their blocks become ordinary cached blocks (with `wasted`,
    /// the bytes preloads read for them are counted as wasted). Returns how many.
    pub(crate) fn end_holds_where(&self, end: impl Fn(&Held) -> bool, wasted: bool) -> usize {
        let gone: Vec<(MapKey, Held)> = {
            let mut m = self.preloads.lock();
            let keys: Vec<MapKey> = m
                .map
                .iter()
                .filter(|(_, h)| end(h))
                .map(|(k, _)| *k)
                .collect();
            if keys.is_empty() {
                return 0;
            }
            let gone: Vec<(MapKey, Held)> = keys
                .into_iter()
                .filter_map(|k| m.map.remove(&k).map(|h| (k, h)))
                .collect();
            m.earliest = m.map.values().map(|h| h.deadline).min();
            gone
        };
        let n = gone.len();
        for (mk, h) in gone {
            let key = BlockKey::from(mk);
            if let Some(mut e) = self.shard(key).lock().map.get_mut(&mk) {
                if e.slot() == h.slot {
                    e.set_preloaded(false);
                }
            }
            if wasted && h.read {
                self.stats.prefetch_wasted_bytes.fetch_add(h.bytes, Relaxed);
            }
            self.drop_hold(key, h);
        }
        n
    }

    fn prefetch(
        &self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Instant,
        tag: u64,
        quota: PrefetchQuota,
    ) -> Prefetch {
        self.reap_preloads(Instant::now());
        // Hints wait for room in order: behind any already waiting.
        let behind = self.work.reads.hints_waiting();
        let out = self
            .walk_hint(keys, priority, deadline, tag, quota, behind, false)
            .0;
        self.continues(keys, out.present);
        out
    }

    /// A waiting hint's turn (the reader, as room came back): true if it made progress.
    pub(crate) fn resume_hint(&self, w: Waiting) -> bool {
        if Instant::now() >= w.deadline {
            self.stats
                .prefetch_expired
                .fetch_add(w.keys.len() as u64, Relaxed);
            return true;
        }
        self.reap_preloads(Instant::now());
        let (out, quota_cut) =
            self.walk_hint(&w.keys, w.priority, w.deadline, w.tag, w.quota, false, true);
        // Cut by its owner's quota: it waits for that owner, not for the store's room (the
        // reader goes on with the other waiting hints).
        out.queued + out.held > 0 || out.waiting < w.keys.len() || quota_cut
    }

    /// Walks a hint's prefix: holds host blocks, queues the promotion of blocks below; from the
    /// first one that does not fit (or all, if `behind`), the rest waits for room (at the
    /// front of the waiting list if `resumed`, so a resumed hint keeps its place). Within
    /// `quota` for its owner; true with it if that quota (not the store's room) cut the hint.
    #[allow(clippy::too_many_arguments)]
    fn walk_hint(
        &self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Instant,
        tag: u64,
        quota: PrefetchQuota,
        behind: bool,
        resumed: bool,
    ) -> (Prefetch, bool) {
        let mut out = Prefetch::default();
        let room = self.prefetch_room();
        let owner_bytes = self.owner_bytes(quota.owner);
        let quota_room = quota.max_bytes.saturating_sub(owner_bytes);
        // Whether `len` more bytes fit beside `planned`: the store's room, and the owner's
        // quota (an owner holding nothing may always take one block, however small its quota).
        let fits = |planned: u64, len: u64| {
            planned + len <= room && (planned + len <= quota_room || owner_bytes + planned == 0)
        };
        // Whether the owner's quota, not the store's room, cut the hint.
        let mut quota_cut = false;
        let mut planned = 0u64;
        let mut full = behind;
        // The first key not taken for want of room.
        let mut cut: Option<usize> = behind.then_some(0);
        // (tier, items, bytes)
        let mut batches: Vec<(usize, Vec<Promote>, u64)> = Vec::new();
        let mut seen = FoldMap::default();
        let mut far = None;
        // Where the prefix ended at a block not stored yet (absent, or being written).
        let mut ended: Option<usize> = None;
        for (i, k) in keys.iter().enumerate() {
            let mk = MapKey::from(*k);
            if seen.insert(mk, ()).is_some() {
                break;
            }
            let found = self
                .shard(*k)
                .lock()
                .map
                .get(&mk)
                .map(|e| (e.life(), e.slot()));
            match found {
                Some((Life::Ready, slot)) => {
                    // Read after the shard's lock (the class's comes first in the order):
                    // `hold_in_host` holds the block only if it is still in this slot.
                    let len = u64::from(self.len_of(slot));
                    out.present += 1;
                    out.in_host += 1;
                    // Held for the load, so that the hints of requests further back in the
                    // queue cannot see it evicted before its load (within the same budget).
                    if full || !fits(planned, len) {
                        if !full {
                            quota_cut = planned + len <= room;
                        }
                        full = true;
                        cut.get_or_insert(i);
                    } else if self.hold_in_host(*k, (slot, len), deadline, quota.owner, tag) {
                        planned += len;
                        out.held += 1;
                    }
                    continue;
                }
                Some((Life::Promoting, _)) => {
                    out.present += 1;
                    out.joined += 1;
                    continue;
                }
                // Being written or removed: the prefix ends here for now.
                Some((Life::Filling | Life::Cancelled, _)) => {
                    ended = Some(i);
                    break;
                }
                None => {}
            }
            // The local tiers, then the remote tier: remote blocks are preloaded too.
            let Some((ti, info)) = self.find_below_or_far(keys, i, true, &mut far) else {
                ended = Some(i);
                break;
            };
            out.present += 1;
            let len = u64::from(info.len);
            if full || !fits(planned, len) {
                if !full {
                    quota_cut = planned + len <= room;
                }
                full = true;
                cut.get_or_insert(i);
                continue;
            }
            let Ok(class) = self.class_for(info.len as usize) else {
                break;
            };
            // No waiting for room here: the rest of the hint waits for it in the list.
            let Ok((slot, page)) = self.alloc(class, *k, info.len as usize, Instant::now()) else {
                full = true;
                cut.get_or_insert(i);
                continue;
            };
            {
                let mut sh = self.shard(*k).lock();
                if sh.map.contains_key(&mk) {
                    drop(sh);
                    self.free_slot(slot);
                    out.joined += 1;
                    continue;
                }
                sh.insert_promoting(mk, slot, info.ns);
            }
            let item = Promote {
                key: *k,
                slot,
                page,
                cap: self.class_sizes[class],
                len: info.len,
            };
            planned += len;
            // Jobs of at most PRELOAD_JOB_BYTES (or one block): a real load that arrives while
            // the reader reads a preload waits for one small job, not a whole request's.
            match batches
                .iter_mut()
                .rev()
                .find(|(t, _, _)| *t == ti)
                .filter(|(_, _, b)| *b + len <= PRELOAD_JOB_BYTES)
            {
                Some(b) => {
                    b.1.push(item);
                    b.2 += len;
                }
                None => batches.push((ti, vec![item], len)),
            }
        }
        for (ti, items, bytes) in batches {
            let n = items.len();
            let hint = Hint {
                tag,
                priority,
                deadline,
                bytes,
                owner: quota.owner,
            };
            match self.enqueue_prefetch(ti, items, hint) {
                Ok(()) => out.queued += n,
                Err(items) => {
                    // Another hint took the room meanwhile: undone, counted as dropped.
                    self.undo_prefetch(&items);
                    out.dropped += n;
                }
            }
        }
        if let Some(i) = cut {
            // The rest up to where the prefix ended (or all of it: keys past the present ones
            // may arrive meanwhile, a request's own earlier blocks being saved).
            let rest = keys[i..].to_vec();
            let n = rest.len();
            let w = Waiting {
                keys: rest,
                priority,
                deadline,
                tag,
                quota,
                owner_full_at: quota_cut.then_some(owner_bytes + planned),
            };
            if self.work.reads.wait_hint(w, resumed, WAITING_KEYS_MAX) {
                out.waiting = n;
                if !resumed {
                    self.stats.prefetch_waited.fetch_add(1, Relaxed);
                }
            } else {
                out.dropped += out.present.saturating_sub(i);
            }
        } else if let Some(i) = ended.filter(|_| tag != 0) {
            // The prefix ends at a block not stored yet: an earlier request may be computing
            // it. The rest waits for that block's commit (see `Reads::watch`). Only a hint
            // with a tag, which its engine ends once its request has loaded: an untagged one
            // would hold the blocks its own request computes and saves, until its deadline.
            self.watch_rest(keys, i, priority, deadline, tag, quota);
        }
        self.stats
            .prefetch_hinted
            .fetch_add(out.queued as u64, Relaxed);
        self.stats
            .prefetch_dropped
            .fetch_add(out.dropped as u64, Relaxed);
        (out, quota_cut)
    }

    /// Keeps `keys[i..]` until `keys[i]` is committed, then it resumes like a hint waiting
    /// for room. (Committed meanwhile: resumed now; a commit after the watch was recorded
    /// finds it itself.)
    fn watch_rest(
        &self,
        keys: &[BlockKey],
        i: usize,
        priority: u8,
        deadline: Instant,
        tag: u64,
        quota: PrefetchQuota,
    ) {
        let at = keys[i];
        let w = Waiting {
            keys: keys[i..].to_vec(),
            priority,
            deadline,
            tag,
            quota,
            owner_full_at: None,
        };
        if !self.work.reads.watch(at, w, WAITING_KEYS_MAX) {
            return;
        }
        let stored = self
            .shard(at)
            .lock()
            .map
            .get(&MapKey::from(at))
            .is_some_and(|e| e.life() == Life::Ready);
        if stored {
            self.work.reads.arrived(at);
        }
    }

    /// Gives back the slots of preload items that were never queued.
    fn undo_prefetch(&self, items: &[Promote]) {
        for p in items {
            self.shard(p.key).lock().abort(MapKey::from(p.key), p.slot);
            self.free_slot(p.slot);
        }
        self.progress.bump();
    }
}

#[cfg(test)]
#[path = "prefetch_tests.rs"]
mod tests;

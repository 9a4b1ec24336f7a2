//! Finding a host slot for a block. Never I/O: a dirty block that must leave is queued for the
//! tiering worker (pinned, marked Demoting) and the allocation takes something else or waits,
//! with one deadline, for the worker to make room (back-pressure, counted in `waits`).
//!
//! Order for class `c`: a free slot of `c`; a populated segment from the pool; an *empty*
//! segment of another class (no eviction); a victim from `c`'s policy (clean, or refused by
//! admission, or with no tier below); a whole segment taken from another class (its chunk with
//! the fewest live blocks, all of them evictable).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use crate::error::StoreError;
use crate::events::EventKind;
use crate::key::BlockKey;
use crate::types::{MapKey, Tier};

use super::index::{Copy, Slot};
use super::slab::page_of;
use super::tiering::Demote;
use super::Inner;

impl Inner {
    pub(crate) fn class_for(&self, len: usize) -> Result<usize, StoreError> {
        if len == 0 {
            return Err(StoreError::Empty);
        }
        let max = *self.class_sizes.last().unwrap_or(&0);
        if len > max {
            return Err(StoreError::TooLarge { len, max });
        }
        if len > u32::MAX as usize {
            return Err(StoreError::TooLarge { len, max });
        }
        Ok(self.class_sizes.partition_point(|&c| c < len))
    }

    /// Allocates a slot of `class` for `key`; returns it and its arena page.
    pub(crate) fn alloc(
        &self,
        class: usize,
        key: BlockKey,
        len: usize,
        until: Instant,
    ) -> Result<(Slot, u32), StoreError> {
        let mut waited = false;
        // `class_for` refused lengths over `u32::MAX`.
        let len32 = u32::try_from(len).map_err(|_| StoreError::TooLarge {
            len,
            max: u32::MAX as usize,
        })?;
        self.note_demand(class);
        loop {
            let seen = self.progress.current();
            // A class holding fewer segments than its share of recent demand takes one from
            // the class most above its share before evicting its own blocks, so block sizes do
            // not starve each other.
            if let Some(found) = self.try_alloc_free(class, key, len32) {
                return Ok(found);
            }
            if let Some(from) = self.over_provisioned(class) {
                let mut demote = Vec::new();
                let seg = self.take_chunk_of(from, &mut demote);
                if !demote.is_empty() {
                    self.enqueue_demotions(demote);
                }
                if let Some(seg) = seg {
                    self.segments.lock().push(seg);
                    continue;
                }
            }
            let mut demote = Vec::new();
            let found = self.try_alloc(class, key, len32, &mut demote);
            if !demote.is_empty() {
                self.enqueue_demotions(demote);
            }
            if let Some(found) = found {
                return Ok(found);
            }
            // Take a segment away from another class, evicting what it holds.
            let mut demote = Vec::new();
            let seg = self.reclaim_segment(class, true, &mut demote);
            if !demote.is_empty() {
                self.enqueue_demotions(demote);
            }
            if let Some(seg) = seg {
                self.segments.lock().push(seg);
                continue;
            }
            let now = Instant::now();
            if self.reap_expired_leases_at(now) + self.reap_retained(now) > 0 {
                continue;
            }
            // Nothing can leave now. Room appears when the worker has written dirty blocks
            // back, a segment is populated, or a lease goes: wait for that, with the
            // request's one deadline.
            let busy =
                self.work.demote.pending() || self.populating() || self.leases.lock().len() > 0;
            if !busy || Instant::now() >= until {
                return Err(StoreError::NoSpace { len });
            }
            if !waited {
                waited = true;
                self.stats.waits.fetch_add(1, Relaxed);
            }
            self.progress.wait(seen, until);
        }
    }

    pub(crate) fn populating(&self) -> bool {
        self.populated.load(Relaxed) < self.n_segments
    }

    /// Counts an allocation of `class` (recent demand decays by halving every 2^16
    /// allocations), and warns once when more size classes are in use than there are
    /// segments: some block sizes then cannot be held at all.
    fn note_demand(&self, class: usize) {
        let d = &self.demand[class];
        if d.fetch_add(1, Relaxed) == 0 {
            let used = self.demand.iter().filter(|d| d.load(Relaxed) > 0).count();
            if used > self.n_segments as usize && !self.warned_classes.swap(true, Relaxed) {
                tracing::warn!(
                    size_classes_in_use = used,
                    segments = self.n_segments,
                    "more block sizes in use than host segments: some sizes will be refused; lower host.segment or raise host.capacity"
                );
            }
        }
        if self.demand_total.fetch_add(1, Relaxed) + 1 >= 1 << 16 {
            self.demand_total.store(0, Relaxed);
            for d in &self.demand {
                let v = d.load(Relaxed);
                d.store(v.div_ceil(2), Relaxed);
            }
        }
    }

    /// The class most above its share of segments by recent demand, when `class` holds at
    /// least one segment fewer than its own share.
    fn over_provisioned(&self, class: usize) -> Option<usize> {
        let demand: Vec<u64> = self.demand.iter().map(|d| d.load(Relaxed)).collect();
        let total: u64 = demand.iter().sum();
        if total == 0 {
            return None;
        }
        let held = |c: usize| self.classes[c].try_lock().map(|x| x.held_segments() as f64);
        let share = |c: usize| f64::from(self.n_segments) * demand[c] as f64 / total as f64;
        let mine = held(class)?;
        if mine + 1.0 > share(class) {
            return None;
        }
        (0..self.classes.len())
            .filter(|&c| c != class)
            .filter_map(|c| Some((c, held(c)? - share(c))))
            .filter(|&(_, surplus)| surplus >= 1.0)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(c, _)| c)
    }

    /// Evicts one whole chunk of class `from` (the one with the fewest live blocks) and
    /// returns its segment; None if every chunk holds a pinned or busy block (dirty ones are
    /// queued for the writer).
    fn take_chunk_of(&self, from: usize, demote: &mut Vec<Demote>) -> Option<u32> {
        let mut queued = 0u64;
        let mut c = self.classes[from].lock();
        for ch in c.chunks_by_liveness(false) {
            let start = ch * c.per_seg;
            let end = start + c.per_seg;
            let mut ok = true;
            for idx in start..end {
                if !c.is_used(idx) {
                    continue;
                }
                let page = c.page_of(idx, self.seg_pages);
                let (h, len) = (c.hashes[idx as usize], c.lens[idx as usize]);
                if self
                    .try_evict(h, len, from, idx, page, &mut queued, demote)
                    .is_some()
                {
                    c.release(idx);
                } else {
                    ok = false;
                    break;
                }
            }
            if ok {
                return c.drop_chunk(ch);
            }
        }
        None
    }

    /// A segment from the pool when class `c` has no free slot. Taken before the caller's
    /// `if let` chain: an `if let` on the pool's lock would keep its guard through the `else`
    /// branches, which reclaim and evict (shard locks).
    fn pooled_segment(&self, c: &super::slab::Class) -> Option<u32> {
        if c.free.is_empty() {
            self.segments.lock().pop()
        } else {
            None
        }
    }

    /// A free slot, a pooled segment or an empty segment of another class; no eviction.
    fn try_alloc_free(&self, class: usize, key: BlockKey, len: u32) -> Option<(Slot, u32)> {
        let mut c = self.classes[class].lock();
        let c = &mut *c;
        let pooled = self.pooled_segment(c);
        let idx = if let Some(idx) = c.free.pop() {
            idx
        } else if let Some(seg) = pooled {
            c.add_segment(seg);
            c.free.pop()?
        } else {
            let mut demote = Vec::new();
            let seg = self.reclaim_segment(class, false, &mut demote)?;
            c.add_segment(seg);
            c.free.pop()?
        };
        c.take(idx, super::table::hash(MapKey::from(key)), len);
        Some((
            Slot {
                class: class as u8,
                idx,
            },
            c.page_of(idx, self.seg_pages),
        ))
    }

    /// One pass under the class lock.
    fn try_alloc(
        &self,
        class: usize,
        key: BlockKey,
        len: u32,
        demote: &mut Vec<Demote>,
    ) -> Option<(Slot, u32)> {
        let mut c = self.classes[class].lock();
        let c = &mut *c;
        let pooled = self.pooled_segment(c);
        let idx = if let Some(idx) = c.free.pop() {
            Some(idx)
        } else if let Some(seg) = pooled {
            c.add_segment(seg);
            c.free.pop()
        } else if let Some(seg) = self.reclaim_segment(class, false, demote) {
            // An empty segment of another class costs no eviction: take it first.
            c.add_segment(seg);
            c.free.pop()
        } else {
            let super::slab::Class {
                policy,
                hashes,
                lens,
                chunks,
                per_seg,
                slot_bytes,
                ..
            } = c;
            let mut queued = 0u64;
            policy.evict(&mut |idx| {
                let page = page_of(chunks, *per_seg, *slot_bytes, idx, self.seg_pages);
                let (h, len) = (hashes[idx as usize], lens[idx as usize]);
                self.try_evict(h, len, class, idx, page, &mut queued, demote)
                    .map(|key| key.0 as u64)
            })
        }?;
        let h = super::table::hash(MapKey::from(key));
        if c.is_used(idx) {
            // An evicted slot is reused directly: it stays counted as live.
            c.hashes[idx as usize] = h;
            c.lens[idx as usize] = len;
        } else {
            c.take(idx, h, len);
        }
        let slot = Slot {
            class: class as u8,
            idx,
        };
        Some((slot, c.page_of(idx, self.seg_pages)))
    }

    /// Under the class lock: evicts the block in slot `idx` if it is committed, unpinned, and
    /// either clean below, refused by admission, or without a tier below. A dirty admitted
    /// block is instead queued for the worker (pinned, Demoting), up to `max_batch_bytes` per
    /// allocation while the worker's queue has room. The slot's block is found from its key's
    /// index hash `h` (what the class remembers of it); returns the evicted block's key.
    #[allow(clippy::too_many_arguments)]
    fn try_evict(
        &self,
        h: u32,
        len: u32,
        class: usize,
        idx: u32,
        page: u32,
        queued: &mut u64,
        demote: &mut Vec<Demote>,
    ) -> Option<BlockKey> {
        let mut sh = self.shards[self.shard_of(h)].lock();
        let slot = Slot {
            class: class as u8,
            idx,
        };
        let super::index::Shard { map, pins } = &mut *sh;
        let (mk, mut e) = map.slot_entry_mut(h, slot)?;
        let key = BlockKey::from(mk);
        if e.pinned() || !e.ready() {
            return None;
        }
        if self.demote_to.is_some() && e.copy() == Copy::Dirty {
            if self.admitted(key, e.accessed()) {
                if *queued < self.max_batch_bytes && self.work.demote.room(self.max_batch_bytes) {
                    // Unpinned (above): the first pin cannot overflow.
                    if pins.add(&mut e).is_err() {
                        return None;
                    }
                    *queued += u64::from(len);
                    e.set_copy(Copy::Demoting);
                    demote.push(Demote {
                        key,
                        slot: e.slot(),
                        page,
                        cap: self.class_sizes[class],
                        len,
                        ns: e.ns,
                    });
                }
                return None;
            }
            self.stats.admission_rejects.fetch_add(1, Relaxed);
            self.remember([key]);
        }
        if e.copy() == Copy::Demoting {
            return None;
        }
        let ns = e.ns;
        let e_copy = e.copy();
        drop(e);
        map.remove(&mk);
        self.events.emit(EventKind::Removed, key, Tier::Host, ns);
        drop(sh);
        self.stats.evictions.fetch_add(1, Relaxed);
        self.stats.blocks.fetch_sub(1, Relaxed);
        self.stats.used_bytes.fetch_sub(u64::from(len), Relaxed);
        tracing::trace!(%key, copy = ?e_copy, "evicted");
        Some(key)
    }

    /// Takes a whole segment away from another class for `for_class`: picks the chunk with the
    /// fewest live slots and, if `evict`, evicts them all (else only empty chunks qualify).
    /// Gives up on a chunk as soon as one of its blocks is pinned or being written; dirty
    /// blocks get queued for the worker, so a later call can take the chunk (the evicted ones
    /// stay free in their class). Called with `for_class`'s lock held when `!evict` (class
    /// locks are then only tried, never waited for, so two allocators cannot deadlock).
    pub(crate) fn reclaim_segment(
        &self,
        for_class: usize,
        evict: bool,
        demote: &mut Vec<Demote>,
    ) -> Option<u32> {
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
            for ch in c.chunks_by_liveness(!evict) {
                let start = ch * c.per_seg;
                let end = start + c.per_seg;
                let mut ok = true;
                for idx in start..end {
                    if !c.is_used(idx) {
                        continue;
                    }
                    let page = c.page_of(idx, self.seg_pages);
                    let (h, len) = (c.hashes[idx as usize], c.lens[idx as usize]);
                    if self
                        .try_evict(h, len, ci, idx, page, &mut queued, demote)
                        .is_some()
                    {
                        c.release(idx);
                    } else {
                        ok = false;
                        break;
                    }
                }
                if ok {
                    return c.drop_chunk(ch);
                }
            }
        }
        None
    }

    /// The length of the block in `slot` (as its class remembers it).
    pub(crate) fn len_of(&self, slot: Slot) -> u32 {
        self.classes[slot.class as usize].lock().lens[slot.idx as usize]
    }

    /// Gives a slot back to its class and wakes waiters: a slot whose block was never
    /// published (an aborted or cancelled write or promotion).
    pub(crate) fn free_slot(&self, slot: Slot) {
        self.classes[slot.class as usize].lock().release(slot.idx);
        self.progress.bump();
    }

    /// Gives back the slot of a block that was published (Ready) and is gone from the index:
    /// its bytes leave `used_bytes` now. (`used_bytes` counts a block from its publication to
    /// the free of its slot: a block removed while pinned counts until its last unpin, as its
    /// bytes are still held.)
    pub(crate) fn free_published(&self, slot: Slot) {
        let len = {
            let mut c = self.classes[slot.class as usize].lock();
            let len = c.lens[slot.idx as usize];
            c.release(slot.idx);
            len
        };
        self.stats.used_bytes.fetch_sub(u64::from(len), Relaxed);
        self.progress.bump();
    }
}

//! Writes: reserve a slot, fill it, commit it (with its checksum). A reservation is an owned
//! guard: dropped uncommitted, it frees its slot.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use crate::error::StoreError;
use crate::events::EventKind;
use crate::key::BlockKey;
use crate::types::{MapKey, NsId, Tier};

use super::config::PAGE;
use super::index::{Copy, Entry, Life, Slot};
use super::tiering::Demote;
use super::{Inner, Store};

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
pub enum Reserve {
    /// A slot to fill, then commit.
    Slot(Reservation),
    /// A committed block with this key exists already.
    AlreadyPresent,
    /// Another writer is filling this key right now.
    InFlight,
}

impl Store {
    /// Reserves a slot for `len` bytes under `key` (or says the key is present, in host memory
    /// or a lower tier, or being written). Fill it through
    /// [`Reservation::as_mut_slice`] and [`Reservation::commit`]; dropping it uncommitted frees
    /// the slot. Until commit the block is invisible. Never does I/O: when room must first be
    /// written below, it waits (at most the store's `wait`) for the tiering worker.
    pub fn reserve(&self, ns: NsId, key: BlockKey, len: usize) -> Result<Reserve, StoreError> {
        self.inner
            .reserve(ns, key, len, Instant::now() + self.inner.wait)
    }

    /// [`Store::reserve_until`] for a block another node of the cluster hands over (it owns
    /// it): committed like any other, but never pushed on to the remote tier.
    pub fn reserve_replica(
        &self,
        ns: NsId,
        key: BlockKey,
        len: usize,
        deadline: Instant,
    ) -> Result<Reserve, StoreError> {
        let r = self.inner.reserve(ns, key, len, deadline)?;
        Ok(match r {
            Reserve::Slot(mut r) => {
                r.push = false;
                Reserve::Slot(r)
            }
            other => other,
        })
    }

    /// [`Store::reserve`] waiting for room at most until `deadline` (one deadline for a whole
    /// batch of reservations: after it passes, the rest are `NoSpace` at once).
    pub fn reserve_until(
        &self,
        ns: NsId,
        key: BlockKey,
        len: usize,
        deadline: Instant,
    ) -> Result<Reserve, StoreError> {
        self.inner.reserve(ns, key, len, deadline)
    }

    /// Copies `data` into the store under `key` (reserve, copy, commit).
    pub fn put(&self, ns: NsId, key: BlockKey, data: &[u8]) -> Result<PutOutcome, StoreError> {
        match self.reserve(ns, key, data.len())? {
            Reserve::Slot(mut r) => {
                let sum = crate::checksum::copy_hashed(r.as_mut_slice(), data);
                r.commit_with_checksum(sum)?;
                Ok(PutOutcome::Stored)
            }
            Reserve::AlreadyPresent => Ok(PutOutcome::AlreadyPresent),
            Reserve::InFlight => Ok(PutOutcome::InFlight),
        }
    }
}

impl Inner {
    fn reserve(
        self: &Arc<Self>,
        ns: NsId,
        key: BlockKey,
        len: usize,
        deadline: Instant,
    ) -> Result<Reserve, StoreError> {
        let class = self.class_for(len)?;
        if !self.namespace_ok(ns) {
            return Err(StoreError::UnknownNamespace(ns.0));
        }
        let mk = MapKey::from(key);
        let existing = |e: Option<Entry>| {
            e.map(|e| {
                if e.ready() {
                    Reserve::AlreadyPresent
                } else {
                    Reserve::InFlight
                }
            })
        };
        let found = existing(self.shard(key).lock().map.get(&mk));
        if let Some(r) = found {
            if matches!(r, Reserve::AlreadyPresent) {
                // Put again while present (two engines computed the same prefix): seen twice,
                // so seen-twice admission writes it to disk when it leaves host memory.
                self.remember([key]);
            }
            return Ok(r);
        }
        // Committed in a lower tier (e.g. after a restart, or evicted from host memory): the
        // same key is the same bytes, so writing it again would only cost a copy and room.
        if self
            .tiers
            .iter()
            .any(|t| t.local() && t.lookup(&key).is_some())
        {
            return Ok(Reserve::AlreadyPresent);
        }
        let (slot, page) = self.alloc(class, key, len, deadline)?;
        let mut sh = self.shard(key).lock();
        if let Some(r) = existing(sh.map.get(&mk)) {
            drop(sh);
            self.free_slot(slot);
            return Ok(r);
        }
        sh.map
            .insert(mk, Entry::new(slot, ns.0 as u16, Life::Filling));
        Ok(Reserve::Slot(Reservation {
            inner: self.clone(),
            key,
            slot,
            page,
            len,
            ns: ns.0 as u16,
            done: false,
            push: true,
        }))
    }

    /// Publishes a filled reservation; false if it was removed meanwhile (its slot is freed).
    fn commit(&self, r: &Reservation, sum: u64) -> bool {
        let (key, slot, len) = (r.key, r.slot, r.len);
        let round = len.div_ceil(PAGE) * PAGE;
        if round > len {
            // Zero the tail of the last page, so a copy below holds no stale bytes of an
            // earlier block. SAFETY: the slot is at least `round` bytes (classes are multiples
            // of 4096) and exclusively ours until commit.
            unsafe { std::ptr::write_bytes(self.ptr(r.page).add(len), 0, round - len) };
        }
        // Into the policy first: an evictor that meets the slot before it is Ready skips it.
        {
            let mut c = self.classes[slot.class as usize].lock();
            c.sums[slot.idx as usize] = sum;
            c.policy.insert(slot.idx, key.0 as u64);
        }
        let mut through = None;
        let mut push = None;
        {
            let mut sh = self.shard(key).lock();
            let mk = MapKey::from(key);
            match sh.publish(mk, slot, Copy::Dirty) {
                None => {
                    drop(sh);
                    self.free_slot(slot);
                    return false;
                }
                Some(_) => {
                    let d = Demote {
                        key,
                        slot,
                        page: r.page,
                        cap: self.class_sizes[slot.class as usize],
                        len: len as u32,
                        ns: r.ns,
                    };
                    let through_admitted = self.write_through && self.admitted(key, false);
                    let super::index::Shard { map, pins } = &mut *sh;
                    if let Some(mut e) = map.get_mut(&mk) {
                        // Each queue holds its own pin until it is done with the block.
                        if self.push_to.is_some() && r.push && pins.add(&mut e).is_ok() {
                            push = Some(d);
                        }
                        if through_admitted && pins.add(&mut e).is_ok() {
                            e.set_copy(Copy::Demoting);
                            through = Some(d);
                        }
                    }
                    // Under the shard's lock, as every host event of a block: a removal that
                    // follows emits after this (see `Events`).
                    self.events.emit(EventKind::Stored, key, Tier::Host, r.ns);
                }
            }
        }
        self.stats.blocks.fetch_add(1, Relaxed);
        self.stats.used_bytes.fetch_add(len as u64, Relaxed);
        self.stats.bytes_in.fetch_add(len as u64, Relaxed);
        tracing::trace!(%key, "committed");
        if let Some(d) = through {
            self.enqueue_demotions(vec![d]);
        }
        if let Some(d) = push {
            self.enqueue_push(d);
        }
        // Hints whose prefix ended here resume.
        self.work.reads.arrived(key);
        self.progress.bump();
        true
    }

    fn abort(&self, key: BlockKey, slot: Slot) {
        self.shard(key).lock().abort(MapKey::from(key), slot);
        self.free_slot(slot);
    }
}

/// A reserved, invisible slot. Write the block, then [`commit`](Reservation::commit); dropping
/// it uncommitted frees the slot.
pub struct Reservation {
    inner: Arc<Inner>,
    key: BlockKey,
    slot: Slot,
    page: u32,
    len: usize,
    ns: u16,
    done: bool,
    /// Pushed to the remote tier once committed (not for blocks a peer stored here).
    push: bool,
}

impl Reservation {
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
        unsafe { std::slice::from_raw_parts_mut(self.inner.ptr(self.page), self.len) }
    }

    /// Raw pointer to the slot, for a copy engine (DMA, io_uring) that fills it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.inner.ptr(self.page)
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

    /// Makes the block visible (and, with write-through, queues it for the tier below),
    /// computing its checksum over the slot. `Ok(false)`: it was removed meanwhile and is not
    /// stored (the removal wins).
    pub fn commit(mut self) -> Result<bool, StoreError> {
        let sum = crate::checksum::checksum(self.as_mut_slice());
        self.commit_with_checksum(sum)
    }

    /// Like [`Reservation::commit`], with the block's xxh3-64 computed by the writer as it
    /// filled the slot (so the store does not read the block again). The checksum is checked
    /// whenever the block is loaded or written below: a wrong one makes the block a miss.
    pub fn commit_with_checksum(mut self, checksum: u64) -> Result<bool, StoreError> {
        self.done = true;
        Ok(self.inner.commit(&self, checksum))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            self.inner.abort(self.key, self.slot);
        }
    }
}

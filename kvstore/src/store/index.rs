//! The host tier's index: per shard, key → [`Entry`] (8 bytes, in a [`Table`]), and the pin
//! counts of pinned blocks by slot ([`Pins`]: an entry says only *whether* its block is
//! pinned), removed but still pinned ones included. A block's length lives with its slot (the
//! size class's `lens`), not here. The transitions are plain functions on a [`Shard`] (the caller holds
//! its lock), so the pin/lease/evict protocol can be model-checked on its own
//! (`shuttle_tests.rs` runs them, with the rest of the store, under shuttle).
//!
//! ```text
//!  reserve ──► Filling ──commit──► Ready ──evict / remove / clear──► gone (slot freed)
//!  promote ──► Promoting ─┘  │       │ pins > 0 at removal
//!                 │ remove   │ drop  ▼
//!                 ▼          ▼      Doomed (invisible) ──last unpin──► gone (slot freed)
//!             Cancelled ──commit/abort──► gone (slot freed)
//! ```
//!
//! Besides its life, a Ready block has a copy state: `Dirty` (no durable copy below),
//! `Demoting` (the tiering worker is writing it; holds one pin), `Clean` (a copy is durable
//! below: evicting it only drops the host copy) or `Unwritable` (its write failed for good:
//! dropped on eviction, a later miss, never wrong data).

use super::table::Table;
use crate::error::StoreError;
use crate::types::{FoldMap, MapKey};

/// Where a block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Life {
    /// A put being written (invisible).
    Filling,
    /// Being read from a lower tier (invisible; a load waits for it).
    Promoting,
    /// Committed and visible.
    Ready,
    /// Removed while Filling or Promoting: its commit frees it instead of publishing it.
    Cancelled,
}

/// Whether a durable copy exists below the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Copy {
    /// None yet.
    Dirty,
    /// Being written by the tiering worker (which holds one pin).
    Demoting,
    /// Durable below.
    Clean,
    /// Its write failed for good.
    Unwritable,
}

/// Which slot holds a block: size class and dense slot index within the class.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Slot {
    pub class: u8,
    pub idx: u32,
}

/// Per-block metadata in the index: 8 bytes, so a table bucket with its key is 24 bytes. What
/// is rare or belongs to the slot is elsewhere: a pinned block's pin count in its shard's
/// [`Pins`], the block's length and checksum in its size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub idx: u32,
    pub ns: u16,
    pub class: u8,
    /// Bits 0-1: life; 2-3: copy; 4: accessed (read while in host memory); 5: preloaded and not
    /// used yet; 6: demoted (leaves host memory once its write below is done); 7: pinned (its
    /// count is in the shard's [`Pins`]).
    state: u8,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 8);

/// The state bit of a pinned block.
const PINNED: u8 = 128;

impl Entry {
    pub(crate) fn new(slot: Slot, ns: u16, life: Life) -> Self {
        let mut e = Entry {
            idx: slot.idx,
            ns,
            class: slot.class,
            state: 0,
        };
        e.set_life(life);
        e
    }
    pub(crate) fn slot(&self) -> Slot {
        Slot {
            class: self.class,
            idx: self.idx,
        }
    }
    pub(crate) fn life(&self) -> Life {
        match self.state & 3 {
            0 => Life::Filling,
            1 => Life::Promoting,
            2 => Life::Ready,
            _ => Life::Cancelled,
        }
    }
    pub(crate) fn set_life(&mut self, l: Life) {
        self.state = (self.state & !3) | l as u8;
    }
    pub(crate) fn copy(&self) -> Copy {
        match (self.state >> 2) & 3 {
            0 => Copy::Dirty,
            1 => Copy::Demoting,
            2 => Copy::Clean,
            _ => Copy::Unwritable,
        }
    }
    pub(crate) fn set_copy(&mut self, c: Copy) {
        self.state = (self.state & !12) | ((c as u8) << 2);
    }
    pub(crate) fn accessed(&self) -> bool {
        self.state & 16 != 0
    }
    pub(crate) fn set_accessed(&mut self) {
        self.state |= 16;
    }
    /// Promoted by a preload hint and not pinned by a load since.
    pub(crate) fn preloaded(&self) -> bool {
        self.state & 32 != 0
    }
    pub(crate) fn set_preloaded(&mut self, on: bool) {
        if on {
            self.state |= 32;
        } else {
            self.state &= !32;
        }
    }
    /// Demoted by the application: once written below, the host copy goes.
    pub(crate) fn drop_when_written(&self) -> bool {
        self.state & 64 != 0
    }
    pub(crate) fn set_drop_when_written(&mut self, on: bool) {
        if on {
            self.state |= 64;
        } else {
            self.state &= !64;
        }
    }
    pub(crate) fn ready(&self) -> bool {
        self.life() == Life::Ready
    }
    /// Whether the block holds a pin (its count: [`Pins::count`]).
    pub(crate) fn pinned(&self) -> bool {
        self.state & PINNED != 0
    }
    fn set_pinned(&mut self, on: bool) {
        if on {
            self.state |= PINNED;
        } else {
            self.state &= !PINNED;
        }
    }

    /// The entry as one word, as a table bucket stores it (`table::Cell`): the class byte is
    /// bits 48-55.
    pub(crate) fn to_word(self) -> u64 {
        u64::from(self.idx)
            | u64::from(self.ns) << 32
            | u64::from(self.class) << 48
            | u64::from(self.state) << 56
    }

    /// [`Entry::to_word`] undone.
    pub(crate) fn from_word(w: u64) -> Self {
        Entry {
            idx: w as u32,
            ns: (w >> 32) as u16,
            class: (w >> 48) as u8,
            state: (w >> 56) as u8,
        }
    }
}

/// The pin counts of a shard's pinned blocks, by slot (a slot holds one block at a time, and a
/// pinned slot is never freed). A count is here while above zero: a block's entry marks it
/// pinned, and a block removed while pinned (doomed) keeps its count here, with no entry,
/// until its last unpin frees the slot. Pins are few and short (a load, a lease, a queued
/// write), so they cost nothing at rest.
#[derive(Default)]
pub(crate) struct Pins(FoldMap<Slot, u32>);

impl Pins {
    /// One more pin on the block of entry `e` (the caller's copy, stored back by it).
    pub(crate) fn add(&mut self, e: &mut Entry) -> Result<(), StoreError> {
        let n = self.0.entry(e.slot()).or_insert(0);
        *n = n.checked_add(1).ok_or(StoreError::TooManyPins)?;
        e.set_pinned(true);
        Ok(())
    }

    /// The pins on the block of entry `e`.
    pub(crate) fn count(&self, e: &Entry) -> u32 {
        if e.pinned() {
            self.0.get(&e.slot()).copied().unwrap_or(0)
        } else {
            0
        }
    }

    /// Forgets the pins of `slot`, whose entry goes and whose slot the caller frees.
    pub(crate) fn forget(&mut self, slot: Slot) {
        self.0.remove(&slot);
    }

    /// Slots with pins (live or doomed).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// One shard of the index.
#[derive(Default)]
pub(crate) struct Shard {
    pub map: Table,
    /// Pin counts, those of removed blocks (freed on their last unpin) included.
    pub pins: Pins,
}

/// What [`Shard::pin_read`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PinRead {
    /// Pinned (the entry after the pin), and whether a preload had brought it in unused.
    Pinned(Entry, bool),
    Absent,
    Filling,
    Promoting,
    Cancelled,
}

/// What a removal did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Removed {
    /// Nothing with this key.
    Absent,
    /// It was being written: its commit will free it.
    Cancelled,
    /// Gone; its slot is free now (the caller frees it in its class). The namespace.
    Freed(Slot, u16),
    /// Gone from view; its slot is freed by the last unpin. The namespace.
    Doomed(u16),
}

impl Shard {
    /// An empty shard whose table publishes itself in `hints[at]` (see [`Table::with_hint`]).
    pub(crate) fn with_hint(hints: std::sync::Arc<[super::table::Hint]>, at: usize) -> Self {
        Shard {
            map: Table::with_hint(hints, at),
            pins: Pins::default(),
        }
    }

    /// Pins a Ready block (one more reader); `None` if absent or not Ready.
    pub(crate) fn pin(&mut self, key: MapKey) -> Result<Option<Entry>, StoreError> {
        match self.map.get_mut(&key) {
            Some(mut e) if e.ready() => {
                self.pins.add(&mut e)?;
                Ok(Some(*e))
            }
            _ => Ok(None),
        }
    }

    /// A load's pin, in one probe: pins a Ready block and marks it accessed (and no longer
    /// "preloaded, not used yet"); otherwise says where the block is in its life.
    pub(crate) fn pin_read(&mut self, h: u32, key: MapKey) -> Result<PinRead, StoreError> {
        let Shard { map, pins } = self;
        let Some(mut e) = map.get_hashed_mut(h, &key) else {
            return Ok(PinRead::Absent);
        };
        match e.life() {
            Life::Filling => Ok(PinRead::Filling),
            Life::Promoting => Ok(PinRead::Promoting),
            Life::Cancelled => Ok(PinRead::Cancelled),
            Life::Ready => {
                pins.add(&mut e)?;
                let preloaded = e.preloaded();
                e.set_accessed();
                e.set_preloaded(false);
                Ok(PinRead::Pinned(*e, preloaded))
            }
        }
    }

    /// Drops one pin of the block that was in `slot` under `key`; true when that freed the slot
    /// (the block had been removed while pinned and this was its last pin).
    pub(crate) fn unpin(&mut self, key: MapKey, slot: Slot) -> bool {
        let Some(p) = self.pins.0.get_mut(&slot) else {
            debug_assert!(false, "unpin of an unpinned slot");
            return false;
        };
        *p -= 1;
        if *p > 0 {
            return false;
        }
        self.pins.0.remove(&slot);
        match self.map.get_mut(&key) {
            Some(mut e) if e.slot() == slot => {
                e.set_pinned(false);
                false
            }
            // Removed while pinned (doomed): this was its last pin.
            _ => true,
        }
    }

    /// Removes a block from view (see [`Removed`]).
    pub(crate) fn remove(&mut self, key: MapKey) -> Removed {
        let Some(mut e) = self.map.get_mut(&key) else {
            return Removed::Absent;
        };
        match e.life() {
            Life::Filling | Life::Promoting => {
                e.set_life(Life::Cancelled);
                Removed::Cancelled
            }
            Life::Cancelled => Removed::Absent,
            Life::Ready => {
                let gone = *e;
                drop(e);
                self.map.remove(&key);
                if gone.pinned() {
                    Removed::Doomed(gone.ns)
                } else {
                    Removed::Freed(gone.slot(), gone.ns)
                }
            }
        }
    }

    /// Ends a write (a put's or a promotion's) of `key` into `slot`: Ready if still wanted,
    /// else the entry is dropped and the caller frees the slot. Returns the entry published.
    pub(crate) fn publish(&mut self, key: MapKey, slot: Slot, copy: Copy) -> Option<Entry> {
        let mut e = self.map.get_mut(&key).filter(|e| e.slot() == slot)?;
        match e.life() {
            Life::Filling | Life::Promoting => {
                e.set_life(Life::Ready);
                e.set_copy(copy);
                Some(*e)
            }
            _ => {
                drop(e);
                // Cancelled: the removal wins. A promotion's pins belong to its waiters, who
                // will find the key gone; the caller frees the slot.
                self.map.remove(&key);
                self.pins.forget(slot);
                None
            }
        }
    }

    /// Drops an unpublished write of `key` into `slot` (abort): true if the entry was there.
    pub(crate) fn abort(&mut self, key: MapKey, slot: Slot) -> bool {
        if self
            .map
            .get(&key)
            .is_some_and(|e| !e.ready() && e.slot() == slot)
        {
            self.map.remove(&key);
            self.pins.forget(slot);
            return true;
        }
        false
    }

    /// Inserts the entry of a block being promoted, holding one pin (its promoter's).
    pub(crate) fn insert_promoting(&mut self, key: MapKey, slot: Slot, ns: u16) {
        let mut e = Entry::new(slot, ns, Life::Promoting);
        // A free slot has no pins: the first cannot overflow.
        let _ = self.pins.add(&mut e);
        self.map.insert(key, e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::BlockKey;

    fn mk(i: u128) -> MapKey {
        MapKey::from(BlockKey(i))
    }
    const S: Slot = Slot { class: 1, idx: 7 };

    #[test]
    fn entry_state_packs() {
        let mut e = Entry::new(S, 3, Life::Filling);
        assert_eq!(
            (e.life(), e.copy(), e.accessed()),
            (Life::Filling, Copy::Dirty, false)
        );
        e.set_life(Life::Ready);
        e.set_copy(Copy::Unwritable);
        e.set_accessed();
        assert_eq!(
            (e.life(), e.copy(), e.accessed()),
            (Life::Ready, Copy::Unwritable, true)
        );
        e.set_copy(Copy::Clean);
        assert_eq!((e.life(), e.copy()), (Life::Ready, Copy::Clean));
        assert_eq!(e.slot(), S);
    }

    #[test]
    fn remove_while_pinned_defers_the_free_to_the_last_unpin() {
        let mut sh = Shard::default();
        sh.map.insert(mk(1), Entry::new(S, 0, Life::Ready));
        assert!(sh.pin(mk(1)).unwrap().is_some());
        assert!(sh.pin(mk(1)).unwrap().is_some());
        assert_eq!(sh.remove(mk(1)), Removed::Doomed(0));
        assert!(
            sh.pin(mk(1)).unwrap().is_none(),
            "removed blocks cannot be pinned"
        );
        assert!(!sh.unpin(mk(1), S));
        assert!(sh.unpin(mk(1), S), "last unpin frees");
        assert_eq!(sh.pins.len(), 0);
    }

    #[test]
    fn a_pin_count_follows_its_slot_not_its_key() {
        let mut sh = Shard::default();
        sh.map.insert(mk(1), Entry::new(S, 0, Life::Ready));
        assert!(sh.pin(mk(1)).unwrap().unwrap().pinned());
        assert!(!sh.unpin(mk(1), S));
        assert!(
            !sh.map.get(&mk(1)).unwrap().pinned(),
            "a live block's last unpin clears its mark"
        );
        assert_eq!(sh.pins.len(), 0);
        // Removed while pinned, then stored again in another slot: the old slot's last unpin
        // frees it, and the new block's pin is its own.
        assert!(sh.pin(mk(1)).unwrap().is_some());
        assert_eq!(sh.remove(mk(1)), Removed::Doomed(0));
        let s2 = Slot { class: 1, idx: 8 };
        sh.map.insert(mk(1), Entry::new(s2, 0, Life::Ready));
        assert!(sh.pin(mk(1)).unwrap().is_some());
        assert!(sh.unpin(mk(1), S), "the doomed slot's last pin frees it");
        assert_eq!(sh.pins.count(&sh.map.get(&mk(1)).unwrap()), 1);
        assert!(!sh.unpin(mk(1), s2));
        assert_eq!(sh.pins.len(), 0);
        // A promotion's pin goes with an abort.
        sh.insert_promoting(mk(2), s2, 0);
        assert_eq!(sh.pins.len(), 1);
        assert!(sh.abort(mk(2), s2));
        assert_eq!(sh.pins.len(), 0);
    }

    #[test]
    fn removal_wins_over_a_write_in_flight() {
        let mut sh = Shard::default();
        sh.map.insert(mk(2), Entry::new(S, 0, Life::Filling));
        assert!(sh.pin(mk(2)).unwrap().is_none(), "invisible until commit");
        assert_eq!(sh.remove(mk(2)), Removed::Cancelled);
        assert!(sh.publish(mk(2), S, Copy::Dirty).is_none());
        assert!(sh.map.is_empty());
    }

    #[test]
    fn a_read_pin_says_where_the_block_is_and_marks_it_used() {
        let mut sh = Shard::default();
        let h = |i| crate::store::table::hash(mk(i));
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Absent));
        sh.map.insert(mk(4), Entry::new(S, 0, Life::Filling));
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Filling));
        sh.map.get_mut(&mk(4)).unwrap().set_life(Life::Promoting);
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Promoting));
        assert_eq!(sh.remove(mk(4)), Removed::Cancelled);
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Cancelled));
        let mut e = Entry::new(S, 0, Life::Ready);
        e.set_preloaded(true);
        sh.map.insert(mk(5), e);
        let PinRead::Pinned(got, preloaded) = sh.pin_read(h(5), mk(5)).unwrap() else {
            panic!("a Ready block is pinned");
        };
        assert!(preloaded);
        assert_eq!(sh.pins.count(&got), 1);
        let now = sh.map.get(&mk(5)).unwrap();
        assert!(now.accessed() && !now.preloaded() && sh.pins.count(&now) == 1);
        assert!(matches!(
            sh.pin_read(h(5), mk(5)),
            Ok(PinRead::Pinned(_, false))
        ));
        assert_eq!(sh.pins.count(&sh.map.get(&mk(5)).unwrap()), 2);
    }

    #[test]
    fn pins_saturate_with_an_error() {
        let mut sh = Shard::default();
        sh.map.insert(mk(3), Entry::new(S, 0, Life::Ready));
        assert!(sh.pin(mk(3)).unwrap().is_some());
        *sh.pins.0.get_mut(&S).unwrap() = u32::MAX;
        assert_eq!(sh.pin(mk(3)), Err(StoreError::TooManyPins));
        assert_eq!(sh.pins.count(&sh.map.get(&mk(3)).unwrap()), u32::MAX);
    }
}

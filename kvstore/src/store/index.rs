//! The host tier's index: per shard, key → [`Entry`] (16 bytes, in a [`Table`]), and the slots of removed but
//! still pinned blocks. The transitions are plain functions on a [`Shard`] (the caller holds
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

use std::collections::HashMap;

use super::table::Table;
use crate::error::StoreError;
use crate::types::MapKey;

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

/// Per-block metadata in the index: 16 bytes, so a map bucket with its key is 32 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub idx: u32,
    pub len: u32,
    pub pins: u32,
    pub ns: u16,
    pub class: u8,
    /// Bits 0-1: life; 2-3: copy; 4: accessed (read while in host memory); 5: preloaded and not
    /// used yet; 6: demoted (leaves host memory once its write below is done).
    state: u8,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 16);

impl Entry {
    pub(crate) fn new(slot: Slot, len: u32, ns: u16, life: Life, pins: u32) -> Self {
        let mut e = Entry {
            idx: slot.idx,
            len,
            pins,
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

    /// The entry as two words, as a table bucket stores it (`table::Cell`): the class byte is
    /// bits 48-55 of the second word.
    pub(crate) fn to_words(self) -> [u64; 2] {
        [
            u64::from(self.idx) | u64::from(self.len) << 32,
            u64::from(self.pins)
                | u64::from(self.ns) << 32
                | u64::from(self.class) << 48
                | u64::from(self.state) << 56,
        ]
    }

    /// [`Entry::to_words`] undone.
    pub(crate) fn from_words(w: [u64; 2]) -> Self {
        Entry {
            idx: w[0] as u32,
            len: (w[0] >> 32) as u32,
            pins: w[1] as u32,
            ns: (w[1] >> 32) as u16,
            class: (w[1] >> 48) as u8,
            state: (w[1] >> 56) as u8,
        }
    }
}

/// One shard of the index.
#[derive(Default)]
pub(crate) struct Shard {
    pub map: Table,
    /// Removed while pinned: slot → pins left. Freed on the last unpin.
    pub doomed: HashMap<Slot, u32>,
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
    /// Gone; its slot is free now (the caller frees it in its class).
    Freed(Slot, u32, u16),
    /// Gone from view; its slot is freed by the last unpin.
    Doomed(u32, u16),
}

impl Shard {
    /// Pins a Ready block (one more reader); `None` if absent or not Ready.
    pub(crate) fn pin(&mut self, key: MapKey) -> Result<Option<Entry>, StoreError> {
        match self.map.get_mut(&key) {
            Some(mut e) if e.ready() => {
                e.pins = e.pins.checked_add(1).ok_or(StoreError::TooManyPins)?;
                Ok(Some(*e))
            }
            _ => Ok(None),
        }
    }

    /// A load's pin, in one probe: pins a Ready block and marks it accessed (and no longer
    /// "preloaded, not used yet"); otherwise says where the block is in its life.
    pub(crate) fn pin_read(&mut self, h: u32, key: MapKey) -> Result<PinRead, StoreError> {
        let Some(mut e) = self.map.get_hashed_mut(h, &key) else {
            return Ok(PinRead::Absent);
        };
        match e.life() {
            Life::Filling => Ok(PinRead::Filling),
            Life::Promoting => Ok(PinRead::Promoting),
            Life::Cancelled => Ok(PinRead::Cancelled),
            Life::Ready => {
                e.pins = e.pins.checked_add(1).ok_or(StoreError::TooManyPins)?;
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
        if let Some(mut e) = self.map.get_mut(&key) {
            if e.slot() == slot {
                debug_assert!(e.pins > 0, "unpin without a pin");
                e.pins = e.pins.saturating_sub(1);
                return false;
            }
        }
        match self.doomed.get_mut(&slot) {
            Some(p) => {
                *p -= 1;
                if *p == 0 {
                    self.doomed.remove(&slot);
                    return true;
                }
                false
            }
            None => {
                debug_assert!(false, "unpin of an unknown slot");
                false
            }
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
                if gone.pins > 0 {
                    self.doomed.insert(gone.slot(), gone.pins);
                    Removed::Doomed(gone.len, gone.ns)
                } else {
                    Removed::Freed(gone.slot(), gone.len, gone.ns)
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
                // will find the key gone.
                self.map.remove(&key);
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
            return true;
        }
        false
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
        let mut e = Entry::new(S, 10, 3, Life::Filling, 0);
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
        sh.map.insert(mk(1), Entry::new(S, 10, 0, Life::Ready, 0));
        assert!(sh.pin(mk(1)).unwrap().is_some());
        assert!(sh.pin(mk(1)).unwrap().is_some());
        assert_eq!(sh.remove(mk(1)), Removed::Doomed(10, 0));
        assert!(
            sh.pin(mk(1)).unwrap().is_none(),
            "removed blocks cannot be pinned"
        );
        assert!(!sh.unpin(mk(1), S));
        assert!(sh.unpin(mk(1), S), "last unpin frees");
        assert!(sh.doomed.is_empty());
    }

    #[test]
    fn removal_wins_over_a_write_in_flight() {
        let mut sh = Shard::default();
        sh.map.insert(mk(2), Entry::new(S, 10, 0, Life::Filling, 0));
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
        sh.map.insert(mk(4), Entry::new(S, 10, 0, Life::Filling, 0));
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Filling));
        sh.map.get_mut(&mk(4)).unwrap().set_life(Life::Promoting);
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Promoting));
        assert_eq!(sh.remove(mk(4)), Removed::Cancelled);
        assert_eq!(sh.pin_read(h(4), mk(4)), Ok(PinRead::Cancelled));
        let mut e = Entry::new(S, 10, 0, Life::Ready, 0);
        e.set_preloaded(true);
        sh.map.insert(mk(5), e);
        let PinRead::Pinned(got, preloaded) = sh.pin_read(h(5), mk(5)).unwrap() else {
            panic!("a Ready block is pinned");
        };
        assert!(preloaded);
        assert_eq!(got.pins, 1);
        let now = sh.map.get(&mk(5)).unwrap();
        assert!(now.accessed() && !now.preloaded() && now.pins == 1);
        assert!(matches!(
            sh.pin_read(h(5), mk(5)),
            Ok(PinRead::Pinned(_, false))
        ));
        assert_eq!(sh.map.get(&mk(5)).unwrap().pins, 2);
    }

    #[test]
    fn pins_saturate_with_an_error() {
        let mut sh = Shard::default();
        sh.map
            .insert(mk(3), Entry::new(S, 10, 0, Life::Ready, u32::MAX));
        assert_eq!(sh.pin(mk(3)), Err(StoreError::TooManyPins));
        assert_eq!(sh.map.get(&mk(3)).unwrap().pins, u32::MAX);
    }
}

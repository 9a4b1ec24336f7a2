//! CLOCK over the slots themselves, as an operating system's page reclaim sweeps page frames:
//! a referenced bit per id and a hand that walks the id space, clearing the bits it passes
//! and offering the first tracked id whose bit is clear. Three bits per id (tracked,
//! referenced, cooled) where LRU's list takes 8 bytes.
//!
//! It approximates LRU: a block read since the hand last passed it gets another lap. The store
//! reuses the slot it just evicted first (its free slots are a stack), so a new block usually
//! lands where the hand has just been and waits a whole lap, as CLOCK's newest page does.
//! A new block's bit starts clear: filling an empty cache from slot 0 up, the first lap then
//! evicts in insertion order.
//! A third bit per id marks the ids `cool` named since: they are offered before the sweep.

use super::{reserve_total, EvictionPolicy, Offer};

/// Cooled ids remembered for the next evictions; past this, a cooled block only loses its bit.
const COOLED_MAX: usize = 4096;

/// CLOCK over dense ids.
#[derive(Default)]
pub struct Clock {
    /// Bit `id`: tracked.
    tracked: Vec<u64>,
    /// Bit `id`: read since the hand last passed it (only for tracked ids).
    referenced: Vec<u64>,
    /// The next id the hand looks at.
    hand: usize,
    len: usize,
    /// Bit `id`: cooled, and not read, removed or replaced since.
    cooled_bits: Vec<u64>,
    /// The cooled ids, most recent last (each at most once): offered before the sweep.
    cooled: Vec<u32>,
}

fn bit(id: u32) -> (usize, u64) {
    (id as usize / 64, 1u64 << (id % 64))
}

impl Clock {
    fn tracks(&self, id: u32) -> bool {
        let (w, b) = bit(id);
        self.tracked.get(w).is_some_and(|x| x & b != 0)
    }

    fn untrack(&mut self, id: u32) {
        let (w, b) = bit(id);
        self.tracked[w] &= !b;
        self.referenced[w] &= !b;
        self.cooled_bits[w] &= !b;
        self.len -= 1;
    }
}

impl EvictionPolicy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }

    fn reserve(&mut self, ids: usize) {
        reserve_total(&mut self.tracked, ids.div_ceil(64));
        reserve_total(&mut self.referenced, ids.div_ceil(64));
        reserve_total(&mut self.cooled_bits, ids.div_ceil(64));
    }

    fn insert(&mut self, id: u32, _key_hash: u64) {
        let (w, b) = bit(id);
        if self.tracked.len() <= w {
            self.tracked.resize(w + 1, 0);
            self.referenced.resize(w + 1, 0);
            self.cooled_bits.resize(w + 1, 0);
        }
        if self.tracked[w] & b == 0 {
            self.tracked[w] |= b;
            self.len += 1;
        }
        self.referenced[w] &= !b;
        // A new block in the slot: whatever was cooled there is gone.
        self.cooled_bits[w] &= !b;
    }

    fn access(&mut self, id: u32, _key_hash: u64) {
        if self.tracks(id) {
            let (w, b) = bit(id);
            self.referenced[w] |= b;
            self.cooled_bits[w] &= !b;
        }
    }

    fn remove(&mut self, id: u32) {
        if self.tracks(id) {
            self.untrack(id);
        }
    }

    fn cool(&mut self, id: u32) {
        if self.tracks(id) {
            let (w, b) = bit(id);
            self.referenced[w] &= !b;
            if self.cooled_bits[w] & b != 0 {
                // Cooled again: it moves to the end offered first.
                self.cooled.retain(|&c| c != id);
                self.cooled.push(id);
            } else if self.cooled.len() < COOLED_MAX {
                self.cooled_bits[w] |= b;
                self.cooled.push(id);
            }
        }
    }

    fn evict(&mut self, try_evict: &mut Offer<'_>) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        // Cooled blocks first, the most recently cooled first, as long as nothing read,
        // removed or replaced them since (their cooled bit says so).
        while let Some(id) = self.cooled.pop() {
            let (w, b) = bit(id);
            if self.cooled_bits[w] & b == 0 {
                continue;
            }
            self.cooled_bits[w] &= !b;
            if try_evict(id).is_some() {
                self.untrack(id);
                return Some(id);
            }
        }
        // The sweep: at most two laps (the first clears every bit, the second offers every
        // tracked id once) and the part of a word the hand started in.
        let ids = self.tracked.len() * 64;
        let mut budget = 2 * ids + 64;
        while budget > 0 {
            if self.hand >= ids {
                self.hand = 0;
            }
            let (w, from) = (self.hand / 64, self.hand % 64);
            let ahead = !0u64 << from;
            let candidates = self.tracked[w] & !self.referenced[w] & ahead;
            if candidates == 0 {
                // Every tracked id left in this word was referenced: a second chance each.
                self.referenced[w] &= !ahead;
                budget = budget.saturating_sub(64 - from);
                self.hand = (w + 1) * 64;
                continue;
            }
            let at = candidates.trailing_zeros() as usize;
            self.referenced[w] &= !(ahead & ((1u64 << at) - 1));
            budget = budget.saturating_sub(at + 1 - from);
            self.hand = w * 64 + at + 1;
            let id = (w * 64 + at) as u32;
            if try_evict(id).is_some() {
                self.untrack(id);
                return Some(id);
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yes(id: u32) -> Option<u64> {
        Some(u64::from(id))
    }

    #[test]
    fn a_read_block_gets_another_lap() {
        let mut p = Clock::default();
        for i in 0..100 {
            p.insert(i, u64::from(i));
        }
        for i in (0..100).filter(|i| i % 3 == 0) {
            p.access(i, u64::from(i));
        }
        // The first lap evicts the unread ones in order and clears the others' bits.
        let first: Vec<u32> = (0..66).map(|_| p.evict(&mut yes).unwrap()).collect();
        let unread: Vec<u32> = (0..100).filter(|i| i % 3 != 0).collect();
        assert_eq!(first, unread);
        // A new block in the slot just freed (98) sits behind the hand: the read ones before it
        // go first (their bits were cleared), then it, then 99 (the hand had not passed it).
        p.insert(98, 98);
        let next: Vec<u32> = std::iter::from_fn(|| p.evict(&mut yes)).collect();
        let mut want: Vec<u32> = (0..99).filter(|i| i % 3 == 0).collect();
        want.extend([98, 99]);
        assert_eq!(next, want);
        assert!(p.is_empty());
    }

    #[test]
    fn a_refused_block_stays_and_the_sweep_ends() {
        let mut p = Clock::default();
        for i in 0..200 {
            p.insert(i, 0);
            p.access(i, 0);
        }
        assert_eq!(p.evict(&mut |_| None), None);
        assert_eq!(p.len(), 200);
        // Only 150 may go.
        assert_eq!(p.evict(&mut |id| (id == 150).then_some(0)), Some(150));
        assert_eq!(p.evict(&mut |id| (id == 150).then_some(0)), None);
        assert_eq!(p.len(), 199);
    }

    #[test]
    fn a_cooled_block_then_reused_slot_is_not_cooled() {
        let mut p = Clock::default();
        for i in 0..10 {
            p.insert(i, 0);
            p.access(i, 0);
        }
        p.cool(7);
        p.remove(7);
        p.insert(7, 0);
        p.access(7, 0);
        p.cool(4);
        assert_eq!(p.evict(&mut yes), Some(4));
        // 7 was read after its slot was reused: it takes its lap like the others.
        let v = p.evict(&mut yes).unwrap();
        assert_ne!(v, 7);
    }

    #[test]
    fn a_new_block_in_a_cooled_slot_is_not_cooled() {
        let mut p = Clock::default();
        for i in 0..10 {
            p.insert(i, 0);
            if i != 2 {
                p.access(i, 0);
            }
        }
        // Cooled twice, evicted, its slot taken by a new block never read.
        p.cool(5);
        p.cool(5);
        assert_eq!(p.evict(&mut yes), Some(5));
        p.insert(5, 0);
        // Cooled, then removed and its slot taken by a new block.
        p.cool(8);
        p.remove(8);
        p.insert(8, 0);
        // Neither new block is offered as cooled: the sweep goes in slot order, from the
        // unread 2 to the new 5 and 8.
        let order: Vec<u32> = (0..3).map(|_| p.evict(&mut yes).unwrap()).collect();
        assert_eq!(order, vec![2, 5, 8]);
        assert!(p.cooled.is_empty());
    }
}

//! SIEVE (Zhang et al., NSDI'24): one FIFO queue, a visited bit per block and a hand that moves
//! from the oldest block toward the newest, clearing visited bits and evicting the first block
//! it finds unvisited. Hits cost a bit set, no list move.

use super::lists::{Lists, NIL};
use super::{EvictionPolicy, Offer};

/// SIEVE over dense ids.
pub struct Sieve {
    /// The queue; its spare bits hold each block's visited bit.
    q: Lists<1>,
    /// Where the next eviction scan starts; [`NIL`]: at the oldest block.
    hand: u32,
}

impl Default for Sieve {
    fn default() -> Self {
        Self {
            q: Lists::default(),
            hand: NIL,
        }
    }
}

impl Sieve {
    fn take(&mut self, id: u32) {
        if self.hand == id {
            self.hand = self.q.toward_head(id);
        }
        self.q.unlink(id);
    }
}

impl EvictionPolicy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn reserve(&mut self, ids: usize) {
        self.q.reserve(ids);
    }

    fn insert(&mut self, id: u32, _key_hash: u64) {
        self.take(id);
        self.q.set_aux(id, 0);
        self.q.push_front(0, id);
    }

    fn access(&mut self, id: u32, _key_hash: u64) {
        if self.q.list_of(id).is_some() {
            self.q.set_aux(id, 1);
        }
    }

    fn remove(&mut self, id: u32) {
        if self.q.list_of(id).is_some() {
            self.take(id);
        }
    }

    fn cool(&mut self, id: u32) {
        if self.q.list_of(id).is_some() {
            // At the oldest end, unvisited, under the hand: the next one looked at.
            self.take(id);
            self.q.set_aux(id, 0);
            self.q.push_back(0, id);
            self.hand = id;
        }
    }

    fn evict(&mut self, try_evict: &mut Offer<'_>) -> Option<u32> {
        let n = self.q.len(0);
        let mut cur = if self.hand == NIL {
            self.q.back(0)?
        } else {
            self.hand
        };
        // Two passes clear every visited bit; a third finds only refusals.
        for _ in 0..(3 * n + 2) {
            if cur == NIL {
                cur = self.q.back(0)?;
            }
            let next = self.q.toward_head(cur);
            if self.q.aux(cur) != 0 {
                self.q.set_aux(cur, 0);
            } else if try_evict(cur).is_some() {
                self.hand = next;
                self.q.unlink(cur);
                return Some(cur);
            }
            cur = next;
        }
        self.hand = cur;
        None
    }

    fn len(&self) -> usize {
        self.q.len(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sieve_keeps_visited_blocks_and_moves_its_hand() {
        let mut p = Sieve::default();
        for i in 0..4 {
            p.insert(i, i as u64);
        }
        p.access(0, 0);
        p.access(2, 2);
        // Oldest first: 0 is visited (bit cleared, kept), 1 goes.
        assert_eq!(p.evict(&mut |id| Some(u64::from(id))), Some(1));
        // The hand continues at 2 (visited: cleared), then 3.
        assert_eq!(p.evict(&mut |id| Some(u64::from(id))), Some(3));
        // Around again: 0 and 2 have lost their bits.
        assert_eq!(p.evict(&mut |id| Some(u64::from(id))), Some(0));
        p.insert(7, 7);
        p.remove(2);
        assert_eq!(p.evict(&mut |id| Some(u64::from(id))), Some(7));
        assert!(p.is_empty());
    }
}

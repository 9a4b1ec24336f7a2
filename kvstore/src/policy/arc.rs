//! ARC (Megiddo and Modha, FAST'03): two resident LRU lists — T1 for blocks seen once recently,
//! T2 for blocks seen at least twice — and two ghost lists of evicted keys (B1 behind T1, B2
//! behind T2). A miss found in B1 says T1 was too short and grows its target `p`; one found in
//! B2 shrinks it. It adapts between recency (multi-turn chat: a conversation returns once, a
//! minute later) and frequency (document QA: a few hot documents and a long tail) without a
//! tuned constant.
//!
//! Adapted to the [`EvictionPolicy`] seam: the cache size `c` is the number of resident blocks
//! (the store evicts only when full, so that is its capacity in blocks of this size class), and
//! the victim is chosen before the incoming key is known (the paper's tie rule that looks at
//! the incoming key is dropped).

use std::collections::{HashMap, VecDeque};

use super::lists::{Lists, NIL};
use super::{EvictionPolicy, Offer};

const T1: usize = 0;
const T2: usize = 1;

/// One ghost list: keys in eviction order, stale entries (hit or trimmed) skipped lazily.
#[derive(Default)]
struct Ghosts {
    order: VecDeque<(u64, u64)>,
    len: usize,
}

/// ARC over dense ids.
#[derive(Default)]
pub struct Arc {
    t: Lists<2>,
    /// Target size of T1, in blocks.
    p: usize,
    b: [Ghosts; 2],
    /// Ghost key → (list, sequence number of its entry in that list's `order`).
    ghost: HashMap<u64, (u8, u64)>,
    seq: u64,
}

impl Arc {
    fn capacity(&self) -> usize {
        self.t.total().max(16)
    }

    fn forget_ghost(&mut self, key: u64) -> Option<usize> {
        let (l, _) = self.ghost.remove(&key)?;
        let l = l as usize;
        self.b[l].len -= 1;
        self.compact(l);
        Some(l)
    }

    /// Drops the oldest live ghost of list `l`.
    fn pop_ghost(&mut self, l: usize) {
        while let Some((key, seq)) = self.b[l].order.pop_front() {
            if self.ghost.get(&key) == Some(&(l as u8, seq)) {
                self.ghost.remove(&key);
                self.b[l].len -= 1;
                return;
            }
        }
    }

    /// Drops stale entries once they outnumber the live ones.
    fn compact(&mut self, l: usize) {
        if self.b[l].order.len() > 2 * self.b[l].len + 64 {
            let ghost = &self.ghost;
            self.b[l]
                .order
                .retain(|(k, s)| ghost.get(k) == Some(&(l as u8, *s)));
        }
    }

    fn remember(&mut self, l: usize, key: u64) {
        self.forget_ghost(key);
        self.seq += 1;
        self.b[l].order.push_back((key, self.seq));
        self.b[l].len += 1;
        self.ghost.insert(key, (l as u8, self.seq));
        // |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        let c = self.capacity();
        while self.t.len(T1) + self.b[0].len > c && self.b[0].len > 0 {
            self.pop_ghost(0);
        }
        while self.t.total() + self.b[0].len + self.b[1].len > 2 * c && self.b[1].len > 0 {
            self.pop_ghost(1);
        }
    }

    /// Offers list `l` from its LRU end; the evicted block's key joins the ghost list behind it.
    fn evict_from(&mut self, l: usize, try_evict: &mut Offer<'_>) -> Option<u32> {
        let mut cur = self.t.back(l).unwrap_or(NIL);
        while cur != NIL {
            let next = self.t.toward_head(cur);
            if let Some(key) = try_evict(cur) {
                self.t.unlink(cur);
                self.remember(l, key);
                return Some(cur);
            }
            cur = next;
        }
        None
    }
}

impl EvictionPolicy for Arc {
    fn name(&self) -> &'static str {
        "arc"
    }

    fn reserve(&mut self, ids: usize) {
        self.t.reserve(ids);
    }

    fn insert(&mut self, id: u32, key_hash: u64) {
        self.t.unlink(id);
        let c = self.capacity();
        match self.forget_ghost(key_hash) {
            Some(0) => {
                // T1 was too short for this block to be seen again: grow it.
                let step = (self.b[1].len / self.b[0].len.max(1)).max(1);
                self.p = (self.p + step).min(c);
                self.t.push_front(T2, id);
            }
            Some(_) => {
                let step = (self.b[0].len / self.b[1].len.max(1)).max(1);
                self.p = self.p.saturating_sub(step);
                self.t.push_front(T2, id);
            }
            None => self.t.push_front(T1, id),
        }
    }

    fn access(&mut self, id: u32, _key_hash: u64) {
        if self.t.list_of(id).is_some() {
            self.t.push_front(T2, id);
        }
    }

    fn remove(&mut self, id: u32) {
        self.t.unlink(id);
    }

    fn cool(&mut self, id: u32) {
        if let Some(l) = self.t.list_of(id) {
            self.t.push_back(l, id);
        }
    }

    fn evict(&mut self, try_evict: &mut Offer<'_>) -> Option<u32> {
        let first = if self.t.len(T1) > 0 && (self.t.len(T1) > self.p || self.t.len(T2) == 0) {
            T1
        } else {
            T2
        };
        self.evict_from(first, try_evict)
            .or_else(|| self.evict_from(1 - first, try_evict))
    }

    fn len(&self) -> usize {
        self.t.total()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ghost_hit_in_b1_grows_t1_and_returns_to_t2() {
        let mut a = Arc::default();
        for i in 0..32u32 {
            a.insert(i, 100 + u64::from(i));
        }
        // 0..16 seen twice: T2.
        for i in 0..16 {
            a.access(i, 100 + u64::from(i));
        }
        let key = &mut |id| Some(100 + u64::from(id));
        // p = 0: T1 (16..32) goes first, oldest first.
        assert_eq!(a.evict(key), Some(16));
        assert_eq!(a.b[0].len, 1);
        // Key 116 comes back: a B1 hit, p grows, the block lands in T2.
        a.insert(16, 116);
        assert_eq!(a.p, 1);
        assert_eq!(a.t.list_of(16), Some(T2));
        assert_eq!(a.b[0].len, 0);
        // A B2 hit shrinks p again.
        a.p = 0;
        assert_eq!(a.evict_from(T2, key), Some(0));
        a.p = 5;
        a.insert(0, 100);
        assert!(a.p < 5);
    }

    #[test]
    fn ghosts_stay_bounded() {
        let mut a = Arc::default();
        let mut keys: Vec<u64> = (0..64).collect();
        for i in 0..64u32 {
            a.insert(i, u64::from(i));
        }
        for k in 64..100_000u64 {
            let id = a.evict(&mut |id| Some(keys[id as usize])).unwrap();
            keys[id as usize] = k;
            a.insert(id, k);
        }
        assert_eq!(a.len(), 64);
        assert!(a.b[0].len + a.b[1].len <= 64, "{}", a.b[0].len + a.b[1].len);
        assert!(a.b[0].order.len() + a.b[1].order.len() <= 4 * 64 + 128);
        assert_eq!(a.ghost.len(), a.b[0].len + a.b[1].len);
    }
}

//! A ghost history: the key hashes a policy evicted, oldest first, at most a given number of
//! them, each with the queue it left from (1 or 2), and whether a key is among them.
//!
//! It holds as many entries as the cache holds blocks, so on a node in steady state it is
//! part of the per-block metadata (`kvtier-bench host`, case `metadata 10M blocks evicting`).
//! A ring of 8-byte entries (the key hash, its lowest bit replaced by the origin) and an
//! open-addressing index of 4-byte ring positions, linear probing with backward-shift
//! deletion: 13–22 bytes an entry, where a `VecDeque<(u64, u8)>` beside a
//! `HashMap<u64, (u32, u8)>` took ~55 at 10 M. Keys are compared on 63 bits.

/// No entry in an index slot.
const EMPTY: u32 = 0;

#[derive(Default)]
pub(super) struct Ghost {
    /// Circular, `len` entries from `head` (the oldest); `(key & !1) | (from - 1)`.
    ring: Vec<u64>,
    head: usize,
    len: usize,
    /// Ring position + 1 of the newest entry of each key present (0: empty); a power of two
    /// long, at most 80% full.
    index: Vec<u32>,
    /// Entries per origin (index 1 and 2).
    n: [usize; 3],
}

fn id(key: u64) -> u64 {
    key & !1
}

impl Ghost {
    /// Entries that left from queue `from` (duplicates of a key counted each).
    pub(super) fn count(&self, from: u8) -> usize {
        self.n[from as usize]
    }

    /// Entries held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The queue the newest entry of `key` left from, if any.
    pub(super) fn get(&self, key: u64) -> Option<u8> {
        let pos = self.find(id(key))?;
        Some((self.ring[pos] & 1) as u8 + 1)
    }

    /// Adds `key` (evicted from queue `from`) as the newest entry, then drops the oldest ones
    /// past `cap`.
    pub(super) fn remember(&mut self, key: u64, from: u8, cap: usize) {
        debug_assert!(from == 1 || from == 2);
        if self.len == self.ring.len() {
            self.grow(cap);
        }
        let pos = (self.head + self.len) % self.ring.len();
        self.ring[pos] = id(key) | u64::from(from - 1);
        self.len += 1;
        self.n[from as usize] += 1;
        self.point(id(key), pos);
        while self.len > cap.max(1) {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        let pos = self.head;
        let e = self.ring[pos];
        self.head = (self.head + 1) % self.ring.len();
        self.len -= 1;
        self.n[(e & 1) as usize + 1] -= 1;
        // Only the key's newest entry is indexed; an older one just leaves the ring.
        if let Some(slot) = self.slot_of(id(e)) {
            if self.index[slot] as usize == pos + 1 {
                self.delete(slot);
            }
        }
    }

    fn home(&self, k: u64) -> usize {
        let mask = self.index.len() - 1;
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask
    }

    /// The index slot of key id `k`, if present.
    fn slot_of(&self, k: u64) -> Option<usize> {
        if self.index.is_empty() {
            return None;
        }
        let mask = self.index.len() - 1;
        let mut s = self.home(k);
        loop {
            match self.index[s] {
                EMPTY => return None,
                p if id(self.ring[p as usize - 1]) == k => return Some(s),
                _ => s = (s + 1) & mask,
            }
        }
    }

    fn find(&self, k: u64) -> Option<usize> {
        self.slot_of(k).map(|s| self.index[s] as usize - 1)
    }

    /// Makes the index name ring position `pos` for key id `k` (its newest entry).
    fn point(&mut self, k: u64, pos: usize) {
        let mask = self.index.len() - 1;
        let mut s = self.home(k);
        loop {
            match self.index[s] {
                EMPTY => break,
                p if id(self.ring[p as usize - 1]) == k => break,
                _ => s = (s + 1) & mask,
            }
        }
        self.index[s] = pos as u32 + 1;
    }

    /// Empties index slot `s`, shifting back the entries after it that probed past it.
    fn delete(&mut self, mut s: usize) {
        let mask = self.index.len() - 1;
        let mut next = (s + 1) & mask;
        while self.index[next] != EMPTY {
            let p = self.index[next];
            let home = self.home(id(self.ring[p as usize - 1]));
            // Move it back if `s` lies on its probe path (between its home and `next`).
            if (next.wrapping_sub(home) & mask) >= (next.wrapping_sub(s) & mask) {
                self.index[s] = p;
                s = next;
            }
            next = (next + 1) & mask;
        }
        self.index[s] = EMPTY;
    }

    /// Room for at least one more entry: the ring laid out again oldest first with a quarter
    /// more room (at least `cap + 1`), and the index rebuilt.
    fn grow(&mut self, cap: usize) {
        let want = (self.len + self.len / 4).max(cap + 1).max(16);
        let mut ring = Vec::with_capacity(want);
        ring.extend((0..self.len).map(|i| self.ring[(self.head + i) % self.ring.len()]));
        ring.resize(want, 0);
        self.ring = ring;
        self.head = 0;
        let slots = (want + want / 4).next_power_of_two();
        self.index = vec![EMPTY; slots];
        for pos in 0..self.len {
            let k = id(self.ring[pos]);
            self.point(k, pos);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, VecDeque};

    /// The structure this replaced, as the reference.
    #[derive(Default)]
    struct Model {
        ring: VecDeque<(u64, u8)>,
        set: HashMap<u64, (u32, u8)>,
        n: [usize; 3],
    }

    impl Model {
        fn remember(&mut self, key: u64, from: u8, cap: usize) {
            self.ring.push_back((key, from));
            self.n[from as usize] += 1;
            let e = self.set.entry(key).or_insert((0, from));
            e.0 += 1;
            e.1 = from;
            while self.ring.len() > cap.max(1) {
                let (old, q) = self.ring.pop_front().unwrap();
                self.n[q as usize] -= 1;
                let c = self.set.get_mut(&old).unwrap();
                c.0 -= 1;
                if c.0 == 0 {
                    self.set.remove(&old);
                }
            }
        }
    }

    #[test]
    fn it_answers_as_the_map_and_queue_it_replaced() {
        let mut g = Ghost::default();
        let mut m = Model::default();
        let mut x = 1u64;
        for step in 0..200_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Few distinct keys (repeats, re-evictions), even so their lowest bit is free; a
            // capacity that grows, holds and shrinks.
            let key = ((x >> 40) % 300) << 1;
            let from = 1 + ((x >> 20) & 1) as u8;
            let cap = match step {
                0..50_000 => 16 + (step / 500) as usize,
                50_000..120_000 => 116,
                _ => 116 - ((step - 120_000) / 1_000) as usize,
            };
            g.remember(key, from, cap);
            m.remember(key, from, cap);
            assert_eq!(g.len(), m.ring.len());
            assert_eq!((g.count(1), g.count(2)), (m.n[1], m.n[2]));
            let probe = ((x >> 8) % 300) << 1;
            assert_eq!(g.get(probe), m.set.get(&probe).map(|e| e.1), "step {step}");
            assert_eq!(g.get(key), Some(from));
        }
    }

    #[test]
    fn the_index_stays_a_fraction_of_the_entries() {
        let mut g = Ghost::default();
        for k in 0..1_000_000u64 {
            g.remember(k << 1, 1, 100_000);
        }
        assert_eq!(g.len(), 100_000);
        assert!(g.ring.len() <= 125_001, "{}", g.ring.len());
        assert!(g.index.len() <= 262_144, "{}", g.index.len());
        assert_eq!(g.get(999_999 << 1), Some(1));
        assert_eq!(g.get(899_999 << 1), None);
    }
}

//! An index shard's table: block key → [`Entry`], open addressing with Robin Hood linear
//! probing and backward-shift deletion, in one flat array of 32-byte buckets (the key's two
//! words and the 16-byte entry; an empty bucket is one whose entry names class 255, which no
//! store has: at most 255 classes, numbered from 0).
//!
//! Why not `hashbrown` (what it replaced): two things a 10 M-block node needs.
//! - **Memory.** The capacity is not a power of two: the table grows by a third when 90% full,
//!   so it runs between 68% and 90% full (hashbrown: 44–88%, plus a control byte a bucket).
//!   Robin Hood keeps probes short at that load, a miss included (a probe stops at the first
//!   bucket whose key sits closer to its home than the probe has come).
//! - **Prefetching.** A key's home bucket is a function of its hash and the table's size, which
//!   the table publishes in a [`Hint`] outside the shard's lock: a batched lookup prefetches
//!   the home bucket of every key first, then takes each shard's lock once and probes, so the
//!   cache misses of 64 keys overlap instead of queueing one after the other behind a lock.
//!
//! A key's index hash is 32 bits ([`hash`]): its low bits pick the shard, and its home bucket
//! is `fastrange(hash, capacity)`, which the high bits decide. 32 bits place a key exactly in
//! any table under 2^32 buckets, and a size class remembers each slot's key by these 4 bytes.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use super::index::{Entry, Life, Slot};
use crate::key::BlockKey;
use crate::types::{key_mix, MapKey};

/// The class byte of an empty bucket (classes are numbered 0..=254).
const EMPTY: u8 = u8::MAX;
/// Grow when more than 9 in 10 buckets would be full…
const MAX_LOAD: (usize, usize) = (9, 10);
/// …to a capacity 4/3 the old one (68% full after).
const GROWTH: (usize, usize) = (4, 3);
const MIN_CAPACITY: usize = 16;
/// Buckets a probe compares keys in before it checks whether it can stop early.
const CHEAP_PROBES: usize = 4;

#[derive(Clone, Copy)]
#[repr(C)]
struct Bucket {
    key: MapKey,
    e: Entry,
}

const _: () = assert!(std::mem::size_of::<Bucket>() == 32);

impl Bucket {
    fn empty() -> Self {
        Bucket {
            key: MapKey([0, 0]),
            e: Entry::new(
                Slot {
                    class: EMPTY,
                    idx: 0,
                },
                0,
                0,
                Life::Filling,
                0,
            ),
        }
    }
    fn is_empty(&self) -> bool {
        self.e.class == EMPTY
    }
}

/// The index hash of a key: its low bits pick the shard ([`super::Inner::shard_of`]), its high
/// bits the bucket.
pub(crate) fn hash(key: MapKey) -> u32 {
    key_mix(BlockKey::from(key)) as u32
}

/// The home bucket of a key with hash `h` in a table of `cap` buckets (`cap` < 2^32).
fn home(h: u32, cap: usize) -> usize {
    ((u64::from(h) * cap as u64) >> 32) as usize
}

/// Where a shard's buckets are, for prefetching without the shard's lock. Read racily on
/// purpose: a stale pair (the table grew meanwhile) only prefetches the wrong line, and a
/// prefetch never faults, so nothing depends on it being right.
#[derive(Default)]
pub(crate) struct Hint {
    base: AtomicUsize,
    cap: AtomicUsize,
}

impl Hint {
    /// The table's buckets (as last published).
    pub(crate) fn capacity(&self) -> usize {
        self.cap.load(Relaxed)
    }

    /// Starts loading the home bucket of the key with hash `h` into the cache.
    #[inline]
    pub(crate) fn prefetch(&self, h: u32) {
        let (base, cap) = (self.base.load(Relaxed), self.cap.load(Relaxed));
        if cap == 0 {
            return;
        }
        let addr = base.wrapping_add(home(h, cap) * std::mem::size_of::<Bucket>());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `_mm_prefetch` only hints the cache; it never faults and reads nothing the
        // program sees, whatever the address (which may be stale: see `Hint`).
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(addr as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = addr;
    }
}

/// The table. Same shape of API as the `HashMap` it replaced.
pub(crate) struct Table {
    buckets: Box<[Bucket]>,
    len: usize,
    hint: Arc<Hint>,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            buckets: Box::new([]),
            len: 0,
            hint: Arc::default(),
        }
    }
}

impl Table {
    /// The table's prefetch hint (shared: the store keeps one per shard outside its lock).
    pub(crate) fn hint(&self) -> Arc<Hint> {
        self.hint.clone()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Distance of the entry in bucket `i` from its home.
    fn dist(&self, i: usize) -> usize {
        let cap = self.buckets.len();
        let h = home(hash(self.buckets[i].key), cap);
        (i + cap - h) % cap
    }

    /// The first bucket on the probe path of hash `h` that `hit` accepts.
    #[inline]
    fn probe(&self, h: u32, hit: impl Fn(&Bucket) -> bool) -> Option<usize> {
        let cap = self.buckets.len();
        if self.len == 0 {
            return None;
        }
        let mut i = home(h, cap);
        let mut d = 0;
        loop {
            let b = &self.buckets[i];
            if b.is_empty() {
                return None;
            }
            if hit(b) {
                return Some(i);
            }
            // Robin Hood: every key between its home and here sits at least as far from its
            // own home as the probe has come, so one closer to home ends the search. Asked
            // only from the `CHEAP_PROBES`th bucket on (it costs a hash): most keys are found
            // before, and a miss ends a few buckets later.
            if d >= CHEAP_PROBES && self.dist(i) < d {
                return None;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
            d += 1;
        }
    }

    /// The bucket holding `key` (hash `h`).
    #[inline]
    fn find(&self, h: u32, key: &MapKey) -> Option<usize> {
        self.probe(h, |b| b.key == *key)
    }

    /// The entry of `key`, given its [`hash`].
    #[inline]
    pub(crate) fn get_hashed(&self, h: u32, key: &MapKey) -> Option<&Entry> {
        self.find(h, key).map(|i| &self.buckets[i].e)
    }

    /// The entry of `key` to change, given its [`hash`].
    #[inline]
    pub(crate) fn get_hashed_mut(&mut self, h: u32, key: &MapKey) -> Option<&mut Entry> {
        self.find(h, key).map(|i| &mut self.buckets[i].e)
    }

    pub(crate) fn get(&self, key: &MapKey) -> Option<&Entry> {
        self.get_hashed(hash(*key), key)
    }

    pub(crate) fn get_mut(&mut self, key: &MapKey) -> Option<&mut Entry> {
        self.get_hashed_mut(hash(*key), key)
    }

    /// The key and entry that hold `slot`, given the key's hash (what a size class remembers
    /// of a slot's block): the bucket is on the probe path of the hash's home, like the key's.
    pub(crate) fn slot_entry_mut(&mut self, h: u32, slot: Slot) -> Option<(MapKey, &mut Entry)> {
        let i = self.probe(h, |b| b.e.slot() == slot)?;
        let b = &mut self.buckets[i];
        Some((b.key, &mut b.e))
    }

    pub(crate) fn contains_key(&self, key: &MapKey) -> bool {
        self.get(key).is_some()
    }

    /// Inserts or replaces; returns the entry replaced.
    pub(crate) fn insert(&mut self, key: MapKey, e: Entry) -> Option<Entry> {
        debug_assert!(e.class != EMPTY, "class 255 marks an empty bucket");
        let h = hash(key);
        if let Some(i) = self.find(h, &key) {
            return Some(std::mem::replace(&mut self.buckets[i].e, e));
        }
        if (self.len + 1) * MAX_LOAD.1 > self.buckets.len() * MAX_LOAD.0 {
            self.grow();
        }
        self.place(h, Bucket { key, e });
        self.len += 1;
        None
    }

    /// Puts a bucket whose key is absent into the table (which has an empty bucket).
    fn place(&mut self, h: u32, mut b: Bucket) {
        let cap = self.buckets.len();
        let mut i = home(h, cap);
        let mut d = 0;
        loop {
            if self.buckets[i].is_empty() {
                self.buckets[i] = b;
                return;
            }
            let theirs = self.dist(i);
            if theirs < d {
                // Take the bucket from the richer key and carry it on.
                std::mem::swap(&mut self.buckets[i], &mut b);
                d = theirs;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
            d += 1;
        }
    }

    fn grow(&mut self) {
        let cap = (self.buckets.len() * GROWTH.0 / GROWTH.1).max(MIN_CAPACITY);
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::empty(); cap].into());
        for b in old.iter().filter(|b| !b.is_empty()) {
            self.place(hash(b.key), *b);
        }
        self.hint
            .base
            .store(self.buckets.as_ptr() as usize, Relaxed);
        self.hint.cap.store(cap, Relaxed);
    }

    /// Removes `key`; returns its entry.
    pub(crate) fn remove(&mut self, key: &MapKey) -> Option<Entry> {
        let mut i = self.find(hash(*key), key)?;
        let gone = self.buckets[i].e;
        let cap = self.buckets.len();
        // Backward shift: pull each following displaced key one bucket nearer its home.
        loop {
            let next = if i + 1 == cap { 0 } else { i + 1 };
            if self.buckets[next].is_empty() || self.dist(next) == 0 {
                self.buckets[i] = Bucket::empty();
                break;
            }
            self.buckets[i] = self.buckets[next];
            i = next;
        }
        self.len -= 1;
        Some(gone)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&MapKey, &Entry)> {
        self.buckets
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| (&b.key, &b.e))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&MapKey, &mut Entry)> {
        self.buckets
            .iter_mut()
            .filter(|b| !b.is_empty())
            .map(|b| (&b.key, &mut b.e))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &Entry> {
        self.iter().map(|(_, e)| e)
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
impl std::ops::Index<&MapKey> for Table {
    type Output = Entry;
    fn index(&self, key: &MapKey) -> &Entry {
        self.get(key).expect("no entry for the key")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn entry(i: u32) -> Entry {
        Entry::new(Slot { class: 0, idx: i }, i, 0, Life::Ready, 0)
    }

    /// The table against a `HashMap` over random inserts, replacements and removals, with
    /// keys that collide in their low or high word (as crafted keys would).
    #[test]
    fn behaves_as_a_map() {
        let mut rng = 0x1234_5678_9ABC_DEF0u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let (mut t, mut m) = (Table::default(), HashMap::new());
        for step in 0..200_000u32 {
            let r = next();
            // A small key space so that hits, replacements and removals are frequent; the
            // space grows and shrinks so the table grows through many sizes.
            let span = 1 + (step / 20_000 % 5) as u64 * 3_000;
            let k = r % span;
            let key = MapKey(if r & 1 == 0 { [k, 7] } else { [7, k] });
            match (r >> 40) % 8 {
                0..=3 => assert_eq!(t.insert(key, entry(step)), m.insert(key, entry(step))),
                4..=5 => assert_eq!(t.remove(&key), m.remove(&key)),
                _ => assert_eq!(t.get(&key), m.get(&key)),
            }
            assert_eq!(t.len(), m.len());
        }
        let mut got: Vec<_> = t.iter().map(|(k, e)| (k.0, e.idx)).collect();
        let mut want: Vec<_> = m.iter().map(|(k, e)| (k.0, e.idx)).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        for (k, e) in t.iter_mut() {
            e.pins = k.0[0] as u32;
        }
        for (k, _) in m.iter() {
            assert_eq!(t[k].pins, k.0[0] as u32);
        }
    }

    #[test]
    fn a_slot_leads_back_to_its_key() {
        let mut t = Table::default();
        for i in 0..5_000u32 {
            let e = Entry::new(Slot { class: 2, idx: i }, 1, 0, Life::Ready, 0);
            t.insert(MapKey([u64::from(i), 9]), e);
        }
        for i in 0..5_000u32 {
            let k = MapKey([u64::from(i), 9]);
            let found = t.slot_entry_mut(hash(k), Slot { class: 2, idx: i });
            assert_eq!(found.map(|(key, e)| (key, e.idx)), Some((k, i)));
            assert!(t
                .slot_entry_mut(hash(k), Slot { class: 1, idx: i })
                .is_none());
        }
        let k = MapKey([7, 9]);
        t.remove(&k);
        assert!(t
            .slot_entry_mut(hash(k), Slot { class: 2, idx: 7 })
            .is_none());
    }

    #[test]
    fn runs_between_68_and_90_percent_full() {
        let mut t = Table::default();
        let mut lowest = 1.0f64;
        for i in 0..100_000u64 {
            t.insert(MapKey([i, !i]), entry(i as u32));
            let load = t.len() as f64 / t.capacity() as f64;
            assert!(load <= 0.9, "load {load} at {i}");
            if i > 1000 {
                lowest = lowest.min(load);
            }
        }
        assert!(lowest > 0.67, "lowest load {lowest}");
        for i in 0..100_000u64 {
            assert_eq!(t.get(&MapKey([i, !i])).map(|e| e.idx), Some(i as u32));
        }
        assert!(t.get(&MapKey([1, 1])).is_none());
    }

    #[test]
    fn the_hint_follows_growth() {
        let mut t = Table::default();
        let h = t.hint();
        assert_eq!(h.cap.load(Relaxed), 0);
        h.prefetch(42); // nothing to prefetch: no fault, no effect
        for i in 0..100u64 {
            t.insert(MapKey([i, i]), entry(1));
        }
        assert_eq!(h.cap.load(Relaxed), t.capacity());
        assert_eq!(h.base.load(Relaxed), t.buckets.as_ptr() as usize);
        h.prefetch(hash(MapKey([3, 3])));
    }
}

//! W-TinyLFU as Caffeine builds it (Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient
//! Cache Admission Policy", ACM ToS 2017; Caffeine's `BoundedLocalCache`): new blocks enter a
//! small LRU *window*; the main space is a segmented LRU (*probation* 20%, *protected* 80%);
//! when the window overflows, its oldest block (the candidate) enters the main space only if a
//! frequency sketch says it is used more often than the main space's next victim, else it is
//! the one evicted. The sketch is a Count-Min sketch of 4-bit counters behind a doorkeeper
//! (a bloom filter that absorbs first references), halved every `10 x capacity` references
//! (aging). The window's share adapts by hill climbing on the hit rate (from 1%, in 6.25%
//! steps that decay by 0.98 per sample, restarted by a 5% hit-rate shift).
//!
//! Capacity is not configured: it is the number of blocks tracked when evictions start (the
//! store evicts only when full), and the sketch grows with it.

use super::lists::Lists;
use super::{EvictionPolicy, Offer};

const WINDOW: usize = 0;
const PROBATION: usize = 1;
const PROTECTED: usize = 2;

const PROTECTED_SHARE: f64 = 0.8;
const START_WINDOW: f64 = 0.01;
const MAX_WINDOW: f64 = 0.8;
const STEP: f64 = 0.0625;
const STEP_DECAY: f64 = 0.98;
const RESTART: f64 = 0.05;

/// Count-Min sketch (4 rows of 4-bit counters, two per byte) with a doorkeeper and halving.
/// Sized as Caffeine's: 16 counters per cached block (4 rows of `4 x capacity`), so the
/// `10 x capacity` references of a sample leave each counter a few increments, not a
/// saturated 15; the doorkeeper has 16 bits per cached block.
struct Sketch {
    /// `4 * width / 2` bytes.
    table: Vec<u8>,
    /// Doorkeeper bits, `4 * width` of them.
    door: Vec<u64>,
    mask: u64,
    additions: u64,
    sample: u64,
}

const SEEDS: [u64; 4] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x27D4_EB2F_1656_67C5,
];

impl Sketch {
    /// A sketch for a cache of `capacity` blocks.
    fn new(capacity: usize) -> Self {
        let capacity = capacity.next_power_of_two().max(64);
        let width = 4 * capacity;
        Self {
            table: vec![0; 2 * width],
            door: vec![0; width / 16],
            mask: width as u64 - 1,
            additions: 0,
            sample: 10 * capacity as u64,
        }
    }

    /// The cache size it was built for.
    fn capacity(&self) -> usize {
        self.width() / 4
    }

    fn width(&self) -> usize {
        self.mask as usize + 1
    }

    fn index(&self, h: u64, row: usize) -> usize {
        let x = (h ^ SEEDS[row]).wrapping_mul(SEEDS[(row + 1) % 4]);
        let col = ((x >> 32) ^ x) & self.mask;
        row * self.width() + col as usize
    }

    fn counter(&self, i: usize) -> u8 {
        (self.table[i / 2] >> ((i % 2) * 4)) & 0xF
    }

    fn door_bits(&self, h: u64) -> [(usize, u64); 2] {
        let a = h.wrapping_mul(SEEDS[2]) >> 7;
        let b = h.wrapping_mul(SEEDS[3]) >> 11;
        let bits = 4 * self.width() as u64 - 1;
        [a, b].map(|x| {
            let bit = x & bits;
            ((bit / 64) as usize, 1u64 << (bit % 64))
        })
    }

    fn in_door(&self, h: u64) -> bool {
        self.door_bits(h)
            .iter()
            .all(|&(w, m)| self.door[w] & m != 0)
    }

    fn frequency(&self, h: u64) -> u8 {
        let f = (0..4)
            .map(|r| self.counter(self.index(h, r)))
            .min()
            .unwrap_or(0);
        f + u8::from(self.in_door(h))
    }

    fn increment(&mut self, h: u64) {
        if !self.in_door(h) {
            for (w, m) in self.door_bits(h) {
                self.door[w] |= m;
            }
        } else {
            for r in 0..4 {
                let i = self.index(h, r);
                if self.counter(i) < 15 {
                    self.table[i / 2] += 1 << ((i % 2) * 4);
                }
            }
        }
        self.additions += 1;
        if self.additions >= self.sample {
            // Aging: halve every counter, forget the doorkeeper.
            for b in &mut self.table {
                *b = (*b >> 1) & 0x77;
            }
            self.door.iter_mut().for_each(|w| *w = 0);
            self.additions /= 2;
        }
    }
}

/// W-TinyLFU over dense ids.
pub struct WTinyLfu {
    lists: Lists<3>,
    hash: Vec<u64>,
    /// Cooled ids (a bit each): they lose the frequency duel whatever their count.
    cold: Vec<u64>,
    sketch: Sketch,
    /// The window's target share of the capacity.
    window: f64,
    step: f64,
    hits: u64,
    misses: u64,
    last_rate: Option<f64>,
}

impl Default for WTinyLfu {
    fn default() -> Self {
        Self {
            lists: Lists::default(),
            hash: Vec::new(),
            cold: Vec::new(),
            sketch: Sketch::new(64),
            window: START_WINDOW,
            step: STEP,
            hits: 0,
            misses: 0,
            last_rate: None,
        }
    }
}

impl WTinyLfu {
    fn record(&mut self, h: u64, hit: bool) {
        let n = self.lists.total();
        if n > self.sketch.capacity() {
            // Grown past the sketch: a wider one (the counts start over).
            self.sketch = Sketch::new(n);
        }
        self.sketch.increment(h);
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        if self.hits + self.misses >= 10 * n.max(64) as u64 {
            self.climb();
        }
    }

    /// One hill-climbing step on the window's share, from the last sample's hit rate.
    fn climb(&mut self) {
        let rate = self.hits as f64 / (self.hits + self.misses) as f64;
        self.hits = 0;
        self.misses = 0;
        if let Some(last) = self.last_rate {
            let change = rate - last;
            if change < 0.0 {
                self.step = -self.step;
            }
            self.window = (self.window + self.step).clamp(0.0, MAX_WINDOW);
            self.step = if change.abs() >= RESTART {
                STEP.copysign(self.step)
            } else {
                self.step * STEP_DECAY
            };
        }
        self.last_rate = Some(rate);
    }

    fn set_cold(&mut self, id: u32, on: bool) {
        let (w, b) = (id as usize / 64, id % 64);
        if on {
            if self.cold.len() <= w {
                self.cold.resize(w + 1, 0);
            }
            self.cold[w] |= 1 << b;
        } else if let Some(x) = self.cold.get_mut(w) {
            *x &= !(1 << b);
        }
    }

    fn is_cold(&self, id: u32) -> bool {
        self.cold
            .get(id as usize / 64)
            .is_some_and(|x| x & (1 << (id % 64)) != 0)
    }

    fn freq(&self, id: u32) -> u8 {
        self.sketch.frequency(self.hash[id as usize])
    }

    /// Keeps the protected segment at its share of the main space.
    fn trim_protected(&mut self) {
        let n = self.lists.total();
        let main = n - self.lists.len(WINDOW).min(n);
        let max = ((main as f64) * PROTECTED_SHARE) as usize;
        while self.lists.len(PROTECTED) > max.max(1) {
            let Some(old) = self.lists.back(PROTECTED) else {
                break;
            };
            self.lists.push_front(PROBATION, old);
        }
    }

    /// Offers the blocks of `lists`, oldest first, to `try_evict`.
    fn scan(&mut self, lists: &[usize], try_evict: &mut Offer<'_>) -> Option<u32> {
        for &l in lists {
            let mut cur = self.lists.back(l);
            while let Some(id) = cur {
                let next = self.lists.toward_head(id);
                if try_evict(id).is_some() {
                    self.lists.unlink(id);
                    return Some(id);
                }
                cur = (next != super::lists::NIL).then_some(next);
            }
        }
        None
    }

    /// The window's share of the capacity now (for tests and stats).
    pub fn window_share(&self) -> f64 {
        self.window
    }
}

impl EvictionPolicy for WTinyLfu {
    fn name(&self) -> &'static str {
        "wtinylfu"
    }

    fn reserve(&mut self, ids: usize) {
        self.lists.reserve(ids);
        super::reserve_total(&mut self.hash, ids);
        super::reserve_total(&mut self.cold, ids.div_ceil(64));
    }

    fn insert(&mut self, id: u32, key_hash: u64) {
        self.lists.ensure(id);
        if self.hash.len() <= id as usize {
            self.hash.resize(id as usize + 1, 0);
        }
        self.hash[id as usize] = key_hash;
        self.set_cold(id, false);
        self.lists.push_front(WINDOW, id);
        self.record(key_hash, false);
    }

    fn access(&mut self, id: u32, _key_hash: u64) {
        let Some(l) = self.lists.list_of(id) else {
            return;
        };
        self.set_cold(id, false);
        match l {
            PROBATION => {
                self.lists.push_front(PROTECTED, id);
                self.trim_protected();
            }
            _ => self.lists.push_front(l, id),
        }
        self.record(self.hash[id as usize], true);
    }

    fn remove(&mut self, id: u32) {
        self.lists.unlink(id);
        self.set_cold(id, false);
    }

    fn cool(&mut self, id: u32) {
        // The main space's next victim, and it loses the duel with a window arrival.
        if self.lists.list_of(id).is_some() {
            self.lists.push_back(PROBATION, id);
            self.set_cold(id, true);
        }
    }

    fn evict(&mut self, try_evict: &mut Offer<'_>) -> Option<u32> {
        let n = self.lists.total();
        if n == 0 {
            return None;
        }
        let wmax = ((n as f64) * self.window).round().max(1.0) as usize;
        // The window's overflow moves into the main space (oldest first, order kept).
        let mut cand = None;
        while self.lists.len(WINDOW) > wmax {
            let Some(c) = self.lists.back(WINDOW) else {
                break;
            };
            self.lists.push_front(PROBATION, c);
            cand = Some(c);
        }
        if let Some(c) = cand {
            // The duel: the newest arrival against the main space's next victim.
            let victim = self
                .lists
                .back(PROBATION)
                .filter(|&v| v != c)
                .or_else(|| self.lists.back(PROTECTED));
            match victim {
                Some(v) if self.is_cold(v) || self.freq(c) > self.freq(v) => {}
                _ => {
                    if try_evict(c).is_some() {
                        self.lists.unlink(c);
                        return Some(c);
                    }
                }
            }
        }
        self.scan(&[PROBATION, PROTECTED, WINDOW], try_evict)
    }

    fn len(&self) -> usize {
        self.lists.total()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sketch_counts_ages_and_keeps_first_references_at_the_door() {
        let mut s = Sketch::new(256);
        assert_eq!(s.frequency(42), 0);
        s.increment(42);
        assert_eq!(
            s.frequency(42),
            1,
            "the doorkeeper holds the first reference"
        );
        for _ in 0..20 {
            s.increment(42);
        }
        assert_eq!(s.frequency(42), 16, "15 (saturated) + the doorkeeper bit");
        // Aging halves the counters and clears the doorkeeper.
        for i in 0..s.sample {
            s.increment(1_000_000 + i);
        }
        let f = s.frequency(42);
        assert!((7..=8).contains(&f), "after halving: {f}");
    }

    #[test]
    fn frequent_blocks_survive_a_scan() {
        // 100 slots; 20 hot blocks read all the time while one-hit blocks stream through.
        let mut p = WTinyLfu::default();
        let mut key_in: Vec<u64> = (0..100).collect();
        for i in 0..100u32 {
            p.insert(i, u64::from(i));
        }
        // The hot ones have been read before.
        for _ in 0..3 {
            (0..20).for_each(|h| p.access(h, u64::from(h)));
        }
        let mut x = 99u64;
        for k in 1000..20_000u64 {
            for _ in 0..2 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                let hot = (x >> 33) % 20;
                if let Some(slot) = key_in.iter().position(|&key| key == hot) {
                    p.access(slot as u32, hot);
                }
            }
            let v = p
                .evict(&mut |v| Some(key_in[v as usize]))
                .expect("a victim");
            key_in[v as usize] = k;
            p.insert(v, k);
        }
        let hot_left = (0..20u64).filter(|h| key_in.contains(h)).count();
        assert_eq!(hot_left, 20, "hot blocks evicted by a scan");
    }

    #[test]
    fn window_share_climbs_within_bounds() {
        let mut p = WTinyLfu::default();
        for i in 0..64 {
            p.insert(i, u64::from(i));
        }
        let mut x = 7u64;
        for _ in 0..200_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            let id = ((x >> 33) % 64) as u32;
            if x.is_multiple_of(3) {
                p.access(id, 0);
            } else {
                let v = p.evict(&mut |_| Some(0)).expect("victim");
                p.insert(v, x);
            }
        }
        let w = p.window_share();
        assert!((0.0..=MAX_WINDOW).contains(&w), "{w}");
        assert_ne!(w, START_WINDOW, "the climber never moved");
    }
}

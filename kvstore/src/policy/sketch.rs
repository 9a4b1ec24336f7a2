//! The frequency estimate shared by W-TinyLFU's admission duel and the store's admission into
//! the disk tier: a Count-Min sketch of 4-bit counters (4 rows) behind a doorkeeper (a bloom
//! filter that absorbs first references), halved after `10 x capacity` references and then
//! every `5 x capacity` (the count restarts from half, aging), as in Caffeine's
//! `FrequencySketch` and the TinyLFU paper (Einziger, Friedman, Manes, ACM ToS 2017). Sized
//! as Caffeine's: 16 counters per tracked block (4 rows of `4 x capacity`), so the `10 x
//! capacity` references of a sample leave each counter a few increments, not a saturated 15;
//! the doorkeeper has 16 bits per tracked block: 10 bytes per tracked block in all.

const SEEDS: [u64; 4] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x27D4_EB2F_1656_67C5,
];

/// How often a key was referenced lately (0–16), in bounded memory.
pub(crate) struct FrequencySketch {
    /// `4 * width / 2` bytes: 4 rows of `width` 4-bit counters.
    table: Vec<u8>,
    /// Doorkeeper bits, `4 * width` of them.
    door: Vec<u64>,
    mask: u64,
    additions: u64,
    sample: u64,
}

impl FrequencySketch {
    /// A sketch for `capacity` tracked blocks (rounded up to a power of two, at least 64).
    pub(crate) fn new(capacity: usize) -> Self {
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

    /// The number of tracked blocks it was sized for.
    pub(crate) fn capacity(&self) -> usize {
        self.width() / 4
    }

    /// Widens the sketch to track `capacity` blocks, keeping every estimate: a counter of the
    /// wider table starts from the one its column folds onto (`col & old_mask`: the columns
    /// are the same hash bits, masked wider), so no key's estimate drops, as a Count-Min
    /// sketch must not; the doorkeeper's bits fold the same way. Keys that shared a column keep
    /// sharing its count until the next halving, so estimates run high for a while: fine for
    /// the store's seen-twice admission (a one-hit block is rarely put with a hot one's count),
    /// not for W-TinyLFU's duel, which starts over instead.
    pub(crate) fn grow(&mut self, capacity: usize) {
        let capacity = capacity.next_power_of_two().max(64);
        if capacity <= self.capacity() {
            return;
        }
        let mut wider = Self::new(capacity);
        // Column `c` of a wider row reads the old row's column `c mod old_width`: each wider
        // row is the old row repeated (two counters per byte, widths even), and the doorkeeper
        // the old one repeated (its bit count is a multiple of 64).
        let (old_row, new_row) = (self.width() / 2, wider.width() / 2);
        for row in 0..4 {
            let old = &self.table[row * old_row..(row + 1) * old_row];
            for tile in wider.table[row * new_row..(row + 1) * new_row].chunks_exact_mut(old_row) {
                tile.copy_from_slice(old);
            }
        }
        for tile in wider.door.chunks_exact_mut(self.door.len()) {
            tile.copy_from_slice(&self.door);
        }
        wider.additions = self.additions;
        *self = wider;
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

    /// The estimate: references since the last halving, roughly (never fewer), at most 16.
    pub(crate) fn frequency(&self, h: u64) -> u8 {
        let f = (0..4)
            .map(|r| self.counter(self.index(h, r)))
            .min()
            .unwrap_or(0);
        f + u8::from(self.in_door(h))
    }

    /// Records one reference of `h`.
    pub(crate) fn increment(&mut self, h: u64) {
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

    /// Heap bytes it holds.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.table.len() + 8 * self.door.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sketch_counts_ages_and_keeps_first_references_at_the_door() {
        let mut s = FrequencySketch::new(256);
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
        assert_eq!(s.bytes(), 10 * 256, "10 bytes per tracked block");
    }

    #[test]
    fn growing_keeps_every_estimate() {
        let mut s = FrequencySketch::new(64);
        let keys: Vec<u64> = (0..200u64)
            .map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for (n, &k) in keys.iter().enumerate() {
            for _ in 0..n % 5 {
                s.increment(k);
            }
        }
        let before: Vec<u8> = keys.iter().map(|&k| s.frequency(k)).collect();
        s.grow(1000);
        assert_eq!(s.capacity(), 1024);
        let after: Vec<u8> = keys.iter().map(|&k| s.frequency(k)).collect();
        assert_eq!(before, after, "folded counters give the same minimum");
        s.increment(keys[1]);
        assert!(s.frequency(keys[1]) > before[1]);
        assert_eq!(s.bytes(), 10 * 1024);
    }
}

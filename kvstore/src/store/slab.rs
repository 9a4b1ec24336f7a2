//! Size classes and segments: the arena is cut into segments; a segment serves one size class at
//! a time, carved into equal slots. Slots are dense indices per class; nothing here does I/O or
//! knows about keys beyond remembering the index hash of each slot's key (for eviction).

use crate::policy::{reserve_total, EvictionPolicy};

use super::config::PAGE;

/// One size class.
pub(crate) struct Class {
    pub slot_bytes: usize,
    pub per_seg: u32,
    /// Chunk `c` holds slots `c*per_seg .. (c+1)*per_seg`, backed by segment `chunks[c]`.
    pub chunks: Vec<Option<u32>>,
    pub free_chunks: Vec<u32>,
    /// Slots in use (reserved or committed) per chunk.
    pub live: Vec<u32>,
    pub free: Vec<u32>,
    /// The index hash (`table::hash`) of the block's key in each slot (valid while in use):
    /// enough to find the block's entry (the shard, then the bucket holding this slot), in
    /// a quarter of the bytes of the key.
    pub hashes: Vec<u32>,
    /// Commit checksum (xxh3-64) of the block in each slot (valid once committed).
    pub sums: Vec<u64>,
    /// Length in bytes of the block in each slot, 0 for a free slot (a block is never empty):
    /// so it also says which slots are in use (reserved or committed). Here rather than in the
    /// index's entry: read where the slot's page and checksum are (a load, under this lock),
    /// and on eviction and free, which hold this lock anyway.
    pub lens: Vec<u32>,
    pub policy: Box<dyn EvictionPolicy>,
    /// The most slots this class can ever have: the whole arena cut into its slots (a chunk
    /// exists only while it holds a segment or waits in `free_chunks` for the next one).
    max_slots: usize,
}

/// Arena page of slot `idx` of a class with the given chunk table.
pub(crate) fn page_of(
    chunks: &[Option<u32>],
    per_seg: u32,
    slot_bytes: usize,
    idx: u32,
    seg_pages: u32,
) -> u32 {
    let seg = chunks[(idx / per_seg) as usize].unwrap_or(0);
    seg * seg_pages + (idx % per_seg) * (slot_bytes / PAGE) as u32
}

impl Class {
    pub(crate) fn new(
        slot_bytes: usize,
        segment_bytes: u64,
        segments: u32,
        policy: Box<dyn EvictionPolicy>,
    ) -> Self {
        let per_seg = (segment_bytes as usize / slot_bytes) as u32;
        Self {
            slot_bytes,
            per_seg,
            max_slots: per_seg as usize * segments as usize,
            chunks: Vec::new(),
            free_chunks: Vec::new(),
            live: Vec::new(),
            free: Vec::new(),
            hashes: Vec::new(),
            sums: Vec::new(),
            lens: Vec::new(),
            policy,
        }
    }

    pub(crate) fn page_of(&self, idx: u32, seg_pages: u32) -> u32 {
        page_of(&self.chunks, self.per_seg, self.slot_bytes, idx, seg_pages)
    }

    /// Takes a segment: its slots become free slots of this class.
    pub(crate) fn add_segment(&mut self, seg: u32) {
        let chunk = match self.free_chunks.pop() {
            Some(c) => {
                self.chunks[c as usize] = Some(seg);
                c
            }
            None => {
                self.chunks.push(Some(seg));
                self.live.push(0);
                (self.chunks.len() - 1) as u32
            }
        };
        let start = chunk * self.per_seg;
        let end = start + self.per_seg;
        if self.hashes.len() < end as usize {
            // Grow geometrically, but never past `max_slots`: a store filled to capacity keeps
            // no doubling slack in its per-slot tables (bench: `metadata 10M blocks`).
            let n = end as usize;
            let cap = (self.hashes.capacity() * 2).clamp(n, self.max_slots.max(n));
            reserve_total(&mut self.hashes, cap);
            reserve_total(&mut self.sums, cap);
            reserve_total(&mut self.lens, cap);
            self.policy.reserve(cap);
            self.hashes.resize(end as usize, 0);
            self.sums.resize(end as usize, 0);
            self.lens.resize(end as usize, 0);
        }
        self.free.extend((start..end).rev());
    }

    /// Whether slot `idx` is in use.
    pub(crate) fn is_used(&self, idx: u32) -> bool {
        self.lens.get(idx as usize).is_some_and(|&l| l != 0)
    }

    /// Slots in use.
    #[cfg(all(test, kvtier_shuttle))]
    pub(crate) fn used_slots(&self) -> u64 {
        self.lens.iter().filter(|&&l| l != 0).count() as u64
    }

    /// Marks a free slot used by a block of `len` bytes whose key has index hash `hash`.
    pub(crate) fn take(&mut self, idx: u32, hash: u32, len: u32) {
        self.hashes[idx as usize] = hash;
        debug_assert!(len > 0, "an empty block");
        self.lens[idx as usize] = len;
        self.live[(idx / self.per_seg) as usize] += 1;
    }

    /// Gives a slot back (no-op for a free one).
    pub(crate) fn release(&mut self, idx: u32) {
        self.policy.remove(idx);
        if self.is_used(idx) {
            self.lens[idx as usize] = 0;
            self.live[(idx / self.per_seg) as usize] -= 1;
            self.free.push(idx);
        }
    }

    /// Gives up chunk `ch` (every slot in it free): returns its segment.
    pub(crate) fn drop_chunk(&mut self, ch: u32) -> Option<u32> {
        let start = ch * self.per_seg;
        let end = start + self.per_seg;
        self.free.retain(|&i| i < start || i >= end);
        let seg = self.chunks[ch as usize].take();
        self.free_chunks.push(ch);
        seg
    }

    /// Segments this class holds.
    pub(crate) fn held_segments(&self) -> usize {
        self.chunks.iter().filter(|c| c.is_some()).count()
    }

    /// Chunks backed by a segment, those with the fewest live slots first (`only_empty`: only
    /// chunks with none).
    pub(crate) fn chunks_by_liveness(&self, only_empty: bool) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.chunks.len() as u32)
            .filter(|&ch| self.chunks[ch as usize].is_some())
            .filter(|&ch| !only_empty || self.live[ch as usize] == 0)
            .collect();
        order.sort_by_key(|&ch| self.live[ch as usize]);
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;

    #[test]
    fn segments_carve_into_slots_and_come_back() {
        let mut c = Class::new(64 << 10, 1 << 20, 8, PolicyKind::Lru.build());
        assert_eq!(c.per_seg, 16);
        c.add_segment(3);
        assert_eq!(c.free.len(), 16);
        let idx = c.free.pop().unwrap();
        assert_eq!(idx, 0);
        c.take(idx, 9, 1);
        assert_eq!(c.page_of(idx, 256), 3 * 256);
        assert_eq!(c.page_of(5, 256), 3 * 256 + 5 * 16);
        assert_eq!(c.chunks_by_liveness(true), Vec::<u32>::new());
        c.release(idx);
        c.release(idx); // twice: no double free
        assert_eq!(c.free.len(), 16);
        assert_eq!(c.chunks_by_liveness(true), vec![0]);
        assert_eq!(c.drop_chunk(0), Some(3));
        assert!(c.free.is_empty());
        c.add_segment(4);
        assert_eq!(c.page_of(0, 256), 4 * 256, "the chunk id is reused");
    }

    #[test]
    fn a_full_class_keeps_no_doubling_slack() {
        // 5 segments of 16 slots: the tables grow geometrically, up to the 80 slots the arena
        // can hold in this class, and not past them.
        for p in PolicyKind::ALL {
            let mut c = Class::new(64 << 10, 1 << 20, 5, p.build());
            for seg in 0..5 {
                c.add_segment(seg);
                while let Some(idx) = c.free.pop() {
                    c.take(idx, idx, 1);
                    c.policy.insert(idx, u64::from(idx));
                }
            }
            assert_eq!(c.hashes.len(), 80);
            assert_eq!(c.hashes.capacity(), 80, "{}", p.name());
            assert_eq!(c.sums.capacity(), 80);
            assert_eq!(c.lens.capacity(), 80);
        }
    }
}

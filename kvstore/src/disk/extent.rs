//! Free-extent allocator over the 4096-byte pages of one data file: best fit, coalescing frees.

use std::collections::{BTreeMap, BTreeSet};

/// Free extents of one file, in pages.
#[derive(Debug)]
pub(crate) struct Extents {
    by_start: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    free: u64,
}

impl Extents {
    /// All of `[first, end)` free.
    pub(crate) fn new(first: u64, end: u64) -> Self {
        let mut e = Self {
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free: 0,
        };
        if end > first {
            e.insert(first, end - first);
        }
        e
    }

    fn insert(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free += len;
    }

    fn take(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free -= len;
    }

    /// Free pages.
    #[cfg(test)]
    pub(crate) fn free_pages(&self) -> u64 {
        self.free
    }

    /// Allocates `pages` contiguous pages (smallest extent that fits); returns the first page.
    pub(crate) fn alloc(&mut self, pages: u64) -> Option<u64> {
        let &(len, start) = self.by_len.range((pages, 0)..).next()?;
        self.take(start, len);
        if len > pages {
            self.insert(start + pages, len - pages);
        }
        Some(start)
    }

    /// Returns `[start, start+pages)`, merging with free neighbours.
    pub(crate) fn free(&mut self, start: u64, pages: u64) {
        let (mut s, mut l) = (start, pages);
        if let Some((&ps, &pl)) = self.by_start.range(..s).next_back() {
            debug_assert!(ps + pl <= s, "double free at page {s}");
            if ps + pl == s {
                self.take(ps, pl);
                s = ps;
                l += pl;
            }
        }
        if let Some((&ns, &nl)) = self.by_start.range(s + l..).next() {
            if ns == s + l {
                self.take(ns, nl);
                l += nl;
            }
        }
        self.insert(s, l);
    }

    /// Marks `[start, start+pages)` used if it is wholly free (recovery); false otherwise.
    pub(crate) fn reserve(&mut self, start: u64, pages: u64) -> bool {
        let Some((&fs, &fl)) = self.by_start.range(..=start).next_back() else {
            return false;
        };
        if fs + fl < start + pages {
            return false;
        }
        self.take(fs, fl);
        if start > fs {
            self.insert(fs, start - fs);
        }
        if fs + fl > start + pages {
            self.insert(start + pages, fs + fl - start - pages);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesce() {
        let mut e = Extents::new(1, 101);
        assert_eq!(e.free_pages(), 100);
        let a = e.alloc(10).unwrap();
        let b = e.alloc(10).unwrap();
        let c = e.alloc(80).unwrap();
        assert_eq!((a, b, c), (1, 11, 21));
        assert_eq!(e.alloc(1), None);
        e.free(b, 10);
        assert_eq!(e.alloc(11), None);
        e.free(a, 10);
        assert_eq!(e.by_start.len(), 1, "neighbours merge");
        assert_eq!(e.alloc(20), Some(1));
        e.free(1, 20);
        e.free(c, 80);
        assert_eq!(e.free_pages(), 100);
        assert_eq!(e.by_start.len(), 1);
    }

    #[test]
    fn best_fit_and_reserve() {
        let mut e = Extents::new(0, 100);
        assert!(e.reserve(10, 5));
        assert!(!e.reserve(12, 5), "overlap");
        assert!(e.reserve(50, 50));
        // Free: [0,10) and [15,50). Best fit for 8 is the 10-page hole.
        assert_eq!(e.alloc(8), Some(0));
        assert_eq!(e.free_pages(), 2 + 35);
    }
}

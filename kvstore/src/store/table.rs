//! An index shard's table: block key → [`Entry`], open addressing with Robin Hood linear
//! probing and backward-shift deletion, in one flat array of 24-byte buckets (the key's two
//! words and the 8-byte entry; an empty bucket is one whose entry names class 255, which no
//! store has: at most 255 classes, numbered from 0).
//!
//! Why not `hashbrown` (what it replaced): three things a 10 M-block node needs.
//! - **Memory.** The capacity is not a power of two: the table grows by a seventh when 90%
//!   full, so it runs between 78% and 90% full (hashbrown: 44–88%, plus a control byte a
//!   bucket). Only small tables, whose memory does not matter, run at most half full
//!   ([`SPARSE_BELOW`]).
//!   Robin Hood keeps probes short at that load, a miss included (a probe stops at the first
//!   bucket whose key sits closer to its home than the probe has come).
//! - **Prefetching.** A key's home bucket is a function of its hash and the table's size, which
//!   the table publishes in a [`Hint`] outside the shard's lock: a walk along a prefix
//!   prefetches the home buckets of the keys ahead of the one it is at.
//! - **Reads without the lock.** A lookup that changes nothing (a prefix match, a peer's probe)
//!   reads the table through its [`Hint`] with no lock and no atomic read-modify-write
//!   ([`Hint::read`]): each bucket is three atomic words (plain moves on x86), every change to
//!   the table runs inside a *write section* that makes the shard's sequence number odd, and a
//!   reader keeps what it read only if the number was even and unchanged around its probe (a
//!   seqlock; Boehm, "Can seqlocks get along with programming language memory models?",
//!   2012). A reader that meets a write asks again under the lock, so it never waits on a
//!   writer and never takes a torn bucket. A table that grows retires its old buckets through
//!   `crossbeam-epoch`, so a reader still probing them reads memory that is still allocated.
//!   Per key, the lock's two locked instructions were most of a cached lookup, and they
//!   serialised the cache misses of a long prefix (a locked instruction waits for every load
//!   before it).
//!
//! A key's index hash is 32 bits ([`hash`]): its low bits pick the shard, and its home bucket
//! is `fastrange(hash, capacity)`, which the high bits decide. 32 bits place a key exactly in
//! any table under 2^32 buckets, and a size class remembers each slot's key by these 4 bytes.

use std::sync::atomic::{
    fence, AtomicPtr, AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed,
    Ordering::Release,
};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};

use super::index::{Entry, Life, Slot};
use crate::key::BlockKey;
use crate::types::{key_mix, KeyMix, MapKey};

/// The class byte of an empty bucket (classes are numbered 0..=254).
const EMPTY: u8 = u8::MAX;
/// Grow when more than 9 in 10 buckets would be full…
const MAX_LOAD: (usize, usize) = (9, 10);
/// …to a capacity 8/7 the old one (79% full after). A table of N keys then holds on average
/// 1.07 N / 0.9 buckets over the sizes it passes through (4/3, before: 1.16 N / 0.9, 2 bytes a
/// block more at 24 bytes a bucket), for 7 moves of a key per insert, amortized, instead of 3.
/// The moves are a shard's alone, under its lock, and a store at its size stops growing.
const GROWTH: (usize, usize) = (8, 7);
const MIN_CAPACITY: usize = 16;
/// A table under this many buckets (24 KiB) grows at half full instead, to twice its size.
/// So a shard of up to 512 keys (32,768 blocks over 64 shards) is at most half full, at a
/// cost of at most 24 KiB a shard (1.5 MiB for 64), where nothing else of the metadata
/// weighs; from 922 keys on it is 78–90% full again, and large stores' metadata is
/// unchanged. Half full, a key is nearly always in its home bucket or the next, and the
/// probe's exit, a branch on data, is predicted: `match_prefix chain 1000` ran 30% faster
/// than at 78–90% full, and `chain 4000` 50% (Zen 5).
const SPARSE_BELOW: usize = 1024;
/// Buckets a probe compares keys in before it checks whether it can stop early.
const CHEAP_PROBES: usize = 4;

/// A bucket's contents, as a value.
#[derive(Clone, Copy)]
struct Bucket {
    key: MapKey,
    e: Entry,
}

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
                Life::Filling,
            ),
        }
    }
}

/// A bucket as stored: the key's two words and the entry's one ([`Entry::to_word`]), each
/// read and written atomically (relaxed), so that a reader without the lock races with no
/// write (see the module's doc). 24 bytes: a quarter of the buckets straddle two cache lines,
/// and a line holds 2.67 buckets where it held 2.
#[repr(C)]
struct Cell([AtomicU64; 3]);

const _: () = assert!(std::mem::size_of::<Cell>() == 24);

impl Cell {
    fn new(b: Bucket) -> Self {
        Cell([
            AtomicU64::new(b.key.0[0]),
            AtomicU64::new(b.key.0[1]),
            AtomicU64::new(b.e.to_word()),
        ])
    }
    #[inline]
    fn key(&self) -> MapKey {
        MapKey([self.0[0].load(Relaxed), self.0[1].load(Relaxed)])
    }
    #[inline]
    fn entry(&self) -> Entry {
        Entry::from_word(self.0[2].load(Relaxed))
    }
    #[inline]
    fn is_empty(&self) -> bool {
        (self.0[2].load(Relaxed) >> 48) as u8 == EMPTY
    }
    fn load(&self) -> Bucket {
        Bucket {
            key: self.key(),
            e: self.entry(),
        }
    }
    /// Only inside a write section (`Table::write`).
    fn store(&self, b: Bucket) {
        self.0[0].store(b.key.0[0], Relaxed);
        self.0[1].store(b.key.0[1], Relaxed);
        self.store_entry(b.e);
    }
    /// Only inside a write section (`Table::write`).
    fn store_entry(&self, e: Entry) {
        self.0[2].store(e.to_word(), Relaxed);
    }
}

/// A table's buckets (replaced whole when it grows). A table of 2 MiB or more is placed on
/// 2 MiB boundaries and advised to transparent huge pages before its first touch: a lookup in
/// a 10 M-block index lands on a random bucket of ~300 MB, and on 4 KiB pages each such probe
/// is a TLB miss too (a page walk before the cache miss, and the walk is what a software
/// prefetch may give up on). From the global allocator all the same, so the bytes count as
/// heap (`--metadata-blocks`).
struct Cells {
    ptr: std::ptr::NonNull<Cell>,
    len: usize,
    layout: std::alloc::Layout,
}

/// Tables from this size are huge-page aligned and advised.
const HUGE: usize = 2 << 20;

// SAFETY: `Cells` owns its buckets, which are atomics (`Sync`); it is `Box<[Cell]>` with a
// chosen alignment.
unsafe impl Send for Cells {}
// SAFETY: as above: shared access reads and writes only through the atomics.
unsafe impl Sync for Cells {}

impl Cells {
    fn new(cap: usize) -> Self {
        use std::alloc::{alloc, handle_alloc_error, Layout};
        let layout = Layout::array::<Cell>(cap.max(1)).and_then(|l| {
            if l.size() >= HUGE {
                l.align_to(HUGE)
            } else {
                Ok(l)
            }
        });
        let Ok(layout) = layout else {
            panic!("an index table of {cap} buckets is larger than memory");
        };
        let bytes = layout.size();
        // SAFETY: the layout's size is not zero.
        let raw = unsafe { alloc(layout) } as *mut Cell;
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            handle_alloc_error(layout);
        };
        if bytes >= HUGE {
            // SAFETY: `raw` starts a 2 MiB-aligned allocation of `bytes` bytes; the advice
            // covers only whole huge pages inside it and changes no contents (none yet).
            // Refused (no THP in this kernel): 4 KiB pages, as before.
            unsafe {
                libc::madvise(
                    raw as *mut libc::c_void,
                    bytes / HUGE * HUGE,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
        for i in 0..cap {
            // SAFETY: `i < cap`, inside the allocation, and each bucket is written once
            // before any read.
            unsafe { raw.add(i).write(Cell::new(Bucket::empty())) };
        }
        Cells {
            ptr,
            len: cap,
            layout,
        }
    }
}

impl std::ops::Deref for Cells {
    type Target = [Cell];
    fn deref(&self) -> &[Cell] {
        // SAFETY: `len` buckets, all written in `new`, owned until `drop`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Cells {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; buckets need no drop (atomics).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr() as *mut u8, self.layout) };
    }
}

/// The index hash of a key: its low bits pick the shard ([`super::Inner::shard_of`]), its high
/// bits the bucket.
pub(crate) fn hash(key: MapKey) -> u32 {
    key_mix(BlockKey::from(key)) as u32
}

/// [`hash`] of `key` with the secret `mix` read beforehand (a loop over many keys).
#[inline(always)]
pub(crate) fn hash_with(mix: KeyMix, key: BlockKey) -> u32 {
    mix.mix(key) as u32
}

/// The home bucket of a key with hash `h` in a table of `cap` buckets (`cap` < 2^32).
#[inline]
fn home(h: u32, cap: usize) -> usize {
    ((u64::from(h) * cap as u64) >> 32) as usize
}

/// Distance of the key in `cells[i]` from its home.
fn dist(cells: &[Cell], i: usize) -> usize {
    let cap = cells.len();
    let h = home(hash(cells[i].key()), cap);
    (i + cap - h) % cap
}

/// What a probe found.
enum Probe {
    Hit(usize),
    Miss,
    /// The buckets changed under a reader without the lock (it went round the whole table).
    Torn,
}

/// The first bucket on the probe path of hash `h` that `hit` accepts. Under the lock the
/// answer is exact; without it (racing a write) it may be anything, `Torn` included, but the
/// probe always ends and reads only inside `cells`.
#[inline(always)]
fn probe(cells: &[Cell], h: u32, hit: impl Fn(&Cell) -> bool) -> Probe {
    let cap = cells.len();
    if cap == 0 {
        return Probe::Miss;
    }
    let mut i = home(h, cap);
    let mut d = 0;
    while d < cap {
        let c = &cells[i];
        if c.is_empty() {
            return Probe::Miss;
        }
        if hit(c) {
            return Probe::Hit(i);
        }
        // Robin Hood: every key between its home and here sits at least as far from its
        // own home as the probe has come, so one closer to home ends the search. Asked
        // only from the `CHEAP_PROBES`th bucket on (it costs a hash): most keys are found
        // before, and a miss ends a few buckets later.
        if d >= CHEAP_PROBES && dist(cells, i) < d {
            return Probe::Miss;
        }
        i += 1;
        if i == cap {
            i = 0;
        }
        d += 1;
    }
    Probe::Torn
}

/// Buckets [`Hint::read_ready`] looks at before it leaves a key to [`Hint::read`]. At 84%
/// full (a 10 M-block index) about 1 key in 200 sits 16 or more buckets from home, so with
/// 16 a quarter of 64-key prefix matches left the fast walk for the general one at such a
/// key; at 64 hardly any does (`lookupbench`: 4% off the p50 at 65,536 and at 10 M blocks).
/// The price: the absent key that ends a prefix is scanned up to an empty bucket, at most 64
/// buckets (~20 on average at 84% full), before [`Hint::read`]'s Robin Hood stop answers
/// for it; once a lookup.
const HIT_PROBES: usize = 64;

/// A write section ([`Table::write`]) begins: the sequence number turns odd.
fn write_begin(seq: &AtomicU64) {
    let s = seq.load(Relaxed);
    debug_assert!(s.is_multiple_of(2), "write sections do not nest");
    seq.store(s + 1, Relaxed);
    // The bucket stores after this fence are ordered after the odd number: a reader that
    // sees one of them sees the odd number (or a later one) on its second read.
    fence(Release);
}

/// A write section ends: the sequence number is even again.
fn write_end(seq: &AtomicU64) {
    let s = seq.load(Relaxed);
    seq.store(s + 1, Release);
}

/// What the rest of the store sees of a shard's table outside its lock: where its buckets
/// are (for prefetching, and for [`Hint::read`]) and its sequence number. The store keeps all
/// its shards' hints in one array ([`new_hints`]), a line each: a reader goes from the store to
/// the hint to the bucket, and a writer's sequence number shares no line with another shard's.
#[derive(Default)]
#[repr(align(64))]
pub(crate) struct Hint {
    /// The buckets' owner: replaced whole when the table grows, the old ones retired through
    /// the epoch.
    cells: Atomic<Cells>,
    /// The same buckets' address and count, published beside `cells` by `grow` (the address
    /// first, then the count) so that a reader reaches a bucket in one load fewer: the
    /// hint's own fields, then the bucket. A reader loads the count, then the address: a new
    /// count comes with its new address, and an old count with an address of at least that
    /// many buckets (tables only grow), so its probe stays inside an allocation the epoch
    /// keeps; the sequence number tells it whether the buckets it read were current.
    ptr: AtomicPtr<Cell>,
    cap: AtomicUsize,
    /// Odd while a write section runs; bumped at its start and end.
    seq: AtomicU64,
}

impl Hint {
    /// The table's buckets, as last published, for a reader without the lock. `_guard`: the
    /// caller's epoch, which keeps them allocated for as long as it lives.
    #[inline]
    fn buckets<'g>(&self, _guard: &'g Guard) -> &'g [Cell] {
        let cap = self.cap.load(Acquire);
        let ptr = self.ptr.load(Acquire);
        if cap == 0 || ptr.is_null() {
            return &[];
        }
        // SAFETY: `ptr` holds at least `cap` initialized buckets (see the fields' doc: the
        // count is published after its address, and tables only grow), published by `grow`
        // with release ordering and read here with acquire (their initialization is
        // visible). Old buckets are retired only through the epoch, after the address
        // moved on, so they outlive `_guard`, which the caller pinned before these loads.
        unsafe { std::slice::from_raw_parts(ptr, cap) }
    }

    /// The number of buckets, as last published. `guard`: the caller's epoch.
    pub(crate) fn capacity(&self, guard: &Guard) -> usize {
        self.buckets(guard).len()
    }

    /// Starts loading the home bucket of the key with hash `h` into the cache, and the two
    /// lines after it. At 78–90% full a linear probe finds a key 2–4.5 buckets past its home
    /// on average (½(1 + 1/(1 − load)) probes), 48–110 bytes on: with only the next line
    /// prefetched, the keys past it missed in the walk, a third of a 64-key lookup's time at
    /// 10 M blocks (p50 3.7–4.0 → 2.7–3.1 µs with the third line; a fourth was slower: too
    /// many misses in flight, 8 keys ahead). `guard`: the caller's epoch (see [`Hint::read`]).
    #[inline]
    pub(crate) fn prefetch(&self, h: u32, guard: &Guard) {
        self.prefetch_lines::<3>(h, guard);
    }

    /// [`Hint::prefetch`] of `LINES` lines from the home bucket's on.
    #[inline(always)]
    pub(crate) fn prefetch_lines<const LINES: usize>(&self, h: u32, guard: &Guard) {
        let cells = self.buckets(guard);
        if cells.is_empty() {
            return;
        }
        let addr = &cells[home(h, cells.len())] as *const Cell;
        #[cfg(target_arch = "x86_64")]
        for line in 0..LINES {
            // SAFETY: `_mm_prefetch` only hints the cache; it never faults (lines past the
            // last bucket included) and reads nothing the program sees.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>((addr as *const i8).wrapping_add(64 * line));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = addr;
    }

    /// Whether `key` (hash `h`) is in the table and ready ([`Entry::ready`]), read without
    /// the shard's lock as [`Hint::read`] reads it, for a key that is most likely so: `false`
    /// also when it is not found within [`HIT_PROBES`] buckets or a write got in the way,
    /// and the caller then asks [`Hint::read`] or the shard under its lock. A walk along a
    /// prefix whose keys are in host memory is a loop of these
    /// ([`super::Inner::match_prefix_in`]), so this is [`Hint::read`] with less work a key:
    /// no empty-table slice, no bounds checks, no Robin Hood stop of a miss (it stops at an
    /// empty bucket or after [`HIT_PROBES`]; a miss here is rare and is asked again), the
    /// entry's readiness tested on its word.
    #[inline(always)]
    pub(crate) fn read_ready(&self, h: u32, key: &MapKey, _guard: &Guard) -> bool {
        let s = self.seq.load(Acquire);
        // The count, then the address: see the fields' doc.
        let cap = self.cap.load(Acquire);
        let ptr = self.ptr.load(Acquire);
        if s % 2 == 1 || cap == 0 || ptr.is_null() {
            return false;
        }
        let mut i = home(h, cap);
        let mut ready = false;
        for _ in 0..HIT_PROBES {
            // SAFETY: `i < cap`, and `ptr` holds at least `cap` initialized buckets that
            // outlive `_guard` (as in `Hint::buckets`).
            let c = unsafe { &*ptr.add(i) };
            if c.key() == *key {
                // An empty bucket is never ready (`Bucket::empty`), whatever its key words.
                ready = Entry::from_word(c.0[2].load(Relaxed)).ready();
                break;
            }
            if c.is_empty() {
                break;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
        // As in `Hint::read`: the bucket loads above come before the second read.
        fence(Acquire);
        ready && self.seq.load(Relaxed) == s
    }

    /// The entry of `key` (hash `h`), read without the shard's lock: `Some(answer)` when no
    /// write section ran during the read (the answer is what the table held at one moment
    /// within it), `None` when one did (ask again under the lock). Never waits. `guard`: an
    /// epoch pinned by the caller, kept for a whole walk along a prefix.
    ///
    /// Always inlined: out of line, its answer (12 bytes) came back through memory in two
    /// stores that the caller's one 8-byte load could not take from the store buffer (a
    /// store-forwarding stall, half the time of a prefix match from cache).
    #[inline(always)]
    pub(crate) fn read(&self, h: u32, key: &MapKey, guard: &Guard) -> Option<Option<Entry>> {
        let s = self.seq.load(Acquire);
        if s % 2 == 1 {
            return None;
        }
        let cells = self.buckets(guard);
        let e = match probe(cells, h, |c| c.key() == *key) {
            Probe::Hit(i) => Some(cells[i].entry()),
            Probe::Miss => None,
            Probe::Torn => return None,
        };
        // The bucket loads above are ordered before the second read of the number: if one of
        // them saw a store of a write section, this read sees that section's odd number or a
        // later one.
        fence(Acquire);
        (self.seq.load(Relaxed) == s).then_some(e)
    }
}

/// A block's entry to change in place, under the shard's lock: a copy that goes back into
/// its bucket, in a write section of its own, when dropped (and only if it changed).
pub(crate) struct EntryMut<'a> {
    cell: &'a Cell,
    seq: &'a AtomicU64,
    e: Entry,
    was: Entry,
}

impl std::ops::Deref for EntryMut<'_> {
    type Target = Entry;
    fn deref(&self) -> &Entry {
        &self.e
    }
}

impl std::ops::DerefMut for EntryMut<'_> {
    fn deref_mut(&mut self) -> &mut Entry {
        &mut self.e
    }
}

impl Drop for EntryMut<'_> {
    fn drop(&mut self) {
        if self.e != self.was {
            write_begin(self.seq);
            self.cell.store_entry(self.e);
            write_end(self.seq);
        }
    }
}

impl<'a> EntryMut<'a> {
    fn new(cell: &'a Cell, seq: &'a AtomicU64) -> Self {
        let e = cell.entry();
        EntryMut {
            cell,
            seq,
            e,
            was: e,
        }
    }
}

/// `n` shards' hints, in one array, for [`Table::with_hint`].
pub(crate) fn new_hints(n: usize) -> Arc<[Hint]> {
    (0..n).map(|_| Hint::default()).collect()
}

/// The table (owned by its shard, which holds the lock for every call). Same shape of API
/// as the `HashMap` it replaced, except that entries come out as copies ([`Entry`]) or as
/// [`EntryMut`] to change.
pub(crate) struct Table {
    len: usize,
    /// The store's hints; this table's is `hints[at]`.
    hints: Arc<[Hint]>,
    at: usize,
}

impl Default for Table {
    /// A table with a hint of its own.
    fn default() -> Self {
        Table::with_hint(new_hints(1), 0)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        self.hint().cap.store(0, Relaxed);
        self.hint().ptr.store(std::ptr::null_mut(), Relaxed);
        // SAFETY: readers without the lock reach the buckets only through the store that owns
        // this table (`Inner::hints`), which is being dropped: none is left. Freed now rather
        // than through the epoch so that a dropped store's memory is back at once.
        unsafe {
            let old = self
                .hint()
                .cells
                .swap(Shared::null(), Relaxed, epoch::unprotected());
            if !old.is_null() {
                drop(old.into_owned());
            }
        }
    }
}

impl Table {
    /// An empty table that publishes its buckets in `hints[at]` (the store's array, which it
    /// reads outside the shards' locks). One table a hint.
    pub(crate) fn with_hint(hints: Arc<[Hint]>, at: usize) -> Self {
        assert!(at < hints.len(), "hint {at} of {}", hints.len());
        Table { len: 0, hints, at }
    }

    /// The table's hint.
    #[inline]
    fn hint(&self) -> &Hint {
        &self.hints[self.at]
    }

    /// The buckets.
    fn cells(&self) -> &[Cell] {
        // SAFETY: only this table replaces its buckets (in `grow`, with `&mut self`), so the
        // ones loaded here stay allocated for as long as `self` is borrowed; null or published.
        match unsafe {
            self.hint()
                .cells
                .load(Relaxed, epoch::unprotected())
                .as_ref()
        } {
            Some(c) => c,
            None => &[],
        }
    }

    /// Runs `f` in a write section: the only way the buckets change.
    fn write<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        write_begin(&self.hint().seq);
        let r = f(self);
        write_end(&self.hint().seq);
        r
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bucket holding `key` (hash `h`).
    #[inline]
    fn find(&self, h: u32, key: &MapKey) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        match probe(self.cells(), h, |c| c.key() == *key) {
            Probe::Hit(i) => Some(i),
            Probe::Miss | Probe::Torn => None,
        }
    }

    /// The entry of `key`, given its [`hash`].
    #[inline]
    pub(crate) fn get_hashed(&self, h: u32, key: &MapKey) -> Option<Entry> {
        self.find(h, key).map(|i| self.cells()[i].entry())
    }

    /// The entry of `key` to change, given its [`hash`].
    #[inline]
    pub(crate) fn get_hashed_mut(&mut self, h: u32, key: &MapKey) -> Option<EntryMut<'_>> {
        let i = self.find(h, key)?;
        Some(EntryMut::new(&self.cells()[i], &self.hint().seq))
    }

    pub(crate) fn get(&self, key: &MapKey) -> Option<Entry> {
        self.get_hashed(hash(*key), key)
    }

    pub(crate) fn get_mut(&mut self, key: &MapKey) -> Option<EntryMut<'_>> {
        self.get_hashed_mut(hash(*key), key)
    }

    /// The key and entry that hold `slot`, given the key's hash (what a size class remembers
    /// of a slot's block): the bucket is on the probe path of the hash's home, like the key's.
    pub(crate) fn slot_entry_mut(&mut self, h: u32, slot: Slot) -> Option<(MapKey, EntryMut<'_>)> {
        if self.len == 0 {
            return None;
        }
        let Probe::Hit(i) = probe(self.cells(), h, |c| c.entry().slot() == slot) else {
            return None;
        };
        let c = &self.cells()[i];
        Some((c.key(), EntryMut::new(c, &self.hint().seq)))
    }

    pub(crate) fn contains_key(&self, key: &MapKey) -> bool {
        self.get(key).is_some()
    }

    /// Inserts or replaces; returns the entry replaced.
    pub(crate) fn insert(&mut self, key: MapKey, e: Entry) -> Option<Entry> {
        debug_assert!(e.class != EMPTY, "class 255 marks an empty bucket");
        let h = hash(key);
        if let Some(i) = self.find(h, &key) {
            let c = &self.cells()[i];
            let old = c.entry();
            self.write(|t| t.cells()[i].store_entry(e));
            return Some(old);
        }
        self.write(|t| {
            let cap = t.cells().len();
            let full = if cap < SPARSE_BELOW {
                (t.len + 1) * 2 > cap
            } else {
                (t.len + 1) * MAX_LOAD.1 > cap * MAX_LOAD.0
            };
            if full {
                t.grow();
            }
            place(t.cells(), h, Bucket { key, e });
            t.len += 1;
        });
        None
    }

    fn grow(&mut self) {
        let old = self.cells().len();
        let cap = if old < SPARSE_BELOW {
            (old * 2).max(MIN_CAPACITY)
        } else {
            old * GROWTH.0 / GROWTH.1
        };
        let new = Cells::new(cap);
        for c in self.cells().iter().filter(|c| !c.is_empty()) {
            let b = c.load();
            place(&new, hash(b.key), b);
        }
        // SAFETY: `unprotected` is enough for a swap by the one writer of the pointer (this
        // table, under `&mut self`): the old buckets are not read through it here.
        let unprotected = unsafe { epoch::unprotected() };
        let owned = Owned::new(new);
        let (ptr, cap) = (owned.ptr.as_ptr(), owned.len);
        let old = self.hint().cells.swap(owned, Release, unprotected);
        // Readers' view: the address, then the count (see `Hint`'s fields), both before
        // the old buckets are retired.
        self.hint().ptr.store(ptr, Release);
        self.hint().cap.store(cap, Release);
        if old.is_null() {
            return;
        }
        retire(old);
    }

    /// Removes `key`; returns its entry.
    pub(crate) fn remove(&mut self, key: &MapKey) -> Option<Entry> {
        let mut i = self.find(hash(*key), key)?;
        let gone = self.cells()[i].entry();
        self.write(|t| {
            let cells = t.cells();
            let cap = cells.len();
            // Backward shift: pull each following displaced key one bucket nearer its home.
            loop {
                let next = if i + 1 == cap { 0 } else { i + 1 };
                if cells[next].is_empty() || dist(cells, next) == 0 {
                    cells[i].store(Bucket::empty());
                    break;
                }
                cells[i].store(cells[next].load());
                i = next;
            }
            t.len -= 1;
        });
        Some(gone)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (MapKey, Entry)> + '_ {
        self.cells()
            .iter()
            .filter(|c| !c.is_empty())
            .map(|c| (c.key(), c.entry()))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (MapKey, EntryMut<'_>)> {
        let seq = &self.hint().seq;
        self.cells()
            .iter()
            .filter(|c| !c.is_empty())
            .map(move |c| (c.key(), EntryMut::new(c, seq)))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = Entry> + '_ {
        self.iter().map(|(_, e)| e)
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.cells().len()
    }
}

/// Puts a bucket whose key is absent into `cells` (which have an empty bucket); inside a
/// write section.
fn place(cells: &[Cell], h: u32, mut b: Bucket) {
    let cap = cells.len();
    let mut i = home(h, cap);
    let mut d = 0;
    loop {
        if cells[i].is_empty() {
            cells[i].store(b);
            return;
        }
        let theirs = dist(cells, i);
        if theirs < d {
            // Take the bucket from the richer key and carry it on.
            let was = cells[i].load();
            cells[i].store(b);
            b = was;
            d = theirs;
        }
        i += 1;
        if i == cap {
            i = 0;
        }
        d += 1;
    }
}

/// Frees a table's old buckets once no reader without the lock can be probing them.
fn retire(old: Shared<'_, Cells>) {
    let guard = epoch::pin();
    // SAFETY: `old` was just unlinked from the hint (no new reader can load it), it was
    // allocated by `Owned::new`, and it is retired once.
    unsafe { guard.defer_destroy(old) };
    guard.flush();
    drop(guard);
    // With no reader pinned, two more advances of the epoch free the buckets now rather than
    // at some later pin: a grown table's old buckets are three quarters of its size.
    for _ in 0..2 {
        epoch::pin().flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn entry(i: u32) -> Entry {
        Entry::new(Slot { class: 0, idx: i }, 0, Life::Ready)
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
                _ => assert_eq!(t.get(&key), m.get(&key).copied()),
            }
            assert_eq!(t.len(), m.len());
        }
        let mut got: Vec<_> = t.iter().map(|(k, e)| (k.0, e.idx)).collect();
        let mut want: Vec<_> = m.iter().map(|(k, e)| (k.0, e.idx)).collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        for (k, mut e) in t.iter_mut() {
            e.ns = k.0[0] as u16;
        }
        for (k, _) in m.iter() {
            assert_eq!(t.get(k).map(|e| e.ns), Some(k.0[0] as u16));
        }
    }

    #[test]
    fn a_slot_leads_back_to_its_key() {
        let mut t = Table::default();
        for i in 0..5_000u32 {
            let e = Entry::new(Slot { class: 2, idx: i }, 1, Life::Ready);
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
    fn runs_between_78_and_90_percent_full() {
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
        assert!(lowest > 0.78, "lowest load {lowest}");
        for i in 0..100_000u64 {
            assert_eq!(t.get(&MapKey([i, !i])).map(|e| e.idx), Some(i as u32));
        }
        assert!(t.get(&MapKey([1, 1])).is_none());
    }

    #[test]
    fn small_tables_run_at_most_half_full() {
        let mut t = Table::default();
        let mut caps = vec![];
        for i in 0..SPARSE_BELOW as u64 {
            t.insert(MapKey([i, !i]), entry(i as u32));
            let load = t.len() as f64 / t.capacity() as f64;
            if t.capacity() < SPARSE_BELOW {
                assert!(load <= 0.5, "load {load} at {} keys", t.len());
            }
            if caps.last() != Some(&t.capacity()) {
                caps.push(t.capacity());
            }
        }
        // Doubling from the first 16 buckets to SPARSE_BELOW, then by 8/7 at 90% full.
        assert_eq!(caps, [16, 32, 64, 128, 256, 512, 1024, 1170]);
    }

    #[test]
    fn the_hint_follows_growth() {
        let mut t = Table::default();
        let hints = t.hints.clone();
        let h = &hints[0];
        let guard = epoch::pin();
        assert_eq!(h.capacity(&guard), 0);
        h.prefetch(42, &guard); // nothing to prefetch: no fault, no effect
        assert_eq!(h.read(42, &MapKey([1, 1]), &guard), Some(None));
        for i in 0..100u64 {
            t.insert(MapKey([i, i]), entry(i as u32));
        }
        assert_eq!(h.capacity(&guard), t.capacity());
        h.prefetch(hash(MapKey([3, 3])), &guard);
        // Grown several times: the reads without the lock find every key, and no other.
        for i in 0..100u64 {
            let k = MapKey([i, i]);
            assert_eq!(h.read(hash(k), &k, &guard), Some(Some(entry(i as u32))));
        }
        let k = MapKey([100, 100]);
        assert_eq!(h.read(hash(k), &k, &guard), Some(None));
    }

    #[test]
    fn read_ready_says_ready_only_for_a_ready_key() {
        let mut t = Table::default();
        let hints = t.hints.clone();
        let h = &hints[0];
        let guard = epoch::pin();
        // An empty table (no buckets yet), and the key whose words an empty bucket holds.
        let zero = MapKey([0, 0]);
        assert!(!h.read_ready(hash(zero), &zero, &guard));
        let filling = |i: u32| Entry::new(Slot { class: 1, idx: i }, 0, Life::Filling);
        for i in 0..2_000u64 {
            let e = if i % 3 == 0 {
                filling(i as u32)
            } else {
                entry(i as u32)
            };
            t.insert(MapKey([i, 5]), e);
        }
        // Some removed, so that buckets were emptied by backward shifts.
        for i in (0..2_000u64).step_by(11) {
            t.remove(&MapKey([i, 5]));
        }
        assert!(!h.read_ready(hash(zero), &zero, &guard));
        let mut displaced = 0;
        for i in 0..2_000u64 {
            let k = MapKey([i, 5]);
            let want = i % 3 != 0 && i % 11 != 0;
            assert_eq!(t.get(&k).is_some_and(|e| e.ready()), want);
            let cells = t.cells();
            let from_home = match probe(cells, hash(k), |c| c.key() == k) {
                Probe::Hit(b) => Some(dist(cells, b)),
                _ => None,
            };
            displaced += usize::from(from_home.is_some_and(|d| d > 0));
            // Never ready for a key that is not; for one that is, ready unless it sits
            // HIT_PROBES or more buckets from home (the index's hash has a secret drawn per
            // process, so rarely, some key does: the caller then asks `read`).
            let got = h.read_ready(hash(k), &k, &guard);
            let far = from_home.is_some_and(|d| d >= HIT_PROBES);
            assert!(got == want || (want && far), "key {i}: {got} {from_home:?}");
        }
        // The keys found were not all in their home bucket: the probe went on past it.
        assert!(displaced > 100, "{displaced} keys away from home");
        for i in 2_000..3_000u64 {
            let k = MapKey([i, 5]);
            assert!(!h.read_ready(hash(k), &k, &guard));
        }
    }

    /// An entry that names its key (`idx` is `k`) and the round that wrote it (`ns`), so a
    /// read that pairs a key with another bucket's entry shows. (The entry is one word: what
    /// can tear is the key against the entry.)
    fn stamped(k: u64, round: u32) -> Entry {
        Entry::new(
            Slot {
                class: 1,
                idx: k as u32,
            },
            round as u16,
            Life::Ready,
        )
    }

    /// Readers without the lock against a writer that grows the table, shifts buckets (inserts
    /// and removals of other keys) and rewrites entries: a read that returns an answer returns
    /// the whole entry of the key asked, never another key's, never a torn one, never a miss
    /// of a key that is always present, never a hit of one that never was. Waits on counts,
    /// not time.
    #[test]
    fn reads_without_the_lock_are_whole_or_retried() {
        use std::sync::atomic::{AtomicBool, AtomicU64};
        use std::sync::Mutex;
        const STABLE: u64 = 512;
        const READS: u64 = 300_000;
        let table = Arc::new(Mutex::new(Table::default()));
        let hints = table.lock().unwrap().hints.clone();
        {
            let mut t = table.lock().unwrap();
            for k in 0..STABLE {
                t.insert(MapKey([k, 1]), stamped(k, 0));
            }
        }
        let done = Arc::new(AtomicBool::new(false));
        let (whole, retried) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let writer = {
            let (table, done) = (table.clone(), done.clone());
            let (whole, retried) = (whole.clone(), retried.clone());
            std::thread::spawn(move || {
                let mut round = 0u32;
                let mut churn = 0u64;
                while !done.load(Relaxed) {
                    round += 1;
                    let mut t = table.lock().unwrap();
                    // Rewrite some stable entries in place…
                    for k in (u64::from(round) % 7..STABLE).step_by(7) {
                        if let Some(mut e) = t.get_mut(&MapKey([k, 1])) {
                            *e = stamped(k, round);
                        }
                    }
                    // …and move buckets around them: inserts (growing the table now and
                    // then) and removals of other keys, with backward shifts.
                    for _ in 0..64 {
                        churn += 1;
                        t.insert(MapKey([churn, 2]), stamped(churn, 0));
                        if churn > 3_000 {
                            t.remove(&MapKey([churn - 3_000, 2]));
                        }
                    }
                    drop(t);
                    // Between rounds, a few reads with no write section running: in a debug
                    // build the writer is otherwise in one nearly all the time, and on a busy
                    // machine no read came out whole (the reads above race the writes).
                    let seen = whole.load(Relaxed) + retried.load(Relaxed);
                    while !done.load(Relaxed)
                        && whole.load(Relaxed) + retried.load(Relaxed) < seen + 16
                    {
                        std::thread::yield_now();
                    }
                }
                round
            })
        };
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (hints, whole, retried) = (hints.clone(), whole.clone(), retried.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9E37_79B9u64 + r;
                    for _ in 0..READS {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let guard = epoch::pin();
                        // Keys `[k, 1]` below STABLE are always there; `[k, 3]` never were.
                        let (k, absent) = (x % STABLE, x & (1 << 40) != 0);
                        let key = MapKey([k, if absent { 3 } else { 1 }]);
                        // The fast path's answer: never ready for a key never stored (for
                        // one always present, false is a retry).
                        if hints[0].read_ready(hash(key), &key, &guard) {
                            assert!(!absent, "read_ready of a key never stored");
                        }
                        match hints[0].read(hash(key), &key, &guard) {
                            None => {
                                retried.fetch_add(1, Relaxed);
                            }
                            Some(got) => {
                                whole.fetch_add(1, Relaxed);
                                if absent {
                                    assert_eq!(got, None, "a hit of a key never stored");
                                    continue;
                                }
                                let e = got.expect("a miss of a key always present");
                                assert_eq!((e.idx, e.class), (k as u32, 1), "another key's entry");
                                assert!(e.ready(), "a torn entry");
                            }
                        }
                    }
                })
            })
            .collect();
        for r in readers {
            r.join().unwrap();
        }
        done.store(true, Relaxed);
        let rounds = writer.join().unwrap();
        let (whole, retried) = (whole.load(Relaxed), retried.load(Relaxed));
        assert_eq!(whole + retried, 2 * READS);
        assert!(rounds > 1, "the writer ran");
        // How many needed the lock depends on how the threads met (most, in a debug build
        // whose writer is nearly always in a write section); some did not (those between
        // the writer's rounds at least).
        assert!(whole > 0, "{whole} whole reads, {retried} retried");
    }
}

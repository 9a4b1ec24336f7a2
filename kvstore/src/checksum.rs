//! Block checksums: a chunked XXH3-64. A block of at most [`CHUNK`] bytes has the XXH3-64 (seed
//! 0) of its bytes, the same value as xxHash's `xxh3_64`; a longer block has the XXH3-64 of the
//! XXH3-64s of its [`CHUNK`]-byte pieces (the last one shorter), each as 8 little-endian bytes,
//! back to back. Every piece is hashed one-shot with `twox-hash`, which picks its AVX2 kernel at
//! run time (~57 GB/s on a piece still in cache right after it was copied), where a streaming
//! XXH3 over the whole block runs at 15 (twox-hash) to 27 GB/s (xxhash-rust, SSE2): the pieces
//! make the fused copy-and-hash helpers cost little more than the copy (`cargo run --release -p
//! kvstore --example hashbench`). With AVX2, those helpers copy and hash a piece in one pass
//! (`fused`: each stripe loaded once, stored and hashed from the same registers, so the
//! checksum is of the bytes the destination got): 256 KiB pieces out of DRAM at 0.91 of memcpy
//! here, against 0.75 copying then hashing the destination; with AVX-512F, where the CPU has
//! it, 0.86 against 0.74 for the AVX2 kernel on a later day (bench/RESULTS.md). The value does
//! not depend on how a caller splits the bytes, nor on the kernel.
//! (Disk format 1 used the plain XXH3-64 of the whole block: a format-1 disk tier is started
//! empty, see `disk::recovery`.) Keys keep using xxhash-rust's XXH3-128.

use twox_hash::XxHash3_64;

mod fused;

/// Whether copies out of the store use non-temporal stores (see [`copy_out_hashed`]).
const NT_OUT: bool = false;

/// Whether copies into an engine's runs ([`scatter_hashed_raw`], a connector's load) use
/// non-temporal stores where the runs are aligned for them: a load is megabytes to
/// gigabytes, far more than the caches keep until the engine reads it, and plain stores
/// read every destination line first (`kvtier-bench connector`: loads 0.84–0.93 of memcpy
/// with plain stores, 1.24–1.51 with these; bench/RESULTS.md).
const NT_ENGINE: bool = true;

/// Copies one piece and returns its XXH3-64: in one pass where the CPU allows (the hash of the
/// registers the stores wrote), else copied, then the destination hashed.
/// `ahead`: bytes of the same source after this piece (the rest of the copy).
fn copy_piece(d: &mut [u8], s: &[u8], nt: bool, ahead: usize) -> u64 {
    if s.len() >= fused::MIN_LEN && fused::available() {
        assert_eq!(d.len(), s.len(), "copy_piece: lengths differ");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available()` said the CPU has AVX2; `s` is a slice as long as `d`, and a
        // `&mut` cannot overlap it.
        return unsafe { fused::copy_xxh3(d, s.as_ptr(), nt, ahead) };
    }
    if nt {
        copy_nt(d, s);
    } else {
        d.copy_from_slice(s);
    }
    oneshot(d)
}

/// [`copy_out_hashed`] from raw memory (a block in an arena other processes map: read only
/// through raw loads, never as a Rust reference): the checksum of the bytes `dst` got.
///
/// # Safety
/// `src` is valid for reads of `dst.len()` bytes and does not overlap `dst`.
pub(crate) unsafe fn copy_out_hashed_raw(dst: &mut [u8], src: *const u8) -> u64 {
    let mut l = Leaves::new();
    let len = dst.len();
    prefetch_start(src, len);
    for (i, d) in dst.chunks_mut(CHUNK).enumerate() {
        prime_pages(src, len, i);
        let ahead = len - i * CHUNK - d.len();
        // SAFETY: piece `i` lies within the `dst.len()` bytes the caller vouched for, apart
        // from `dst`.
        l.push(unsafe { copy_piece_raw(d, src.add(i * CHUNK), ahead) });
    }
    l.finish()
}

/// Runs `f` with this thread's private piece buffer ([`CHUNK`] bytes, kept between calls: a
/// paged copy takes it for every block, and allocating and zeroing 64 KiB each time is a
/// pass over it more). Not reentrant: `f` must not call it again (none of its users does).
fn with_piece_buffer<R>(f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static PIECE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PIECE.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < CHUNK {
            b.resize(CHUNK, 0);
        }
        f(&mut b[..CHUNK])
    })
}

/// The XXH3-64 of one checksum piece, gathered in parts from an engine's runs in the order
/// of the piece's bytes, each part hashed as it is copied (what a layer-by-layer save of
/// layers smaller than a piece does: a piece is whole only once several layers are in). The
/// value is the piece's leaf, as [`gather_hashed`] would give it for the whole piece.
#[derive(Clone, Debug)]
pub struct PieceHash {
    /// The piece's length.
    len: usize,
    /// Its bytes hashed so far.
    done: usize,
    /// XXH3's lanes after them (`None` before the first part).
    acc: Option<[u64; 8]>,
}

impl PieceHash {
    /// Hashing a `len`-byte piece in parts, where this CPU and the length allow it (AVX2; a
    /// whole number of 64-byte stripes, longer than 240 bytes).
    pub fn new(len: usize) -> Option<Self> {
        (fused::available() && len >= fused::MIN_LEN && len.is_multiple_of(64)).then_some(
            PieceHash {
                len,
                done: 0,
                acc: None,
            },
        )
    }

    /// Where the next part starts: the bytes of the piece hashed so far.
    pub fn done(&self) -> usize {
        self.done
    }

    /// Whether `segs` (`(address, bytes)` each) may be the next part: whole 64-byte stripes,
    /// at least one, ending within the piece.
    pub fn fits(&self, segs: &[(usize, usize)]) -> bool {
        let n: usize = segs.iter().map(|&(_, k)| k).sum();
        n > 0
            && self.done + n <= self.len
            && segs.iter().all(|&(_, k)| k > 0 && k.is_multiple_of(64))
    }

    /// Copies the next part, `segs`, into `dst` (as long as they are together), hashing it
    /// in the same pass, non-temporal stores where `dst` is 32-byte aligned. Returns the
    /// piece's leaf once this part ends it.
    ///
    /// # Safety
    /// [`PieceHash::fits`]`(segs)` (else a panic), and their bytes add up to `dst.len()`;
    /// each segment is valid for reads of its bytes, does not overlap `dst`, and is not
    /// written during the call.
    pub unsafe fn gather(&mut self, dst: &mut [u8], segs: &[(usize, usize)]) -> Option<u64> {
        assert!(
            self.fits(segs),
            "PieceHash::gather: a part that does not fit"
        );
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `new` saw AVX2; the part fits the piece (asserted), its segments add up
            // to `dst.len()` and are the caller's to read, apart from `dst`.
            let h =
                unsafe { fused::gather_xxh3_part(dst, segs, self.len, self.done, self.acc, true) };
            self.done += dst.len();
            match h {
                fused::Hashed::Whole(h) => Some(h),
                fused::Hashed::Part(acc) => {
                    self.acc = Some(acc);
                    None
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("PieceHash::new gives none without AVX2")
    }
}

/// A walk along runs (`(address, bytes)` each, back to back in a block's canonical order: an
/// engine's tensors), a checksum piece (or any number of bytes) at a time.
pub struct RunCursor<'a> {
    runs: &'a [(usize, usize)],
    /// The run the walk is in…
    r: usize,
    /// …and how many of its bytes are behind it.
    done: usize,
}

impl<'a> RunCursor<'a> {
    /// A walk along `runs`, which must add up to `len` bytes (else a panic).
    pub fn new(runs: &'a [(usize, usize)], len: usize) -> Self {
        let total: usize = runs.iter().map(|&(_, n)| n).sum();
        assert_eq!(total, len, "the runs hold {total} bytes, the block {len}");
        RunCursor {
            runs,
            r: 0,
            done: 0,
        }
    }

    /// The parts of runs that the next `n` bytes cover, in order, into `out` (fewer bytes
    /// once the runs end).
    pub fn next(&mut self, n: usize, out: &mut Vec<(usize, usize)>) {
        out.clear();
        let mut got = 0;
        while let (true, Some(&(at, len))) = (got < n, self.runs.get(self.r)) {
            let take = (len - self.done).min(n - got);
            out.push((at + self.done, take));
            got += take;
            self.done += take;
            if self.done == len {
                self.r += 1;
                self.done = 0;
            }
        }
    }
}

/// Copies `len` bytes at `src` (raw memory, as for [`copy_out_hashed_raw`]) into `runs` (an
/// engine's tensors: `(address, bytes)` each, back to back in canonical order) and returns the
/// checksum of the bytes the runs got. A piece whose runs are whole 64-byte stripes (an
/// engine's runs are: tokens × heads × head size × element) goes in one pass, loaded once
/// and stored to the runs and hashed from the same registers (`fused`; non-temporal stores
/// where the runs are aligned for them, [`NT_ENGINE`]); another piece is
/// copied and hashed into a private buffer (the thread's own) in one pass, then placed from
/// there while it is in cache. Either way the checksum is of the bytes the runs got, never of
/// a second read of `src`: another process that writes `src` meanwhile changes both or
/// neither (issue 35).
///
/// # Safety
/// `src` is valid for reads of `len` bytes; each run is valid for writes of its bytes and
/// does not overlap `src` (runs that overlap each other are written in order, the later
/// last). The runs add up to `len` bytes (else a panic).
pub(crate) unsafe fn scatter_hashed_raw(
    src: *const u8,
    len: usize,
    runs: &[(usize, usize)],
) -> u64 {
    let mut cur = RunCursor::new(runs, len);
    let mut segs = Vec::new();
    let mut l = Leaves::new();
    prefetch_start(src, len);
    for at in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - at);
        cur.next(n, &mut segs);
        let ahead = len - at - n;
        // SAFETY: bytes `at..at + n` lie within the caller's `len`.
        let s = unsafe { src.add(at) };
        #[cfg(target_arch = "x86_64")]
        if fused::available() && fused::segs_fit(n, &segs) {
            // SAFETY: AVX2 is present, the segments fit; the caller vouched for `s` and for
            // the runs the segments are parts of.
            l.push(unsafe { fused::scatter_xxh3(&segs, s, n, NT_ENGINE, ahead) });
            continue;
        }
        l.push(with_piece_buffer(|buf| {
            let piece = &mut buf[..n];
            // SAFETY: `s` is valid for `n` bytes; `buf` is this thread's private memory.
            let h = unsafe { copy_piece_raw(piece, s, ahead) };
            let mut off = 0;
            for &(to, k) in &segs {
                // SAFETY: the segment is part of a run the caller vouched for; `off + k` ≤ `n`
                // (the segments add up to the piece).
                unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr().add(off), to as *mut u8, k) };
                off += k;
            }
            h
        }));
    }
    l.finish()
}

/// The checksum of `len` bytes at `src` (raw memory, as for [`copy_out_hashed_raw`]) as they
/// are now (for a check before or beside a copy engine's read of the memory itself): each
/// piece hashed where it lies through raw loads where the CPU has AVX2, else copied into a
/// private buffer first.
///
/// # Safety
/// `src` is valid for reads of `len` bytes.
pub(crate) unsafe fn checksum_raw(src: *const u8, len: usize) -> u64 {
    let mut piece = Vec::new();
    let mut l = Leaves::new();
    for at in (0..len).step_by(CHUNK) {
        let n = CHUNK.min(len - at);
        // SAFETY: bytes `at..at + n` lie within the caller's `len`.
        let s = unsafe { src.add(at) };
        if n >= fused::MIN_LEN && fused::available() {
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: AVX2 is present; `s` is valid for `n` bytes.
                l.push(unsafe { fused::xxh3_raw(s, n) });
                continue;
            }
        }
        piece.resize(n, 0);
        // SAFETY: `piece` is private, `n` bytes long.
        l.push(unsafe { copy_piece_raw(&mut piece, s, 0) });
    }
    l.finish()
}

/// Copies one piece from raw memory and returns its XXH3-64: in one pass where the CPU allows.
///
/// # Safety
/// `s` is valid for reads of `d.len()` bytes and does not overlap `d`.
unsafe fn copy_piece_raw(d: &mut [u8], s: *const u8, ahead: usize) -> u64 {
    if d.len() >= fused::MIN_LEN && fused::available() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 is present; `s` is valid for `d.len()` bytes, apart from `d`.
        return unsafe { fused::copy_xxh3(d, s, NT_OUT, ahead) };
    }
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(s, d.as_mut_ptr(), d.len()) };
    oneshot(d)
}

/// Prefetches the start of a block a get copies out (see `fused::prefetch_start`), where
/// the kernels run.
fn prefetch_start(src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= fused::MIN_LEN && fused::available() {
        fused::prefetch_start(src, len);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, len);
}

/// Bytes per piece of the chunked checksum; the fused copy-and-hash helpers copy this much at a
/// time, so a piece is still in cache when it is hashed.
pub const CHUNK: usize = 64 << 10;

/// How far ahead of the piece it copies a copy out of the store touches its source's pages
/// ([`prime_pages`]): 4 pieces, 64 pages of 4 KiB (an L1 TLB holds more).
const PRIMED: usize = 4 * CHUNK;

/// Prefetches one line in each 4 KiB of a copy's source (a page's first line when the
/// source is page-aligned) in the window that piece `i` of the copy opens (bytes `from..to`
/// of the `len` at `src`: the first [`PRIMED`] bytes before piece 0, then one piece more
/// before each next one), so that the pages' address
/// translations are walked all at once and early, not one by one as the copy's own
/// prefetches (a few KiB ahead) reach each new page. A block in the arena lies on 4 KiB
/// pages unless `huge_pages` reserved it hugetlb ones. Measured on a Zen 5 (`kvtier-bench
/// host --sizes 256K,2M --threads 1,2`, 4 interleaved pairs, medians): `get 256KiB x1t`
/// 23.6 → 26.2 GB/s (0.67 → 0.74 of memcpy), `x2t` 0.61 → 0.76, `get 2MiB x1t` 27.6 →
/// 31.0 GB/s (bench/RESULTS.md). Only a hint: the kernels' loads are what read the bytes.
/// Gets only: the connector's loads into an engine's runs ([`scatter_hashed_raw`]) showed
/// no gain with it within `kvtier-bench connector`'s spread (3 pairs), so they go without.
fn prime_pages(src: *const u8, len: usize, i: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (from, to) = match i {
            0 => (4096, PRIMED),
            _ => (PRIMED + (i - 1) * CHUNK, PRIMED + i * CHUNK),
        };
        for off in (from..to.min(len)).step_by(4096) {
            // SAFETY: SSE is part of x86-64; a prefetch never faults and reads nothing the
            // program sees (the address is inside the caller's range anyway).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    src.wrapping_add(off) as *const i8,
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, len, i);
}

fn oneshot(piece: &[u8]) -> u64 {
    XxHash3_64::oneshot(piece)
}

/// The XXH3-64s of a block's pieces, folded into its checksum.
#[derive(Clone)]
struct Leaves {
    /// Pieces so far.
    n: u64,
    /// The first piece's hash (the checksum of a one-piece block).
    first: u64,
    /// XXH3-64 over the pieces' hashes (little-endian), streamed.
    h: Box<xxhash_rust::xxh3::Xxh3>,
}

impl Leaves {
    fn new() -> Self {
        Self {
            n: 0,
            first: 0,
            h: Box::new(xxhash_rust::xxh3::Xxh3::new()),
        }
    }

    fn push(&mut self, leaf: u64) {
        if self.n == 0 {
            self.first = leaf;
        }
        self.n += 1;
        self.h.update(&leaf.to_le_bytes());
    }

    /// The checksum of a block made of the pieces pushed (an empty block: no piece).
    fn finish(&self) -> u64 {
        match self.n {
            0 => oneshot(&[]),
            1 => self.first,
            _ => self.h.digest(),
        }
    }
}

/// The checksum of `data`.
pub fn checksum(data: &[u8]) -> u64 {
    if data.len() <= CHUNK {
        return oneshot(data);
    }
    let mut l = Leaves::new();
    for piece in data.chunks(CHUNK) {
        l.push(oneshot(piece));
    }
    l.finish()
}

/// The checksum of `data` when the XXH3-64s of some of its [`CHUNK`]-byte pieces are known
/// already (`known[i]`: piece `i`'s, from the fused copy that wrote it, as [`gather_hashed`]
/// of that piece alone returns): only the others are hashed here. The same value as
/// [`checksum`] when the known ones are right. For a block written a part at a time (a
/// layer-by-layer save), whose pieces each part wrote whole were hashed as they were copied.
pub fn checksum_with_leaves(data: &[u8], known: &[Option<u64>]) -> u64 {
    if known.iter().all(Option::is_none) {
        return checksum(data);
    }
    let mut l = Leaves::new();
    for (i, piece) in data.chunks(CHUNK).enumerate() {
        l.push(match known.get(i).copied().flatten() {
            Some(leaf) => leaf,
            None => oneshot(piece),
        });
    }
    l.finish()
}

/// A checksum computed from the bytes in any split (the pieces back to back give the same
/// value as [`checksum`] of their concatenation). Bytes that do not arrive in whole
/// [`CHUNK`]-byte pieces are gathered in a buffer (allocated on first need) before they are
/// hashed.
#[derive(Clone)]
pub struct Checksummer {
    leaves: Leaves,
    buf: Vec<u8>,
}

impl Default for Checksummer {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksummer {
    /// An empty one.
    pub fn new() -> Self {
        Self {
            leaves: Leaves::new(),
            buf: Vec::new(),
        }
    }

    /// Adds the next bytes.
    pub fn update(&mut self, mut piece: &[u8]) {
        if !self.buf.is_empty() {
            let take = (CHUNK - self.buf.len()).min(piece.len());
            self.buf.extend_from_slice(&piece[..take]);
            piece = &piece[take..];
            if self.buf.len() < CHUNK {
                return;
            }
            self.leaves.push(oneshot(&self.buf));
            self.buf.clear();
        }
        // Whole pieces straight from the caller's bytes.
        let mut chunks = piece.chunks_exact(CHUNK);
        for c in &mut chunks {
            self.leaves.push(oneshot(c));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(CHUNK);
            }
            self.buf.extend_from_slice(rest);
        }
    }

    /// The checksum of everything added.
    pub fn finish(&self) -> u64 {
        if self.buf.is_empty() {
            return self.leaves.finish();
        }
        let mut l = self.leaves.clone();
        l.push(oneshot(&self.buf));
        l.finish()
    }
}

/// A checksum of bytes that arrive in runs much shorter than a piece (a block scattered into,
/// or read back from, an engine's strided tensors), hashed where they lie: each piece is fed
/// run by run to a streaming XXH3 (no copy into a buffer, as [`Checksummer`] makes of pieces
/// that do not come whole); a run that is a whole piece is hashed in one shot. The value is
/// [`checksum`]'s.
pub struct RunChecksummer {
    leaves: Leaves,
    cur: Box<xxhash_rust::xxh3::Xxh3>,
    /// Bytes of the current piece so far.
    fill: usize,
}

impl Default for RunChecksummer {
    fn default() -> Self {
        Self::new()
    }
}

impl RunChecksummer {
    /// An empty one.
    pub fn new() -> Self {
        Self {
            leaves: Leaves::new(),
            cur: Box::new(xxhash_rust::xxh3::Xxh3::new()),
            fill: 0,
        }
    }

    /// Adds the next run.
    pub fn update(&mut self, mut run: &[u8]) {
        while !run.is_empty() {
            let take = (CHUNK - self.fill).min(run.len());
            if self.fill == 0 && take == CHUNK {
                self.leaves.push(oneshot(&run[..CHUNK]));
            } else {
                self.cur.update(&run[..take]);
                self.fill += take;
                if self.fill == CHUNK {
                    self.leaves.push(self.cur.digest());
                    self.cur.reset();
                    self.fill = 0;
                }
            }
            run = &run[take..];
        }
    }

    /// The checksum of every run added.
    pub fn finish(&self) -> u64 {
        if self.fill == 0 {
            return self.leaves.finish();
        }
        let mut l = self.leaves.clone();
        l.push(self.cur.digest());
        l.finish()
    }
}

/// Copies `runs` (an engine's tensors: `(address, bytes)` each, back to back in canonical
/// order) into `dst` and returns the checksum of what `dst` got, non-temporal stores where
/// `dst` is 32-byte aligned (a block is not read back soon). A piece whose runs are whole
/// 64-byte stripes goes in one pass that loads each stripe once, stores it and hashes it
/// from the same registers (`fused`); another piece is gathered into a private buffer (the
/// thread's own), then copied and hashed from there in one pass.
///
/// # Safety
/// Each run is valid for reads of its bytes, does not overlap `dst`, and is not written
/// during the call. The runs add up to `dst.len()` bytes (else a panic).
pub unsafe fn gather_hashed(dst: &mut [u8], runs: &[(usize, usize)]) -> u64 {
    let mut cur = RunCursor::new(runs, dst.len());
    let mut segs = Vec::new();
    let mut l = Leaves::new();
    for d in dst.chunks_mut(CHUNK) {
        cur.next(d.len(), &mut segs);
        #[cfg(target_arch = "x86_64")]
        if fused::available() && fused::segs_fit(d.len(), &segs) {
            // SAFETY: AVX2 is present, the segments fit; they are parts of runs the caller
            // vouched for, apart from `d`.
            l.push(unsafe { fused::gather_xxh3(d, &segs, true) });
            continue;
        }
        l.push(with_piece_buffer(|buf| {
            let piece = &mut buf[..d.len()];
            let mut off = 0;
            for &(from, k) in &segs {
                // SAFETY: the segment is part of a run the caller vouched for; `off + k` ≤
                // the piece's length (the segments add up to it); `buf` is private.
                unsafe {
                    std::ptr::copy_nonoverlapping(from as *const u8, piece.as_mut_ptr().add(off), k)
                };
                off += k;
            }
            copy_piece(d, piece, true, 0)
        }));
    }
    l.finish()
}

/// Copies `src` into `dst` (same length) and returns the checksum of the bytes copied (in one
/// pass with AVX2; else each piece hashed right after it was copied, in cache). Non-temporal
/// stores where `dst` is 32-byte aligned: a block is not read back soon.
pub fn copy_hashed(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_hashed: lengths differ");
    let mut l = Leaves::new();
    for (i, (d, s)) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)).enumerate() {
        l.push(copy_piece(d, s, true, src.len() - i * CHUNK - s.len()));
    }
    l.finish()
}

/// Copies `src` into `dst` (same length) and returns the checksum of the bytes `dst` got (in
/// one pass with AVX2; else each piece of `dst` hashed right after it was copied, in cache).
/// Plain stores: for copies out of the store into memory the caller uses next (an engine's
/// KV).
pub fn copy_out_hashed(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_out_hashed: lengths differ");
    let mut l = Leaves::new();
    prefetch_start(src.as_ptr(), src.len());
    for (i, (d, s)) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)).enumerate() {
        prime_pages(src.as_ptr(), src.len(), i);
        l.push(copy_piece(d, s, NT_OUT, src.len() - i * CHUNK - s.len()));
    }
    l.finish()
}

/// Copies `src` into `dst` (same length), with non-temporal stores for the 32-byte-aligned
/// middle of copies of at least 4 KiB when the CPU has AVX2 (a plain copy otherwise). The
/// stores are fenced before returning, so whoever publishes the bytes after this call (a
/// commit, a lock release) publishes them whole.
pub fn copy_nt(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_nt: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        if dst.len() >= 4096 && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked above); both slices are valid for their common
            // length and do not overlap (`&mut` and `&` to distinct memory).
            unsafe { copy_nt_avx2(dst, src) };
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_nt_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    let len = dst.len();
    // Head up to the first 32-byte-aligned destination address, plainly.
    let head = dst.as_ptr().align_offset(32).min(len);
    dst[..head].copy_from_slice(&src[..head]);
    let mut i = head;
    let d = dst.as_mut_ptr();
    let s = src.as_ptr();
    while i + 128 <= len {
        // SAFETY: i + 128 <= len, so every 32-byte load and store is in bounds; `d + i` is
        // 32-byte aligned (head brought it there, and i grows by 128), as streaming stores need.
        unsafe {
            let a = _mm256_loadu_si256(s.add(i) as *const __m256i);
            let b = _mm256_loadu_si256(s.add(i + 32) as *const __m256i);
            let c = _mm256_loadu_si256(s.add(i + 64) as *const __m256i);
            let e = _mm256_loadu_si256(s.add(i + 96) as *const __m256i);
            _mm256_stream_si256(d.add(i) as *mut __m256i, a);
            _mm256_stream_si256(d.add(i + 32) as *mut __m256i, b);
            _mm256_stream_si256(d.add(i + 64) as *mut __m256i, c);
            _mm256_stream_si256(d.add(i + 96) as *mut __m256i, e);
        }
        i += 128;
    }
    dst[i..].copy_from_slice(&src[i..]);
    // Orders the streaming stores before any later store (the caller's publication).
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    /// The definition, spelled out.
    fn reference(data: &[u8]) -> u64 {
        if data.len() <= CHUNK {
            return xxh3_64(data);
        }
        let leaves: Vec<u8> = data
            .chunks(CHUNK)
            .flat_map(|p| xxh3_64(p).to_le_bytes())
            .collect();
        xxh3_64(&leaves)
    }

    #[test]
    fn chunked_xxh3_64_whatever_the_split() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 4096) as u8).collect();
        for n in [
            0, 1, 16, 17, 128, 129, 240, 241, 1024, 65_535, 65_536, 65_537, 100_000, 131_072,
            300_000,
        ] {
            let want = reference(&data[..n]);
            if n <= CHUNK {
                assert_eq!(want, xxh3_64(&data[..n]), "a short block is plain xxh3-64");
            }
            assert_eq!(checksum(&data[..n]), want, "{n} bytes");
            for split in [1usize, 7_777, 32 << 10, 64 << 10, 70_000] {
                let mut h = Checksummer::new();
                for piece in data[..n].chunks(split) {
                    h.update(piece);
                }
                assert_eq!(h.finish(), want, "{n} bytes in pieces of {split}");
                let mut r = RunChecksummer::new();
                for piece in data[..n].chunks(split) {
                    r.update(piece);
                }
                assert_eq!(r.finish(), want, "{n} bytes in runs of {split}");
            }
            // Uneven pieces, and finish() more than once.
            let mut h = Checksummer::new();
            let (a, b) = data[..n].split_at(n / 3);
            h.update(a);
            h.update(&[]);
            h.update(b);
            assert_eq!(h.finish(), want);
            assert_eq!(h.finish(), want);
        }
        let mut dst = vec![0u8; data.len() + 64];
        for off in [0, 1, 7, 32, 33] {
            for n in [0, 100, 4095, 4096, 4097, 65_536, 70_000, 300_000] {
                let want = reference(&data[..n]);
                dst.fill(0);
                assert_eq!(copy_hashed(&mut dst[off..off + n], &data[..n]), want);
                assert_eq!(&dst[off..off + n], &data[..n], "offset {off}, {n} bytes");
                assert!(
                    dst[..off].iter().all(|&b| b == 0) && dst[off + n..].iter().all(|&b| b == 0)
                );
                dst.fill(0);
                let got = copy_out_hashed(&mut dst[off..off + n], &data[..n]);
                assert_eq!(got, want);
                assert_eq!(&dst[off..off + n], &data[..n]);
                // Gathered from one run.
                dst.fill(0);
                let run = [(data.as_ptr() as usize, n)];
                // SAFETY: the run is `data`'s first `n` bytes, apart from `dst`.
                let got = unsafe { gather_hashed(&mut dst[off..off + n], &run) };
                assert_eq!(got, want, "one run: offset {off}, {n} bytes");
                assert_eq!(&dst[off..off + n], &data[..n]);
            }
        }
    }

    /// Runs of `sizes` (cycled) covering `n` bytes, each placed in `buf` at `align` past a
    /// 64-byte boundary and 64 bytes after the previous one's end.
    fn runs_in(buf: &mut [u8], n: usize, sizes: &[usize], align: usize) -> Vec<(usize, usize)> {
        let base = buf.as_mut_ptr() as usize;
        let first = (base + align).next_multiple_of(64) + align - base;
        let (mut runs, mut at, mut left) = (Vec::new(), first, n);
        for &k in sizes.iter().cycle() {
            if left == 0 {
                break;
            }
            let k = k.min(left);
            assert!(at + k <= buf.len(), "buffer too small");
            runs.push((base + at, k));
            at = (at + k + 64).next_multiple_of(64) + align;
            left -= k;
        }
        runs
    }

    #[test]
    fn gathers_and_scatters_through_runs() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + i / 977) as u8).collect();
        let mut engine = vec![0u8; 2 * data.len() + (1 << 20)];
        let mut out = vec![0u8; data.len() + 64];
        let splits: [&[usize]; 7] = [
            &[32 << 10],
            &[2560],
            &[64, 128, 4096],
            &[65_536 + 64],
            &[1000],
            &[4096, 100, 4096],
            &[300_000],
        ];
        let kernels: &[bool] = if cfg!(target_arch = "x86_64") {
            &[true, false]
        } else {
            &[false]
        };
        for &avx2_only in kernels {
            #[cfg(target_arch = "x86_64")]
            fused::force_avx2(avx2_only);
            let _ = avx2_only;
            for n in [0, 64, 320, 4096, 65_536, 65_536 + 2560, 200_000, 300_000] {
                let want = reference(&data[..n]);
                for sizes in splits {
                    for align in [0, 8, 32] {
                        engine.fill(0);
                        let runs = runs_in(&mut engine, n, sizes, align);
                        // Scatter: the bytes land in the runs, nothing between them.
                        // SAFETY: the runs lie apart in `engine`, apart from `data`, and add
                        // up to `n`.
                        let got = unsafe { scatter_hashed_raw(data.as_ptr(), n, &runs) };
                        assert_eq!(got, want, "scatter {n} in {sizes:?} at {align}");
                        let mut at = 0;
                        for &(a, k) in &runs {
                            let off = a - engine.as_ptr() as usize;
                            assert_eq!(&engine[off..off + k], &data[at..at + k]);
                            at += k;
                        }
                        let landed = engine.iter().filter(|&&b| b != 0).count();
                        let want_nz = data[..n].iter().filter(|&&b| b != 0).count();
                        assert_eq!(landed, want_nz, "bytes outside the runs");
                        // Gather back: the same checksum, the same bytes.
                        out.fill(0);
                        // SAFETY: the runs lie in `engine`, apart from `out`.
                        let got = unsafe { gather_hashed(&mut out[..n], &runs) };
                        assert_eq!(got, want, "gather {n} in {sizes:?} at {align}");
                        assert_eq!(&out[..n], &data[..n]);
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        fused::force_avx2(false);
    }

    #[test]
    fn a_piece_hashed_in_parts_is_its_leaf() {
        if PieceHash::new(4096).is_none() {
            return; // no AVX2: nothing is hashed in parts here
        }
        assert!(PieceHash::new(4000).is_none(), "not whole stripes");
        assert!(
            PieceHash::new(192).is_none(),
            "shorter than the kernels take"
        );
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 11 + i / 251) as u8).collect();
        let mut engine = vec![0u8; 3 * data.len()];
        let mut out = vec![0u8; data.len() + 128];
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % m as u64) as usize
        };
        for avx2_only in [true, false] {
            #[cfg(target_arch = "x86_64")]
            fused::force_avx2(avx2_only);
            let _ = avx2_only;
            for len in [256, 320, 1024, 1088, 2048, 4096, 32_768, 65_472, 65_536] {
                let want = xxh3_64(&data[..len]);
                let stripes = len / 64;
                // Cuts (in stripes): halves, at and beside block boundaries, one stripe at a
                // time, a last part of one stripe, and random ones.
                let mut cuts: Vec<Vec<usize>> = vec![
                    vec![],
                    vec![stripes / 2],
                    vec![16.min(stripes - 1)],
                    vec![15.min(stripes - 1), 17.min(stripes - 1)],
                    (1..stripes).collect(),
                    vec![stripes - 1],
                ];
                for _ in 0..6 {
                    let mut c: Vec<usize> = (0..next(6)).map(|_| 1 + next(stripes - 1)).collect();
                    c.sort_unstable();
                    c.dedup();
                    cuts.push(c);
                }
                for cut in cuts.iter_mut() {
                    cut.dedup();
                }
                for cut in &cuts {
                    for (sizes, align) in [
                        (&[64usize][..], 0),
                        (&[4096, 192][..], 32),
                        (&[1 << 20][..], 0),
                    ] {
                        engine.fill(0);
                        out.fill(0);
                        let runs = runs_in(&mut engine, len, sizes, align);
                        let base = engine.as_ptr() as usize;
                        let mut at = 0;
                        for &(a, k) in &runs {
                            engine[a - base..a - base + k].copy_from_slice(&data[at..at + k]);
                            at += k;
                        }
                        let mut cur = RunCursor::new(&runs, len);
                        let (mut h, mut segs) = (PieceHash::new(len).unwrap(), Vec::new());
                        let ends: Vec<usize> = cut.iter().map(|c| c * 64).chain([len]).collect();
                        let off = 64 * next(2);
                        let mut got = None;
                        for &end in &ends {
                            let at = h.done();
                            cur.next(end - at, &mut segs);
                            assert!(h.fits(&segs), "{len} cut {cut:?}");
                            assert!(got.is_none(), "a leaf before the last part");
                            // SAFETY: the segments lie in `engine`, apart from `out`, and
                            // add up to the part.
                            got = unsafe { h.gather(&mut out[off + at..off + end], &segs) };
                        }
                        assert_eq!(got, Some(want), "{len} bytes cut at {cut:?}, {sizes:?}");
                        assert_eq!(&out[off..off + len], &data[..len]);
                        assert!(out[..off].iter().chain(&out[off + len..]).all(|&b| b == 0));
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        fused::force_avx2(false);
        let h = PieceHash::new(4096).unwrap();
        assert!(!h.fits(&[(0, 100)]), "not whole stripes");
        assert!(!h.fits(&[(0, 4160)]), "past the piece's end");
        assert!(!h.fits(&[]), "nothing");
    }

    #[test]
    fn known_leaves_stand_for_their_pieces() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 5 + i / 333) as u8).collect();
        for n in [0, 1000, 65_536, 65_537, 200_000, 300_000] {
            let d = &data[..n];
            let pieces = n.div_ceil(CHUNK);
            let right: Vec<Option<u64>> = d.chunks(CHUNK).map(|p| Some(xxh3_64(p))).collect();
            for mask in 0..(1u32 << pieces.min(5)) {
                let known: Vec<Option<u64>> = right
                    .iter()
                    .enumerate()
                    .map(|(i, l)| l.filter(|_| mask & (1 << i) != 0))
                    .collect();
                assert_eq!(checksum_with_leaves(d, &known), checksum(d), "{n} {mask:b}");
            }
            // A wrong known leaf shows (it is trusted, not checked): the value is not the
            // block's.
            if pieces > 0 {
                let mut wrong = vec![None; pieces];
                wrong[pieces - 1] = Some(right[pieces - 1].unwrap() ^ 1);
                assert_ne!(checksum_with_leaves(d, &wrong), checksum(d));
            }
        }
    }

    #[test]
    #[should_panic(expected = "the runs hold")]
    fn runs_that_do_not_cover_the_block_are_refused() {
        let data = vec![1u8; 4096];
        let mut out = vec![0u8; 4096];
        // SAFETY: the run is in `data`; the call panics before any copy.
        unsafe { gather_hashed(&mut out, &[(data.as_ptr() as usize, 4000)]) };
    }
}

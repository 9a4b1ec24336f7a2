//! Copy and XXH3-64 in one pass (x86-64 with AVX2, selected at run time): each 64-byte stripe
//! is loaded once into registers, stored to the destination from them and hashed from the
//! same registers, so the value is the hash of exactly the bytes the destination got (a
//! concurrent writer of the source can change what is copied, never make the checksum vouch
//! for bytes the destination does not hold) and the destination is never read back (but for
//! XXH3's last stripe, 64 bytes a piece, read after the stores are fenced). The arithmetic is
//! xxHash's own AVX2 kernel (`XXH3_accumulate_512_avx2`, `XXH3_scrambleAcc_avx2`), seed 0 and
//! the default secret; the tests check every length against `xxh3_64`. Where the CPU has
//! AVX-512F, the same kernel on 64-byte registers (`XXH3_accumulate_512_avx512`): a stripe is
//! one load, one store and one register's arithmetic.

/// XXH3's default secret (`XXH3_kSecret`).
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

const STRIPE: usize = 64;
/// Stripes per block with the default secret: (192 - 64) / 8.
const STRIPES_PER_BLOCK: usize = 16;

/// The shortest piece the fused kernel takes (XXH3's long path starts past 240 bytes; shorter
/// pieces are copied, then hashed).
pub(super) const MIN_LEN: usize = 241;

/// XXH3's accumulator lanes before the first stripe.
const INIT: [u64; 8] = [
    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
];

/// What of a piece a kernel walks: bytes `from..to` (`to`: `None` for the rest of the
/// piece, its last stripe and the merge included), starting from the accumulator lanes `acc`
/// a part before left (`None`: XXH3's first). A piece cut in parts this way hashes to the
/// same value as whole, its parts walked in order: `from` and `to` are multiples of
/// [`STRIPE`], the piece's length too, and `to` is short of the piece's end.
#[derive(Clone, Copy)]
pub(super) struct Part {
    pub(super) from: usize,
    pub(super) to: Option<usize>,
    pub(super) acc: Option<[u64; 8]>,
}

/// A whole piece.
const WHOLE: Part = Part {
    from: 0,
    to: None,
    acc: None,
};

/// What a kernel returns: the hash of the piece, or the lanes after a part that is not its
/// last.
pub(super) enum Hashed {
    Whole(u64),
    Part([u64; 8]),
}

/// The hash of a whole piece.
#[inline(always)]
fn whole(h: Hashed) -> u64 {
    match h {
        Hashed::Whole(h) => h,
        // A kernel given `WHOLE` walks to the end.
        Hashed::Part(_) => unreachable!("a whole piece's walk stops short"),
    }
}

/// Whether the fused kernel runs on this CPU.
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where a kernel reads its source or writes its destination: the address of byte `off` of
/// the piece. Offsets are asked in increasing order, but for XXH3's last stripe, which may
/// start up to 63 bytes before the tail (a [`Contig`] piece of any length; a [`Segs`] piece is
/// whole stripes, so its last stripe is its tail).
pub(super) trait Addr {
    /// The address of byte `off`.
    fn at(&mut self, off: usize) -> *mut u8;
    /// Where to prefetch `pf` bytes past byte `off` (`at(off)` asked already), if anywhere.
    fn ahead(&self, off: usize, pf: usize) -> Option<*const u8>;
}

/// One contiguous range.
#[derive(Clone, Copy)]
pub(super) struct Contig(pub(super) *mut u8);

impl Addr for Contig {
    #[inline(always)]
    fn at(&mut self, off: usize) -> *mut u8 {
        self.0.wrapping_add(off)
    }
    #[inline(always)]
    fn ahead(&self, off: usize, pf: usize) -> Option<*const u8> {
        Some(self.0.wrapping_add(off + pf).cast_const())
    }
}

/// Segments back to back: `(address, bytes)` each, every one a whole number of stripes (the
/// runs of an engine's tensor that a piece of a block covers).
pub(super) struct Segs<'a> {
    segs: &'a [(usize, usize)],
    /// The segment the kernel is in…
    i: usize,
    /// …and the piece's offset where it starts.
    start: usize,
}

impl<'a> Segs<'a> {
    pub(super) fn new(segs: &'a [(usize, usize)]) -> Self {
        Segs {
            segs,
            i: 0,
            start: 0,
        }
    }
}

impl Addr for Segs<'_> {
    #[inline(always)]
    fn at(&mut self, off: usize) -> *mut u8 {
        while off >= self.start + self.segs[self.i].1 {
            self.start += self.segs[self.i].1;
            self.i += 1;
        }
        (self.segs[self.i].0 + (off - self.start)) as *mut u8
    }
    #[inline(always)]
    fn ahead(&self, off: usize, pf: usize) -> Option<*const u8> {
        // Within the segment the kernel is in (the next one lies anywhere).
        let (at, len) = self.segs[self.i];
        (off + pf < self.start + len).then(|| (at + (off + pf - self.start)) as *const u8)
    }
}

/// Whether a piece of `len` bytes over `segs` may go through the kernels as [`Segs`]: whole
/// stripes each, as many bytes in all, and long enough for the kernels.
pub(super) fn segs_fit(len: usize, segs: &[(usize, usize)]) -> bool {
    len >= MIN_LEN
        && len.is_multiple_of(STRIPE)
        && segs.iter().all(|&(_, n)| n > 0 && n.is_multiple_of(STRIPE))
        && segs.iter().map(|&(_, n)| n).sum::<usize>() == len
}

/// Copies a `len`-byte piece from `src` into the segments `dst` (an engine's runs), hashing
/// it in the same pass, and returns its `xxh3_64`: the hash of the registers the stores
/// wrote, as [`copy_xxh3`]. `nt`: non-temporal stores where every segment starts 32-byte
/// aligned (64 for the AVX-512 kernel's; every stripe then is, segments being whole
/// stripes). `ahead`: as in [`copy_xxh3`].
///
/// # Safety
/// The CPU has AVX2 ([`available`]); [`segs_fit`]`(len, dst)`; `src` is valid for reads of
/// `len` bytes; each segment is valid for writes of its bytes and does not overlap `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scatter_xxh3(
    dst: &[(usize, usize)],
    src: *const u8,
    len: usize,
    nt: bool,
    ahead: usize,
) -> u64 {
    assert!(segs_fit(len, dst), "scatter_xxh3: bad segments");
    let aligned = |to: usize| dst.iter().all(|&(at, _)| at % to == 0);
    let nt = nt && aligned(32);
    let (d, s) = (Segs::new(dst), Contig(src.cast_mut()));
    if avx512() && (!nt || aligned(64)) {
        // SAFETY: the caller's promises, and the CPU has AVX-512F (`avx512`); with `nt`
        // every stripe's destination is 64-byte aligned.
        return unsafe { kernel512::<true, _, _>(d, s, len, nt, ahead) };
    }
    // SAFETY: the caller's promises; with `nt` every stripe's destination is 32-byte aligned.
    unsafe { kernel::<true, _, _>(d, s, len, nt, ahead) }
}

/// Copies the segments `src` (an engine's runs, `dst.len()` bytes in all) into `dst`,
/// hashing them in the same pass, and returns the `xxh3_64` of what `dst` got; `nt`: as in
/// [`copy_xxh3`].
///
/// # Safety
/// The CPU has AVX2 ([`available`]); [`segs_fit`]`(dst.len(), src)`; each segment is valid
/// for reads of its bytes and does not overlap `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn gather_xxh3(dst: &mut [u8], src: &[(usize, usize)], nt: bool) -> u64 {
    assert!(segs_fit(dst.len(), src), "gather_xxh3: bad segments");
    let len = dst.len();
    let nt = nt && dst.as_mut_ptr().align_offset(32) == 0;
    let (d, s) = (Contig(dst.as_mut_ptr()), Segs::new(src));
    if avx512() && !(nt && dst.as_mut_ptr().align_offset(64) != 0) {
        // SAFETY: the caller's promises, and the CPU has AVX-512F (`avx512`).
        return unsafe { kernel512::<true, _, _>(d, s, len, nt, 0) };
    }
    // SAFETY: the caller's promises.
    unsafe { kernel::<true, _, _>(d, s, len, nt, 0) }
}

/// [`gather_xxh3`] of a part of a `len`-byte piece: `dst` is the piece's bytes from `from`
/// on (`dst.len()` of them), `src` its segments; `acc` the lanes the part before left
/// (`None` for the first part). A part that ends the piece returns its hash; another, the
/// lanes for the next part.
///
/// `len` and `from` are multiples of [`STRIPE`], `len` ≥ [`MIN_LEN`], and the part is
/// whole stripes within the piece, its segments whole stripes adding up to `dst.len()` (else
/// a panic).
///
/// # Safety
/// The CPU has AVX2 ([`available`]); each segment is valid for reads of its bytes and does
/// not overlap `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn gather_xxh3_part(
    dst: &mut [u8],
    src: &[(usize, usize)],
    len: usize,
    from: usize,
    acc: Option<[u64; 8]>,
    nt: bool,
) -> Hashed {
    let n = dst.len();
    let end = from + n;
    assert!(
        len >= MIN_LEN
            && len.is_multiple_of(STRIPE)
            && from.is_multiple_of(STRIPE)
            && n.is_multiple_of(STRIPE)
            && n > 0
            && end <= len
            && src.iter().all(|&(_, k)| k > 0 && k.is_multiple_of(STRIPE))
            && src.iter().map(|&(_, k)| k).sum::<usize>() == n,
        "gather_xxh3_part: bad part"
    );
    let part = Part {
        from,
        to: (end < len).then_some(end),
        acc,
    };
    let nt = nt && dst.as_mut_ptr().align_offset(32) == 0;
    // Offsets are the piece's: byte `from` of the piece is the part's first.
    let d = Contig(dst.as_mut_ptr().wrapping_sub(from));
    let s = Segs {
        segs: src,
        i: 0,
        start: from,
    };
    if avx512() && !(nt && dst.as_mut_ptr().align_offset(64) != 0) {
        // SAFETY: the caller's promises, and the CPU has AVX-512F (`avx512`).
        return unsafe { kernel512_part::<true, _, _>(d, s, len, nt, 0, part) };
    }
    // SAFETY: the caller's promises.
    unsafe { kernel_part::<true, _, _>(d, s, len, nt, 0, part) }
}

/// Copies `dst.len()` bytes (at least [`MIN_LEN`]) from `src` into `dst` and returns
/// `xxh3_64` of the bytes copied; `nt`: non-temporal stores where the destination is 32-byte
/// aligned. The source is read only through raw loads, so it may be memory another process
/// writes meanwhile (a shared arena): that changes what is copied, and the hash follows it.
/// `ahead`: how many bytes of the same source follow this piece (the rest of the copy), which
/// the kernel may prefetch while it works on this one ([`prefetch_distance`]).
///
/// # Safety
/// The CPU has AVX2 ([`available`]); `src` is valid for reads of `dst.len()` bytes and does not
/// overlap `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn copy_xxh3(dst: &mut [u8], src: *const u8, nt: bool, ahead: usize) -> u64 {
    assert!(dst.len() >= MIN_LEN, "copy_xxh3: bad length");
    let nt = nt && dst.as_mut_ptr().align_offset(32) == 0;
    // Non-temporal 64-byte stores need 64-byte alignment: a destination aligned to 32 only
    // keeps the AVX2 kernel's streaming stores rather than losing them.
    if avx512() && !(nt && dst.as_mut_ptr().align_offset(64) != 0) {
        // SAFETY: the caller's promises, and the CPU has AVX-512F (`avx512`).
        return unsafe {
            kernel512::<true, _, _>(
                Contig(dst.as_mut_ptr()),
                Contig(src.cast_mut()),
                dst.len(),
                nt,
                ahead,
            )
        };
    }
    // SAFETY: the caller's promises; `dst` is valid for writes of its length.
    unsafe {
        kernel::<true, _, _>(
            Contig(dst.as_mut_ptr()),
            Contig(src.cast_mut()),
            dst.len(),
            nt,
            ahead,
        )
    }
}

/// How far ahead of the stripe it copies a kernel prefetches its source, in bytes (0: not
/// at all), chosen once: `KVTIER_COPY_PREFETCH` (bytes) where set, to time the choices on one
/// machine; else 4 KiB on Intel CPUs, 8 KiB on AMD ones from family 0x1A (Zen 5) on, and none
/// on others (older AMD ones included: measured only as below). Measured with
/// `hashbench` (256 KiB blocks into a buffer that stays in cache): on an Intel Xeon
/// (AVX-512), out of DRAM the AVX-512 kernel ran at 0.82 of memcpy with no prefetch, 0.89 at
/// 512 bytes ahead, 0.95 at 2 KiB and 1.0 at 4 to 16 KiB, and out of L3 at 0.87 → 0.95; on
/// an AMD EPYC of family 0x1A (Zen 5) at 0.63 with none, 0.70 at 2 KiB, 0.80 at 4 KiB, 0.84
/// at 8 KiB, 0.75 at 16 KiB and 0.70 at 32 KiB (1 KiB was slower than none there, as on an
/// earlier EPYC, where 4 KiB and more were not tried; bench/RESULTS.md).
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_distance() -> usize {
    static CHOSEN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if let Some(b) = std::env::var("KVTIER_COPY_PREFETCH")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
        {
            return b.min(1 << 20);
        }
        // CPUID leaf 0: the vendor string.
        let id = std::arch::x86_64::__cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&id.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&id.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&id.ecx.to_le_bytes());
        // CPUID leaf 1: the family (base, plus extended where the base is 0xF).
        let sig = std::arch::x86_64::__cpuid(1).eax;
        let base = (sig >> 8) & 0xF;
        let family = if base == 0xF {
            base + ((sig >> 20) & 0xFF)
        } else {
            base
        };
        match &vendor {
            b"GenuineIntel" => 4096,
            b"AuthenticAMD" if family >= 0x1A => 8192,
            _ => 0,
        }
    })
}

/// The end (an offset from the piece's start) below which a kernel prefetches, and how far
/// ahead: nothing when prefetching is off.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_window(len: usize, ahead: usize) -> (usize, usize) {
    match prefetch_distance() {
        0 => (0, 0),
        pf => (len.saturating_add(ahead), pf),
    }
}

/// Prefetches the first `len` bytes at `src`, up to the kernels' prefetch distance, past the
/// first line: a copy of a block out of DRAM starts with as many lines in flight as the
/// kernels keep ahead of each stripe later (else its first stripes wait on DRAM one by one;
/// a later piece's start was prefetched by the piece before it). Only a hint.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_start(src: *const u8, len: usize) {
    let end = len.min(prefetch_distance());
    for off in (STRIPE..end).step_by(STRIPE) {
        // SAFETY: SSE is part of x86-64; a prefetch never faults and reads nothing the
        // program sees (the address is inside the caller's range anyway).
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                src.wrapping_add(off) as *const i8,
            )
        };
    }
}

/// Whether the AVX-512 kernel runs here: the CPU has AVX-512F, and neither the environment
/// (`KVTIER_CHECKSUM_KERNEL=avx2`, read once: to time both kernels on one machine) nor a test
/// asked for the AVX2 one. Both give the same value.
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !FORCE_AVX2.load(std::sync::atomic::Ordering::Relaxed)
        && *CHOSEN.get_or_init(|| {
            std::env::var("KVTIER_CHECKSUM_KERNEL").as_deref() != Ok("avx2")
                && std::arch::is_x86_feature_detected!("avx512f")
        })
}

#[cfg(target_arch = "x86_64")]
static FORCE_AVX2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`copy_xxh3`] and [`xxh3_raw`] use the AVX2 kernel (`true`) or the best one (`false`).
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) fn force_avx2(on: bool) {
    FORCE_AVX2.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `xxh3_64` of `len` bytes (at least [`MIN_LEN`]) at `src`, read only through raw loads (the
/// same kernel with no destination: each stripe loaded once and hashed from registers).
///
/// # Safety
/// The CPU has AVX2 ([`available`]); `src` is valid for reads of `len` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn xxh3_raw(src: *const u8, len: usize) -> u64 {
    assert!(len >= MIN_LEN, "xxh3_raw: bad length");
    if avx512() {
        // SAFETY: as below, and the CPU has AVX-512F (`avx512`).
        return unsafe {
            kernel512::<false, _, _>(
                Contig(std::ptr::null_mut()),
                Contig(src.cast_mut()),
                len,
                false,
                0,
            )
        };
    }
    // SAFETY: the caller's promises; with `STORE` false the destination is never touched.
    unsafe {
        kernel::<false, _, _>(
            Contig(std::ptr::null_mut()),
            Contig(src.cast_mut()),
            len,
            false,
            0,
        )
    }
}

/// The fused kernel: with `STORE`, copies `len` bytes from `s` to `d` and hashes them; without,
/// only hashes `s` (`d` unused).
///
/// # Safety
/// As [`copy_xxh3`] (`d` valid for writes of `len` bytes when `STORE`), `len` ≥ [`MIN_LEN`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn kernel<const STORE: bool, D: Addr, S: Addr>(
    d: D,
    s: S,
    len: usize,
    nt: bool,
    ahead: usize,
) -> u64 {
    // SAFETY: the caller's promises.
    whole(unsafe { kernel_part::<STORE, D, S>(d, s, len, nt, ahead, WHOLE) })
}

/// [`kernel`] over a part of the piece ([`Part`]; `d` and `s` as for the whole piece: the
/// part's bytes are at their offsets in it).
///
/// # Safety
/// As [`kernel`] for the part's bytes (and the last stripe's, for a last part); `part`
/// within [`Part`]'s rules.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn kernel_part<const STORE: bool, D: Addr, S: Addr>(
    mut d: D,
    mut s: S,
    len: usize,
    nt: bool,
    ahead: usize,
    part: Part,
) -> Hashed {
    use std::arch::x86_64::*;
    let (pf_end, pf) = prefetch_window(len, ahead);
    let k = SECRET.as_ptr();
    let init = part.acc.unwrap_or(INIT);
    // SAFETY (every pointer below): offsets stay within `len` bytes of `src` and `dst` (the
    // loops stop a full stripe short of the end, the tail is copied by `ptr::copy_nonoverlapping`) and
    // within the 192-byte secret (stripe secrets at ≤ 15 * 8 + 32 + 32 = 184, the scramble's
    // at 128..192, the last stripe's at 121..185).
    // SAFETY: `init` holds 8 u64s (64 bytes).
    let mut acc = unsafe {
        [
            _mm256_loadu_si256(init.as_ptr() as *const __m256i),
            _mm256_loadu_si256(init.as_ptr().add(4) as *const __m256i),
        ]
    };
    let lanes = |acc: &[__m256i; 2]| {
        let mut lanes = [0u64; 8];
        // SAFETY: `lanes` holds 64 bytes.
        unsafe {
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, acc[0]);
            _mm256_storeu_si256(lanes.as_mut_ptr().add(4) as *mut __m256i, acc[1]);
        }
        lanes
    };
    // One stripe: `a`, `b` its two halves, `sec` its secret.
    let accumulate = |acc: &mut [__m256i; 2], a: __m256i, b: __m256i, sec: *const u8| {
        for (i, data) in [a, b].into_iter().enumerate() {
            // SAFETY: see above; AVX2 is enabled for this function.
            unsafe {
                let key = _mm256_loadu_si256(sec.add(32 * i) as *const __m256i);
                let dk = _mm256_xor_si256(data, key);
                let dk_hi = _mm256_shuffle_epi32::<0b00_11_00_01>(dk);
                let product = _mm256_mul_epu32(dk, dk_hi);
                let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
                let sum = _mm256_add_epi64(acc[i], swapped);
                acc[i] = _mm256_add_epi64(product, sum);
            }
        }
    };
    let mut copy_stripe = |acc: &mut [__m256i; 2], off: usize, sec: *const u8| {
        // SAFETY: see above.
        unsafe {
            let from = s.at(off);
            if off + pf < pf_end {
                if let Some(p) = s.ahead(off, pf) {
                    // Only a hint: never faults, and reads nothing the program sees.
                    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
                }
            }
            let a = _mm256_loadu_si256(from as *const __m256i);
            let b = _mm256_loadu_si256(from.add(32) as *const __m256i);
            if STORE {
                let to = d.at(off);
                if nt {
                    _mm256_stream_si256(to as *mut __m256i, a);
                    _mm256_stream_si256(to.add(32) as *mut __m256i, b);
                } else {
                    _mm256_storeu_si256(to as *mut __m256i, a);
                    _mm256_storeu_si256(to.add(32) as *mut __m256i, b);
                }
            }
            accumulate(acc, a, b, sec);
        }
    };
    let prime = _mm256_set1_epi32(PRIME32_1 as i32);
    let done = walk(
        len,
        part.from,
        part.to,
        &mut acc,
        |acc, off, sec| copy_stripe(acc, off, k.wrapping_add(sec)),
        |acc| {
            // Scramble, with the secret's last 64 bytes.
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: see above.
                unsafe {
                    let shifted = _mm256_srli_epi64::<47>(*a);
                    let data = _mm256_xor_si256(*a, shifted);
                    let key = _mm256_loadu_si256(k.add(128 + 32 * i) as *const __m256i);
                    let dk = _mm256_xor_si256(data, key);
                    let dk_hi = _mm256_shuffle_epi32::<0b00_11_00_01>(dk);
                    let lo = _mm256_mul_epu32(dk, prime);
                    let hi = _mm256_mul_epu32(dk_hi, prime);
                    *a = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
                }
            }
        },
    );
    if part.to.is_some() {
        if STORE && nt {
            // The part's streaming stores are ordered before what the caller does next.
            _mm_sfence();
        }
        return Hashed::Part(lanes(&acc));
    }
    // SAFETY: the caller's promises (`done` ≤ `len`).
    let last = unsafe { finish_tail::<STORE, _, _>(&mut d, &mut s, done, len, nt) };
    // SAFETY: see above.
    unsafe {
        let a = _mm256_loadu_si256(last as *const __m256i);
        let b = _mm256_loadu_si256(last.add(32) as *const __m256i);
        accumulate(&mut acc, a, b, k.add(192 - STRIPE - 7));
    }
    Hashed::Whole(merge(lanes(&acc), len))
}

/// XXH3's walk over a long input, for both kernels, from stripe offset `from` (a multiple of
/// [`STRIPE`]; 0 for a whole piece) to `to` (a part ending there: a multiple of [`STRIPE`],
/// before the piece's last stripe) or, with `None`, to the end: per whole block of stripes,
/// `stripe(acc, offset, secret offset)` for each of its 16 stripes, then `scramble(acc)`; then
/// the whole stripes of the last, partial block. Returns where it stopped: `to`, or where
/// the tail starts. (XXH3's last stripe, which overlaps, is the caller's.) A part that
/// starts or ends inside a block walks that block's stripes on either side of the cut, and
/// the block is scrambled once, where its last stripe is walked: the same sequence as one
/// walk over the whole.
#[inline(always)]
fn walk<A>(
    len: usize,
    from: usize,
    to: Option<usize>,
    acc: &mut A,
    mut stripe: impl FnMut(&mut A, usize, usize),
    mut scramble: impl FnMut(&mut A),
) -> usize {
    // Stripes walked in all, up to the end: whole blocks' and the last, partial block's
    // (fewer than 16: a block ending at the piece's end is the partial one).
    let stop = to.map_or((len - 1) / STRIPE, |t| t / STRIPE);
    let mut st = from / STRIPE;
    // The rest of a block a part starts inside of.
    while !st.is_multiple_of(STRIPES_PER_BLOCK) && st < stop {
        stripe(acc, st * STRIPE, (st % STRIPES_PER_BLOCK) * 8);
        st += 1;
        if st.is_multiple_of(STRIPES_PER_BLOCK) {
            scramble(acc);
        }
    }
    while st + STRIPES_PER_BLOCK <= stop {
        for i in 0..STRIPES_PER_BLOCK {
            stripe(acc, (st + i) * STRIPE, i * 8);
        }
        scramble(acc);
        st += STRIPES_PER_BLOCK;
    }
    // Fewer than a block's stripes: no scramble (the block ends past `stop`).
    while st < stop {
        stripe(acc, st * STRIPE, (st % STRIPES_PER_BLOCK) * 8);
        st += 1;
    }
    stop * STRIPE
}

/// The kernels' tail: with `STORE`, copies bytes `done..len` (after the last whole stripe) and
/// fences the non-temporal stores; returns where XXH3's last stripe (the last 64 bytes, which
/// may overlap what was hashed already) is read from: the destination once the tail is there,
/// or the source when nothing is stored.
///
/// # Safety
/// As the kernels': `s` valid for reads and, with `STORE`, `d` for writes of `len` bytes, apart;
/// `done` ≤ `len`; bytes `done..len` and `len - 64..len` each lie in one segment of `s` and of
/// `d` (a [`Segs`] piece is whole stripes: both are its last stripe).
#[cfg(target_arch = "x86_64")]
unsafe fn finish_tail<const STORE: bool, D: Addr, S: Addr>(
    d: &mut D,
    s: &mut S,
    done: usize,
    len: usize,
    nt: bool,
) -> *const u8 {
    if !STORE {
        return s.at(len - STRIPE).cast_const();
    }
    // SAFETY: `done..len` is within both (the caller's promise); no overlap.
    unsafe { std::ptr::copy_nonoverlapping(s.at(done), d.at(done), len - done) };
    if nt {
        // SAFETY: SSE is part of x86-64; a fence has no other requirement.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    d.at(len - STRIPE).cast_const()
}

/// XXH3's final merge of the eight accumulator lanes of a `len`-byte input.
fn merge(lanes: [u64; 8], len: usize) -> u64 {
    let secret64 = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&SECRET[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let mut result = (len as u64).wrapping_mul(PRIME64_1);
    for i in 0..4 {
        let l = lanes[2 * i] ^ secret64(11 + 16 * i);
        let r = lanes[2 * i + 1] ^ secret64(11 + 16 * i + 8);
        let m = u128::from(l) * u128::from(r);
        result = result.wrapping_add((m as u64) ^ ((m >> 64) as u64));
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ (result >> 32)
}

/// [`kernel`] with AVX-512F: a stripe is one 64-byte register (loaded, stored and hashed from
/// it), the accumulator one register; the arithmetic is xxHash's `XXH3_accumulate_512_avx512`
/// and `XXH3_scrambleAcc_avx512`, so the value is the same.
///
/// # Safety
/// As [`kernel`], and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn kernel512<const STORE: bool, D: Addr, S: Addr>(
    d: D,
    s: S,
    len: usize,
    nt: bool,
    ahead: usize,
) -> u64 {
    // SAFETY: the caller's promises.
    whole(unsafe { kernel512_part::<STORE, D, S>(d, s, len, nt, ahead, WHOLE) })
}

/// [`kernel512`] over a part of the piece, as [`kernel_part`].
///
/// # Safety
/// As [`kernel_part`], and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel512_part<const STORE: bool, D: Addr, S: Addr>(
    mut d: D,
    mut s: S,
    len: usize,
    nt: bool,
    ahead: usize,
    part: Part,
) -> Hashed {
    use std::arch::x86_64::*;
    let (pf_end, pf) = prefetch_window(len, ahead);
    let k = SECRET.as_ptr();
    let init = part.acc.unwrap_or(INIT);
    // SAFETY (every pointer below): as in `kernel`, whose offsets these are.
    // SAFETY: `init` holds 8 u64s (64 bytes).
    let mut acc = unsafe { _mm512_loadu_si512(init.as_ptr() as *const _) };
    let accumulate = |acc: &mut __m512i, data: __m512i, sec: *const u8| {
        // SAFETY: see above; AVX-512F is enabled for this function.
        unsafe {
            let key = _mm512_loadu_si512(sec as *const _);
            let dk = _mm512_xor_si512(data, key);
            let dk_hi = _mm512_shuffle_epi32::<0b00_11_00_01>(dk);
            let product = _mm512_mul_epu32(dk, dk_hi);
            let swapped = _mm512_shuffle_epi32::<0b01_00_11_10>(data);
            let sum = _mm512_add_epi64(*acc, swapped);
            *acc = _mm512_add_epi64(product, sum);
        }
    };
    let mut copy_stripe = |acc: &mut __m512i, off: usize, sec: *const u8| {
        // SAFETY: see above.
        unsafe {
            let from = s.at(off);
            if off + pf < pf_end {
                if let Some(p) = s.ahead(off, pf) {
                    // Only a hint: never faults, and reads nothing the program sees.
                    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
                }
            }
            let a = _mm512_loadu_si512(from as *const _);
            if STORE {
                let to = d.at(off);
                if nt {
                    _mm512_stream_si512(to as *mut _, a);
                } else {
                    _mm512_storeu_si512(to as *mut _, a);
                }
            }
            accumulate(acc, a, sec);
        }
    };
    let prime = _mm512_set1_epi32(PRIME32_1 as i32);
    let lanes = |acc: &__m512i| {
        let mut lanes = [0u64; 8];
        // SAFETY: `lanes` holds 64 bytes.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, *acc) };
        lanes
    };
    let done = walk(
        len,
        part.from,
        part.to,
        &mut acc,
        |acc, off, sec| copy_stripe(acc, off, k.wrapping_add(sec)),
        |acc| {
            // Scramble, with the secret's last 64 bytes.
            // SAFETY: see above.
            unsafe {
                let shifted = _mm512_srli_epi64::<47>(*acc);
                let data = _mm512_xor_si512(*acc, shifted);
                let key = _mm512_loadu_si512(k.add(128) as *const _);
                let dk = _mm512_xor_si512(data, key);
                let dk_hi = _mm512_shuffle_epi32::<0b00_11_00_01>(dk);
                let lo = _mm512_mul_epu32(dk, prime);
                let hi = _mm512_mul_epu32(dk_hi, prime);
                *acc = _mm512_add_epi64(lo, _mm512_slli_epi64::<32>(hi));
            }
        },
    );
    if part.to.is_some() {
        if STORE && nt {
            // The part's streaming stores are ordered before what the caller does next.
            _mm_sfence();
        }
        return Hashed::Part(lanes(&acc));
    }
    // SAFETY: the caller's promises (`done` ≤ `len`).
    let last = unsafe { finish_tail::<STORE, _, _>(&mut d, &mut s, done, len, nt) };
    // SAFETY: see above.
    unsafe {
        let a = _mm512_loadu_si512(last as *const _);
        accumulate(&mut acc, a, k.add(192 - STRIPE - 7));
    }
    Hashed::Whole(merge(lanes(&acc), len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    #[test]
    fn equals_xxh3_64_for_every_length_and_alignment() {
        if !available() {
            return;
        }
        let src: Vec<u8> = (0..200_000u32).map(|i| (i * 31 + i / 977) as u8).collect();
        let mut dst = vec![0u8; src.len() + 64];
        let mut lens: Vec<usize> = (MIN_LEN..1300).collect();
        lens.extend([
            2047, 2048, 2049, 4096, 65_535, 65_536, 65_537, 100_000, 131_072, 199_000,
        ]);
        // Both kernels where the CPU has AVX-512 (other tests running meanwhile may get
        // either: both give the same value).
        for avx2_only in [true, false] {
            force_avx2(avx2_only);
            check_kernel(&src, &mut dst, &lens);
        }
        force_avx2(false);
    }

    fn check_kernel(src: &[u8], dst: &mut [u8], lens: &[usize]) {
        for &n in lens {
            for (so, dof) in [(0, 0), (1, 0), (0, 3), (7, 32), (32, 32), (0, 64), (64, 64)] {
                for nt in [false, true] {
                    dst.iter_mut().for_each(|b| *b = 0);
                    let s = &src[so..so + n];
                    // The rest of `src` as what follows the piece (prefetched where the CPU's
                    // distance is not 0): no effect on the value or the copy.
                    let ahead = src.len() - so - n;
                    // SAFETY: guarded by `available()` above.
                    let h = unsafe { copy_xxh3(&mut dst[dof..dof + n], s.as_ptr(), nt, ahead) };
                    assert_eq!(h, xxh3_64(s), "{n} bytes, offsets {so}/{dof}, nt {nt}");
                    assert_eq!(&dst[dof..dof + n], s, "{n} bytes copied");
                    // SAFETY: as above.
                    let h = unsafe { xxh3_raw(s.as_ptr(), n) };
                    assert_eq!(h, xxh3_64(s), "{n} bytes hashed in place, offset {so}");
                    assert!(dst[..dof].iter().all(|&b| b == 0), "nothing before");
                    assert!(dst[dof + n..].iter().all(|&b| b == 0), "nothing after");
                }
            }
        }
    }
}

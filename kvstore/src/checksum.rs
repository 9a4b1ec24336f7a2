//! Block checksums: XXH3-64 (seed 0) of a block's bytes, the same value as `xxh3_64` of
//! xxHash. Computed by `twox-hash`, which picks its AVX2 kernel at run time (xxhash-rust picks
//! SIMD at compile time, so a portable build would run its SSE2 kernel: hashing a block that is
//! still in cache right after copying it then costs ~20% of the copy instead of ~5%). Keys keep
//! using xxhash-rust's XXH3-128.

use std::hash::Hasher;

use twox_hash::XxHash3_64;

/// Bytes hashed at a time by the fused copy-and-hash helpers: small enough to still be in
/// cache when hashed right after being copied.
pub const CHUNK: usize = 64 << 10;

/// The checksum of `data`.
pub fn checksum(data: &[u8]) -> u64 {
    XxHash3_64::oneshot(data)
}

/// A checksum computed piece by piece (the pieces back to back give the same value as
/// [`checksum`] of their concatenation).
#[derive(Default, Clone)]
pub struct Checksummer(XxHash3_64);

impl Checksummer {
    /// An empty one.
    pub fn new() -> Self {
        Self(XxHash3_64::new())
    }

    /// Adds the next piece.
    pub fn update(&mut self, piece: &[u8]) {
        self.0.write(piece);
    }

    /// The checksum of everything added.
    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// Copies `src` into `dst` (same length) and returns the checksum of the bytes, hashing each
/// chunk of the source right after copying it, while it is in cache. Large copies go with
/// non-temporal stores ([`copy_nt`]): a block is not read back soon, and streaming it past the
/// cache leaves the cache to the hash.
pub fn copy_hashed(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_hashed: lengths differ");
    let mut h = Checksummer::new();
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        copy_nt(d, s);
        h.update(s);
    }
    h.finish()
}

/// Copies `src` into `dst` (same length) and returns the checksum of the bytes, each chunk
/// hashed right after it was copied (in cache). Plain stores: for copies out of the store into
/// memory the caller uses next (an engine's KV).
pub fn copy_out_hashed(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_out_hashed: lengths differ");
    let mut h = Checksummer::new();
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        d.copy_from_slice(s);
        h.update(d);
    }
    h.finish()
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

    #[test]
    fn same_values_as_xxh3_64() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 4096) as u8).collect();
        for n in [
            0, 1, 16, 17, 128, 129, 240, 241, 1024, 65_536, 100_000, 300_000,
        ] {
            assert_eq!(checksum(&data[..n]), xxh3_64(&data[..n]), "{n} bytes");
            let mut h = Checksummer::new();
            for piece in data[..n].chunks(7_777) {
                h.update(piece);
            }
            assert_eq!(h.finish(), xxh3_64(&data[..n]), "{n} bytes in pieces");
        }
        let mut dst = vec![0u8; data.len() + 64];
        for off in [0, 1, 7, 32, 33] {
            for n in [0, 100, 4095, 4096, 4097, 70_000, 300_000] {
                dst.fill(0);
                assert_eq!(
                    copy_hashed(&mut dst[off..off + n], &data[..n]),
                    xxh3_64(&data[..n])
                );
                assert_eq!(&dst[off..off + n], &data[..n], "offset {off}, {n} bytes");
                assert!(
                    dst[..off].iter().all(|&b| b == 0) && dst[off + n..].iter().all(|&b| b == 0)
                );
                dst.fill(0);
                let got = copy_out_hashed(&mut dst[off..off + n], &data[..n]);
                assert_eq!(got, xxh3_64(&data[..n]));
                assert_eq!(&dst[off..off + n], &data[..n]);
            }
        }
    }
}

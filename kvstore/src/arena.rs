//! The host arena: one memfd-backed shared mapping, 4096-aligned, optionally huge pages and
//! pre-populated so first-touch page faults stay out of the hot path.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};

use memmap2::{MmapMut, MmapOptions};

use crate::error::ConfigError;

/// A memfd-backed shared memory region. Another process can map the same memory through
/// [`Arena::fd`].
pub struct Arena {
    map: MmapMut,
    file: File,
    huge_pages: bool,
}

impl Arena {
    /// Creates an arena of `bytes` bytes (rounded up to 4096, or 2 MiB with huge pages).
    /// `populate` faults every page in now.
    pub fn new(bytes: u64, huge_pages: bool, populate: bool) -> Result<Self, ConfigError> {
        let page: u64 = if huge_pages { 2 << 20 } else { 4096 };
        let bytes = bytes.div_ceil(page) * page;
        let err = |source: io::Error, hint: &'static str| ConfigError::Arena {
            bytes,
            source,
            hint,
        };
        // Sealing: the fd is handed to engine processes, which must not be able to shrink the
        // memfd under our mapping (the daemon's next access would die with SIGBUS).
        let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        if huge_pages {
            flags |= libc::MFD_HUGETLB;
        }
        // SAFETY: the name is a valid NUL-terminated C string and flags are valid memfd flags.
        let fd = unsafe { libc::memfd_create(c"kvtier-host-arena".as_ptr(), flags) };
        if fd < 0 {
            return Err(err(
                io::Error::last_os_error(),
                if huge_pages {
                    " (huge pages need reserved hugetlb pages: set vm.nr_hugepages, or disable huge_pages)"
                } else {
                    ""
                },
            ));
        }
        // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(bytes)
            .map_err(|e| err(e, " (is the memory cgroup or RLIMIT_FSIZE too small?)"))?;
        // Fix the size for good before anyone else sees the fd: no shrinking (SIGBUS in every
        // mapping), no growing, and no removing these seals.
        // SAFETY: fcntl on the memfd we own; F_ADD_SEALS takes an int of seal flags.
        let r = unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if r != 0 {
            return Err(err(
                io::Error::last_os_error(),
                " (sealing the memfd against resizing failed: Linux 3.17+, 4.16+ for huge pages)",
            ));
        }
        let mut opts = MmapOptions::new();
        opts.len(bytes as usize);
        // With 4 KiB pages, ask for transparent huge pages before the first touch (taken where
        // the system allows them for shared memory: `shmem_enabled` = advise or always), then
        // populate: a 1 GiB arena in 4 KiB pages costs its copies TLB misses.
        let advise_huge = !huge_pages;
        if populate && !advise_huge {
            opts.populate();
        }
        // SAFETY: the memfd is private to this process until its fd is handed out on purpose;
        // the mapping's lifetime is tied to `Arena`, and concurrent access to its bytes is
        // coordinated by the store's slot ownership (one writer per reserved slot, readers only
        // of committed slots).
        let mut map = unsafe { opts.map_mut(&file) }.map_err(|e| {
            err(
                e,
                if huge_pages {
                    " (not enough free huge pages)"
                } else {
                    ""
                },
            )
        })?;
        if advise_huge {
            note_small_pages();
            // Best effort: an older kernel or a system without shmem THP says no.
            let _ = map.advise(memmap2::Advice::HugePage);
            if populate && map.advise(memmap2::Advice::PopulateWrite).is_err() {
                // Before Linux 5.14: touch every page.
                let base = map.as_mut_ptr();
                for off in (0..map.len()).step_by(4096) {
                    // SAFETY: `off` is within the mapping, which nothing else uses yet.
                    unsafe { base.add(off).write_volatile(0) };
                }
            }
        }
        Ok(Self {
            map,
            file,
            huge_pages,
        })
    }

    /// Whether the arena is in 4 KiB pages: no hugetlb pages, and shared memory may not have
    /// transparent huge ones (`shmem_enabled` says `never` or `deny`, or cannot be read).
    /// The 2 MiB size's own setting (`hugepages-2048kB/shmem_enabled`, Linux 6.11+) wins over
    /// the global one unless it says `inherit`.
    pub fn small_pages(&self) -> bool {
        !self.huge_pages && shmem_thp().is_none_or(|(_, v)| matches!(v.as_str(), "never" | "deny"))
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the arena is empty (never, once built).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Base address (4096-aligned).
    pub fn base(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }

    /// The memfd, to pass to another process that maps the arena.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Whether the arena uses explicit huge pages.
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }
}

/// A range of arena memory that other processes map writable (the shared arena of kvtierd,
/// which every engine of the node or of the tenant maps): never a Rust reference, whose
/// aliasing rules (nobody writes while a `&[u8]` lives) another process does not keep. Bytes
/// leave it only through raw-pointer copies into private memory ([`ArenaSlice::copy_to`],
/// [`ArenaSlice::copy_to_hashed`], which hashes the private copy: what was checked is what
/// was copied), and enter it only through [`ArenaSlice::write`] by the holder of the slot's
/// reservation. A writer that scribbles over a slot meanwhile makes the copy wrong, never
/// undefined: the commit checksum of the private copy catches it.
#[derive(Clone, Copy, Debug)]
pub struct ArenaSlice<'a> {
    ptr: *mut u8,
    len: usize,
    _life: std::marker::PhantomData<&'a ()>,
}

// SAFETY: an ArenaSlice is an address range whose memory stays mapped for 'a (its creator's
// promise); every access is a raw copy, which is as sound from any thread as from one.
unsafe impl Send for ArenaSlice<'_> {}
// SAFETY: as for Send: shared access only copies through raw pointers.
unsafe impl Sync for ArenaSlice<'_> {}

impl<'a> ArenaSlice<'a> {
    /// The range `ptr..ptr + len`.
    ///
    /// # Safety
    /// The range must stay mapped (readable, and writable for [`ArenaSlice::write`]) for
    /// `'a`; others may write it at any time.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Self {
            ptr,
            len,
            _life: std::marker::PhantomData,
        }
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte's address (for DMA and I/O engines, which copy through it themselves).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// `len` bytes from `off`, or `None` past the end.
    pub fn get(&self, off: usize, len: usize) -> Option<ArenaSlice<'a>> {
        let end = off.checked_add(len)?;
        (end <= self.len).then(|| ArenaSlice {
            // SAFETY: `off <= self.len` (checked): within the range the creator vouched for.
            ptr: unsafe { self.ptr.add(off) },
            len,
            _life: std::marker::PhantomData,
        })
    }

    /// Copies bytes `off..off + dst.len()` into `dst` (private memory).
    ///
    /// # Panics
    /// If the range ends past the slice.
    pub fn copy_to(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off.checked_add(dst.len()).is_some_and(|e| e <= self.len),
            "ArenaSlice::copy_to: {}+{} past {}",
            off,
            dst.len(),
            self.len
        );
        // SAFETY: the source range is within the slice (checked) and mapped (the creator's
        // promise); `dst` is private memory the source cannot overlap (a `&mut` of ours). A
        // concurrent write by another process only changes which bytes arrive.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
    }

    /// A private copy of the whole slice.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.copy_to(0, &mut v);
        v
    }

    /// Copies the whole slice into `dst` (same length), piece by piece, and returns the
    /// checksum of what landed in `dst`, each piece hashed right after it was copied (in
    /// cache): compared with the commit checksum, it says whether `dst` holds the block.
    pub fn copy_to_hashed(&self, dst: &mut [u8]) -> u64 {
        assert_eq!(
            dst.len(),
            self.len,
            "ArenaSlice::copy_to_hashed: lengths differ"
        );
        // SAFETY: the slice's range is mapped for its life (the creator's promise) and as long
        // as `dst` (asserted); `dst` is private memory it cannot overlap. The copy reads the
        // source only through raw loads and hashes what it stored.
        unsafe { crate::checksum::copy_out_hashed_raw(dst, self.ptr) }
    }

    /// Copies the slice into `runs` (an engine's tensors: `(address, bytes)` each, back to
    /// back in canonical order), hashing it in the same pass, and returns the checksum of the
    /// bytes the runs got, which is what to compare with the commit checksum (bytes another
    /// process writes into the slice meanwhile change what the runs get and the checksum with
    /// it, never one without the other): the shared memory is read once.
    ///
    /// # Safety
    /// Each run is valid for writes of its bytes and does not overlap the arena (runs that
    /// overlap each other are written in order). The runs add up to the slice's length (else
    /// a panic).
    pub unsafe fn scatter_hashed(&self, runs: &[(usize, usize)]) -> u64 {
        // SAFETY: the slice's range is mapped for its life (the creator's promise) and read
        // only through raw loads; the caller vouched for the runs.
        unsafe { crate::checksum::scatter_hashed_raw(self.ptr, self.len, runs) }
    }

    /// The checksum of the slice as it is now, each piece hashed where it lies through raw
    /// loads (AVX2; without it, from a private copy): for a check before or beside a copy
    /// engine's read of the slot itself, which may find other bytes (a copy out checks what it
    /// copied instead: `copy_to_hashed`).
    pub fn checksum(&self) -> u64 {
        // SAFETY: the slice's range is mapped for its life (the creator's promise); it is
        // read only through raw loads.
        unsafe { crate::checksum::checksum_raw(self.ptr, self.len) }
    }

    /// Copies `src` into bytes `off..off + src.len()`.
    ///
    /// # Safety
    /// The range must be writable and this process's to fill: a reserved slot it holds (nobody
    /// else may rely on its bytes until the commit).
    ///
    /// # Panics
    /// If the range ends past the slice.
    pub unsafe fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off.checked_add(src.len()).is_some_and(|e| e <= self.len),
            "ArenaSlice::write: {}+{} past {}",
            off,
            src.len(),
            self.len
        );
        // SAFETY: within the slice (checked), writable and ours to fill (the caller's
        // promise); `src` is private memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
    }
}

impl<'a> From<&'a [u8]> for ArenaSlice<'a> {
    /// Private memory seen as a slice of it (a store inside the engine's own process, a test's
    /// buffer): read-only through it.
    fn from(s: &'a [u8]) -> Self {
        Self {
            ptr: s.as_ptr() as *mut u8,
            len: s.len(),
            _life: std::marker::PhantomData,
        }
    }
}

/// A heap buffer aligned to 4096 bytes and touched once at creation, for benchmark and test
/// buffers and for O_DIRECT I/O. A plain `Vec<u8>` is not aligned enough for fast copies.
pub struct AlignedBuf {
    map: MmapMut,
    /// Where the buffer starts in the mapping.
    off: usize,
    len: usize,
}

impl AlignedBuf {
    /// A zero-filled buffer of `len` bytes whose pages are already faulted in.
    pub fn new(len: usize) -> io::Result<Self> {
        let mut map = MmapOptions::new().len(len.max(1)).populate().map_anon()?;
        // Touch every page: MAP_POPULATE is a hint, and a written page is never a zero-page alias.
        for page in map.chunks_mut(4096) {
            page[0] = 0;
        }
        Ok(Self { map, off: 0, len })
    }

    /// [`AlignedBuf::new`] asking for transparent huge pages before the first touch (granted
    /// for private memory where `transparent_hugepage/enabled` is `madvise` or `always`, the
    /// usual settings; 4 KiB pages otherwise).
    /// The buffer starts on a 2 MiB boundary (the mapping is 2 MiB longer and the buffer
    /// begins at its first boundary), so that each 2 MiB of it can be one huge page.
    pub fn new_huge(len: usize) -> io::Result<Self> {
        const HUGE: usize = 2 << 20;
        let mut map = MmapOptions::new().len(len.max(1) + HUGE).map_anon()?;
        let off = (map.as_ptr() as usize).next_multiple_of(HUGE) - map.as_ptr() as usize;
        // Best effort: a kernel without THP says no and the pages are small.
        let _ = map.advise_range(memmap2::Advice::HugePage, off, len.max(1));
        for page in map[off..off + len].chunks_mut(4096) {
            page[0] = 0;
        }
        Ok(Self { map, off, len })
    }

    /// Whether private memory can get transparent huge pages when asked for them
    /// (`transparent_hugepage/enabled` is `madvise` or `always`).
    pub fn huge_pages_available() -> bool {
        thp_setting(ANON_THP).is_some_and(|v| v == "madvise" || v == "always")
    }

    /// Fills the buffer with a deterministic pattern derived from `seed`.
    pub fn fill_pattern(&mut self, seed: u64) {
        fill_pattern(self, seed);
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.off..self.off + self.len]
    }
}

/// Fills `buf` with a cheap deterministic pattern (splitmix64 of `seed` and the word index), so
/// a test can check bytes without keeping a copy.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut words = buf.chunks_exact_mut(8);
    for (i, w) in (&mut words).enumerate() {
        w.copy_from_slice(&splitmix(seed ^ (i as u64).wrapping_mul(0x9E37_79B9)).to_le_bytes());
    }
    let rem = words.into_remainder();
    let tail = splitmix(!seed).to_le_bytes();
    let n = rem.len();
    rem.copy_from_slice(&tail[..n]);
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_buffer_starts_on_a_huge_page_and_is_zeroed() {
        for len in [4 << 20, (6 << 20) + 4096] {
            let mut b = AlignedBuf::new_huge(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(
                b.as_ptr() as usize % (2 << 20),
                0,
                "not on a 2 MiB boundary"
            );
            assert!(b.iter().all(|&x| x == 0));
            b.fill_pattern(3);
            let mut want = vec![0u8; len];
            fill_pattern(&mut want, 3);
            assert!(b[..] == want[..]);
        }
    }

    #[test]
    fn arena_is_aligned_shared_and_rounded() {
        let a = Arena::new(10_000, false, true).unwrap();
        assert_eq!(a.len(), 12_288);
        assert_eq!(a.base() as usize % 4096, 0);
        // The memfd maps the same bytes a second time.
        let f = File::from(a.fd().try_clone_to_owned().unwrap());
        // SAFETY: test-only second mapping; we only read after writing through the first one.
        let m2 = unsafe { MmapOptions::new().len(a.len()).map(&f) }.unwrap();
        // SAFETY: in bounds of the arena; no other reference to this byte exists.
        unsafe { a.base().add(5000).write(42) };
        assert_eq!(m2[5000], 42);
    }

    #[test]
    fn arena_memfd_cannot_be_resized() {
        let a = Arena::new(1 << 20, false, true).unwrap();
        let f = File::from(a.fd().try_clone_to_owned().unwrap());
        let e = f.set_len(0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        let e = f.set_len(2 << 20).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        // SAFETY: fcntl on a valid fd.
        let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
        let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        assert_eq!(seals & want, want);
        // Still fully usable.
        // SAFETY: in bounds of the arena.
        unsafe { a.base().add(a.len() - 1).write(1) };
    }

    #[test]
    fn aligned_buf() {
        let mut b = AlignedBuf::new(10_001).unwrap();
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert_eq!(b.len(), 10_001);
        b.fill_pattern(3);
        let mut c = vec![0u8; 10_001];
        fill_pattern(&mut c, 3);
        assert_eq!(&b[..], &c[..]);
        fill_pattern(&mut c, 4);
        assert_ne!(&b[..], &c[..]);
    }
}

#[cfg(test)]
mod arena_slice_tests {
    use super::*;

    #[test]
    fn an_arena_slice_copies_out_checks_what_it_copied_and_refuses_out_of_range() {
        let a = Arena::new(1 << 20, false, true).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 4096) as u8).collect();
        // SAFETY: the first 300,000 bytes of the arena, mapped while `a` lives; this test is
        // its only writer.
        let s = unsafe { ArenaSlice::new(a.base(), data.len()) };
        // SAFETY: as above: ours to fill.
        unsafe { s.write(0, &data) };
        let mut out = vec![0u8; data.len()];
        assert_eq!(s.copy_to_hashed(&mut out), crate::checksum(&data));
        assert_eq!(out, data);
        assert_eq!(s.to_vec(), data);
        assert_eq!(s.checksum(), crate::checksum(&data));
        // Every length, fused kernel or not: short pieces, a piece's edge, a short last piece.
        for n in [
            1,
            240,
            241,
            4096,
            65_536,
            65_537,
            65_536 + 240,
            131_072 + 241,
        ] {
            let mut o = vec![0u8; n];
            let part = s.get(7, n).unwrap();
            assert_eq!(
                part.copy_to_hashed(&mut o),
                crate::checksum(&data[7..7 + n]),
                "{n}"
            );
            assert_eq!(o, &data[7..7 + n]);
            assert_eq!(part.checksum(), crate::checksum(&data[7..7 + n]), "{n}");
            // Into runs (an engine's tensors, here in one private buffer with gaps): the same
            // checksum, the same bytes. Runs of whole stripes, and runs that are not.
            for run in [4096, 1000] {
                let gap = 64;
                let mut buf = vec![0u8; n + (n / run + 1) * gap];
                let mut runs = Vec::new();
                let (mut at, mut left) = (0, n);
                while left > 0 {
                    let k = run.min(left);
                    runs.push((buf.as_mut_ptr() as usize + at, k));
                    at += k + gap;
                    left -= k;
                }
                // SAFETY: each run lies in `buf` (private, apart from the arena), none
                // overlapping another; they add up to `n`.
                let sum = unsafe { part.scatter_hashed(&runs) };
                assert_eq!(
                    sum,
                    crate::checksum(&data[7..7 + n]),
                    "{n} in runs of {run}"
                );
                let got: Vec<u8> = runs
                    .iter()
                    .flat_map(|&(a, k)| {
                        let off = a - buf.as_ptr() as usize;
                        buf[off..off + k].to_vec()
                    })
                    .collect();
                assert_eq!(got, &data[7..7 + n]);
            }
        }
        assert_eq!(s.get(0, 0).unwrap().checksum(), crate::checksum(&[]));
        let mid = s.get(70_000, 10).unwrap();
        assert_eq!(mid.to_vec(), &data[70_000..70_010]);
        assert!(s.get(299_995, 10).is_none() && s.get(usize::MAX, 2).is_none());
        // A write by "another process" (a second mapping) between two copies changes what
        // the second copy gets, and its hash says so.
        let fd = File::from(a.fd().try_clone_to_owned().unwrap());
        // SAFETY: a second shared mapping of the same memfd, as an engine maps it.
        let mut other = unsafe { MmapOptions::new().map_mut(&fd) }.unwrap();
        other[100] ^= 0xff;
        assert_ne!(s.copy_to_hashed(&mut out), crate::checksum(&data));
        let r = std::panic::catch_unwind(|| {
            let mut big = vec![0u8; 11];
            mid.copy_to(0, &mut big);
        });
        assert!(r.is_err(), "a copy past the end must panic");
    }
}

const SHMEM_THP: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
const SHMEM_THP_2M: &str = "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled";
const ANON_THP: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// The selected value of a transparent-huge-page setting (the one in brackets), if readable.
fn thp_setting(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    Some(s.split('[').nth(1)?.split(']').next()?.to_string())
}

/// Shared memory's setting for 2 MiB pages and the file it is read from: the size's own
/// (Linux 6.11+) unless it says `inherit`, else the global one.
fn shmem_thp() -> Option<(&'static str, String)> {
    thp_setting(SHMEM_THP_2M)
        .filter(|v| v != "inherit")
        .map(|v| (SHMEM_THP_2M, v))
        .or_else(|| thp_setting(SHMEM_THP).map(|v| (SHMEM_THP, v)))
}

/// Says once per process, when the system gives shared memory no transparent huge pages, what
/// that costs and how to change it.
fn note_small_pages() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Some((path, value)) = shmem_thp() else {
            return;
        };
        if matches!(value.as_str(), "never" | "deny") {
            // A hint, not a fault: the daemon's default log level shows it. `path` is the file
            // the setting came from (the 2 MiB size's own where it does not inherit).
            let bounce_mib = crate::disk::BOUNCE_BYTES >> 20;
            tracing::info!(
                setting = path,
                value = value.as_str(),
                "host arena in 4 KiB pages: copies out of it run about 10-30% below memcpy (TLB \
                 misses) on this kind of machine, and a disk tier reads and writes through up \
                 to {bounce_mib} MiB of huge-page bounce buffers. Allow shared-memory huge \
                 pages (echo advise > {path}; kvtier asks for them) or reserve hugetlb pages \
                 and set host.huge_pages"
            );
        }
    });
}

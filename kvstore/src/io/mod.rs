//! I/O engines for the disk tier.
//!
//! An engine *takes* each request's buffer and hands it back in the completion, the shape
//! io_uring needs (the kernel owns the memory while the I/O is in flight) and the shape that keeps
//! it sound. Two engines: [`uring::UringEngine`] (io_uring on a dedicated thread, registered files
//! and fixed buffers) and [`psync::PsyncEngine`] (pread/pwrite on a small thread pool). The choice
//! is made at run time by [`open_engine`]. [`fault::FaultEngine`] wraps either to inject errors.

use std::fs::File;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use crossbeam_channel::Sender;

use crate::arena::AlignedBuf;

pub mod fault;
pub mod psync;
pub mod uring;

/// Alignment of offsets, lengths and buffer addresses for O_DIRECT.
pub const ALIGN: usize = 4096;

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// Read from the file into the buffer.
    Read,
    /// Write the buffer to the file.
    Write,
}

/// Memory an engine reads into or writes from, owned by the engine while the I/O is in flight.
pub struct IoBuf {
    ptr: NonNull<u8>,
    cap: usize,
    owned: Option<AlignedBuf>,
}

// SAFETY: an IoBuf is either an owned AlignedBuf (Send) or raw memory whose creator promised, in
// `from_raw`, exclusive use by the holder of this IoBuf until it is handed back.
unsafe impl Send for IoBuf {}

impl IoBuf {
    /// Wraps an owned aligned buffer.
    pub fn owned(mut b: AlignedBuf) -> Self {
        let cap = b.len();
        let ptr = NonNull::new(b.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Self {
            ptr,
            cap,
            owned: Some(b),
        }
    }

    /// Wraps raw memory, e.g. a reserved or pinned slot of the host arena.
    ///
    /// # Safety
    /// `ptr..ptr+cap` must stay valid until this `IoBuf` is handed back and dropped; nobody else
    /// may write it meanwhile, and for reads nobody else may read it either.
    pub unsafe fn from_raw(ptr: *mut u8, cap: usize) -> Self {
        Self {
            ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
            cap,
            owned: None,
        }
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Capacity in bytes.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The owned buffer back, if it was one.
    pub fn into_owned(self) -> Option<AlignedBuf> {
        self.owned
    }
}

/// One read or write of `len` bytes at `offset` of file `file`.
pub struct IoReq {
    /// Read or write.
    pub kind: IoKind,
    /// Index into the engine's file list.
    pub file: u32,
    /// Byte offset, a multiple of [`ALIGN`].
    pub offset: u64,
    /// Bytes to transfer, a multiple of [`ALIGN`], at most `buf.cap()`.
    pub len: u32,
    /// The memory.
    pub buf: IoBuf,
    /// Caller's tag, returned in the completion.
    pub tag: u64,
}

/// A finished request: the request (with its buffer) and the outcome. `Ok` means every byte was
/// transferred; a short transfer the engine could not complete is an error.
pub struct IoDone {
    /// The request, buffer included.
    pub req: IoReq,
    /// The outcome.
    pub result: io::Result<()>,
}

/// An I/O engine.
pub trait IoEngine: Send + Sync {
    /// `io_uring` or `psync` (or a wrapper's name).
    fn name(&self) -> &'static str;
    /// Most requests in flight at once.
    fn queue_depth(&self) -> u32;
    /// Queues requests; each completion is sent to `done` (in any order).
    fn submit(&self, reqs: Vec<IoReq>, done: Sender<IoDone>);
    /// Registers memory regions for faster I/O (io_uring fixed buffers), in the background;
    /// a no-op for engines without such a notion. The regions must stay mapped for the
    /// engine's life.
    fn register_buffers(&self, _regions: Vec<(usize, usize)>) {}
}

/// Checks O_DIRECT alignment rules; engines complete a bad request with this error unsent.
pub(crate) fn check(req: &IoReq, files: usize) -> io::Result<()> {
    let bad = |what: String| Err(io::Error::new(io::ErrorKind::InvalidInput, what));
    if req.file as usize >= files {
        return bad(format!(
            "file index {} out of range ({files} files)",
            req.file
        ));
    }
    if !req.offset.is_multiple_of(ALIGN as u64)
        || !(req.len as usize).is_multiple_of(ALIGN)
        || req.len == 0
    {
        return bad(format!(
            "offset {} and length {} must be non-zero multiples of {ALIGN}",
            req.offset, req.len
        ));
    }
    if !(req.buf.as_ptr() as usize).is_multiple_of(ALIGN) || req.len as usize > req.buf.cap() {
        return bad(format!(
            "buffer at {:p} ({} bytes) must be {ALIGN}-aligned and hold {} bytes",
            req.buf.as_ptr(),
            req.buf.cap(),
            req.len
        ));
    }
    Ok(())
}

/// Which engine to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IoEngineKind {
    /// io_uring, falling back to psync (logged once) when the kernel refuses it.
    #[default]
    Auto,
    /// io_uring only; an error if unavailable.
    Uring,
    /// pread/pwrite on a thread pool.
    Psync,
}

impl IoEngineKind {
    /// Parses `auto`, `io_uring`/`uring`, `psync`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "io_uring" | "uring" | "io-uring" => Some(Self::Uring),
            "psync" | "pread" => Some(Self::Psync),
            _ => None,
        }
    }
}

/// Engine settings.
#[derive(Clone, Debug)]
pub struct IoConfig {
    /// Which engine.
    pub kind: IoEngineKind,
    /// Requests in flight at most.
    pub queue_depth: u32,
    /// io_uring: a kernel thread polls the submission queue.
    pub sqpoll: bool,
    /// io_uring: memory regions to register as fixed buffers (e.g. the host arena). Requests
    /// whose buffer lies inside one use READ_FIXED / WRITE_FIXED.
    pub fixed_buffers: Vec<(usize, usize)>,
    /// Do not register `fixed_buffers` at open (registering pins, and so faults in, every
    /// page): the owner calls [`IoEngine::register_buffers`] once the memory is populated.
    pub defer_fixed_buffers: bool,
}

impl Default for IoConfig {
    fn default() -> Self {
        Self {
            kind: IoEngineKind::Auto,
            queue_depth: 32,
            sqpoll: false,
            fixed_buffers: Vec::new(),
            defer_fixed_buffers: false,
        }
    }
}

/// Opens the configured engine over `files`.
pub fn open_engine(files: Vec<File>, cfg: &IoConfig) -> io::Result<Arc<dyn IoEngine>> {
    let qd = cfg.queue_depth.clamp(1, 4096);
    match cfg.kind {
        IoEngineKind::Psync => Ok(Arc::new(psync::PsyncEngine::new(files, qd))),
        IoEngineKind::Uring => Ok(Arc::new(uring::UringEngine::new(files, qd, cfg)?)),
        IoEngineKind::Auto => {
            let clones: io::Result<Vec<File>> = files.iter().map(|f| f.try_clone()).collect();
            match uring::UringEngine::new(files, qd, cfg) {
                Ok(e) => Ok(Arc::new(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring unavailable: using the psync engine");
                    Ok(Arc::new(psync::PsyncEngine::new(clones?, qd)))
                }
            }
        }
    }
}

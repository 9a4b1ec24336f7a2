//! GPU gather/scatter (feature `cuda`): the engine's paged KV lives in device memory, kvtier's
//! blocks in host memory (ideally pinned: the shared arena or a registered store slot). Each
//! block is a handful of strided 2D pieces ([`PagedKv::pieces`]), each one `cuMemcpy2DAsync` on
//! a dedicated stream that can be ordered after the engine's compute stream. The CUDA driver is
//! loaded at run time: this builds and links without CUDA, and [`driver_present`] says whether
//! one can be used (creating a context without it would panic).

use std::sync::Arc;

use cudarc::driver::sys::{self, CUmemorytype, CUDA_MEMCPY2D};
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use crate::layout::{LayoutError, PagedKv, Piece};

/// Why a GPU copy failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaCopyError {
    /// No CUDA driver library on this machine.
    #[error("no CUDA driver (libcuda) on this machine")]
    NoDriver,
    /// The driver refused.
    #[error("CUDA driver: {0:?}")]
    Driver(#[from] DriverError),
    /// Block ids or sizes do not fit the layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// Whether the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// Copies between device KV tensors and host blocks on its own stream.
pub struct CudaCopier {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The device's largest 2D-copy pitch: pieces never have rows farther apart.
    max_pitch: usize,
}

enum Dir {
    DeviceToHost(*mut u8),
    HostToDevice(*const u8),
}

impl CudaCopier {
    /// A copier on GPU `ordinal` (its primary context) with a fresh stream.
    pub fn new(ordinal: usize) -> Result<Self, CudaCopyError> {
        if !driver_present() {
            return Err(CudaCopyError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let max_pitch =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)? as usize;
        Ok(Self {
            ctx,
            stream,
            max_pitch,
        })
    }

    /// The copy stream (e.g. for tests that allocate on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes later copies wait for the work queued so far on the engine's stream (a raw
    /// `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`), without blocking the host.
    ///
    /// # Safety
    /// `engine_stream` must be a live stream of this copier's context (0 = the legacy default).
    pub unsafe fn order_after(&self, engine_stream: usize) -> Result<(), CudaCopyError> {
        self.ctx.bind_to_thread()?;
        let ev = self.ctx.new_event(None)?;
        // SAFETY: the event is live (owned above); the stream is the caller's (contract).
        unsafe { sys::cuEventRecord(ev.cu_event(), engine_stream as sys::CUstream) }.result()?;
        self.stream.wait(&ev)?;
        Ok(())
    }

    fn submit(&self, pieces: &[Piece], dir: Dir) -> Result<(), CudaCopyError> {
        self.ctx.bind_to_thread()?;
        let r = self.submit_all(pieces, dir);
        if r.is_err() {
            // Copies already queued still target the caller's buffers: let them finish before
            // the caller reuses or frees them.
            let _ = self.stream.synchronize();
        }
        r
    }

    fn submit_all(&self, pieces: &[Piece], dir: Dir) -> Result<(), CudaCopyError> {
        for p in pieces {
            // SAFETY: an all-zero CUDA_MEMCPY2D is a valid (empty) descriptor: plain integers
            // and null pointers; every field used is set below.
            let mut c: CUDA_MEMCPY2D = unsafe { std::mem::zeroed() };
            c.WidthInBytes = p.width;
            c.Height = p.rows;
            match dir {
                Dir::DeviceToHost(host) => {
                    c.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
                    c.srcDevice = p.src as sys::CUdeviceptr;
                    c.srcPitch = p.pitch;
                    c.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_HOST;
                    c.dstHost = host.wrapping_add(p.at).cast();
                    c.dstPitch = p.width;
                }
                Dir::HostToDevice(host) => {
                    c.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_HOST;
                    c.srcHost = host.wrapping_add(p.at).cast();
                    c.srcPitch = p.width;
                    c.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_DEVICE;
                    c.dstDevice = p.src as sys::CUdeviceptr;
                    c.dstPitch = p.pitch;
                }
            }
            // SAFETY: the descriptor names device memory inside the registered tensors and host
            // memory inside the caller's buffer (both per the callers' contracts), and the
            // stream belongs to the bound context.
            unsafe { sys::cuMemcpy2DAsync_v2(&c, self.stream.cu_stream()) }.result()?;
        }
        Ok(())
    }

    /// Queues the copy of engine blocks `ids` (device) into `dst` (host, canonical form).
    ///
    /// # Safety
    /// `paged` must describe device memory of this copier's GPU that stays valid, and is not
    /// written, until [`CudaCopier::synchronize`] returns; `dst` must stay valid and untouched
    /// until then too (pinned host memory makes the copy asynchronous; pageable memory works
    /// but serialises).
    pub unsafe fn gather(
        &self,
        paged: &PagedKv,
        ids: &[usize],
        dst: &mut [u8],
    ) -> Result<(), CudaCopyError> {
        if dst.len() != ids.len() * paged.block_bytes() {
            return Err(LayoutError::Size {
                want: ids.len() * paged.block_bytes(),
                got: dst.len(),
            }
            .into());
        }
        self.submit(
            &paged.pieces(ids, self.max_pitch)?,
            Dir::DeviceToHost(dst.as_mut_ptr()),
        )
    }

    /// Queues the copy of `src` (host, canonical form) into engine blocks `ids` (device).
    ///
    /// # Safety
    /// As [`CudaCopier::gather`], with the engine blocks written and `src` read.
    pub unsafe fn scatter(
        &self,
        paged: &PagedKv,
        ids: &[usize],
        src: &[u8],
    ) -> Result<(), CudaCopyError> {
        if src.len() != ids.len() * paged.block_bytes() {
            return Err(LayoutError::Size {
                want: ids.len() * paged.block_bytes(),
                got: src.len(),
            }
            .into());
        }
        self.submit(
            &paged.pieces(ids, self.max_pitch)?,
            Dir::HostToDevice(src.as_ptr()),
        )
    }

    /// Waits for every queued copy.
    pub fn synchronize(&self) -> Result<(), CudaCopyError> {
        Ok(self.stream.synchronize()?)
    }
}

//! GPU gather/scatter (feature `cuda`): the engine's paged KV lives in device memory, kvtier's
//! blocks in host memory (ideally pinned: the shared arena or a registered store slot). Each
//! block is a handful of strided 2D pieces ([`PagedKv::pieces`]), each one `cuMemcpy2DAsync` on
//! a dedicated stream that can be ordered after the engine's compute stream. The CUDA driver is
//! loaded at run time: this builds and links without CUDA, and [`driver_present`] says whether
//! one can be used (creating a context without it would panic).
//!
//! Ordering with the engine: a save's copy waits for an event recorded on the engine's stream
//! right after the layer's attention was queued ([`CudaCopier::record_on`],
//! [`CudaCopier::wait_for`]); a load records an event per layer on the copy stream
//! ([`CudaCopier::record`]) that the engine's stream waits on before the layer runs
//! ([`CudaCopier::make_wait`]). Host memory the copies use is registered with the driver
//! ([`CudaCopier::register`]: page-locked, so the copies are DMA straight to and from it).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUmemorytype, CUDA_MEMCPY2D};
pub use cudarc::driver::CudaEvent;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use crate::layout::{Copy2D, LayoutError, PagedKv, Piece};

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

/// Copies between device KV tensors and host blocks on streams of its own: one for saves
/// (device to host), one for loads (host to device), so a load never queues behind a save
/// waiting for a layer's attention. (One stream per direction runs the coalesced 2D copies at
/// 0.97-0.98 of torch's 1D pinned copies on an H200; spreading their rows over 2 or 4 streams
/// measured no faster, loads slower: bench/RESULTS.md.)
pub struct CudaCopier {
    ctx: Arc<CudaContext>,
    saves: Arc<CudaStream>,
    loads: Arc<CudaStream>,
    /// The device's largest 2D-copy pitch: pieces never have rows farther apart.
    max_pitch: usize,
}

enum Dir {
    DeviceToHost(*mut u8),
    HostToDevice(*const u8),
}

impl CudaCopier {
    /// A copier on GPU `ordinal` (its primary context) with fresh streams.
    pub fn new(ordinal: usize) -> Result<Self, CudaCopyError> {
        if !driver_present() {
            return Err(CudaCopyError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        let saves = ctx.new_stream()?;
        let loads = ctx.new_stream()?;
        let max_pitch =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)? as usize;
        Ok(Self {
            ctx,
            saves,
            loads,
            max_pitch,
        })
    }

    /// The saves' stream (e.g. for tests that allocate on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.saves
    }

    fn stream_for(&self, to_host: bool) -> &Arc<CudaStream> {
        if to_host {
            &self.saves
        } else {
            &self.loads
        }
    }

    /// Waits for a stream's copies with raw driver calls (cudarc's own `synchronize` first
    /// reports, and clears, an error an earlier drop recorded, without waiting), once more
    /// if the first attempt fails. An error means the copies may still be running: the caller
    /// must then not free, unmap or unregister the memory they use.
    fn sync(&self, s: &CudaStream) -> Result<(), CudaCopyError> {
        let mut last = Ok(());
        for _ in 0..2 {
            // SAFETY: the context and the stream are live (held by `self`).
            last = unsafe { sys::cuCtxSetCurrent(self.ctx.cu_ctx()) }
                .result()
                .and_then(|()| unsafe { sys::cuStreamSynchronize(s.cu_stream()) }.result());
            if last.is_ok() {
                break;
            }
        }
        Ok(last?)
    }

    fn submit(&self, pieces: &[Piece], dir: Dir) -> Result<(), CudaCopyError> {
        self.ctx.bind_to_thread()?;
        let stream = self.stream_for(matches!(dir, Dir::DeviceToHost(_)));
        let r = self.submit_all(pieces, dir, stream);
        if r.is_err() {
            // Copies already queued still target the caller's buffers: let them finish before
            // the caller reuses or frees them.
            self.sync(stream)?;
        }
        r
    }

    fn submit_all(
        &self,
        pieces: &[Piece],
        dir: Dir,
        stream: &CudaStream,
    ) -> Result<(), CudaCopyError> {
        let (to_host, host) = match dir {
            Dir::DeviceToHost(h) => (true, h as usize),
            Dir::HostToDevice(h) => (false, h as usize),
        };
        for p in pieces {
            let c = memcpy_2d(
                to_host,
                p.src,
                p.pitch,
                host.wrapping_add(p.at),
                p.width,
                p.width,
                p.rows,
            );
            // SAFETY: the descriptor names device memory inside the registered tensors and host
            // memory inside the caller's buffer (both per the callers' contracts), and the
            // stream belongs to the bound context.
            unsafe { sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) }.result()?;
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
        check_len(paged, ids, dst.len())?;
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
        check_len(paged, ids, src.len())?;
        self.submit(
            &paged.pieces(ids, self.max_pitch)?,
            Dir::HostToDevice(src.as_ptr()),
        )
    }

    /// Queues the copies of layers `layers` of several transfers at once, each `(engine block
    /// ids (device), host address of their canonical form)`: device to host (`to_host`) or
    /// back. Runs are coalesced across transfers ([`PagedKv::copies_2d`]): a layer of many
    /// consecutive blocks into evenly laid out slots is a few 2D copies, not one per block.
    ///
    /// # Safety
    /// As [`CudaCopier::gather`], for every transfer's canonical form in host memory (each
    /// `ids.len() * block_bytes` bytes at its address).
    pub unsafe fn copy_many(
        &self,
        paged: &PagedKv,
        transfers: &[(&[usize], usize)],
        layers: Range<usize>,
        to_host: bool,
    ) -> Result<usize, CudaCopyError> {
        let copies = paged.copies_2d(transfers, layers, self.max_pitch)?;
        self.ctx.bind_to_thread()?;
        let stream = self.stream_for(to_host);
        let r = self.submit_2d(&copies, to_host, stream);
        if r.is_err() {
            // Copies already queued still target the caller's buffers.
            self.sync(stream)?;
        }
        r.map(|()| copies.len())
    }

    fn submit_2d(
        &self,
        copies: &[Copy2D],
        to_host: bool,
        stream: &CudaStream,
    ) -> Result<(), CudaCopyError> {
        for p in copies {
            let c = memcpy_2d(
                to_host,
                p.dev,
                p.dev_pitch,
                p.host,
                p.host_pitch,
                p.width,
                p.height,
            );
            // SAFETY: device memory inside the registered tensors and host memory inside the
            // callers' buffers (both per `copy_many`'s contract); the stream belongs to the
            // bound context.
            unsafe { sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) }.result()?;
        }
        Ok(())
    }

    /// An event completed once every load (host to device) queued so far is done.
    pub fn record(&self) -> Result<CudaEvent, CudaCopyError> {
        let ev = self.ctx.new_event(None)?;
        ev.record(&self.loads)?;
        Ok(ev)
    }

    /// An event completed once the work queued so far on the engine's stream is done (e.g.
    /// right after a layer's attention was queued: the layer's KV is written when it fires).
    ///
    /// # Safety
    /// `engine_stream` must be a live stream of this copier's context (0 = the legacy default).
    pub unsafe fn record_on(&self, engine_stream: usize) -> Result<CudaEvent, CudaCopyError> {
        self.ctx.bind_to_thread()?;
        let ev = self.ctx.new_event(None)?;
        // SAFETY: the event is live (owned above); the stream is the caller's (contract).
        unsafe { sys::cuEventRecord(ev.cu_event(), engine_stream as sys::CUstream) }.result()?;
        Ok(ev)
    }

    /// Makes saves (`to_host`) or loads queued from now on wait for `ev` (without blocking the
    /// host).
    pub fn wait_for(&self, ev: &CudaEvent, to_host: bool) -> Result<(), CudaCopyError> {
        self.ctx.bind_to_thread()?;
        Ok(self.stream_for(to_host).wait(ev)?)
    }

    /// Makes work queued on the engine's stream from now on wait for `ev` (e.g. a layer's
    /// load), without blocking the host.
    ///
    /// # Safety
    /// `engine_stream` must be a live stream of this copier's context (0 = the legacy default).
    pub unsafe fn make_wait(
        &self,
        ev: &CudaEvent,
        engine_stream: usize,
    ) -> Result<(), CudaCopyError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the event is live (borrowed); the stream is the caller's (contract).
        unsafe { sys::cuStreamWaitEvent(engine_stream as sys::CUstream, ev.cu_event(), 0) }
            .result()?;
        Ok(())
    }

    /// Registers `len` bytes at `ptr` with the driver (page-locked, usable from every
    /// context): copies to and from them are DMA, with no staging copy. Unregistered when the
    /// returned value is dropped. Memory registered already is an error (a registration that
    /// outlived its mapping would send DMA to other pages).
    ///
    /// # Safety
    /// The memory must stay mapped until the returned value is dropped, and every copy queued
    /// into or out of it must have completed before then.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<Registered, CudaCopyError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the caller's contract (mapped for the registration's life).
        let r =
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        r.result()?;
        Ok(Registered {
            ctx: self.ctx.clone(),
            ptr: ptr as usize,
        })
    }

    /// Waits for every queued copy, saves and loads (see [`CudaCopier::sync`]: an error means
    /// copies may still be running).
    pub fn synchronize(&self) -> Result<(), CudaCopyError> {
        self.sync(&self.saves)?;
        self.sync(&self.loads)
    }

    /// Waits for the queued saves (device to host).
    pub fn synchronize_saves(&self) -> Result<(), CudaCopyError> {
        self.sync(&self.saves)
    }

    /// Waits for the queued loads (host to device).
    pub fn synchronize_loads(&self) -> Result<(), CudaCopyError> {
        self.sync(&self.loads)
    }
}

/// The descriptor of one 2D copy between device memory (`dev`, rows `dev_pitch` apart) and
/// host memory (`host`, rows `host_pitch` apart), `height` rows of `width` bytes, device to
/// host when `to_host`. Every field is set: an all-zero descriptor is not a valid value (its
/// memory types are enums with no zero), and `mem::zeroed` of one aborts the process.
#[allow(clippy::too_many_arguments)]
fn memcpy_2d(
    to_host: bool,
    dev: usize,
    dev_pitch: usize,
    host: usize,
    host_pitch: usize,
    width: usize,
    height: usize,
) -> CUDA_MEMCPY2D {
    let (device, host_side) = (
        CUmemorytype::CU_MEMORYTYPE_DEVICE,
        CUmemorytype::CU_MEMORYTYPE_HOST,
    );
    CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: if to_host { device } else { host_side },
        srcHost: if to_host {
            std::ptr::null()
        } else {
            host as *const std::ffi::c_void
        },
        srcDevice: if to_host { dev as sys::CUdeviceptr } else { 0 },
        srcArray: std::ptr::null_mut(),
        srcPitch: if to_host { dev_pitch } else { host_pitch },
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: if to_host { host_side } else { device },
        dstHost: if to_host {
            host as *mut std::ffi::c_void
        } else {
            std::ptr::null_mut()
        },
        dstDevice: if to_host { 0 } else { dev as sys::CUdeviceptr },
        dstArray: std::ptr::null_mut(),
        dstPitch: if to_host { host_pitch } else { dev_pitch },
        WidthInBytes: width,
        Height: height,
    }
}

fn check_len(paged: &PagedKv, ids: &[usize], len: usize) -> Result<(), CudaCopyError> {
    let want = ids.len() * paged.block_bytes();
    if len != want {
        return Err(LayoutError::Size { want, got: len }.into());
    }
    Ok(())
}

/// Host memory registered with the CUDA driver, unregistered when dropped. (Whoever drops it
/// first waits for the copies that use the memory; if that wait failed, it leaks it instead.)
pub struct Registered {
    ctx: Arc<CudaContext>,
    ptr: usize,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Raw calls: cudarc's bind first reports an error an earlier drop recorded, and the
        // registration must go before its memory is unmapped whatever that was.
        // SAFETY: the context is live (held); the memory was registered by `register` and not
        // unregistered since; the registration's contract says no copy into or out of it is
        // still queued.
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx.cu_ctx());
            let _ = sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_2d_copy_descriptor_sets_each_side_by_its_memory_type() {
        // (Built without a GPU: the descriptor used to be an all-zero value, which aborted the
        // process at the first copy.)
        let d2h = memcpy_2d(true, 0x7000, 4096, 0x1000, 256, 256, 3);
        assert_eq!(d2h.srcMemoryType, CUmemorytype::CU_MEMORYTYPE_DEVICE);
        assert_eq!((d2h.srcDevice, d2h.srcPitch), (0x7000, 4096));
        assert_eq!(d2h.dstMemoryType, CUmemorytype::CU_MEMORYTYPE_HOST);
        assert_eq!((d2h.dstHost as usize, d2h.dstPitch), (0x1000, 256));
        assert_eq!((d2h.WidthInBytes, d2h.Height), (256, 3));
        let h2d = memcpy_2d(false, 0x7000, 4096, 0x1000, 256, 128, 2);
        assert_eq!(h2d.srcMemoryType, CUmemorytype::CU_MEMORYTYPE_HOST);
        assert_eq!((h2d.srcHost as usize, h2d.srcPitch), (0x1000, 256));
        assert_eq!(h2d.dstMemoryType, CUmemorytype::CU_MEMORYTYPE_DEVICE);
        assert_eq!((h2d.dstDevice, h2d.dstPitch), (0x7000, 4096));
        assert_eq!((h2d.WidthInBytes, h2d.Height), (128, 2));
    }
}

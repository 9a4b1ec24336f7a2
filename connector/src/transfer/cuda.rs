//! The GPU side of the one transfer API (feature `cuda`): the same saves and loads, with the
//! engine's paged KV in device memory and the copies queued on a [`CudaCopier`]'s stream, DMA
//! straight to and from the store's (or kvtierd's shared) arena once it is registered
//! ([`Backend::pin_for_cuda`]). Saves go through the layer-by-layer save (a whole-request save
//! is every layer at once); a block is committed only after its copies completed. Loads pin
//! every block, queue each layer's copies and record an event per layer, verify the blocks on
//! the host while the copies run (or first: [`SlotCheck`]), and release the blocks only after
//! every copy completed.

use std::sync::Arc;
use std::time::Duration;

use kvstore::BlockKey;

use super::layer_save::LayerSave;
use super::{Backend, Kind, SlotCheck, TransferError};
use crate::cuda::{CudaCopier, CudaEvent, Registered};
use crate::layout::PagedKv;

/// The embedded arena's registration, dropped (after the copier's queued copies finished)
/// before the store.
pub(super) struct PinnedArena {
    copier: Arc<CudaCopier>,
    reg: Option<Registered>,
}

impl Drop for PinnedArena {
    fn drop(&mut self) {
        if self.reg.is_some() && self.copier.synchronize().is_err() {
            // Copies may still be using the arena: never unregister under them (the store's
            // arena outlives nothing after this anyway).
            std::mem::forget(self.reg.take());
        }
    }
}

impl Backend {
    /// Registers the host memory GPU copies use with `copier`'s driver (page-locked: DMA
    /// with no staging copy): the embedded store's arena, or kvtierd's shared arena (of this
    /// connection and every later one). False if the registration failed (logged: the copies
    /// still work, through the driver's own staging buffers, slower).
    pub fn pin_for_cuda(&self, copier: &Arc<CudaCopier>) -> Result<bool, TransferError> {
        match &self.kind {
            Kind::Sidecar(side) => side.pin_for_cuda(copier.clone()),
            Kind::Embedded(store) => {
                let mut pin = self.cuda_pin.lock().map_err(|_| TransferError::Poisoned)?;
                *pin = None;
                let a = store.arena();
                // SAFETY: the arena is mapped for the store's life; the registration is kept
                // in `cuda_pin`, which is dropped before the store (field order) and waits for
                // the copier's queued copies first.
                let r = unsafe { copier.register(a.base(), a.len()) };
                let ok = r.is_ok();
                if let Err(e) = &r {
                    tracing::warn!(
                        error = %e,
                        bytes = a.len(),
                        "kvtier: cannot register the store's arena with the CUDA driver: GPU \
                         copies go through the driver's staging buffers (slower)"
                    );
                }
                *pin = Some(PinnedArena {
                    copier: copier.clone(),
                    reg: r.ok(),
                });
                Ok(ok)
            }
        }
    }

    /// [`Backend::save_layer`] from GPU memory: queues the copies of layer `layer` of every
    /// held block into its slot on `copier`'s stream, after `after` (an event recorded on the
    /// engine's stream once the layer's attention was queued). The finish waits for them.
    ///
    /// # Safety
    /// `paged` must describe device memory of `copier`'s GPU that stays valid, and whose
    /// blocks being saved are not written, until [`Backend::finish_layer_save_cuda`] returns.
    pub unsafe fn save_layer_cuda(
        &self,
        s: &mut LayerSave,
        copier: &CudaCopier,
        paged: &PagedKv,
        layer: usize,
        after: Option<&CudaEvent>,
    ) -> Result<(), TransferError> {
        if s.is_late() {
            // Its slots are about to be given up: the copies queued into them land first.
            copier.synchronize_saves()?;
        }
        if let Some(ev) = after {
            copier.wait_for(ev, true)?;
        }
        // Every held slot's layer at once: coalesced 2D copies, queued on one thread.
        self.save_layer_with(s, paged.layers(), layer, &|slots| {
            for (ids, slot, _) in slots.iter() {
                if slot.len() != ids.len() * paged.block_bytes() {
                    return Err(crate::layout::LayoutError::Size {
                        want: ids.len() * paged.block_bytes(),
                        got: slot.len(),
                    }
                    .into());
                }
            }
            let transfers: Vec<(&[usize], usize)> = slots
                .iter_mut()
                .map(|(ids, slot, _)| (*ids, slot.as_mut_ptr() as usize))
                .collect();
            // SAFETY: each slot is reserved to this save (its length checked above) until
            // its commit or abort, both after the copier's synchronize (finish); `paged` per
            // this function's contract.
            unsafe { copier.copy_many(paged, &transfers, layer..layer + 1, true) }?;
            // The copy engine hashes nothing: the commit hashes every piece.
            Ok(Vec::new())
        })
    }

    /// [`Backend::finish_layer_save`] from GPU memory: queues the layers not queued yet, waits
    /// for every copy, then checksums and commits; the keys the begin could not reserve are
    /// saved in further rounds the same way. Returns how many blocks were stored now.
    ///
    /// # Safety
    /// As [`Backend::save_layer_cuda`].
    pub unsafe fn finish_layer_save_cuda(
        &self,
        mut s: LayerSave,
        copier: &CudaCopier,
        paged: &PagedKv,
    ) -> Result<usize, TransferError> {
        let mut now = 0;
        loop {
            for layer in 0..s.gathered.len() {
                if !s.failed {
                    // SAFETY: the caller's contract. An error marks the save failed.
                    let _ = unsafe { self.save_layer_cuda(&mut s, copier, paged, layer, None) };
                }
            }
            // Every copy into the slots done before anything reads or commits them.
            if let Err(e) = copier.synchronize_saves() {
                // Copies may still be writing the slots: leak them (never freed for another
                // block while DMA may reach them); nothing is committed.
                std::mem::forget(s.take_held());
                return Err(e.into());
            }
            now += self.commit_held(&mut s)?;
            if s.rest >= s.keys.len() {
                return Ok(now);
            }
            // The keys past the daemon's per-connection reservation limit: another round.
            let tags = s.tags.tail(s.rest);
            let next = self.begin_layer_save_described(
                s.ns,
                paged,
                &s.keys[s.rest..],
                &s.block_ids[s.rest..],
                tags,
            )?;
            if next.rest == 0 {
                // Not even one block fits (or the daemon is away): the rest are not stored.
                return Ok(now);
            }
            s = next;
        }
    }

    /// [`Backend::load_layerwise`] into GPU memory: every block is pinned, each layer's
    /// copies are queued on `copier`'s stream and `on_layer(layer, n, event)` called with an
    /// event that completes once they are done (the engine's stream waits on it before the
    /// layer runs: [`CudaCopier::make_wait`]). Each block's checksum is verified on the host,
    /// in the shared slot: with [`SlotCheck::Beside`] (what engines use) while the copies
    /// run, with [`SlotCheck::First`] before any is queued. Returns after every copy
    /// completed (the blocks are released only then): how many leading blocks were loaded and
    /// verified, which with `Beside` may be fewer than `on_layer`'s `n` (the blocks past it
    /// were copied and failed their check: the engine treats them as failed, as after the CPU
    /// path's check); 0 if a sidecar lease lapsed meanwhile.
    ///
    /// # Safety
    /// `paged` must describe device memory of `copier`'s GPU that stays valid, and whose
    /// target blocks nobody else reads or writes, until this returns (and, for the engine's
    /// reads, until the events fired).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn load_layerwise_cuda(
        &self,
        copier: &CudaCopier,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        ttl: Duration,
        check: SlotCheck,
        on_layer: &mut dyn FnMut(usize, usize, CudaEvent),
    ) -> Result<usize, TransferError> {
        // Verified on the host in the shared slot, not in the device copy (hashing that would
        // need a GPU pass per block): the window left is a write into a pinned, committed slot
        // between the copy engine's read and the check (`Beside`), or between the check and
        // that read (`First`). Only a process that maps this arena writable can make it (an
        // engine of the same tenant with `server.isolation = "tenant"`, any engine of the node
        // otherwise, never another tenant's), and only into a slot it no longer owns (its
        // reservation lapsed and the block was committed by another writer): ARCHITECTURE.md,
        // "Trust boundary".
        self.load_layers_with(
            paged,
            keys,
            block_ids,
            ttl,
            check,
            &mut |layer, blocks| {
                // Every block's layer at once: coalesced 2D copies (the blocks' sizes were
                // checked against their engine block ids).
                let transfers: Vec<(&[usize], usize)> = blocks
                    .iter()
                    .enumerate()
                    .map(|(i, (b, _))| (&block_ids[i][..], b.as_ptr() as usize))
                    .collect();
                // SAFETY: the blocks stay pinned until `done` (below) waited for these copies;
                // `paged` per this function's contract.
                unsafe { copier.copy_many(paged, &transfers, layer..layer + 1, false) }?;
                let ev = copier.record()?;
                on_layer(layer, blocks.len(), ev);
                Ok(())
            },
            &mut || Ok(copier.synchronize_loads()?),
        )
    }
}

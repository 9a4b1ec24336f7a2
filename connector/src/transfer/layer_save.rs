//! Saves written layer by layer: every block's slot is reserved when the engine's step begins,
//! each layer is gathered into its place in every slot as soon as the engine computed it, and
//! the blocks are committed once every layer is in, so a block is never visible with a layer
//! missing. (On a GPU the per-layer copies are what overlaps the forward pass; on a CPU they
//! run on a thread beside it.)

use std::time::Instant;

use kvstore::{BlockKey, NsId, Reservation};

use super::{
    commit_tokens, granted, lens_u32, reserve_embedded, round_end, save_lens, Backend, Kind,
    Stored, Tags, TransferError,
};
use crate::layout::{PagedKv, PieceParts};

/// How a layer of every held block gets into its slot: `copy([(engine block ids, slot,
/// the slot's pieces hashed in part)])`; returns, per slot in the order given, the checksum
/// pieces it completed the hash of as it copied them (`(piece index, XXH3-64)`, see
/// [`PagedKv::gather_layer_hashed`]; none at all: empty).
pub(super) type LayerCopy<'a> = dyn Fn(
        &mut [(&[usize], &mut [u8], &mut PieceParts)],
    ) -> Result<Vec<Vec<(usize, u64)>>, TransferError>
    + Sync
    + 'a;

/// A save in progress, layer by layer (see [`Backend::begin_layer_save`]). Dropped without
/// [`Backend::finish_layer_save`] or [`Backend::abort_layer_save`], its embedded reservations
/// are freed; a sidecar's are left to the daemon's `server.reservation_ttl_ms`.
pub struct LayerSave {
    pub(super) ns: NsId,
    pub(super) keys: Vec<BlockKey>,
    pub(super) block_ids: Vec<Vec<usize>>,
    pub(super) tags: Tags,
    /// What became of each key reserved here (`Now`: a slot is held for it).
    pub(super) out: Vec<Stored>,
    /// Keys from here on were not reserved (past the daemon's per-connection limit): they are
    /// saved whole by the finish.
    pub(super) rest: usize,
    pub(super) held: Held,
    /// Layers gathered into every held slot.
    pub(super) gathered: Vec<bool>,
    /// A layer's gather failed: nothing is committed.
    pub(super) failed: bool,
    /// Per held slot (in `held`'s order), the XXH3-64 of each checksum piece a layer's
    /// gather wrote whole, hashed as it was copied: the commit hashes only the other pieces
    /// (`kvstore::checksum_with_leaves`). Empty while none is known.
    pub(super) leaves: Vec<Vec<Option<u64>>>,
    /// Per held slot, the pieces whose hash the layers gathered so far began and did not
    /// finish (a layer smaller than a piece).
    pub(super) parts: Vec<PieceParts>,
}

/// Sidecar slots are written only until half the daemon's reservation TTL has passed (after
/// the TTL the daemon gives them to others); a save still open then is redone whole.
fn write_deadline(ttl: std::time::Duration) -> Instant {
    Instant::now() + ttl / 2
}

pub(super) enum Held {
    /// The store's reservations, with their key index.
    Embedded(Vec<(usize, Reservation)>),
    /// Tokens of connection `conn`, with their key index, writable until `until`.
    Sidecar {
        conn: u64,
        tokens: Vec<(usize, u64)>,
        until: Instant,
    },
    /// Nothing held (the daemon was away, or its connection was lost meanwhile).
    Nothing,
}

impl LayerSave {
    /// Takes the held slots out (the save then holds nothing).
    #[cfg(feature = "cuda")]
    pub(super) fn take_held(&mut self) -> Held {
        std::mem::replace(&mut self.held, Held::Nothing)
    }

    /// Blocks whose slots are held (what the layers are gathered into).
    pub fn held(&self) -> usize {
        match &self.held {
            Held::Embedded(v) => v.len(),
            Held::Sidecar { tokens, .. } => tokens.len(),
            Held::Nothing => 0,
        }
    }

    /// Whether its sidecar slots are past their write deadline (the next call gives them up).
    pub(super) fn is_late(&self) -> bool {
        matches!(&self.held, Held::Sidecar { until, .. } if Instant::now() >= *until)
    }

    /// Layers gathered so far.
    pub fn layers_done(&self) -> usize {
        self.gathered.iter().filter(|g| **g).count()
    }
}

impl Backend {
    /// Begins a layer-by-layer save of `keys[i]` as engine blocks `block_ids[i]` (engine
    /// hashes as in [`Backend::save_tagged`]): reserves a slot for every key not present yet,
    /// in sidecar mode up to the daemon's per-connection limit (the keys past it are saved
    /// whole by [`Backend::finish_layer_save`]). Nothing is copied yet.
    pub fn begin_layer_save(
        &self,
        ns: NsId,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        engine_hashes: &[Vec<u8>],
    ) -> Result<LayerSave, TransferError> {
        self.begin_layer_save_described(ns, paged, keys, block_ids, Tags::hashes(engine_hashes))
    }

    /// [`Backend::begin_layer_save`] with each block's parent hash and token ids too (see
    /// [`Tags`]).
    pub fn begin_layer_save_described(
        &self,
        ns: NsId,
        paged: &PagedKv,
        keys: &[BlockKey],
        block_ids: &[Vec<usize>],
        tags: Tags,
    ) -> Result<LayerSave, TransferError> {
        let lens = save_lens(paged, keys, block_ids, &tags)?;
        let mut out = vec![Stored::NoRoom; keys.len()];
        let mut rest = keys.len();
        let held = match &self.kind {
            Kind::Embedded(s) => Held::Embedded(reserve_embedded(
                s,
                ns,
                keys,
                &lens,
                0..keys.len(),
                &mut out,
            )?),
            Kind::Sidecar(side) => {
                let lens32 = lens_u32(&lens)?;
                let got = side.call(|c, map| {
                    let conn = map.connection();
                    let until = write_deadline(c.reservation_ttl());
                    let dns = map.get(c, ns)?;
                    // One round, within what the daemon lets a connection hold.
                    let end = if keys.is_empty() {
                        0
                    } else {
                        round_end(c, 0, &lens32)
                    };
                    let slots = if end == 0 {
                        Vec::new()
                    } else {
                        c.reserve(dns, &keys[..end], &lens32[..end])?
                    };
                    Ok((conn, until, end, slots))
                })?;
                match got {
                    None => Held::Nothing,
                    Some((conn, until, end, slots)) => {
                        rest = end;
                        Held::Sidecar {
                            conn,
                            tokens: granted(&slots[..slots.len().min(end)], 0, &mut out),
                            until,
                        }
                    }
                }
            }
        };
        Ok(LayerSave {
            ns,
            keys: keys.to_vec(),
            block_ids: block_ids.to_vec(),
            tags,
            out,
            rest,
            held,
            gathered: vec![false; paged.layers()],
            failed: false,
            leaves: Vec::new(),
            parts: Vec::new(),
        })
    }

    /// Gathers layer `layer` of every held block into its slot (`paged` as at the begin).
    /// Gathering a layer again is a no-op; a failed gather makes the finish commit nothing.
    pub fn save_layer(
        &self,
        s: &mut LayerSave,
        paged: &PagedKv,
        layer: usize,
    ) -> Result<(), TransferError> {
        let copies = &self.copies;
        self.save_layer_with(s, paged.layers(), layer, &|slots| {
            let sizes: Vec<usize> = slots.iter().map(|(_, s, _)| s.len()).collect();
            Ok(copies
                .map_mut(slots, &sizes, |_, (ids, slot, parts)| {
                    paged.gather_layer_hashed(ids, slot, layer, parts)
                })
                .into_iter()
                .collect::<Result<Vec<_>, _>>()?)
        })
    }

    /// Copies layer `layer` of every held block with `copy`, for a layout of `layers`
    /// layers.
    pub(super) fn save_layer_with(
        &self,
        s: &mut LayerSave,
        layers: usize,
        layer: usize,
        copy: &LayerCopy<'_>,
    ) -> Result<(), TransferError> {
        if layer >= s.gathered.len() || layers != s.gathered.len() {
            return Err(TransferError::Input(format!(
                "layer {layer} of a save begun with {} layers (this layout has {layers})",
                s.gathered.len(),
            )));
        }
        if s.gathered[layer] || s.failed {
            return Ok(());
        }
        self.redo_if_late(s)?;
        let held = s.held();
        if s.parts.len() < held {
            s.parts.resize_with(held, Vec::new);
        }
        let ids = &s.block_ids;
        let parts = &mut s.parts;
        // Ok(false): the sidecar connection (and with it the reservations) is gone.
        let r = match &mut s.held {
            Held::Nothing => Ok(Some(Vec::new())),
            Held::Embedded(slots) => {
                let mut v: Vec<(&[usize], &mut [u8], &mut PieceParts)> = slots
                    .iter_mut()
                    .zip(parts.iter_mut())
                    .map(|((i, r), p)| (&ids[*i][..], r.as_mut_slice(), p))
                    .collect();
                copy(&mut v).map(Some)
            }
            Held::Sidecar { conn, tokens, .. } => {
                let Kind::Sidecar(side) = &self.kind else {
                    return Err(TransferError::Input(
                        "a sidecar save on an embedded store".into(),
                    ));
                };
                let toks: Vec<u64> = tokens.iter().map(|(_, t)| *t).collect();
                let idx: Vec<usize> = tokens.iter().map(|(i, _)| *i).collect();
                let got = side.call_on(*conn, |c, _| {
                    // No checksum yet: the slot is not whole until the last layer is in.
                    c.fill_slots_hashed(&toks, |slots| {
                        let mut v: Vec<(&[usize], &mut [u8], &mut PieceParts)> = slots
                            .iter_mut()
                            .zip(parts.iter_mut())
                            .enumerate()
                            .map(|(j, (slot, p))| (&ids[idx[j]][..], &mut **slot, p))
                            .collect();
                        (copy(&mut v), vec![None; toks.len()])
                    })
                })?;
                match got {
                    Some(r) => r.map(Some),
                    // The connection is gone and its reservations with it: a miss.
                    None => Ok(None),
                }
            }
        };
        match r {
            Ok(Some(leaves)) => {
                for (j, got) in leaves.into_iter().enumerate() {
                    for (piece, leaf) in got {
                        if s.leaves.len() <= j {
                            s.leaves.resize(j + 1, Vec::new());
                        }
                        let known = &mut s.leaves[j];
                        if known.len() <= piece {
                            known.resize(piece + 1, None);
                        }
                        known[piece] = Some(leaf);
                    }
                }
                s.gathered[layer] = true;
                Ok(())
            }
            Ok(None) => {
                s.held = Held::Nothing;
                s.leaves.clear();
                s.parts.clear();
                s.gathered[layer] = true;
                Ok(())
            }
            Err(e) => {
                s.failed = true;
                Err(e)
            }
        }
    }

    /// Gathers the layers not gathered yet, checksums and commits every held block, and saves
    /// the keys that were not reserved at the begin. Returns how many blocks were stored now.
    /// If a layer's gather failed, nothing held is committed (the reservations are aborted)
    /// and the error comes back.
    pub fn finish_layer_save(
        &self,
        mut s: LayerSave,
        paged: &PagedKv,
    ) -> Result<usize, TransferError> {
        for layer in 0..s.gathered.len() {
            if !s.failed {
                // An error here marks the save failed; it is reported by commit_held.
                let _ = self.save_layer(&mut s, paged, layer);
            }
        }
        let mut now = self.commit_held(&mut s)?;
        if s.rest < s.keys.len() {
            let tags = s.tags.tail(s.rest);
            now += self.save_described(
                s.ns,
                paged,
                &s.keys[s.rest..],
                &s.block_ids[s.rest..],
                &tags,
            )?;
        }
        Ok(now)
    }

    /// Checksums and commits every held block (every layer must be in); returns how many of
    /// the reserved keys were stored now. A save whose gather failed is aborted instead: an
    /// error, nothing committed.
    pub(super) fn commit_held(&self, s: &mut LayerSave) -> Result<usize, TransferError> {
        if s.failed {
            let held = std::mem::replace(&mut s.held, Held::Nothing);
            self.abort_held(held)?;
            return Err(TransferError::Input(
                "a layer of a layer-by-layer save could not be copied: nothing committed".into(),
            ));
        }
        debug_assert!(s.gathered.iter().all(|g| *g), "a layer is missing");
        self.redo_if_late(s)?;
        let held = std::mem::replace(&mut s.held, Held::Nothing);
        match held {
            Held::Nothing => {
                for o in s.out[..s.rest].iter_mut() {
                    if *o == Stored::Now {
                        *o = Stored::NoRoom;
                    }
                }
            }
            Held::Embedded(slots) => {
                let leaves = std::mem::take(&mut s.leaves);
                let mut slots: Vec<_> = slots.into_iter().enumerate().collect();
                let sizes: Vec<usize> = slots.iter().map(|(_, (_, r))| r.len()).collect();
                let sums = self.copies.map_mut(&mut slots, &sizes, |_, (j, (_, r))| {
                    kvstore::checksum_with_leaves(r.as_mut_slice(), known(&leaves, *j))
                });
                let slots = slots.into_iter().map(|(_, x)| x);
                for ((i, r), sum) in slots.into_iter().zip(sums) {
                    if !r.commit_with_checksum(sum)? {
                        s.out[i] = Stored::Already;
                    }
                }
            }
            Held::Sidecar { conn, tokens, .. } => {
                let Kind::Sidecar(side) = &self.kind else {
                    return Err(TransferError::Input(
                        "a sidecar save on an embedded store".into(),
                    ));
                };
                let toks: Vec<u64> = tokens.iter().map(|(_, t)| *t).collect();
                let copies = &self.copies;
                let tags = &s.tags;
                let out = &mut s.out;
                let leaves = std::mem::take(&mut s.leaves);
                let got = side.call_on(conn, |c, _| {
                    c.fill_slots_hashed(&toks, |slots| {
                        let mut slots: Vec<_> = slots.iter_mut().enumerate().collect();
                        let sizes: Vec<usize> = slots.iter().map(|(_, s)| s.len()).collect();
                        let sums = copies.map_mut(&mut slots, &sizes, |_, (j, slot)| {
                            Some(kvstore::checksum_with_leaves(slot, known(&leaves, *j)))
                        });
                        ((), sums)
                    })?;
                    commit_tokens(c, &tokens, tags, out)
                })?;
                if got.is_none() {
                    for (i, _) in &tokens {
                        s.out[*i] = Stored::NoRoom;
                    }
                }
            }
        }
        Ok(s.out[..s.rest]
            .iter()
            .filter(|o| **o == Stored::Now)
            .count())
    }

    /// A sidecar save whose slots are past their write deadline gives them up (they may soon
    /// be another client's) and is redone whole by the finish: every key from the first.
    fn redo_if_late(&self, s: &mut LayerSave) -> Result<(), TransferError> {
        if s.is_late() {
            tracing::warn!(
                blocks = s.held(),
                "kvtier: a layer-by-layer save outlived half the daemon's reservation TTL: its \
                 slots are given up and the blocks saved whole at the finish"
            );
            let held = std::mem::replace(&mut s.held, Held::Nothing);
            s.leaves.clear();
            s.parts.clear();
            for o in s.out[..s.rest].iter_mut() {
                if *o == Stored::Now {
                    *o = Stored::NoRoom;
                }
            }
            s.rest = 0;
            self.abort_held(held)?;
        }
        Ok(())
    }

    fn abort_held(&self, held: Held) -> Result<(), TransferError> {
        match held {
            Held::Nothing | Held::Embedded(_) => Ok(()),
            Held::Sidecar { conn, tokens, .. } => {
                let Kind::Sidecar(side) = &self.kind else {
                    return Ok(());
                };
                let toks: Vec<u64> = tokens.iter().map(|(_, t)| *t).collect();
                side.call_on(conn, |c, _| c.abort(&toks))?;
                Ok(())
            }
        }
    }

    /// Gives a layer-by-layer save up: its reservations are freed, nothing is committed. (GPU
    /// copies queued into its slots must have completed first: synchronize the copier.)
    pub fn abort_layer_save(&self, mut s: LayerSave) -> Result<(), TransferError> {
        let held = std::mem::replace(&mut s.held, Held::Nothing);
        self.abort_held(held)
    }
}

/// The pieces of held slot `j` hashed as they were copied (none known: empty).
fn known(leaves: &[Vec<Option<u64>>], j: usize) -> &[Option<u64>] {
    leaves.get(j).map_or(&[], Vec::as_slice)
}

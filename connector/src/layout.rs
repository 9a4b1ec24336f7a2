//! Paged KV layouts and the CPU gather/scatter.
//!
//! An engine hands over, per layer, a tensor's base address, shape, strides (in elements) and
//! element size, and names each dimension: [`Dim::Blocks`] (the paged block index),
//! [`Dim::Kv`] (K and V planes, absent for MLA), [`Dim::Tokens`] (slots in a block) and
//! [`Dim::Inner`] (heads, head size, or a packed latent). Nothing is hard-coded: KV-first
//! `(2, blocks, tokens, heads, dim)`, blocks-first `(blocks, 2, tokens, heads, dim)`, HND
//! `(blocks, 2, heads, tokens, dim)`, MLA `(blocks, tokens, 576)`, vLLM's CPU backend
//! `(blocks, 2, tokens, heads*dim)`, and non-contiguous views of any of them all follow from
//! shape and strides.
//!
//! One engine block's bytes in a kvtier block, whatever the engine layout (the canonical form):
//!
//! ```text
//! for layer in layers:            (in registration order)
//!   for kv in 0..planes:          (K then V; one plane for MLA)
//!     for token in 0..block_size:
//!       inner elements in the order the engine lists its Inner dims
//! ```
//!
//! A kvtier block of N engine blocks is their canonical forms back to back, in the order given.
//! The copy finds, per layer, the longest run of trailing dims that is contiguous in the engine
//! tensor and moves it with one `memcpy`.

use kvstore::ArenaSlice;
use thiserror::Error;

/// What a tensor dimension means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    /// The paged block index.
    Blocks,
    /// K and V planes (size 2).
    Kv,
    /// Token slots within a block.
    Tokens,
    /// Payload (heads, head size, latent).
    Inner,
}

/// One layer's KV tensor.
#[derive(Clone, Debug)]
pub struct LayerView {
    /// Address of element 0 (the tensor's data pointer).
    pub ptr: usize,
    /// Dimension sizes.
    pub shape: Vec<usize>,
    /// Strides in elements.
    pub strides: Vec<isize>,
    /// What each dimension is.
    pub dims: Vec<Dim>,
    /// Bytes per element.
    pub elem: usize,
}

/// Bad layout descriptions.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    /// Shape, strides and dims differ in length.
    #[error("layer {layer}: shape, strides and dims must have the same length")]
    Rank {
        /// Layer index.
        layer: usize,
    },
    /// A required dimension is missing or repeated.
    #[error("layer {layer}: needs exactly one Blocks and one Tokens dim, at most one Kv dim (of size 2)")]
    Dims {
        /// Layer index.
        layer: usize,
    },
    /// Layers disagree on block count or bytes per block.
    #[error("layer {layer} differs from layer 0 in {what}")]
    Mismatch {
        /// Layer index.
        layer: usize,
        /// What differs.
        what: &'static str,
    },
    /// A block id beyond the tensor.
    #[error("block id {id} is out of range (the engine has {blocks} blocks)")]
    BlockId {
        /// The id.
        id: usize,
        /// Block count.
        blocks: usize,
    },
    /// Destination or source of the wrong size.
    #[error("buffer of {got} bytes, expected {want}")]
    Size {
        /// Expected.
        want: usize,
        /// Given.
        got: usize,
    },
    /// No layers or zero-sized dims.
    #[error("empty layout")]
    Empty,
}

/// Per layer, the copy plan: loops over outer dims, memcpy of `run` bytes.
#[derive(Clone, Debug)]
struct Plan {
    ptr: usize,
    block_stride: isize,
    /// (size, stride in bytes) of the dims iterated, outermost first, in canonical order.
    outer: Vec<(usize, isize)>,
    /// Contiguous bytes moved per copy.
    run: usize,
    /// Canonical bytes of this layer per engine block.
    bytes: usize,
}

/// An engine's paged KV cache: every layer, validated once.
#[derive(Clone, Debug)]
pub struct PagedKv {
    plans: Vec<Plan>,
    blocks: usize,
    block_bytes: usize,
}

impl PagedKv {
    /// Validates the layers and plans the copies.
    ///
    /// # Safety
    /// Each layer's `ptr`, shape and strides must describe memory that stays valid, and that
    /// nobody else writes while a gather runs (or reads or writes while a scatter runs), for
    /// as long as this value is used.
    pub unsafe fn new(layers: Vec<LayerView>) -> Result<Self, LayoutError> {
        if layers.is_empty() {
            return Err(LayoutError::Empty);
        }
        let mut plans = Vec::with_capacity(layers.len());
        let mut blocks = 0;
        for (i, l) in layers.iter().enumerate() {
            if l.shape.len() != l.strides.len() || l.shape.len() != l.dims.len() {
                return Err(LayoutError::Rank { layer: i });
            }
            if l.shape.contains(&0) || l.elem == 0 {
                return Err(LayoutError::Empty);
            }
            let count = |d: Dim| l.dims.iter().filter(|x| **x == d).count();
            let kv_ok = match l.dims.iter().position(|d| *d == Dim::Kv) {
                None => true,
                Some(p) => count(Dim::Kv) == 1 && l.shape[p] == 2,
            };
            if count(Dim::Blocks) != 1 || count(Dim::Tokens) != 1 || !kv_ok {
                return Err(LayoutError::Dims { layer: i });
            }
            let b = l.dims.iter().position(|d| *d == Dim::Blocks).unwrap_or(0);
            if i == 0 {
                blocks = l.shape[b];
            } else if l.shape[b] != blocks {
                return Err(LayoutError::Mismatch {
                    layer: i,
                    what: "block count",
                });
            }
            // Canonical order: Kv, Tokens, then Inner dims in the engine's order.
            let mut order: Vec<usize> = Vec::new();
            order.extend(l.dims.iter().position(|d| *d == Dim::Kv));
            order.extend(l.dims.iter().position(|d| *d == Dim::Tokens));
            order.extend((0..l.dims.len()).filter(|&j| l.dims[j] == Dim::Inner));
            let e = l.elem as isize;
            let dims: Vec<(usize, isize)> = order
                .iter()
                .map(|&j| (l.shape[j], l.strides[j] * e))
                .collect();
            // Longest contiguous suffix.
            let mut run = l.elem;
            let mut k = dims.len();
            while k > 0 && dims[k - 1].1 == run as isize {
                run *= dims[k - 1].0;
                k -= 1;
            }
            let bytes = dims.iter().map(|d| d.0).product::<usize>() * l.elem;
            plans.push(Plan {
                ptr: l.ptr,
                block_stride: l.strides[b] * e,
                outer: dims[..k].to_vec(),
                run,
                bytes,
            });
        }
        let block_bytes = plans.iter().map(|p| p.bytes).sum();
        Ok(Self {
            plans,
            blocks,
            block_bytes,
        })
    }

    /// Canonical bytes of one engine block (all layers, K and V).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Engine blocks.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Checks that every block id lies within the engine's tensors.
    pub fn check_ids(&self, ids: &[usize]) -> Result<(), LayoutError> {
        if let Some(&id) = ids.iter().find(|&&id| id >= self.blocks) {
            return Err(LayoutError::BlockId {
                id,
                blocks: self.blocks,
            });
        }
        Ok(())
    }

    fn check(&self, ids: &[usize], len: usize) -> Result<(), LayoutError> {
        self.check_ids(ids)?;
        let want = ids.len() * self.block_bytes;
        if len != want {
            return Err(LayoutError::Size { want, got: len });
        }
        Ok(())
    }

    /// The engine's runs of blocks `ids` (`(address, bytes)` each), in canonical order.
    fn runs(&self, ids: &[usize]) -> Vec<(usize, usize)> {
        let mut runs = Vec::new();
        for &id in ids {
            for p in &self.plans {
                let base = p.ptr as isize + id as isize * p.block_stride;
                walk(p, base, &mut |at, len| runs.push((at, len)));
            }
        }
        runs
    }

    /// Copies engine blocks `ids` into `dst` (canonical form, back to back).
    pub fn gather(&self, ids: &[usize], dst: &mut [u8]) -> Result<(), LayoutError> {
        self.check(ids, dst.len())?;
        let mut at = 0;
        for &id in ids {
            for p in &self.plans {
                let base = p.ptr as isize + id as isize * p.block_stride;
                walk(p, base, &mut |src, len| {
                    // SAFETY: `src` lies in the layer tensor (PagedKv::new's contract, indices
                    // within shape) and nobody writes it during the gather; it does not overlap
                    // `dst` (a separate buffer).
                    let from = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
                    // Large runs stream past the cache (the block is not read back soon).
                    kvstore::copy_nt(&mut dst[at..at + len], from);
                    at += len;
                });
            }
        }
        Ok(())
    }

    /// [`PagedKv::gather`] that also returns the block checksum of the bytes written, computed
    /// as they are copied ([`kvstore::gather_hashed`]): each stripe of the engine's runs is
    /// loaded once, streamed to `dst` past the cache and hashed from the same registers, so
    /// the block is neither read again nor staged to checksum it. (It used to gather each
    /// checksum piece's runs into a private 64 KiB buffer, then copy and hash that: a copy in
    /// cache more. Runs that are not whole 64-byte stripes still go that way.)
    pub fn gather_hashed(&self, ids: &[usize], dst: &mut [u8]) -> Result<u64, LayoutError> {
        self.check(ids, dst.len())?;
        let runs = self.runs(ids);
        // SAFETY: every run lies within a layer tensor (PagedKv::new's contract, indices
        // within shape), which nobody writes during the gather; `dst` is a separate buffer;
        // the runs add up to the canonical form, `dst.len()` bytes (checked above).
        Ok(unsafe { kvstore::gather_hashed(dst, &runs) })
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.plans.len()
    }

    /// Layer `layer`'s plan and where it starts in a block's canonical form, once `ids` and a
    /// canonical form of `len` bytes are checked.
    fn layer_plan(
        &self,
        ids: &[usize],
        len: usize,
        layer: usize,
    ) -> Result<(&Plan, usize), LayoutError> {
        self.check(ids, len)?;
        let Some(p) = self.plans.get(layer) else {
            return Err(LayoutError::Mismatch {
                layer,
                what: "layer index",
            });
        };
        Ok((p, self.plans[..layer].iter().map(|q| q.bytes).sum()))
    }

    /// Calls `f(engine address, offset in the canonical form, bytes)` for every contiguous run
    /// of layer `layer` of engine blocks `ids`, whose canonical form is `len` bytes.
    fn layer_runs(
        &self,
        ids: &[usize],
        len: usize,
        layer: usize,
        f: &mut dyn FnMut(usize, usize, usize),
    ) -> Result<(), LayoutError> {
        let (p, before) = self.layer_plan(ids, len, layer)?;
        for (k, &id) in ids.iter().enumerate() {
            let mut at = k * self.block_bytes + before;
            let base = p.ptr as isize + id as isize * p.block_stride;
            walk(p, base, &mut |addr, run| {
                f(addr, at, run);
                at += run;
            });
        }
        Ok(())
    }

    /// Copies layer `layer` of `src` (canonical form of engine blocks `ids`, every layer) into
    /// that layer's tensor only: what a layer-by-layer load moves before the layer runs.
    pub fn scatter_layer(
        &self,
        ids: &[usize],
        src: ArenaSlice<'_>,
        layer: usize,
    ) -> Result<(), LayoutError> {
        self.layer_runs(ids, src.len(), layer, &mut |dst, at, len| {
            // SAFETY: as in scatter: within the layer tensor, which nobody else reads or writes
            // during the copy (PagedKv::new's contract).
            let to = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
            src.copy_to(at, to);
        })
    }

    /// Copies layer `layer` of engine blocks `ids` into its place in `dst` (their canonical
    /// form, every layer): what a layer-by-layer save moves as soon as the layer was computed.
    /// The other layers' bytes in `dst` are not touched.
    pub fn gather_layer(
        &self,
        ids: &[usize],
        dst: &mut [u8],
        layer: usize,
    ) -> Result<(), LayoutError> {
        let len = dst.len();
        self.layer_runs(ids, len, layer, &mut |src, at, run| {
            // SAFETY: as in gather: within the layer tensor, which nobody writes during the
            // copy (PagedKv::new's contract); `dst` is a separate buffer.
            let from = unsafe { std::slice::from_raw_parts(src as *const u8, run) };
            kvstore::copy_nt(&mut dst[at..at + run], from);
        })
    }

    /// [`PagedKv::gather_layer`] that hashes the checksum pieces ([`kvstore::checksum::CHUNK`]
    /// bytes of the canonical form) as it copies them, and returns those it completed as
    /// `(piece index, XXH3-64)`: those pieces need not be read back at the commit
    /// ([`kvstore::checksum_with_leaves`]).
    /// - A piece that lies wholly in this layer of one block is hashed in one pass. In a
    ///   Llama-3-8B shaped cache (16 tokens, 8 KV heads of 128, bf16) a layer of a block is
    ///   exactly one piece.
    /// - A piece that spans layers (a layer smaller than a piece: Qwen's 4 KV heads, 32 KiB
    ///   a layer of a block) is hashed in parts: `parts` keeps, between the calls for one
    ///   slot, the running hash of each piece begun and not finished. A part is hashed only
    ///   where it continues its piece's hash where the last part left it (or starts the
    ///   piece), so the layers must come in order for it (vLLM saves them so); a layer out
    ///   of order, or runs that are not whole 64-byte stripes, leave the piece to the commit.
    pub fn gather_layer_hashed(
        &self,
        ids: &[usize],
        dst: &mut [u8],
        layer: usize,
        parts: &mut PieceParts,
    ) -> Result<Vec<(usize, u64)>, LayoutError> {
        use kvstore::checksum::{RunCursor, CHUNK};
        let len = dst.len();
        let (p, before) = self.layer_plan(ids, len, layer)?;
        let mut leaves = Vec::new();
        let mut runs = Vec::new();
        let mut segs = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            let (start, end) = (
                k * self.block_bytes + before,
                k * self.block_bytes + before + p.bytes,
            );
            runs.clear();
            let base = p.ptr as isize + id as isize * p.block_stride;
            walk(p, base, &mut |addr, run| runs.push((addr, run)));
            // The layer's range in parts cut at piece boundaries; each part's runs.
            let mut cursor = RunCursor::new(&runs, p.bytes);
            let mut at = start;
            while at < end {
                let piece = at / CHUNK;
                let (first, last) = (piece * CHUNK, ((piece + 1) * CHUNK).min(len));
                let part_end = last.min(end);
                cursor.next(part_end - at, &mut segs);
                let to = &mut dst[at..part_end];
                if at == first && part_end == last {
                    // SAFETY: the segments lie in the layer tensor (PagedKv::new's contract),
                    // which nobody writes during the gather; `dst` is a separate buffer; they
                    // add up to the part's length.
                    leaves.push((piece, unsafe { kvstore::gather_hashed(to, &segs) }));
                } else if let Some(leaf) = {
                    // SAFETY: as above.
                    unsafe { gather_part(parts, piece, at - first, last - first, to, &segs) }
                } {
                    leaves.push((piece, leaf));
                }
                at = part_end;
            }
        }
        Ok(leaves)
    }

    /// Copies `src` (canonical form of engine blocks `ids`) into the engine's tensors.
    pub fn scatter(&self, ids: &[usize], src: &[u8]) -> Result<(), LayoutError> {
        self.check(ids, src.len())?;
        let mut at = 0;
        for &id in ids {
            for p in &self.plans {
                let base = p.ptr as isize + id as isize * p.block_stride;
                walk(p, base, &mut |dst, len| {
                    // SAFETY: as in gather, with roles swapped; the engine tensor is not read or
                    // written by anyone else during the scatter (PagedKv::new's contract).
                    let to = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
                    to.copy_from_slice(&src[at..at + len]);
                    at += len;
                });
            }
        }
        Ok(())
    }

    /// [`PagedKv::scatter`] from shared memory that also returns the checksum of what it
    /// wrote ([`ArenaSlice::scatter_hashed`]): each stripe of the shared `src` is loaded once,
    /// stored to its run of the engine's tensors and hashed from the same registers. The
    /// bytes hashed are the bytes the engine gets, never a second read of `src`: a writer
    /// that changes `src` during the copy cannot make a hash pass for bytes that were not
    /// copied (issue 35). (It used to copy and hash each checksum piece into a private
    /// buffer, then place the runs from there: a copy in cache more. Runs that are not whole
    /// 64-byte stripes still go that way. bench/RESULTS.md.)
    pub fn scatter_hashed(&self, ids: &[usize], src: ArenaSlice<'_>) -> Result<u64, LayoutError> {
        self.check(ids, src.len())?;
        let runs = self.runs(ids);
        // SAFETY: every run lies within a layer tensor (PagedKv::new's contract), which nobody
        // else reads or writes during the scatter, apart from the arena; they add up to
        // `src.len()` (checked above).
        Ok(unsafe { src.scatter_hashed(&runs) })
    }

    /// The checksum of engine blocks `ids` in canonical form, read from the engine's tensors
    /// (what a layer-by-layer load verifies once every layer is in: the engine's private copy,
    /// which no other process can change).
    pub fn checksum_of(&self, ids: &[usize]) -> Result<u64, LayoutError> {
        self.check_ids(ids)?;
        let mut h = kvstore::RunChecksummer::new();
        for &id in ids {
            for p in &self.plans {
                let base = p.ptr as isize + id as isize * p.block_stride;
                walk(p, base, &mut |src, len| {
                    // SAFETY: within the layer tensor (PagedKv::new's contract), which nobody
                    // writes while the load that asks is running.
                    h.update(unsafe { std::slice::from_raw_parts(src as *const u8, len) });
                });
            }
        }
        Ok(h.finish())
    }

    /// The copies a gather (or scatter) of `ids` is made of, as strided pieces for a copy
    /// engine that moves 2D regions (cuMemcpy2DAsync) with rows at most `max_pitch` bytes
    /// apart: in canonical order, each piece lands at `at` in the destination, right after the
    /// previous one.
    pub fn pieces(&self, ids: &[usize], max_pitch: usize) -> Result<Vec<Piece>, LayoutError> {
        self.pieces_of_layers(ids, 0..self.plans.len(), max_pitch)
    }

    /// [`PagedKv::pieces`] of the given layers only (`at` still counts every layer: the
    /// pieces land in their place in the whole canonical form).
    pub fn pieces_of_layers(
        &self,
        ids: &[usize],
        layers: std::ops::Range<usize>,
        max_pitch: usize,
    ) -> Result<Vec<Piece>, LayoutError> {
        self.check(ids, ids.len() * self.block_bytes)?;
        if layers.end > self.plans.len() {
            return Err(LayoutError::Mismatch {
                layer: layers.end.saturating_sub(1),
                what: "layer index",
            });
        }
        let mut out = Vec::new();
        let mut at = 0;
        for &id in ids {
            for (l, p) in self.plans.iter().enumerate() {
                if !layers.contains(&l) {
                    at += p.bytes;
                    continue;
                }
                let base = p.ptr as isize + id as isize * p.block_stride;
                // The innermost outer dim becomes the rows of a 2D piece when its stride is a
                // forward pitch at least one run wide and within the engine's limit; anything
                // else is one row per run.
                let (rows, pitch, outer) = match p.outer.split_last() {
                    Some((&(n, s), rest)) if s >= p.run as isize && s as usize <= max_pitch => {
                        (n, s, rest)
                    }
                    _ => (1, p.run as isize, &p.outer[..]),
                };
                let sub = Plan {
                    ptr: 0,
                    block_stride: 0,
                    outer: outer.to_vec(),
                    run: p.run,
                    bytes: 0,
                };
                walk(&sub, base, &mut |addr, run| {
                    out.push(Piece {
                        src: addr,
                        pitch: pitch as usize,
                        width: run,
                        rows,
                        at,
                    });
                    at += run * rows;
                });
            }
        }
        Ok(out)
    }
}

/// One 2D copy between an engine tensor and host memory: `height` runs of `width` bytes, the
/// i-th at `dev + i * dev_pitch` in the engine tensor and at `host + i * host_pitch` in host
/// memory (pitches ≥ `width` when `height` > 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy2D {
    /// Address of the first run in the engine tensor.
    pub dev: usize,
    /// Bytes between consecutive runs in the engine tensor.
    pub dev_pitch: usize,
    /// Address of the first run in host memory.
    pub host: usize,
    /// Bytes between consecutive runs in host memory.
    pub host_pitch: usize,
    /// Bytes per run.
    pub width: usize,
    /// Runs.
    pub height: usize,
}

impl PagedKv {
    /// The 2D copies that move layers `layers` of several transfers at once, each given as
    /// `(engine block ids, host address of their canonical form)`, with pitches at most
    /// `max_pitch`. Runs are coalesced across transfers: the same run of successive transfers
    /// whose engine and host addresses both advance by one step (consecutive engine blocks
    /// into slots laid out evenly, as a fresh prompt's usually are) becomes one copy, so a
    /// layer of many blocks is a handful of copies rather than one per block; where that does
    /// not make fewer copies than [`PagedKv::pieces_of_layers`] per transfer, those are used.
    pub fn copies_2d(
        &self,
        transfers: &[(&[usize], usize)],
        layers: std::ops::Range<usize>,
        max_pitch: usize,
    ) -> Result<Vec<Copy2D>, LayoutError> {
        // Per transfer, its pieces (2D within a block) and its runs (rows spelled out).
        let mut per: Vec<Vec<Copy2D>> = Vec::with_capacity(transfers.len());
        for &(ids, host) in transfers {
            per.push(
                self.pieces_of_layers(ids, layers.clone(), max_pitch)?
                    .into_iter()
                    .map(|p| Copy2D {
                        dev: p.src,
                        dev_pitch: p.pitch,
                        host: host + p.at,
                        host_pitch: p.width,
                        width: p.width,
                        height: p.rows,
                    })
                    .collect(),
            );
        }
        let plain: usize = per.iter().map(Vec::len).sum();
        let runs: Vec<Vec<(usize, usize, usize)>> = per
            .iter()
            .map(|ps| {
                ps.iter()
                    .flat_map(|c| {
                        (0..c.height)
                            .map(move |r| (c.dev + r * c.dev_pitch, c.host + r * c.width, c.width))
                    })
                    .collect()
            })
            .collect();
        let same_shape = runs
            .windows(2)
            .all(|w| w[0].len() == w[1].len() && w[0].iter().zip(&w[1]).all(|(a, b)| a.2 == b.2));
        if !same_shape || runs.len() < 2 {
            return Ok(per.into_iter().flatten().collect());
        }
        // Run j of every transfer, in transfer order, cut where the steps change.
        let mut merged = Vec::new();
        for j in 0..runs[0].len() {
            let width = runs[0][j].2;
            let mut k = 0;
            while k < runs.len() {
                let (dev, host, _) = runs[k][j];
                let mut c = Copy2D {
                    dev,
                    dev_pitch: width,
                    host,
                    host_pitch: width,
                    width,
                    height: 1,
                };
                if k + 1 < runs.len() {
                    // Forward steps only (a 2D copy's pitches are positive), within the limit.
                    let (d1, h1, _) = runs[k + 1][j];
                    let step = |a: usize, b: usize| {
                        b.checked_sub(a).filter(|p| (width..=max_pitch).contains(p))
                    };
                    if let (Some(dp), Some(hp)) = (step(dev, d1), step(host, h1)) {
                        c.dev_pitch = dp;
                        c.host_pitch = hp;
                        while k + c.height < runs.len() {
                            let (dn, hn, _) = runs[k + c.height][j];
                            let next = |a: usize, p: usize| {
                                c.height.checked_mul(p).and_then(|o| a.checked_add(o))
                            };
                            if Some(dn) != next(dev, dp) || Some(hn) != next(host, hp) {
                                break;
                            }
                            c.height += 1;
                        }
                    }
                }
                k += c.height;
                merged.push(c);
                if merged.len() >= plain {
                    return Ok(per.into_iter().flatten().collect());
                }
            }
        }
        Ok(merged)
    }
}

/// A strided piece of a block in an engine tensor: `rows` runs of `width` bytes starting at
/// address `src`, `pitch` bytes apart; back to back at offset `at` of the canonical bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Address of the first run in the engine tensor.
    pub src: usize,
    /// Bytes between the starts of consecutive runs (≥ `width`).
    pub pitch: usize,
    /// Bytes per run.
    pub width: usize,
    /// Runs.
    pub rows: usize,
    /// Offset in the canonical bytes of the whole transfer.
    pub at: usize,
}

/// The running hashes of the checksum pieces of one slot that a layer-by-layer save has
/// begun and not finished: `(piece index, its hash so far)` (see
/// [`PagedKv::gather_layer_hashed`]).
pub type PieceParts = Vec<(usize, kvstore::checksum::PieceHash)>;

/// Gathers `segs` into `dst`, bytes `at..` of a `piece_len`-byte piece `piece`: hashed as they
/// are copied where they continue the piece's running hash in `parts` (or start the piece),
/// else copied only, and the piece's running hash (if any) dropped. Returns the piece's leaf
/// when this part completed it.
///
/// # Safety
/// Each segment is valid for reads of its bytes, does not overlap `dst`, and is not written
/// during the call; they add up to `dst.len()`.
unsafe fn gather_part(
    parts: &mut PieceParts,
    piece: usize,
    at: usize,
    piece_len: usize,
    dst: &mut [u8],
    segs: &[(usize, usize)],
) -> Option<u64> {
    let running = match parts.iter().position(|(p, _)| *p == piece) {
        Some(i) => Some(parts.swap_remove(i).1).filter(|h| h.done() == at),
        None if at == 0 => kvstore::checksum::PieceHash::new(piece_len),
        None => None,
    };
    if let Some(mut h) = running.filter(|h| h.fits(segs)) {
        // SAFETY: the caller's promises; the part fits.
        return match unsafe { h.gather(dst, segs) } {
            Some(leaf) => Some(leaf),
            None => {
                parts.push((piece, h));
                None
            }
        };
    }
    let mut to = 0;
    for &(addr, n) in segs {
        // SAFETY: the caller's promises.
        let from = unsafe { std::slice::from_raw_parts(addr as *const u8, n) };
        kvstore::copy_nt(&mut dst[to..to + n], from);
        to += n;
    }
    None
}

/// Calls `f(address, run)` for every contiguous run of one layer's block, in canonical order.
fn walk(p: &Plan, base: isize, f: &mut dyn FnMut(usize, usize)) {
    let n = p.outer.len();
    let mut idx = vec![0usize; n];
    loop {
        let off: isize = idx
            .iter()
            .zip(&p.outer)
            .map(|(&i, &(_, s))| i as isize * s)
            .sum();
        f((base + off) as usize, p.run);
        // Odometer increment, innermost first.
        let mut d = n;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < p.outer[d].0 {
                break;
            }
            idx[d] = 0;
        }
    }
}

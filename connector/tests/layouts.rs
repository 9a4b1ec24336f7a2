//! Gather/scatter against a per-element reference on every layout an engine may hand over,
//! with random data and random block ids.

use kvtier_connector::{Dim, LayerView, LayoutError, PagedKv};
use rand::{Rng, SeedableRng};

use Dim::{Blocks as B, Inner as I, Kv as K, Tokens as T};

/// A tensor: backing bytes plus a view (shape, strides in elements, dims).
struct Tensor {
    mem: Vec<u8>,
    shape: Vec<usize>,
    strides: Vec<isize>,
    dims: Vec<Dim>,
    elem: usize,
}

impl Tensor {
    /// A tensor whose physical (contiguous) order is `phys` (a permutation of the logical dims):
    /// `phys[0]` is the outermost. `step` multiplies the Blocks stride (a strided view).
    fn new(
        shape: &[usize],
        dims: &[Dim],
        phys: &[usize],
        elem: usize,
        step: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let mut strides = vec![0isize; shape.len()];
        let mut s = 1isize;
        for &d in phys.iter().rev() {
            strides[d] = s;
            s *= shape[d] as isize;
        }
        let b = dims.iter().position(|d| *d == B).unwrap();
        let total = (s as usize) * step;
        strides[b] *= step as isize;
        let mut mem = vec![0u8; total * elem];
        rng.fill(&mut mem[..]);
        Tensor {
            mem,
            shape: shape.to_vec(),
            strides,
            dims: dims.to_vec(),
            elem,
        }
    }

    fn view(&mut self) -> LayerView {
        LayerView {
            ptr: self.mem.as_mut_ptr() as usize,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            dims: self.dims.clone(),
            elem: self.elem,
        }
    }

    /// Canonical bytes of block `id`, element by element.
    fn reference(&self, id: usize) -> Vec<u8> {
        let pos = |d: Dim| self.dims.iter().position(|x| *x == d);
        let inner: Vec<usize> = (0..self.dims.len())
            .filter(|&j| self.dims[j] == I)
            .collect();
        let planes = pos(K).map_or(1, |p| self.shape[p]);
        let tokens = self.shape[pos(T).unwrap()];
        let n_inner: usize = inner.iter().map(|&j| self.shape[j]).product();
        let mut out = Vec::new();
        for kv in 0..planes {
            for t in 0..tokens {
                for flat in 0..n_inner {
                    // Unflatten in the listed Inner order (last fastest).
                    let mut rem = flat;
                    let mut off = id as isize * self.strides[pos(B).unwrap()]
                        + t as isize * self.strides[pos(T).unwrap()]
                        + pos(K).map_or(0, |p| kv as isize * self.strides[p]);
                    for &j in inner.iter().rev() {
                        off += (rem % self.shape[j]) as isize * self.strides[j];
                        rem /= self.shape[j];
                    }
                    let o = off as usize * self.elem;
                    out.extend_from_slice(&self.mem[o..o + self.elem]);
                }
            }
        }
        out
    }
}

fn check(name: &str, mut layers: Vec<Tensor>, rng: &mut impl Rng) {
    let views: Vec<LayerView> = layers.iter_mut().map(|t| t.view()).collect();
    // SAFETY: the tensors outlive `kv` and nothing else touches them during the copies.
    let kv = unsafe { PagedKv::new(views) }.unwrap();
    let nb = kv.blocks();
    let ids: Vec<usize> = (0..5).map(|_| rng.gen_range(0..nb)).collect();
    let mut got = vec![0u8; ids.len() * kv.block_bytes()];
    kv.gather(&ids, &mut got).unwrap();
    let mut want = Vec::new();
    for &id in &ids {
        for l in &layers {
            want.extend(l.reference(id));
        }
    }
    assert!(got == want, "{name}: gather differs from the reference");
    // The hashed gather (a save): the same bytes, and their block checksum.
    let mut hashed = vec![0u8; got.len()];
    let sum = kv.gather_hashed(&ids, &mut hashed).unwrap();
    assert!(hashed == want, "{name}: gather_hashed differs from gather");
    assert_eq!(
        sum,
        kvstore::checksum(&want),
        "{name}: gather_hashed's checksum"
    );
    // Layer by layer, hashing the pieces a layer writes whole: the same bytes, and with the
    // other pieces hashed at the end, the same checksum.
    let mut by_layer = vec![0u8; got.len()];
    let mut known = vec![None; got.len().div_ceil(kvstore::checksum::CHUNK)];
    let mut parts = Vec::new();
    for l in 0..kv.layers() {
        for (piece, leaf) in kv
            .gather_layer_hashed(&ids, &mut by_layer, l, &mut parts)
            .unwrap()
        {
            assert!(known[piece].is_none(), "{name}: piece {piece} hashed twice");
            known[piece] = Some(leaf);
        }
    }
    assert!(
        by_layer == want,
        "{name}: gather_layer_hashed differs from gather"
    );
    assert_eq!(
        kvstore::checksum_with_leaves(&by_layer, &known),
        kvstore::checksum(&want),
        "{name}: layer-by-layer checksum"
    );
    // Layers of whole pieces (Llama's shape): every piece was hashed as it was copied.
    let layer_bytes = kv.block_bytes() / kv.layers();
    if layer_bytes.is_multiple_of(kvstore::checksum::CHUNK) {
        assert!(
            known.iter().all(Option::is_some),
            "{name}: a piece not hashed in its layer"
        );
    }
    // One block a slot, layer by layer, in order and out of it: the same bytes and checksum.
    // Where the runs are whole 64-byte stripes and the layers come in order, every piece is
    // hashed as it is copied, those spanning layers (Qwen's shape: half a piece a layer)
    // in parts.
    let stripes = name.starts_with("llama-shaped") || name.starts_with("qwen-shaped");
    let bb = kv.block_bytes();
    let mut orders: Vec<Vec<usize>> = vec![(0..kv.layers()).collect()];
    orders.push((0..kv.layers()).rev().collect());
    for (o, order) in orders.iter().enumerate() {
        let mut one = vec![0u8; bb];
        let mut known = vec![None; bb.div_ceil(kvstore::checksum::CHUNK)];
        let mut parts = Vec::new();
        for &l in order {
            for (piece, leaf) in kv
                .gather_layer_hashed(&ids[..1], &mut one, l, &mut parts)
                .unwrap()
            {
                assert!(known[piece].is_none(), "{name}: piece {piece} hashed twice");
                known[piece] = Some(leaf);
            }
        }
        assert!(one[..] == want[..bb], "{name}: one block layer by layer");
        assert_eq!(
            kvstore::checksum_with_leaves(&one, &known),
            kvstore::checksum(&want[..bb]),
            "{name}: one block's layer-by-layer checksum (order {o})"
        );
        if stripes && o == 0 && kvstore::checksum::PieceHash::new(4096).is_some() {
            assert!(
                known.iter().all(Option::is_some),
                "{name}: a piece not hashed as its layers were copied: {known:?}"
            );
            assert!(parts.is_empty(), "{name}: a piece's hash left unfinished");
        }
    }
    assert!(kv
        .gather_layer_hashed(&ids, &mut by_layer, kv.layers(), &mut parts)
        .is_err());
    // The 2D pieces a GPU copy engine is given describe the same bytes, in order, with no
    // rows farther apart than its limit (none: one row per run).
    for max_pitch in [usize::MAX, 0] {
        let pieces = kv.pieces(&ids, max_pitch).unwrap();
        let mut emulated = vec![0u8; got.len()];
        let mut next = 0;
        for p in &pieces {
            assert_eq!(p.at, next, "{name}: pieces out of order");
            assert!(
                p.rows == 1 || (p.pitch >= p.width && p.pitch <= max_pitch),
                "{name}: overlapping rows or a pitch over {max_pitch}"
            );
            for r in 0..p.rows {
                let src = p.src + r * p.pitch;
                // SAFETY: the piece lies within a live tensor (the gather above read the same
                // bytes).
                let row = unsafe { std::slice::from_raw_parts(src as *const u8, p.width) };
                emulated[p.at + r * p.width..p.at + (r + 1) * p.width].copy_from_slice(row);
            }
            next += p.rows * p.width;
        }
        assert_eq!(next, got.len(), "{name}: pieces do not cover the blocks");
        assert!(emulated == got, "{name}: pieces differ from gather");
        // Layer by layer (what a layer-wise GPU copy moves): the same pieces, each layer's in
        // its place.
        let mut by_layer: Vec<_> = (0..kv.layers())
            .flat_map(|l| kv.pieces_of_layers(&ids, l..l + 1, max_pitch).unwrap())
            .collect();
        by_layer.sort_by_key(|p| p.at);
        assert_eq!(by_layer, pieces, "{name}: per-layer pieces differ");
        assert!(kv
            .pieces_of_layers(&ids, 0..kv.layers() + 1, max_pitch)
            .is_err());
    }
    // Several one-block transfers at once, as 2D copies coalesced across blocks: into one
    // contiguous buffer (blocks back to back), and into slots spaced unevenly. Replayed on the
    // CPU, they give what gather gives.
    let bb = kv.block_bytes();
    let consecutive: Vec<usize> = (0..nb.min(6)).collect();
    for (ids, spacing) in [
        (&consecutive, None),
        (&ids, None),
        (&consecutive, Some(vec![0usize, 1, 3, 4, 6, 7])),
    ] {
        let at: Vec<usize> = match &spacing {
            None => (0..ids.len()).map(|t| t * bb).collect(),
            Some(s) => s.iter().take(ids.len()).map(|k| k * (bb + 64)).collect(),
        };
        let mut host = vec![0u8; at.last().unwrap() + bb];
        let base = host.as_mut_ptr() as usize;
        let one: Vec<[usize; 1]> = ids.iter().map(|&i| [i]).collect();
        let transfers: Vec<(&[usize], usize)> = one
            .iter()
            .zip(&at)
            .map(|(i, a)| (&i[..], base + a))
            .collect();
        for max_pitch in [usize::MAX, 0] {
            let copies = kv.copies_2d(&transfers, 0..kv.layers(), max_pitch).unwrap();
            host.iter_mut().for_each(|b| *b = 0);
            for c in &copies {
                assert!(c.height == 1 || (c.dev_pitch >= c.width && c.host_pitch >= c.width));
                assert!(c.height == 1 || (c.dev_pitch <= max_pitch && c.host_pitch <= max_pitch));
                for r in 0..c.height {
                    // SAFETY: the run lies in a live tensor (the gather above read it) and in
                    // `host` (the copies address only the transfers' canonical forms).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (c.dev + r * c.dev_pitch) as *const u8,
                            (c.host + r * c.host_pitch) as *mut u8,
                            c.width,
                        )
                    };
                }
            }
            for (t, &id) in ids.iter().enumerate() {
                let mut want = vec![0u8; bb];
                kv.gather(&[id], &mut want).unwrap();
                assert!(
                    host[at[t]..at[t] + bb] == want[..],
                    "{name}: 2D copies differ from gather (block {id}, max pitch {max_pitch})"
                );
            }
            let pieces: usize = transfers
                .iter()
                .map(|(i, _)| kv.pieces(i, max_pitch).unwrap().len())
                .sum();
            assert!(
                copies.len() <= pieces,
                "{name}: coalescing made more copies"
            );
            // vLLM's GPU layouts (a layer's K and V of a block are one run each): a layer of
            // consecutive blocks into a contiguous buffer is a copy per run, not per block.
            let gpu_layout = ["kv-first nhd", "blocks-first", "mla"].contains(&name);
            if gpu_layout
                && spacing.is_none()
                && std::ptr::eq(ids, &consecutive)
                && max_pitch == usize::MAX
            {
                assert!(
                    copies.len() < pieces,
                    "{name}: consecutive blocks into a contiguous buffer were not coalesced"
                );
            }
        }
    }
    // Scatter into other blocks of the same tensors, then gather those back.
    let targets: Vec<usize> = ids.iter().map(|&i| (i + 1) % nb).collect();
    let mut dedup = targets.clone();
    dedup.sort();
    dedup.dedup();
    if dedup.len() == targets.len() {
        // The hashed scatter (a load) from shared memory, then a plain one over it: both put
        // the same bytes in place, and the hashed one returns their checksum.
        let mut shared = got.clone();
        // SAFETY: `shared` outlives the slice and nobody else writes it.
        let slice = unsafe { kvstore::ArenaSlice::new(shared.as_mut_ptr(), shared.len()) };
        let sum = kv.scatter_hashed(&targets, slice).unwrap();
        assert_eq!(
            sum,
            kvstore::checksum(&got),
            "{name}: scatter_hashed's checksum"
        );
        let mut back = vec![0u8; got.len()];
        kv.gather(&targets, &mut back).unwrap();
        assert!(
            back == got,
            "{name}: scatter_hashed then gather is not the identity"
        );
        for &t in &targets {
            let mut zero = vec![0u8; kv.block_bytes()];
            kv.scatter(&[t], &zero).unwrap();
            kv.gather(&[t], &mut zero).unwrap();
            assert!(zero.iter().all(|&b| b == 0));
        }
        kv.scatter(&targets, &got).unwrap();
        let mut back = vec![0u8; got.len()];
        kv.gather(&targets, &mut back).unwrap();
        assert!(
            back == got,
            "{name}: scatter then gather is not the identity"
        );
        for (t, &id) in targets.iter().enumerate() {
            let mut one = Vec::new();
            for l in &layers {
                one.extend(l.reference(id));
            }
            let bb = kv.block_bytes();
            assert!(
                one[..] == got[t * bb..(t + 1) * bb],
                "{name}: scattered bytes not in place"
            );
        }
    }
}

/// (name, shape, dims, physical order, element size).
type Case = (&'static str, Vec<usize>, Vec<Dim>, Vec<usize>, usize);

#[test]
fn every_layout_matches_the_reference() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (nb, bs, h, d) = (9, 32, 2, 64);
    for step in [1, 2] {
        let cases: Vec<Case> = vec![
            // FlashAttention: (2, blocks, tokens, heads, dim), NHD.
            (
                "kv-first nhd",
                vec![2, nb, bs, h, d],
                vec![K, B, T, I, I],
                vec![0, 1, 2, 3, 4],
                2,
            ),
            // Same logical view over an HND allocation (heads before tokens in memory).
            (
                "kv-first hnd",
                vec![2, nb, bs, h, d],
                vec![K, B, T, I, I],
                vec![0, 1, 3, 2, 4],
                2,
            ),
            // FlashInfer / Triton: blocks first.
            (
                "blocks-first",
                vec![nb, 2, bs, h, d],
                vec![B, K, T, I, I],
                vec![0, 1, 2, 3, 4],
                2,
            ),
            (
                "blocks-first hnd",
                vec![nb, 2, bs, h, d],
                vec![B, K, T, I, I],
                vec![0, 1, 3, 2, 4],
                2,
            ),
            // vLLM's CPU backend (float32, heads*dim packed).
            (
                "cpu",
                vec![nb, 2, bs, h * d],
                vec![B, K, T, I],
                vec![0, 1, 2, 3],
                4,
            ),
            // MLA latent: no K/V planes.
            ("mla", vec![nb, bs, 576], vec![B, T, I], vec![0, 1, 2], 2),
            // Llama-3-8B's shape per layer (16 tokens, 8 KV heads of 128, bf16): a layer of a
            // block is one checksum piece, hashed as the layer is gathered.
            (
                "llama-shaped",
                vec![2, nb, 16, 8, 128],
                vec![K, B, T, I, I],
                vec![0, 1, 2, 3, 4],
                2,
            ),
            // Qwen2.5-7B's shape (16 tokens, 4 KV heads of 128, bf16): a layer of a block is
            // half a checksum piece, hashed in parts as the layers are gathered.
            (
                "qwen-shaped",
                vec![2, nb, 16, 4, 128],
                vec![K, B, T, I, I],
                vec![0, 1, 2, 3, 4],
                2,
            ),
            // Runs that are not whole 64-byte stripes (a head of 20 elements, HND): the
            // hashed copies go through the private piece buffer.
            (
                "odd runs hnd",
                vec![2, nb, bs, h, 20],
                vec![K, B, T, I, I],
                vec![0, 1, 3, 2, 4],
                2,
            ),
            // K/V plane innermost-but-one, an odd but legal view.
            (
                "kv-inner",
                vec![nb, bs, 2, h, d],
                vec![B, T, K, I, I],
                vec![0, 1, 2, 3, 4],
                1,
            ),
        ];
        for (name, shape, dims, phys, elem) in cases {
            let layers = (0..3)
                .map(|_| Tensor::new(&shape, &dims, &phys, elem, step, &mut rng))
                .collect();
            check(&format!("{name} step {step}"), layers, &mut rng);
        }
    }
}

#[test]
fn bad_descriptions_are_clear_errors() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut t = Tensor::new(&[4, 2, 32, 8], &[B, K, T, I], &[0, 1, 2, 3], 2, 1, &mut rng);
    let mut v = t.view();
    v.dims = vec![B, K, I, I];
    // SAFETY: validation fails before any memory is touched.
    let e = unsafe { PagedKv::new(vec![v]) }.unwrap_err();
    assert_eq!(e, LayoutError::Dims { layer: 0 });
    let v = t.view();
    let mut other = Tensor::new(&[5, 2, 32, 8], &[B, K, T, I], &[0, 1, 2, 3], 2, 1, &mut rng);
    // SAFETY: as above.
    let e = unsafe { PagedKv::new(vec![v, other.view()]) }.unwrap_err();
    assert!(matches!(e, LayoutError::Mismatch { layer: 1, .. }));
    // SAFETY: tensors outlive the calls.
    let kv = unsafe { PagedKv::new(vec![t.view()]) }.unwrap();
    let mut buf = vec![0u8; kv.block_bytes()];
    assert_eq!(
        kv.gather(&[4], &mut buf).unwrap_err(),
        LayoutError::BlockId { id: 4, blocks: 4 }
    );
    assert!(matches!(
        kv.gather(&[0, 1], &mut buf),
        Err(LayoutError::Size { .. })
    ));
}

//! Save and load between paged KV tensors and an embedded store (the sidecar path is covered
//! by the Python and vLLM tests against a real kvtierd): byte-exact round trips into other
//! block ids, prefix semantics, and bad input refused without touching what is stored.

use std::time::Duration;

use kvstore::{BlockKey, Namespace, StoreConfig, TpShard};
use kvtier_connector::{Backend, Dim, LayerView, PagedKv, TransferError};
use rand::{Rng, SeedableRng};

const BLOCKS: usize = 16;
const SHAPE: [usize; 5] = [2, BLOCKS, 16, 2, 8]; // KV-first: (2, blocks, tokens, heads, dim)

fn tensors(seed: u64, layers: usize) -> Vec<Vec<u8>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..layers)
        .map(|_| {
            let mut v = vec![0u8; SHAPE.iter().product::<usize>() * 2];
            rng.fill(&mut v[..]);
            v
        })
        .collect()
}

/// Contiguous strides of SHAPE, in elements.
fn strides() -> Vec<isize> {
    let mut s = vec![1isize; SHAPE.len()];
    for j in (0..SHAPE.len() - 1).rev() {
        s[j] = s[j + 1] * SHAPE[j + 1] as isize;
    }
    s
}

fn paged(mem: &mut [Vec<u8>]) -> PagedKv {
    let views = mem
        .iter_mut()
        .map(|m| LayerView {
            ptr: m.as_mut_ptr() as usize,
            shape: SHAPE.to_vec(),
            strides: strides(),
            dims: vec![Dim::Kv, Dim::Blocks, Dim::Tokens, Dim::Inner, Dim::Inner],
            elem: 2,
        })
        .collect();
    // SAFETY: each view covers exactly its own Vec (contiguous strides of SHAPE, 2-byte
    // elements), the Vecs outlive the PagedKv in every test, and nothing else touches them
    // during a copy.
    unsafe { PagedKv::new(views).expect("valid layout") }
}

fn ns() -> Namespace {
    Namespace {
        model: "test/transfer".into(),
        dtype: "bfloat16".into(),
        layout: "kv-first".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn store() -> Backend {
    Backend::embedded(
        StoreConfig {
            capacity_bytes: 16 << 20,
            segment_bytes: 1 << 20,
            ..Default::default()
        }
        .build()
        .expect("store"),
    )
}

#[test]
fn round_trip_into_other_blocks_is_byte_exact() {
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let mut src = tensors(1, 3);
    let mut dst = tensors(2, 3);
    let (ps, pd) = (paged(&mut src), paged(&mut dst));
    // Keys 0..4 hold engine blocks [3], [0], [7, 8] (two engine blocks per kvtier block), [15].
    let ids = vec![vec![3], vec![0], vec![7, 8], vec![15]];
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    assert_eq!(b.save(id, &ps, &keys, &ids).unwrap(), 4);
    assert_eq!(b.save(id, &ps, &keys, &ids).unwrap(), 0, "already present");
    assert_eq!(b.match_prefix(&keys).unwrap(), 4);
    let into = vec![vec![9], vec![1], vec![4, 5], vec![2]];
    assert_eq!(b.load(&pd, &keys, &into, Duration::ZERO).unwrap(), 4);
    let mut a = vec![0u8; 5 * ps.block_bytes()];
    let mut c = vec![0u8; 5 * ps.block_bytes()];
    ps.gather(&[3, 0, 7, 8, 15], &mut a).unwrap();
    pd.gather(&[9, 1, 4, 5, 2], &mut c).unwrap();
    assert_eq!(a, c);
    // Blocks not loaded into are untouched.
    let fresh = tensors(2, 3);
    let pf = {
        let mut f = fresh.clone();
        let p = paged(&mut f);
        let mut x = vec![0u8; ps.block_bytes()];
        p.gather(&[10], &mut x).unwrap();
        x
    };
    let mut y = vec![0u8; ps.block_bytes()];
    pd.gather(&[10], &mut y).unwrap();
    assert_eq!(pf, y);
}

#[test]
fn load_stops_at_the_first_miss_or_size_mismatch() {
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let mut src = tensors(3, 2);
    let mut dst = tensors(4, 2);
    let (ps, pd) = (paged(&mut src), paged(&mut dst));
    let keys: Vec<BlockKey> = (10..14).map(key).collect();
    // Store keys 10, 11, 13 (12 missing).
    b.save(
        id,
        &ps,
        &[keys[0], keys[1], keys[3]],
        &[vec![0], vec![1], vec![3]],
    )
    .unwrap();
    let ids: Vec<Vec<usize>> = (0..4).map(|i| vec![i + 4]).collect();
    assert_eq!(b.load(&pd, &keys, &ids, Duration::ZERO).unwrap(), 2);
    // A stored block of one engine block asked for as two: the prefix ends there.
    let two = vec![vec![6, 7], vec![8]];
    assert_eq!(
        b.load(&pd, &[keys[0], keys[1]], &two, Duration::ZERO)
            .unwrap(),
        0
    );
}

#[test]
fn bad_input_is_refused_and_stored_blocks_survive() {
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let mut src = tensors(5, 2);
    let ps = paged(&mut src);
    let k = [key(20)];
    assert_eq!(b.save(id, &ps, &k, &[vec![1]]).unwrap(), 1);
    let e = b.save(id, &ps, &[key(21)], &[vec![BLOCKS]]).unwrap_err();
    assert!(matches!(e, TransferError::Layout(_)), "{e}");
    assert!(e.to_string().contains(&BLOCKS.to_string()), "{e}");
    let e = b
        .save(id, &ps, &[key(22), key(23)], &[vec![1]])
        .unwrap_err();
    assert!(matches!(e, TransferError::Input(_)), "{e}");
    let e = b.load(&ps, &k, &[vec![]], Duration::ZERO).unwrap_err();
    assert!(matches!(e, TransferError::Input(_)), "{e}");
    // The refused save left nothing behind, and the stored block is intact.
    assert_eq!(b.match_prefix(&[key(21)]).unwrap(), 0);
    let mut dst = tensors(6, 2);
    let pd = paged(&mut dst);
    assert_eq!(b.load(&pd, &k, &[vec![2]], Duration::ZERO).unwrap(), 1);
    let (mut x, mut y) = (vec![0u8; ps.block_bytes()], vec![0u8; ps.block_bytes()]);
    ps.gather(&[1], &mut x).unwrap();
    pd.gather(&[2], &mut y).unwrap();
    assert_eq!(x, y);
}

/// Large transfers split across copy threads: byte-exact, prefix semantics kept (a missing
/// block in the middle ends the prefix even though later blocks were copied in parallel), and
/// engine block ids that repeat are scattered in order (the last wins), not raced.
#[test]
fn parallel_copies_are_byte_exact_and_keep_prefix_semantics() {
    const BIG: [usize; 5] = [2, 12, 256, 8, 64]; // 512 KiB per layer per block
    let mut b = Backend::embedded(
        StoreConfig {
            capacity_bytes: 64 << 20,
            segment_bytes: 4 << 20,
            ..Default::default()
        }
        .build()
        .expect("store"),
    );
    b.set_copy_threads(2);
    assert_eq!(b.copy_threads(), 2);
    let id = b.register_namespace(&ns()).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut mem: Vec<Vec<u8>> = (0..4)
        .map(|_| {
            let mut v = vec![0u8; BIG.iter().product::<usize>() * 2];
            rng.fill(&mut v[..]);
            v
        })
        .collect();
    let mut st = vec![1isize; 5];
    for j in (0..4).rev() {
        st[j] = st[j + 1] * BIG[j + 1] as isize;
    }
    let views: Vec<LayerView> = mem
        .iter_mut()
        .map(|m| LayerView {
            ptr: m.as_mut_ptr() as usize,
            shape: BIG.to_vec(),
            strides: st.clone(),
            dims: vec![Dim::Kv, Dim::Blocks, Dim::Tokens, Dim::Inner, Dim::Inner],
            elem: 2,
        })
        .collect();
    // SAFETY: each view covers exactly its own Vec, which outlives `p`; nothing else touches
    // them during a copy.
    let p = unsafe { PagedKv::new(views).expect("valid layout") };
    assert_eq!(p.block_bytes(), 2 << 20);
    let keys: Vec<BlockKey> = (100..106).map(key).collect();
    let ids: Vec<Vec<usize>> = (0..6).map(|i| vec![i]).collect();
    // Keys 0, 1, 2, 4, 5 stored (3 missing).
    let stored: Vec<usize> = vec![0, 1, 2, 4, 5];
    let sk: Vec<BlockKey> = stored.iter().map(|&i| keys[i]).collect();
    let si: Vec<Vec<usize>> = stored.iter().map(|&i| ids[i].clone()).collect();
    assert_eq!(b.save(id, &p, &sk, &si).unwrap(), 5);
    let want = |blocks: &[usize]| {
        let mut v = vec![0u8; blocks.len() * p.block_bytes()];
        p.gather(blocks, &mut v).unwrap();
        v
    };
    let before = want(&[0, 1, 2]);
    // Into blocks 6..12: three loaded, the rest untouched or ignored.
    let into: Vec<Vec<usize>> = (6..12).map(|i| vec![i]).collect();
    assert_eq!(b.load(&p, &keys, &into, Duration::ZERO).unwrap(), 3);
    assert_eq!(want(&[6, 7, 8]), before);
    // A repeated engine block id: scattered in order, the last key wins.
    let dup = vec![vec![9], vec![9]];
    assert_eq!(
        b.load(&p, &[keys[4], keys[5]], &dup, Duration::ZERO)
            .unwrap(),
        2
    );
    assert_eq!(want(&[9]), want(&[5]));
    // Pages of segments (SGLang's v1 calls), split across threads the same way.
    let pages_src: Vec<Vec<u8>> = (0..8)
        .map(|_| {
            let mut v = vec![0u8; 1 << 20];
            rng.fill(&mut v[..]);
            v
        })
        .collect();
    let pk: Vec<BlockKey> = (200..208).map(key).collect();
    let src: Vec<Vec<&[u8]>> = pages_src
        .iter()
        .map(|v| vec![&v[..1000], &v[1000..]])
        .collect();
    assert_eq!(b.write_segments(id, &pk, &src).unwrap(), vec![true; 8]);
    let mut out: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 1 << 20]).collect();
    let mut dst: Vec<Vec<&mut [u8]>> = out
        .iter_mut()
        .map(|v| {
            let (a, c) = v.split_at_mut(4096);
            vec![a, c]
        })
        .collect();
    assert_eq!(
        b.read_segments(&pk, &mut dst, Duration::ZERO).unwrap(),
        vec![true; 8]
    );
    drop(dst);
    assert_eq!(out, pages_src);
}

#[test]
fn layerwise_loads_copy_each_layer_before_reporting_it() {
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let layers = 3;
    let mut src = tensors(7, layers);
    let ps = paged(&mut src);
    let keys: Vec<BlockKey> = (20..24).map(key).collect();
    let ids = [vec![1], vec![2, 3], vec![4], vec![5]];
    assert_eq!(b.save(id, &ps, &keys[..3], &ids[..3]).unwrap(), 3);
    let mut dst = tensors(8, layers);
    let pd = paged(&mut dst);
    let into = vec![vec![9], vec![10, 11], vec![12], vec![13]];
    // Every layer is the same size here: the canonical block is `layers` equal parts.
    let per = ps.block_bytes() / layers;
    let mut seen = Vec::new();
    let n = b
        .load_layerwise(&pd, &keys, &into, Duration::ZERO, &mut |layer, n| {
            seen.push((layer, n));
            // When layer k is reported, layers <= k of every loaded block hold the saved
            // bytes and the later layers are untouched.
            for (from, to) in ids.iter().zip(&into).take(n) {
                let mut a = vec![0u8; from.len() * ps.block_bytes()];
                let mut c = vec![0u8; to.len() * pd.block_bytes()];
                ps.gather(from, &mut a).unwrap();
                pd.gather(to, &mut c).unwrap();
                for e in 0..from.len() {
                    for l in 0..layers {
                        let at = e * ps.block_bytes() + l * per;
                        let (x, y) = (&a[at..at + per], &c[at..at + per]);
                        if l <= layer {
                            assert_eq!(x, y, "layer {l} when {layer} was reported");
                        } else {
                            assert_ne!(x, y, "layer {l} copied before {layer} was reported");
                        }
                    }
                }
            }
        })
        .unwrap();
    assert_eq!(n, 3, "key 23 is missing: the prefix is 3");
    assert_eq!(seen, vec![(0, 3), (1, 3), (2, 3)]);
    // Block 13 (key 23, not loaded) is untouched.
    let mut fresh = tensors(8, layers);
    let pf = paged(&mut fresh);
    let (mut x, mut y) = (vec![0u8; pf.block_bytes()], vec![0u8; pd.block_bytes()]);
    pf.gather(&[13], &mut x).unwrap();
    pd.gather(&[13], &mut y).unwrap();
    assert_eq!(x, y);
    // Bad block ids are refused before anything is loaded.
    assert!(b
        .load_layerwise(
            &pd,
            &keys[..1],
            &[vec![BLOCKS]],
            Duration::ZERO,
            &mut |_, _| { panic!("no layer may be reported") }
        )
        .is_err());
}

#[test]
fn a_layerwise_load_never_keeps_bytes_written_into_the_slot_after_the_check() {
    // A stalled writer (another process: a second mapping of the arena) writes into a
    // committed block's slot while its load copies it layer by layer. The load used to verify
    // the slot first and then copy each layer from it: the later layers were served. Now the
    // engine's own copy is verified once every layer is in, and the block is failed.
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let layers = 3;
    let mut src = tensors(17, layers);
    let ps = paged(&mut src);
    let keys: Vec<BlockKey> = (40..43).map(key).collect();
    let ids = [vec![1], vec![2], vec![3]];
    assert_eq!(b.save(id, &ps, &keys, &ids).unwrap(), 3);
    let store = b.store().expect("embedded");
    let offset = store.get(&keys[1]).expect("stored").arena_offset() as usize;
    // SAFETY: a second shared mapping of the store's memfd, as an engine process maps it; the
    // test writes only inside one committed block's slot.
    let mut other = unsafe {
        memmap2::MmapMut::map_mut(&std::fs::File::from(
            store.arena().fd().try_clone_to_owned().unwrap(),
        ))
    }
    .expect("map the arena");
    let per = ps.block_bytes() / layers;
    let mut dst = tensors(18, layers);
    let pd = paged(&mut dst);
    let into = [vec![9], vec![10], vec![11]];
    let mut reported = Vec::new();
    let n = b
        .load_layerwise(&pd, &keys, &into, Duration::ZERO, &mut |layer, n| {
            reported.push((layer, n));
            if layer == 0 {
                // Layer 2 of key 41's block, before the load copies it.
                for x in &mut other[offset + 2 * per..offset + 3 * per] {
                    *x = !*x;
                }
            }
        })
        .unwrap();
    assert_eq!(reported, vec![(0, 3), (1, 3), (2, 3)]);
    assert_eq!(
        n, 1,
        "key 41's block changed after its check: the prefix ends before it"
    );
    // What was kept is exact.
    assert_eq!(canon(&pd, &into[0]), canon(&ps, &ids[0]));
}

/// Engine blocks `ids` of `p`, canonical form.
fn canon(p: &PagedKv, ids: &[usize]) -> Vec<u8> {
    let mut v = vec![0u8; ids.len() * p.block_bytes()];
    p.gather(ids, &mut v).unwrap();
    v
}

#[test]
fn layerwise_saves_commit_whole_blocks_each_layer_as_it_was_when_saved() {
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let layers = 3;
    let mut src = tensors(9, layers);
    let ps = paged(&mut src);
    let keys: Vec<BlockKey> = (30..34).map(key).collect();
    let ids = vec![vec![1], vec![2, 3], vec![4], vec![5]];
    // Key 30 is there already: not reserved again, not counted.
    assert_eq!(b.save(id, &ps, &keys[..1], &ids[..1]).unwrap(), 1);
    let want_before = canon(&ps, &[2, 3, 4, 5]);
    let mut s = b.begin_layer_save(id, &ps, &keys, &ids, &[]).unwrap();
    assert_eq!(s.held(), 3);
    b.save_layer(&mut s, &ps, 2).unwrap();
    b.save_layer(&mut s, &ps, 0).unwrap();
    b.save_layer(&mut s, &ps, 0).unwrap(); // again: a no-op
    assert_eq!(s.layers_done(), 2);
    // Not visible with a layer missing.
    assert_eq!(b.match_prefix(&keys).unwrap(), 1);
    // The engine writes layer 0 again after its save (it must not reach the stored block),
    // and layer 1 before the finish gathers it (it must).
    drop(ps);
    for layer in &mut src[..2] {
        layer.iter_mut().for_each(|x| *x = x.wrapping_add(1));
    }
    let ps = paged(&mut src);
    let want_after = canon(&ps, &[2, 3, 4, 5]);
    assert!(matches!(
        b.save_layer(&mut s, &ps, layers),
        Err(TransferError::Input(_))
    ));
    assert_eq!(b.finish_layer_save(s, &ps).unwrap(), 3);
    assert_eq!(b.match_prefix(&keys).unwrap(), 4);
    // Loaded back (checksums verified on the way): layer 0 as saved, layers 1 and 2 as at the
    // finish.
    let mut dst = tensors(10, layers);
    let pd = paged(&mut dst);
    let into = vec![vec![9], vec![10, 11], vec![12], vec![13]];
    assert_eq!(b.load(&pd, &keys, &into, Duration::ZERO).unwrap(), 4);
    let got = canon(&pd, &[10, 11, 12, 13]);
    let per = ps.block_bytes() / layers;
    for blk in 0..4 {
        for l in 0..layers {
            let at = blk * ps.block_bytes() + l * per;
            let want = if l == 0 { &want_before } else { &want_after };
            assert_eq!(
                got[at..at + per],
                want[at..at + per],
                "block {blk} layer {l}"
            );
        }
    }
    // An aborted save stores nothing and frees its slots (a later save stores the keys).
    let more: Vec<BlockKey> = (40..42).map(key).collect();
    let mids = vec![vec![6], vec![7]];
    let mut s = b.begin_layer_save(id, &ps, &more, &mids, &[]).unwrap();
    b.save_layer(&mut s, &ps, 0).unwrap();
    b.abort_layer_save(s).unwrap();
    assert_eq!(b.match_prefix(&more).unwrap(), 0);
    assert_eq!(b.save(id, &ps, &more, &mids).unwrap(), 2);
    // Bad input is refused before anything is reserved.
    assert!(b
        .begin_layer_save(id, &ps, &more, &[vec![BLOCKS], vec![1]], &[])
        .is_err());
    assert!(b
        .begin_layer_save(id, &ps, &more, &mids, &[vec![1u8; 8]])
        .is_err());
}

/// A layer-by-layer save of Llama-3-8B-shaped layers (16 tokens, 8 KV heads of 128, bf16: a
/// layer of a block is one 64 KiB checksum piece, hashed as the layer is copied, so the
/// commit hashes nothing again): the blocks load back byte-exact, their checksums verified.
#[test]
fn layerwise_saves_of_whole_piece_layers_load_back_verified() {
    layerwise_save_loads_back(8, &[2, 0, 1]);
}

/// Qwen2.5-7B's shape (4 KV heads of 128): a layer of a block is half a checksum piece, so
/// the layers, saved in order, hash each piece in two parts (`PieceHash`), and the loads
/// verify those leaves; a wrong one would be a miss here.
#[test]
fn layerwise_saves_of_half_piece_layers_load_back_verified() {
    layerwise_save_loads_back(4, &[0, 1, 2]);
    layerwise_save_loads_back(4, &[1, 0, 2]);
}

/// Saves 3 layers of `heads` KV heads (16 tokens, head 128, bf16) layer by layer in `order`,
/// loads them into other blocks and compares.
fn layerwise_save_loads_back(heads: usize, order: &[usize]) {
    let shape = [2usize, 4, 16, heads, 128];
    let mut st = vec![1isize; shape.len()];
    for j in (0..shape.len() - 1).rev() {
        st[j] = st[j + 1] * shape[j + 1] as isize;
    }
    let make = |seed: u64| -> Vec<Vec<u8>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..3)
            .map(|_| {
                let mut v = vec![0u8; shape.iter().product::<usize>() * 2];
                rng.fill(&mut v[..]);
                v
            })
            .collect()
    };
    let view = |mem: &mut [Vec<u8>]| {
        let views = mem
            .iter_mut()
            .map(|m| LayerView {
                ptr: m.as_mut_ptr() as usize,
                shape: shape.to_vec(),
                strides: st.clone(),
                dims: vec![Dim::Kv, Dim::Blocks, Dim::Tokens, Dim::Inner, Dim::Inner],
                elem: 2,
            })
            .collect();
        // SAFETY: each view covers exactly its own Vec (contiguous strides, 2-byte elements);
        // the Vecs outlive the PagedKv and nothing else touches them during a copy.
        unsafe { PagedKv::new(views).expect("valid layout") }
    };
    let b = store();
    let id = b.register_namespace(&ns()).unwrap();
    let mut src = make(21);
    let ps = view(&mut src);
    assert_eq!(ps.block_bytes(), 3 * (8 << 10) * heads);
    let keys: Vec<BlockKey> = (50..53).map(key).collect();
    let ids = vec![vec![0], vec![1, 2], vec![3]];
    let mut s = b.begin_layer_save(id, &ps, &keys, &ids, &[]).unwrap();
    for &layer in order {
        b.save_layer(&mut s, &ps, layer).unwrap();
    }
    assert_eq!(b.finish_layer_save(s, &ps).unwrap(), 3);
    let mut dst = make(22);
    let pd = view(&mut dst);
    let into = vec![vec![3], vec![2, 1], vec![0]];
    assert_eq!(b.load(&pd, &keys, &into, Duration::ZERO).unwrap(), 3);
    for (a, c) in ids.iter().zip(&into) {
        assert!(canon(&ps, a) == canon(&pd, c), "a block differs");
    }
}

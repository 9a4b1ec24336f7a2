//! The slot checks of a layer-by-layer load, run on the CPU (the GPU path queues copies
//! where these scatter): every check passes what was committed and stops at a slot
//! written after its commit, whatever the pieces' and layers' boundaries.
use super::*;
use crate::layout::{Dim, LayerView};
use rand::{Rng, SeedableRng};

fn paged(mem: &mut [Vec<u8>], shape: &[usize]) -> PagedKv {
    let mut st = vec![1isize; shape.len()];
    for j in (0..shape.len() - 1).rev() {
        st[j] = st[j + 1] * shape[j + 1] as isize;
    }
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
    // SAFETY: each view covers exactly its own Vec (contiguous strides, 2-byte elements),
    // which outlives the PagedKv; nothing else touches them during a copy.
    unsafe { PagedKv::new(views).expect("valid layout") }
}

fn tensors(rng: &mut rand::rngs::StdRng, layers: usize, shape: &[usize]) -> Vec<Vec<u8>> {
    (0..layers)
        .map(|_| {
            let mut v = vec![0u8; shape.iter().product::<usize>() * 2];
            rng.fill(&mut v[..]);
            v
        })
        .collect()
}

#[test]
fn every_slot_check_passes_committed_blocks_and_stops_at_a_changed_one() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    // (layers, shape): 7,680 bytes a layer (pieces straddle layers and engine blocks),
    // and 64 KiB a layer (a piece is a layer, as for Llama-3-8B).
    for (layers, shape) in [(5, [2, 16, 16, 3, 40]), (2, [2, 4, 16, 8, 128])] {
        let b = Backend::embedded(
            kvstore::StoreConfig {
                capacity_bytes: 16 << 20,
                segment_bytes: 1 << 20,
                ..Default::default()
            }
            .build()
            .expect("store"),
        );
        let ns = b
            .register_namespace(&Namespace {
                model: format!("test/slot-check/{layers}"),
                dtype: "bfloat16".into(),
                layout: "kv-first".into(),
                block_tokens: 16,
                tp: kvstore::TpShard::Rank { size: 1, rank: 0 },
                tenant: String::new(),
                lora: String::new(),
            })
            .unwrap();
        let mut src = tensors(&mut rng, layers, &shape);
        let ps = paged(&mut src, &shape);
        let ids = if shape[1] == 16 {
            vec![vec![3], vec![0, 1], vec![7, 8, 9], vec![15]]
        } else {
            vec![vec![3], vec![0], vec![1, 2], vec![2]]
        };
        let keys: Vec<BlockKey> = (0..4u128)
            .map(|i| BlockKey((i + 5).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)))
            .collect();
        assert_eq!(b.save(ns, &ps, &keys, &ids).unwrap(), 4);
        let load = |check: SlotCheck| -> (usize, Vec<usize>) {
            let mut dst = tensors(&mut rand::rngs::StdRng::seed_from_u64(1), layers, &shape);
            let pd = paged(&mut dst, &shape);
            let mut queued = Vec::new();
            let n = b
                .load_layers_with(
                    &pd,
                    &keys,
                    &ids,
                    Duration::ZERO,
                    check,
                    &mut |l, blocks| {
                        for (i, (s, _)) in blocks.iter().enumerate() {
                            pd.scatter_layer(&ids[i], *s, l)?;
                        }
                        queued.push(blocks.len());
                        Ok(())
                    },
                    &mut || Ok(()),
                )
                .unwrap();
            for (i, id) in ids.iter().enumerate().take(n) {
                let (mut want, mut got) = (
                    vec![0u8; id.len() * ps.block_bytes()],
                    vec![0u8; id.len() * ps.block_bytes()],
                );
                ps.gather(id, &mut want).unwrap();
                pd.gather(id, &mut got).unwrap();
                assert!(want == got, "{check:?}: block {i} differs after its load");
            }
            (n, queued)
        };
        for check in [SlotCheck::Off, SlotCheck::First, SlotCheck::Beside] {
            assert_eq!(
                load(check),
                (4, vec![4; layers]),
                "{check:?}, {layers} layers"
            );
        }
        // A stalled writer changes the last piece of key 2's slot (another mapping).
        let kv = b.store().expect("embedded");
        let at = kv.get(&keys[2]).expect("stored").arena_offset() as usize;
        let len = ids[2].len() * ps.block_bytes();
        // SAFETY: a second shared mapping of the store's memfd, as an engine process maps
        // it; the test writes one byte inside one committed block's slot.
        let mut other = unsafe {
            memmap2::MmapMut::map_mut(&std::fs::File::from(
                kv.arena().fd().try_clone_to_owned().unwrap(),
            ))
        }
        .expect("map the arena");
        other[at + len - 3] ^= 0x10;
        assert_eq!(load(SlotCheck::First), (2, vec![2; layers]));
        assert_eq!(load(SlotCheck::Beside), (2, vec![4; layers]));
    }
}

//! GPU gather/scatter (feature `cuda`) against the CPU path on the same bytes, for the layouts
//! engines hand over. Without a CUDA driver and GPU each test says so and passes: the default
//! build and CI have none; `scripts/gpu-check.sh` runs these on a GPU machine.
#![cfg(feature = "cuda")]

use kvtier_connector::cuda::{driver_present, CudaCopier};
use kvtier_connector::{Dim, LayerView, PagedKv, SlotCheck};
use rand::{Rng, SeedableRng};

use Dim::{Blocks as B, Inner as I, Kv as K, Tokens as T};

/// No GPU skips a test, unless `KVTIER_REQUIRE_GPU` is set (`scripts/gpu-check.sh run`):
/// then it fails.
fn no_gpu(why: &str) {
    if std::env::var_os("KVTIER_REQUIRE_GPU").is_some() {
        panic!("{why}, and KVTIER_REQUIRE_GPU is set");
    }
    eprintln!("SKIPPED: {why}");
}

fn copier() -> Option<CudaCopier> {
    if !driver_present() {
        no_gpu("no CUDA driver on this machine");
        return None;
    }
    match CudaCopier::new(0) {
        Ok(c) => Some(c),
        Err(e) => {
            no_gpu(&format!("no usable GPU: {e}"));
            None
        }
    }
}

/// Contiguous strides for `shape` laid out in `phys` order (outermost first), in elements.
fn strides(shape: &[usize], phys: &[usize]) -> (Vec<isize>, usize) {
    let mut st = vec![0isize; shape.len()];
    let mut s = 1isize;
    for &d in phys.iter().rev() {
        st[d] = s;
        s *= shape[d] as isize;
    }
    (st, s as usize)
}

fn views(ptrs: &[usize], shape: &[usize], st: &[isize], dims: &[Dim], elem: usize) -> PagedKv {
    let v = ptrs
        .iter()
        .map(|&ptr| LayerView {
            ptr,
            shape: shape.to_vec(),
            strides: st.to_vec(),
            dims: dims.to_vec(),
            elem,
        })
        .collect();
    // SAFETY: every pointer is a live allocation (host Vec or device slice) of the size the
    // shape and strides describe, kept alive by the caller across all copies.
    unsafe { PagedKv::new(v).expect("valid layout") }
}

/// `layers` buffers of `bytes` random bytes each.
fn random_layers(rng: &mut rand::rngs::StdRng, layers: usize, bytes: usize) -> Vec<Vec<u8>> {
    (0..layers)
        .map(|_| {
            let mut v = vec![0u8; bytes];
            rng.fill(&mut v[..]);
            v
        })
        .collect()
}

/// An embedded store (64 MiB) whose arena is registered with `c`'s driver, and a bf16
/// namespace of 16-token blocks in it.
fn pinned_store(
    c: &std::sync::Arc<CudaCopier>,
    model: &str,
    layout: &str,
) -> (kvtier_connector::Backend, kvstore::NsId) {
    let store = kvtier_connector::Backend::embedded(
        kvstore::StoreConfig {
            capacity_bytes: 64 << 20,
            segment_bytes: 4 << 20,
            ..Default::default()
        }
        .build()
        .unwrap(),
    );
    assert!(store.pin_for_cuda(c).unwrap(), "arena registration failed");
    let ns = store
        .register_namespace(&kvstore::Namespace {
            model: model.into(),
            dtype: "bfloat16".into(),
            layout: layout.into(),
            block_tokens: 16,
            tp: kvstore::TpShard::Rank { size: 1, rank: 0 },
            tenant: String::new(),
            lora: String::new(),
        })
        .unwrap();
    (store, ns)
}

/// (name, shape, dims, physical order, element size, padding per dim (elements the
/// allocation has beyond the shape: odd strides), offset of the view's start (elements)).
type Case = (
    &'static str,
    Vec<usize>,
    Vec<Dim>,
    Vec<usize>,
    usize,
    Vec<usize>,
    usize,
);

#[test]
fn gpu_gather_and_scatter_match_the_cpu_path() {
    let Some(c) = copier() else { return };
    let stream = c.stream().clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (nb, bs, h, d) = (24, 16, 4, 64);
    let cases: Vec<Case> = vec![
        (
            "kv-first nhd (FlashAttention)",
            vec![2, nb, bs, h, d],
            vec![K, B, T, I, I],
            vec![0, 1, 2, 3, 4],
            2,
            vec![0; 5],
            0,
        ),
        (
            "kv-first hnd",
            vec![2, nb, bs, h, d],
            vec![K, B, T, I, I],
            vec![0, 1, 3, 2, 4],
            2,
            vec![0; 5],
            0,
        ),
        (
            "blocks-first nhd (FlashInfer)",
            vec![nb, 2, bs, h, d],
            vec![B, K, T, I, I],
            vec![0, 1, 2, 3, 4],
            2,
            vec![0; 5],
            0,
        ),
        (
            "blocks-first hnd (FlashInfer HND)",
            vec![nb, 2, bs, h, d],
            vec![B, K, T, I, I],
            vec![0, 1, 3, 2, 4],
            2,
            vec![0; 5],
            0,
        ),
        (
            "mla",
            vec![nb, bs, 576],
            vec![B, T, I],
            vec![0, 1, 2],
            2,
            vec![0; 3],
            0,
        ),
        (
            "kv-first, padded head dim and tokens, offset view",
            vec![2, nb, bs, h, d],
            vec![K, B, T, I, I],
            vec![0, 1, 2, 3, 4],
            2,
            vec![0, 1, 3, 0, 8],
            5,
        ),
        (
            "blocks-first hnd, padded heads, odd offset, fp32",
            vec![nb, 2, bs, h, d],
            vec![B, K, T, I, I],
            vec![0, 1, 3, 2, 4],
            4,
            vec![2, 0, 1, 1, 3],
            3,
        ),
        (
            "mla, padded rows, offset",
            vec![nb, bs, 576],
            vec![B, T, I],
            vec![0, 1, 2],
            2,
            vec![0, 0, 64],
            7,
        ),
    ];
    for (name, shape, dims, phys, elem, pad, off) in cases {
        let alloc: Vec<usize> = shape.iter().zip(&pad).map(|(s, p)| s + p).collect();
        let (st, n) = strides(&alloc, &phys);
        let n = n + off;
        let at = off * elem;
        let host = random_layers(&mut rng, 3, n * elem);
        let dev: Vec<_> = host.iter().map(|h| stream.clone_htod(h).unwrap()).collect();
        let dptrs: Vec<usize> = dev
            .iter()
            .map(|s| {
                let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(s, &stream);
                p as usize + at
            })
            .collect();
        let hptrs: Vec<usize> = host.iter().map(|h| h.as_ptr() as usize + at).collect();
        let gpu = views(&dptrs, &shape, &st, &dims, elem);
        let cpu = views(&hptrs, &shape, &st, &dims, elem);
        let ids = vec![3, 0, 17, 5, 23, 9];
        let mut want = vec![0u8; ids.len() * cpu.block_bytes()];
        cpu.gather(&ids, &mut want).unwrap();
        let mut got = vec![0u8; want.len()];
        // SAFETY: `dev` and `got` stay alive and untouched until synchronize() below.
        unsafe { c.gather(&gpu, &ids, &mut got) }.unwrap();
        c.synchronize().unwrap();
        assert!(
            got == want,
            "{name}: GPU gather differs from the CPU gather"
        );
        // Scatter into other blocks on the GPU, copy the tensors back, gather on the CPU.
        let targets = vec![1, 2, 4, 6, 7, 8];
        // SAFETY: as above; `want` is only read.
        unsafe { c.scatter(&gpu, &targets, &want) }.unwrap();
        c.synchronize().unwrap();
        let back: Vec<Vec<u8>> = dev.iter().map(|s| stream.clone_dtoh(s).unwrap()).collect();
        let bptrs: Vec<usize> = back.iter().map(|h| h.as_ptr() as usize + at).collect();
        let after = views(&bptrs, &shape, &st, &dims, elem);
        // The padding between rows and before the view is untouched too.
        let pads_kept = back.iter().zip(&host).all(|(b, h)| {
            let (mut bb, mut hh) = (b.clone(), h.clone());
            for v in [&mut bb, &mut hh] {
                let view = views(&[v.as_mut_ptr() as usize + at], &shape, &st, &dims, elem);
                let zero = vec![0u8; view.block_bytes()];
                for blk in 0..view.blocks() {
                    view.scatter(&[blk], &zero).unwrap();
                }
            }
            bb == hh
        });
        assert!(
            pads_kept,
            "{name}: a GPU scatter wrote outside the view's elements"
        );
        let mut again = vec![0u8; want.len()];
        after.gather(&targets, &mut again).unwrap();
        assert!(
            again == want,
            "{name}: GPU scatter did not land where the CPU path says"
        );
        // Blocks not scattered into are untouched.
        let mut untouched = vec![0u8; after.block_bytes()];
        let mut orig = vec![0u8; after.block_bytes()];
        after.gather(&[10], &mut untouched).unwrap();
        cpu.gather(&[10], &mut orig).unwrap();
        assert!(
            untouched == orig,
            "{name}: a block outside the scatter changed"
        );
        eprintln!(
            "{name}: GPU gather/scatter byte-exact ({} pieces)",
            gpu.pieces(&ids, usize::MAX).unwrap().len()
        );
    }
}

#[test]
fn wrong_sizes_are_refused_before_any_copy() {
    let Some(c) = copier() else { return };
    let stream = c.stream().clone();
    let shape = vec![2, 4, 16, 2, 64];
    let (st, n) = strides(&shape, &[0, 1, 2, 3, 4]);
    let dev = stream.alloc_zeros::<u8>(n * 2).unwrap();
    let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
    let gpu = views(&[p as usize], &shape, &st, &[K, B, T, I, I], 2);
    let mut small = vec![0u8; 10];
    // SAFETY: nothing is queued: the size check fails first.
    assert!(unsafe { c.gather(&gpu, &[0], &mut small) }.is_err());
    let mut ok = vec![0u8; gpu.block_bytes()];
    // SAFETY: as above; block 4 does not exist.
    assert!(unsafe { c.gather(&gpu, &[4], &mut ok) }.is_err());
}

/// The transfer API's GPU path through an embedded store whose arena is registered with the
/// driver: a layer-by-layer save from device tensors (each layer after an event), then a
/// layer-by-layer load into other device blocks (an event per layer that the default stream
/// waits on): byte-exact against the CPU path on the same bytes.
#[test]
fn gpu_layerwise_save_and_load_through_the_store_are_byte_exact() {
    use std::sync::Arc;
    use std::time::Duration;
    let Some(c) = copier() else { return };
    let c = Arc::new(c);
    let stream = c.stream().clone();
    let (store, ns) = pinned_store(&c, "test/gpu", "kv-first");
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let (nb, bs, h, d, layers) = (16, 16, 4, 64, 4);
    let shape = vec![2, nb, bs, h, d];
    let (st, n) = strides(&shape, &[0, 1, 2, 3, 4]);
    let dims = [K, B, T, I, I];
    let host: Vec<Vec<u8>> = random_layers(&mut rng, layers, n * 2);
    let src: Vec<_> = host.iter().map(|h| stream.clone_htod(h).unwrap()).collect();
    let dst: Vec<_> = (0..layers)
        .map(|_| stream.alloc_zeros::<u8>(n * 2).unwrap())
        .collect();
    stream.synchronize().unwrap();
    let ptrs = |v: &[cudarc::driver::CudaSlice<u8>]| -> Vec<usize> {
        v.iter()
            .map(|s| cudarc::driver::DevicePtr::device_ptr(s, &stream).0 as usize)
            .collect()
    };
    let gsrc = views(&ptrs(&src), &shape, &st, &dims, 2);
    let gdst = views(&ptrs(&dst), &shape, &st, &dims, 2);
    let hptrs: Vec<usize> = host.iter().map(|h| h.as_ptr() as usize).collect();
    let cpu = views(&hptrs, &shape, &st, &dims, 2);
    let keys: Vec<kvstore::BlockKey> = (0..6u128)
        .map(|i| kvstore::BlockKey((i + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)))
        .collect();
    let ids: Vec<Vec<usize>> = [3, 0, 11, 5, 15, 9].iter().map(|&i| vec![i]).collect();
    let mut s = store.begin_layer_save(ns, &gsrc, &keys, &ids, &[]).unwrap();
    for layer in 0..layers {
        // SAFETY: the default stream is live; `src` stays alive and unwritten until the
        // finish below returned.
        unsafe {
            let ev = c.record_on(0).unwrap();
            store
                .save_layer_cuda(&mut s, &c, &gsrc, layer, Some(&ev))
                .unwrap();
        }
    }
    // SAFETY: as above.
    let stored = unsafe { store.finish_layer_save_cuda(s, &c, &gsrc) }.unwrap();
    assert_eq!(stored, 6);
    // What the store holds is what the CPU path gathers from the same bytes.
    for (k, id) in keys.iter().zip(&ids) {
        let mut want = vec![0u8; cpu.block_bytes()];
        cpu.gather(id, &mut want).unwrap();
        let mut got = Vec::new();
        store
            .read_with(std::slice::from_ref(k), Duration::ZERO, &mut |_, b, _| {
                got = b.to_vec();
                Ok(true)
            })
            .unwrap();
        assert!(got == want, "stored block differs from the CPU gather");
    }
    let into: Vec<Vec<usize>> = [1, 2, 4, 6, 7, 8].iter().map(|&i| vec![i]).collect();
    let mut seen = Vec::new();
    // SAFETY: `dst` stays alive and nobody else touches it until the load returned and the
    // default stream waited for every layer's event.
    let loaded = unsafe {
        store.load_layerwise_cuda(
            &c,
            &gdst,
            &keys,
            &into,
            Duration::ZERO,
            SlotCheck::Beside,
            &mut |l, n, ev| {
                c.make_wait(&ev, 0).unwrap();
                seen.push((l, n));
            },
        )
    }
    .unwrap();
    assert_eq!(loaded, 6);
    assert_eq!(seen, (0..layers).map(|l| (l, 6)).collect::<Vec<_>>());
    let back: Vec<Vec<u8>> = dst.iter().map(|s| stream.clone_dtoh(s).unwrap()).collect();
    let bptrs: Vec<usize> = back.iter().map(|h| h.as_ptr() as usize).collect();
    let after = views(&bptrs, &shape, &st, &dims, 2);
    for (from, to) in ids.iter().zip(&into) {
        let (mut a, mut b) = (vec![0u8; cpu.block_bytes()], vec![0u8; cpu.block_bytes()]);
        cpu.gather(from, &mut a).unwrap();
        after.gather(to, &mut b).unwrap();
        assert!(a == b, "GPU load differs from the saved block");
    }
    eprintln!("GPU layer-by-layer save and load through the store: byte-exact");
}

/// A block whose slot was written after its commit (a stalled writer: another mapping of the
/// arena) fails the GPU load's check, whether the slots are hashed while the copies run
/// (`Beside`, what engines use) or before any is queued (`First`): the count ends before it,
/// and the blocks before it are byte-exact.
#[test]
fn gpu_loads_count_only_blocks_whose_slot_verifies() {
    use std::sync::Arc;
    use std::time::Duration;
    let Some(c) = copier() else { return };
    let c = Arc::new(c);
    let stream = c.stream().clone();
    let (store, ns) = pinned_store(&c, "test/gpu-check", "blocks-first");
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let (nb, bs, h, d, layers) = (12, 16, 4, 64, 3);
    let shape = vec![nb, 2, bs, h, d];
    let dims = [B, K, T, I, I];
    let (st, n) = strides(&shape, &[0, 1, 2, 3, 4]);
    let mut host: Vec<Vec<u8>> = random_layers(&mut rng, layers, n * 2);
    let hptrs: Vec<usize> = host.iter_mut().map(|h| h.as_mut_ptr() as usize).collect();
    let cpu = views(&hptrs, &shape, &st, &dims, 2);
    let keys: Vec<kvstore::BlockKey> = (0..4u128)
        .map(|i| {
            kvstore::BlockKey((i + 70).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
        })
        .collect();
    let ids: Vec<Vec<usize>> = (1..5).map(|i| vec![i]).collect();
    assert_eq!(store.save(ns, &cpu, &keys, &ids).unwrap(), 4);
    let kv = store.store().expect("embedded");
    let offset = kv.get(&keys[2]).expect("stored").arena_offset() as usize;
    // SAFETY: a second shared mapping of the store's memfd, as an engine process maps it; the
    // test writes only inside one committed block's slot.
    let mut other = unsafe {
        memmap2::MmapMut::map_mut(&std::fs::File::from(
            kv.arena().fd().try_clone_to_owned().unwrap(),
        ))
    }
    .expect("map the arena");
    other[offset + 4321] ^= 0x5a;
    let into: Vec<Vec<usize>> = (6..10).map(|i| vec![i]).collect();
    for check in [SlotCheck::Beside, SlotCheck::First] {
        let dst: Vec<_> = (0..layers)
            .map(|_| stream.alloc_zeros::<u8>(n * 2).unwrap())
            .collect();
        stream.synchronize().unwrap();
        let dptrs: Vec<usize> = dst
            .iter()
            .map(|s| cudarc::driver::DevicePtr::device_ptr(s, &stream).0 as usize)
            .collect();
        let gdst = views(&dptrs, &shape, &st, &dims, 2);
        let mut queued = Vec::new();
        // SAFETY: `dst` stays alive and nobody else touches it until the load returned and
        // the default stream waited for every layer's event.
        let loaded = unsafe {
            store.load_layerwise_cuda(
                &c,
                &gdst,
                &keys,
                &into,
                Duration::ZERO,
                check,
                &mut |_, n, ev| {
                    c.make_wait(&ev, 0).unwrap();
                    queued.push(n);
                },
            )
        }
        .unwrap();
        assert_eq!(
            loaded, 2,
            "{check:?}: the count ends before the changed block"
        );
        let want = if check == SlotCheck::First { 2 } else { 4 };
        assert_eq!(
            queued,
            vec![want; layers],
            "{check:?}: blocks queued per layer"
        );
        let mut back: Vec<Vec<u8>> = dst.iter().map(|s| stream.clone_dtoh(s).unwrap()).collect();
        let bptrs: Vec<usize> = back.iter_mut().map(|h| h.as_mut_ptr() as usize).collect();
        let after = views(&bptrs, &shape, &st, &dims, 2);
        for (from, to) in ids.iter().zip(&into).take(2) {
            let (mut a, mut b) = (vec![0u8; cpu.block_bytes()], vec![0u8; cpu.block_bytes()]);
            cpu.gather(from, &mut a).unwrap();
            after.gather(to, &mut b).unwrap();
            assert!(
                a == b,
                "{check:?}: a verified block differs after its GPU load"
            );
        }
    }
    eprintln!("GPU loads: a block changed after its commit is not counted (every check)");
}

//! Concurrent writers and readers on a store small enough to evict all the time: every byte read
//! must be the byte written for that key, and leased blocks must survive the churn.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use kvstore::{fill_pattern, BlockKey, Namespace, PolicyKind, Reserve, StoreConfig, TpShard};
use rand::{Rng, SeedableRng};

fn key(i: u64) -> BlockKey {
    BlockKey(u128::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) + 1)
}

fn len_of(i: u64) -> usize {
    // Two size classes, and lengths that are not multiples of 8 or 4096.
    if i.is_multiple_of(4) {
        300_001
    } else {
        40_000 + (i as usize % 13) * 1_001
    }
}

#[test]
fn threads_put_get_byte_exact() {
    for policy in [PolicyKind::S3Fifo, PolicyKind::Lru, PolicyKind::Duel] {
        let store = StoreConfig {
            capacity_bytes: 8 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![64 << 10, 512 << 10],
            shards: 8,
            policy,
            ..Default::default()
        }
        .build()
        .unwrap();
        let ns = store
            .register_namespace(&Namespace {
                model: "m".into(),
                dtype: "bf16".into(),
                layout: "nhd".into(),
                block_tokens: 16,
                tp: TpShard::Shared,
                tenant: String::new(),
                lora: String::new(),
            })
            .unwrap();
        let hits = AtomicU64::new(0);
        let pinned_key = key(1_000_000);
        let mut v = vec![0u8; len_of(5)];
        fill_pattern(&mut v, 1_000_000);
        store.put(ns, pinned_key, &v).unwrap();
        let lease = store
            .lease(&[pinned_key], Duration::from_secs(600))
            .unwrap();
        assert_eq!(lease.n, 1);

        thread::scope(|s| {
            for t in 0..4u64 {
                let store = &store;
                let hits = &hits;
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                    let mut buf = vec![0u8; 512 << 10];
                    let mut want = vec![0u8; 512 << 10];
                    for _ in 0..1_500 {
                        let i = rng.gen_range(0..200u64);
                        let len = len_of(i);
                        if rng.gen_bool(0.5) {
                            // Zero-copy path: reserve, fill in place, commit.
                            if let Reserve::Slot(mut r) = store.reserve(ns, key(i), len).unwrap() {
                                fill_pattern(r.as_mut_slice(), i);
                                r.commit().unwrap();
                            }
                        } else if let Some(n) = store.get_into(&key(i), &mut buf).unwrap() {
                            assert_eq!(n, len);
                            fill_pattern(&mut want[..len], i);
                            assert!(buf[..len] == want[..len], "key {i}: wrong bytes");
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                        if let Some(b) = store.get(&key(i)) {
                            fill_pattern(&mut want[..len], i);
                            assert!(b[..] == want[..len], "key {i}: wrong borrowed bytes");
                        }
                    }
                });
            }
        });
        let st = store.stats();
        assert!(hits.load(Ordering::Relaxed) > 100, "{st:?}");
        assert!(st.evictions > 100, "{st:?}");
        assert!(st.used_bytes <= st.capacity_bytes);
        let mut got = vec![0u8; v.len()];
        assert_eq!(
            store.get_into(&pinned_key, &mut got).unwrap(),
            Some(v.len())
        );
        assert_eq!(got, v);
        assert!(store.release(lease.id.unwrap()));
    }
}

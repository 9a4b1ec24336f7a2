//! Unit tests of the store as a whole (host tier only; the disk tier's in kvstore/tests).

use std::time::{Duration, Instant};

use super::*;
use crate::error::StoreError;
use crate::key::TpShard;

fn ns() -> Namespace {
    Namespace {
        model: "test".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    }
}

fn small(policy: PolicyKind) -> (Store, NsId) {
    let s = StoreConfig {
        capacity_bytes: 4 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10, 256 << 10],
        shards: 4,
        policy,
        ..Default::default()
    }
    .build()
    .unwrap();
    let id = s.register_namespace(&ns()).unwrap();
    (s, id)
}

fn k(i: u128) -> BlockKey {
    BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1)
}

#[test]
fn bad_config_is_rejected() {
    let e = StoreConfig {
        capacity_bytes: 1,
        ..Default::default()
    }
    .build()
    .unwrap_err();
    assert!(e.to_string().contains("capacity"), "{e}");
    assert!(StoreConfig {
        shards: 3,
        ..Default::default()
    }
    .build()
    .is_err());
    assert!(StoreConfig {
        size_classes: vec![2 << 20],
        segment_bytes: 1 << 20,
        ..Default::default()
    }
    .build()
    .is_err());
}

#[test]
fn put_get_roundtrip_and_errors() {
    let (s, n) = small(PolicyKind::Lru);
    let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    assert_eq!(s.put(n, k(1), &data).unwrap(), PutOutcome::Stored);
    assert_eq!(s.put(n, k(1), &data).unwrap(), PutOutcome::AlreadyPresent);
    assert_eq!(&*s.get(&k(1)).unwrap(), &data[..]);
    assert!(s.get(&k(2)).is_none());
    let mut small_buf = vec![0u8; 10];
    assert!(matches!(
        s.get_into(&k(1), &mut small_buf),
        Err(StoreError::BufferTooSmall { .. })
    ));
    assert_eq!(s.put(n, k(3), &[]), Err(StoreError::Empty));
    assert!(matches!(
        s.put(n, k(3), &vec![0u8; 300 << 10]),
        Err(StoreError::TooLarge { .. })
    ));
    assert_eq!(
        s.put(NsId(9), k(3), &[1]),
        Err(StoreError::UnknownNamespace(9))
    );
    let st = s.stats();
    assert_eq!(st.blocks, 1);
    assert_eq!(st.used_bytes, 100_000);
    assert_eq!(st.hits, 2);
    assert_eq!(st.misses, 1);
}

#[test]
fn uncommitted_is_invisible_and_dropped_frees() {
    let (s, n) = small(PolicyKind::Lru);
    let Reserve::Slot(mut r) = s.reserve(n, k(1), 1000).unwrap() else {
        panic!("expected slot")
    };
    r.as_mut_slice().fill(7);
    assert!(s.get(&k(1)).is_none());
    assert_eq!(s.match_prefix(&[k(1)]).n, 0);
    assert!(matches!(
        s.reserve(n, k(1), 1000).unwrap(),
        Reserve::InFlight
    ));
    drop(r);
    assert!(s.get(&k(1)).is_none());
    // The key can be written again after the abort.
    let Reserve::Slot(mut r) = s.reserve(n, k(1), 1000).unwrap() else {
        panic!("expected slot")
    };
    r.as_mut_slice().fill(9);
    r.commit().unwrap();
    assert_eq!(&*s.get(&k(1)).unwrap(), &[9u8; 1000][..]);
}

#[test]
fn eviction_respects_capacity_and_pins() {
    for policy in PolicyKind::ALL {
        let (s, n) = small(policy);
        // 4 segments of 1 MiB, 16 slots of 64 KiB each = 64 slots.
        let block = vec![1u8; 60_000];
        s.put(n, k(0), &block).unwrap();
        let lease = s.lease(&[k(0)], Duration::from_secs(60)).unwrap();
        assert_eq!(lease.n, 1);
        for i in 1..200 {
            assert_eq!(s.put(n, k(i), &block).unwrap(), PutOutcome::Stored);
            let st = s.stats();
            assert!(st.blocks <= 64);
            assert!(st.used_bytes <= st.capacity_bytes);
        }
        assert!(s.get(&k(0)).is_some(), "{policy:?}: leased block evicted");
        assert_eq!(s.stats().evictions, 200 - 64);
        assert!(s.release(lease.id.unwrap()));
        assert!(!s.release(lease.id.unwrap()));
    }
}

#[test]
fn segments_move_between_classes() {
    let (s, n) = small(PolicyKind::S3Fifo);
    for i in 0..64 {
        s.put(n, k(i), &[1u8; 1000]).unwrap();
    }
    assert_eq!(s.stats().free_segments, 0);
    // Large class has no segment: one must be reclaimed from the small class.
    s.put(n, k(1000), &vec![2u8; 200_000]).unwrap();
    assert_eq!(s.stats().blocks, 64 - 16 + 1);
    assert_eq!(&*s.get(&k(1000)).unwrap(), &vec![2u8; 200_000][..]);
}

#[test]
fn all_pinned_is_no_space() {
    let s = StoreConfig {
        capacity_bytes: 1 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![512 << 10],
        shards: 1,
        // A put waits this long for a lease to go before it is NoSpace.
        wait: Duration::from_millis(100),
        ..Default::default()
    }
    .build()
    .unwrap();
    let n = s.register_namespace(&ns()).unwrap();
    s.put(n, k(1), &[1]).unwrap();
    s.put(n, k(2), &[2]).unwrap();
    let g1 = s.get(&k(1)).unwrap();
    let l = s.lease(&[k(2)], Duration::from_secs(60)).unwrap();
    assert_eq!(s.put(n, k(3), &[3]), Err(StoreError::NoSpace { len: 1 }));
    drop(g1);
    assert_eq!(s.put(n, k(3), &[3]).unwrap(), PutOutcome::Stored);
    assert!(s.contains(&k(2)));
    s.release(l.id.unwrap());
}

#[test]
fn remove_while_borrowed_defers_free() {
    let (s, n) = small(PolicyKind::Lru);
    s.put(n, k(1), &[5u8; 4000]).unwrap();
    let g = s.get(&k(1)).unwrap();
    assert!(s.remove(&k(1)));
    assert!(!s.remove(&k(1)));
    assert!(s.get(&k(1)).is_none());
    // Fill everything: the borrowed slot must not be reused while borrowed.
    for i in 2..200 {
        s.put(n, k(i), &[9u8; 4000]).unwrap();
    }
    assert_eq!(&*g, &[5u8; 4000][..]);
    drop(g);
    s.put(n, k(1), &[6u8; 4000]).unwrap();
    assert_eq!(&*s.get(&k(1)).unwrap(), &[6u8; 4000][..]);
}

#[test]
fn remove_during_write_wins_over_commit() {
    let (s, n) = small(PolicyKind::Lru);
    let Reserve::Slot(mut r) = s.reserve(n, k(1), 1000).unwrap() else {
        panic!("expected slot")
    };
    r.as_mut_slice().fill(3);
    assert!(
        s.remove(&k(1)),
        "an in-flight write counts as present for remove"
    );
    r.commit().unwrap();
    assert!(
        s.get(&k(1)).is_none(),
        "a removed in-flight block became visible"
    );
    assert_eq!(s.stats().blocks, 0);
    // Its slot came back: the whole capacity is usable.
    for i in 2..66 {
        s.put(n, k(i), &[1u8; 60_000]).unwrap();
    }
    assert_eq!(s.stats().evictions, 0);
    // clear_namespace cancels in-flight writes too.
    let Reserve::Slot(r) = s.reserve(n, k(100), 10).unwrap() else {
        panic!("expected slot")
    };
    s.clear_namespace(n);
    r.commit().unwrap();
    assert!(!s.contains(&k(100)));
}

#[test]
fn match_prefix_and_leases() {
    let (s, n) = small(PolicyKind::S3Fifo);
    for i in 0..5 {
        s.put(n, k(i), &[i as u8; 100]).unwrap();
    }
    let chain: Vec<BlockKey> = (0..8).map(k).collect();
    let before = s.stats();
    let m = s.match_prefix(&chain);
    assert_eq!(m.n, 5);
    assert_eq!(m.tiers, vec![Tier::Host; 5]);
    assert_eq!(s.stats(), before, "match_prefix must have no side effects");
    s.remove(&k(2));
    assert_eq!(s.match_prefix(&chain).n, 2);
    let l = s.lease(&chain, Duration::from_millis(1)).unwrap();
    assert_eq!(l.n, 2);
    assert_eq!(s.stats().leases, 1);
    assert_eq!(
        s.reap_expired_leases_at(Instant::now() + Duration::from_secs(1)),
        1
    );
    assert_eq!(s.stats().leases, 0);
    assert_eq!(s.stats().leases_expired, 1);
    assert!(!s.release(l.id.unwrap()));
    let none = s.lease(&[k(99)], Duration::from_secs(1)).unwrap();
    assert_eq!((none.id, none.n), (None, 0));
}

/// A prefix match in an index larger than the caches (the walk that prefetches ahead and
/// hashes runs of keys at a time): it stops exactly at the first absent key or the first key
/// being written, wherever that falls against its runs and its prefetch distance.
#[test]
fn a_large_index_matches_prefixes_exactly() {
    let blocks: u128 = 70_000;
    let s = StoreConfig {
        capacity_bytes: (blocks as u64 * 4096).div_ceil(64 << 20) * (64 << 20),
        segment_bytes: 64 << 20,
        size_classes: vec![4096],
        populate: crate::Populate::Lazy,
        ..Default::default()
    }
    .build()
    .unwrap();
    let n = s.register_namespace(&ns()).unwrap();
    for i in 0..blocks {
        match s.reserve(n, k(i), 4096).unwrap() {
            Reserve::Slot(r) => assert!(r.commit_with_checksum(0).unwrap()),
            _ => panic!("key {i} twice"),
        }
    }
    let chain: Vec<BlockKey> = (0..200).map(k).collect();
    assert_eq!(s.match_prefix(&chain).n, 200);
    assert_eq!(s.match_prefix(&chain[..1]).n, 1);
    // Absent keys before, at and after the prefetch distance (20), the run boundary (64),
    // the distance into the second run (84) and the second run's end (128).
    for gap in [0usize, 1, 19, 20, 21, 63, 64, 65, 83, 84, 85, 127, 128, 199] {
        let mut keys = chain.clone();
        keys[gap] = k(blocks + gap as u128);
        let m = s.match_prefix(&keys);
        assert_eq!(m.n, gap, "an absent key at {gap}");
        assert_eq!(m.tiers.len(), gap);
    }
    // A key being written ends the ready prefix and counts as pending.
    let writing = match s.reserve(n, k(blocks + 500), 4096).unwrap() {
        Reserve::Slot(r) => r,
        _ => panic!("fresh key"),
    };
    let mut keys = chain.clone();
    keys[70] = k(blocks + 500);
    let m = s.match_prefix(&keys);
    assert_eq!((m.n, m.pending), (70, 1));
    assert!(writing.commit_with_checksum(0).unwrap());
    assert_eq!(s.match_prefix(&keys).n, 200);
}

#[test]
fn clear_namespace_only_touches_its_own() {
    let (s, n1) = small(PolicyKind::Lru);
    let mut other = ns();
    other.tenant = "b".into();
    let n2 = s.register_namespace(&other).unwrap();
    assert_eq!(s.register_namespace(&other).unwrap(), n2);
    for i in 0..10 {
        s.put(n1, k(i), &[1]).unwrap();
        s.put(n2, k(100 + i), &[2]).unwrap();
    }
    let g = s.get(&k(0)).unwrap();
    assert_eq!(s.clear_namespace(n1), 10);
    assert_eq!(s.stats().blocks, 10);
    assert!((100..110).all(|i| s.contains(&k(i))));
    assert_eq!(&*g, &[1]);
}

#[test]
fn too_many_leases() {
    let s = StoreConfig {
        capacity_bytes: 1 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10],
        max_leases: 2,
        ..Default::default()
    }
    .build()
    .unwrap();
    let n = s.register_namespace(&ns()).unwrap();
    s.put(n, k(1), &[1]).unwrap();
    let ttl = Duration::from_secs(60);
    s.lease(&[k(1)], ttl).unwrap();
    s.lease(&[k(1)], ttl).unwrap();
    assert_eq!(s.lease(&[k(1)], ttl), Err(StoreError::TooManyLeases(2)));
}

#[test]
fn repeated_keys_are_pinned_once() {
    let (s, n) = small(PolicyKind::Lru);
    s.put(n, k(1), &[1u8; 100]).unwrap();
    let l = s
        .lease(&[k(1), k(1), k(1)], Duration::from_secs(60))
        .unwrap();
    assert_eq!(l.n, 1);
    assert_eq!(s.stats().leased_blocks, 1);
    let pins = {
        let sh = s.inner.shard(k(1)).lock();
        let e = sh.map.get(&crate::types::MapKey::from(k(1))).unwrap();
        sh.pins.count(&e)
    };
    assert_eq!(pins, 1, "a repeated key took several pins");
    s.release(l.id.unwrap());
    // A load stops at a repeated key: no prefix repeats a block.
    s.put(n, k(2), &[2u8; 100]).unwrap();
    assert_eq!(s.load(&[k(1), k(2), k(1), k(2)]).unwrap().len(), 2);
}

#[test]
fn a_removed_block_is_never_served_from_a_stale_pin() {
    let (s, n) = small(PolicyKind::Lru);
    s.put(n, k(1), &[1u8; 5000]).unwrap();
    let g = s.get(&k(1)).unwrap();
    assert!(s.remove(&k(1)));
    // The slot stays pinned (and unchanged) for the reader; nobody else sees the block.
    assert!(s.get(&k(1)).is_none());
    assert_eq!(&*g, &[1u8; 5000][..]);
    drop(g);
    assert_eq!(s.stats().blocks, 0);
}

#[test]
fn damaged_host_bytes_are_a_miss() {
    let (s, n) = small(PolicyKind::Lru);
    s.put(n, k(1), &[1u8; 5000]).unwrap();
    let off = s.get(&k(1)).unwrap().arena_offset() as usize;
    // An engine writes into a slot it no longer owns.
    // SAFETY: test-only write into the arena, at a committed block nobody reads concurrently.
    unsafe { s.arena().base().add(off + 10).write(9) };
    let mut dst = vec![0u8; 5000];
    assert_eq!(s.get_into(&k(1), &mut dst).unwrap(), None);
    assert_eq!(s.stats().checksum_failures, 1);
    assert!(!s.contains(&k(1)), "the damaged block was dropped");
}

#[test]
fn segments_follow_demand_between_size_classes() {
    let s = StoreConfig {
        capacity_bytes: 8 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10, 256 << 10],
        shards: 4,
        policy: PolicyKind::Lru,
        ..Default::default()
    }
    .build()
    .unwrap();
    let n = s.register_namespace(&ns()).unwrap();
    // Small blocks take every segment.
    for i in 0..128 {
        s.put(n, k(i), &[1u8; 60_000]).unwrap();
    }
    assert_eq!(s.stats().free_segments, 0);
    // Then the traffic turns to large blocks: the large class must grow past one segment
    // (4 blocks) instead of evicting its own blocks forever.
    for i in 1000..1400 {
        s.put(n, k(i), &vec![2u8; 200_000]).unwrap();
    }
    let large = (1000..1400).filter(|&i| s.in_host(&k(i))).count();
    assert!(large >= 16, "only {large} large blocks resident");
}

#[test]
fn a_loaded_prefix_loses_its_tail_first() {
    // LRU, 64 slots: a request's three blocks are loaded together (prefix order); at equal
    // recency the chain's tail is the older, so the parent outlives its children.
    let (s, n) = small(PolicyKind::Lru);
    let block = vec![7u8; 60_000];
    for i in 0..64 {
        s.put(n, k(i), &block).unwrap();
    }
    let chain = [k(0), k(1), k(2)];
    assert_eq!(s.load(&chain).unwrap().len(), 3);
    // Everything else is touched later: the chain is now the least recently used.
    for i in 3..64 {
        assert!(s.get(&k(i)).is_some());
    }
    for (j, gone) in [2u128, 1, 0].into_iter().enumerate() {
        s.put(n, k(1000 + j as u128), &block).unwrap();
        assert!(s.get(&k(gone)).is_none(), "block {gone} evicted next");
        for keep in 0..gone {
            assert!(s.probe_local(&[k(keep)])[0].is_some(), "parent {keep} kept");
        }
    }
}

/// Waits (deadline 30 s) until a load has started waiting for something (`waits` moved).
fn until_waiting(s: &Store, before: u64) {
    let until = Instant::now() + Duration::from_secs(30);
    while s.stats().waits == before {
        assert!(Instant::now() < until, "the load never waited");
        std::thread::yield_now();
    }
}

#[test]
fn a_load_waits_for_a_save_in_progress_and_an_aborted_one_is_a_miss() {
    let (s, id) = small(PolicyKind::Lru);
    let val = |i: u128| vec![i as u8 ^ 0x5A; 40_000];
    for i in 0..4 {
        s.put(id, k(i), &val(i)).unwrap();
    }
    // Engine A reserves blocks 4 and 5 and writes them slowly.
    let Reserve::Slot(mut r4) = s.reserve(id, k(4), 40_000).unwrap() else {
        panic!("no slot")
    };
    let Reserve::Slot(r5) = s.reserve(id, k(5), 40_000).unwrap() else {
        panic!("no slot")
    };
    let keys: Vec<BlockKey> = (0..7).map(k).collect();
    // A lookup says: 4 present, 2 being saved right after them.
    let m = s.match_prefix(&keys);
    assert_eq!((m.n, m.pending), (4, 2));
    // A single get does not wait for a save (it answers at once).
    assert!(s.get(&k(4)).is_none());
    // Engine B loads the prefix meanwhile: it waits for the commit, and gets A's bytes.
    std::thread::scope(|sc| {
        let before = s.stats().waits;
        let b = sc.spawn(|| {
            let l = s.load(&keys[..5]).unwrap();
            (0..l.len())
                .map(|i| l.block(i).to_vec())
                .collect::<Vec<_>>()
        });
        until_waiting(&s, before);
        r4.as_mut_slice().copy_from_slice(&val(4));
        assert!(r4.commit().unwrap());
        let got = b.join().unwrap();
        assert_eq!(got.len(), 5);
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, val(i as u128), "block {i}");
        }
        // An aborted save ends the prefix there: a miss, never stale bytes.
        let before = s.stats().waits;
        let b = sc.spawn(|| s.load(&keys[..6]).unwrap().len());
        until_waiting(&s, before);
        drop(r5);
        assert_eq!(b.join().unwrap(), 5);
    });
    assert_eq!(s.match_prefix(&keys).pending, 0);
}

#[test]
fn a_block_removed_while_leased_counts_its_bytes_until_released() {
    let (s, n) = small(PolicyKind::Lru);
    s.put(n, k(1), &[1u8; 100]).unwrap();
    s.put(n, k(2), &[2u8; 300]).unwrap();
    let l = s.lease(&[k(1)], Duration::from_secs(60)).unwrap();
    assert!(s.remove(&k(1)));
    assert!(s.remove(&k(2)));
    let st = s.stats();
    assert_eq!(st.blocks, 0);
    assert_eq!(
        st.used_bytes, 100,
        "the leased block's bytes are still held"
    );
    // Stored again while the old copy is held: a new slot, counted on its own.
    s.put(n, k(1), &[3u8; 100]).unwrap();
    assert_eq!(s.stats().used_bytes, 200);
    assert!(s.release(l.id.unwrap()));
    let st = s.stats();
    assert_eq!((st.blocks, st.used_bytes), (1, 100));
    let mut buf = vec![0u8; 100];
    assert_eq!(s.get_into(&k(1), &mut buf).unwrap(), Some(100));
    assert_eq!(
        buf,
        vec![3u8; 100],
        "the new bytes, not the removed block's"
    );
}

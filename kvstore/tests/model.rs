//! Property test: the store against a simple model.
//!
//! Invariants checked after every operation of a random sequence of put / get / borrow / lease /
//! release / expire / remove / clear:
//! 1. `get` returns exactly the bytes that were put under that key, or a miss; a key never put,
//!    or removed and not put again, is a miss.
//! 2. A block pinned by a lease or a borrow stays present until it is released, unless it was
//!    removed or cleared explicitly (eviction never takes it).
//! 3. Payload bytes never exceed capacity; the block counter equals the keys present.
//! 4. A borrowed block's bytes never change while borrowed, even after removal.
//! 5. `NoSpace` only happens when at least one block per segment is pinned.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvstore::{
    fill_pattern, BlockKey, BlockRef, LeaseId, Namespace, NsId, PolicyKind, PutOutcome, Store,
    StoreConfig, StoreError, TpShard,
};
use proptest::prelude::*;

const KEYS: u32 = 40;
const SEGMENTS: u64 = 4;

fn key(i: u32) -> BlockKey {
    BlockKey((u128::from(i) + 1).wrapping_mul(0x2545_F491_4F6C_DD1D_9E37_79B9_7F4A_7C15))
}

fn len_of(i: u32) -> usize {
    if i.is_multiple_of(3) {
        200_000
    } else {
        1000 + i as usize * 1000
    }
}

fn bytes_of(i: u32) -> Vec<u8> {
    let mut v = vec![0u8; len_of(i)];
    fill_pattern(&mut v, u64::from(i));
    v
}

#[derive(Debug, Clone)]
enum Op {
    Put(u32),
    Get(u32),
    Borrow(u32),
    DropBorrow(usize),
    Lease(u32, u32),
    Release(usize),
    ExpireAll,
    Remove(u32),
    Clear(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..KEYS).prop_map(Op::Put),
        4 => (0..KEYS).prop_map(Op::Get),
        1 => (0..KEYS).prop_map(Op::Borrow),
        1 => any::<usize>().prop_map(Op::DropBorrow),
        2 => (0..KEYS, 1..6u32).prop_map(|(a, b)| Op::Lease(a, b)),
        1 => any::<usize>().prop_map(Op::Release),
        1 => Just(Op::ExpireAll),
        1 => (0..KEYS).prop_map(Op::Remove),
        1 => any::<bool>().prop_map(Op::Clear),
    ]
}

fn namespace(tenant: &str) -> Namespace {
    Namespace {
        model: "model".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: tenant.into(),
        lora: String::new(),
    }
}

fn run(policy: PolicyKind, ops: Vec<Op>) {
    let store: Store = StoreConfig {
        capacity_bytes: SEGMENTS << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10, 256 << 10],
        shards: 4,
        policy,
        populate: kvstore::Populate::Lazy,
        ..Default::default()
    }
    .build()
    .unwrap();
    let ns = [
        store.register_namespace(&namespace("a")).unwrap(),
        store.register_namespace(&namespace("b")).unwrap(),
    ];
    let ns_of = |i: u32| -> NsId { ns[(i % 2) as usize] };
    // Keys that may be present (put and not removed since). Present ⊆ maybe.
    let mut maybe: HashSet<u32> = HashSet::new();
    // Pins: key -> number of live pins taken while the key was present and not removed since.
    let mut must: HashMap<u32, u32> = HashMap::new();
    let mut leases: Vec<(LeaseId, Vec<u32>)> = Vec::new();
    let mut borrows: Vec<(u32, BlockRef)> = Vec::new();
    let unpin = |must: &mut HashMap<u32, u32>, k: u32| {
        if let Some(c) = must.get_mut(&k) {
            *c -= 1;
            if *c == 0 {
                must.remove(&k);
            }
        }
    };

    for op in ops {
        match op {
            Op::Put(i) => match store.put(ns_of(i), key(i), &bytes_of(i)) {
                Ok(PutOutcome::Stored) | Ok(PutOutcome::AlreadyPresent) => {
                    maybe.insert(i);
                }
                Ok(PutOutcome::InFlight) => panic!("no concurrent writer exists"),
                Err(StoreError::NoSpace { .. }) => {
                    let pinned = borrows.len() + leases.iter().map(|l| l.1.len()).sum::<usize>();
                    assert!(pinned as u64 >= SEGMENTS, "NoSpace with only {pinned} pins");
                }
                Err(e) => panic!("put: {e}"),
            },
            Op::Get(i) => match store.get(&key(i)) {
                Some(b) => {
                    assert!(maybe.contains(&i), "key {i} served but never stored");
                    assert!(*b == bytes_of(i)[..], "key {i}: wrong bytes");
                }
                None => assert!(!must.contains_key(&i), "pinned key {i} missing"),
            },
            Op::Borrow(i) => {
                if let Some(b) = store.get(&key(i)) {
                    *must.entry(i).or_default() += 1;
                    borrows.push((i, b));
                }
            }
            Op::DropBorrow(j) => {
                if !borrows.is_empty() {
                    let (i, b) = borrows.swap_remove(j % borrows.len());
                    drop(b);
                    unpin(&mut must, i);
                }
            }
            Op::Lease(start, n) => {
                let ids: Vec<u32> = (start..(start + n).min(KEYS)).collect();
                let keys: Vec<BlockKey> = ids.iter().map(|&i| key(i)).collect();
                let m = store.match_prefix(&keys);
                let l = store.lease(&keys, Duration::from_secs(3600)).unwrap();
                assert_eq!(l.n, m.n, "lease and match_prefix disagree");
                if let Some(id) = l.id {
                    let got = ids[..l.n].to_vec();
                    for &i in &got {
                        assert!(maybe.contains(&i));
                        *must.entry(i).or_default() += 1;
                    }
                    leases.push((id, got));
                }
            }
            Op::Release(j) => {
                if !leases.is_empty() {
                    let (id, got) = leases.swap_remove(j % leases.len());
                    assert!(store.release(id));
                    for i in got {
                        unpin(&mut must, i);
                    }
                }
            }
            Op::ExpireAll => {
                let n = store.reap_expired_leases_at(Instant::now() + Duration::from_secs(7200));
                assert_eq!(n, leases.len());
                for (_, got) in leases.drain(..) {
                    for i in got {
                        unpin(&mut must, i);
                    }
                }
            }
            Op::Remove(i) => {
                let was = store.contains(&key(i));
                assert_eq!(store.remove(&key(i)), was);
                assert!(!store.contains(&key(i)));
                maybe.remove(&i);
                must.remove(&i);
            }
            Op::Clear(second) => {
                let which = usize::from(second);
                let victims: Vec<u32> = (0..KEYS)
                    .filter(|i| (i % 2) as usize == which && store.contains(&key(*i)))
                    .collect();
                assert_eq!(store.clear_namespace(ns[which]), victims.len());
                for i in 0..KEYS {
                    if (i % 2) as usize == which {
                        maybe.remove(&i);
                        must.remove(&i);
                    }
                }
            }
        }
        // Invariants after every step.
        let st = store.stats();
        assert!(st.used_bytes <= st.capacity_bytes);
        let present: Vec<u32> = (0..KEYS).filter(|&i| store.contains(&key(i))).collect();
        assert_eq!(st.blocks, present.len() as u64);
        for i in &present {
            assert!(
                maybe.contains(i),
                "key {i} present but removed or never put"
            );
        }
        for i in must.keys() {
            assert!(store.contains(&key(*i)), "pinned key {i} was evicted");
        }
        for (i, b) in &borrows {
            assert!(**b == bytes_of(*i)[..], "borrowed key {i} changed");
        }
        assert_eq!(st.leases, leases.len() as u64);
    }
    drop(borrows);
    for (id, _) in leases {
        assert!(store.release(id));
    }
    // Everything unpinned: the whole capacity is usable again by one class.
    for i in 0..KEYS {
        store.remove(&key(i));
    }
    let big = vec![3u8; 256 << 10];
    let evictions = store.stats().evictions;
    for j in 0..(SEGMENTS * 4) as u32 {
        let k = BlockKey(u128::from(j) << 100 | 7);
        assert_eq!(store.put(ns[0], k, &big).unwrap(), PutOutcome::Stored);
    }
    assert_eq!(
        store.stats().evictions,
        evictions,
        "evicted while space was free"
    );
    assert_eq!(store.stats().blocks, SEGMENTS * 4, "slots leaked");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model_s3fifo(ops in proptest::collection::vec(op(), 1..250)) {
        run(PolicyKind::S3Fifo, ops);
    }

    #[test]
    fn store_matches_model_lru(ops in proptest::collection::vec(op(), 1..250)) {
        run(PolicyKind::Lru, ops);
    }

    #[test]
    fn store_matches_model_duel(ops in proptest::collection::vec(op(), 1..250)) {
        run(PolicyKind::Duel, ops);
    }
}

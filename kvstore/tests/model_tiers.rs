//! Property test: the store with its disk tier, through evictions, demotions, promotions,
//! removals and restarts, against a plain set of keys.
//!
//! Invariants, checked after every operation of a random sequence:
//! 1. Every read returns exactly the bytes put under that key, or a miss.
//! 2. Nothing removed (or cleared) ever reappears, in any tier, before or after a restart.
//! 3. Nothing committed and made durable (by `flush`, or `sync` after a write-through commit)
//!    is lost: after a restart it is still there, byte-exact.
//! 4. Loads return a prefix of the keys asked, every block byte-exact.
//!
//! The disk holds every key (no disk eviction) and admission is `always`, so a block leaves host
//! memory only after it is durable below.

use std::collections::HashSet;
use std::time::Duration;

use kvstore::io::{IoConfig, IoEngineKind};
use kvstore::{
    fill_pattern, Admission, BlockKey, DiskConfig, Namespace, NsId, PolicyKind, Store, StoreConfig,
    TpShard,
};
use proptest::prelude::*;

const KEYS: u32 = 30;
const SYNC: Duration = Duration::from_secs(60);

fn key(i: u32) -> BlockKey {
    BlockKey((u128::from(i) + 11).wrapping_mul(0x2545_F491_4F6C_DD1D_9E37_79B9_7F4A_7C15))
}

fn bytes_of(i: u32) -> Vec<u8> {
    let mut v = vec![0u8; 20_000 + (i as usize % 5) * 9_001];
    fill_pattern(&mut v, u64::from(i) * 31 + 7);
    v
}

#[derive(Debug, Clone)]
enum Op {
    Put(u32),
    Get(u32),
    Load(u32, u32),
    Remove(u32),
    Clear(u32),
    Flush,
    Sync,
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..KEYS).prop_map(Op::Put),
        4 => (0..KEYS).prop_map(Op::Get),
        2 => (0..KEYS, 1..6u32).prop_map(|(a, n)| Op::Load(a, n)),
        2 => (0..KEYS).prop_map(Op::Remove),
        1 => (0..2u32).prop_map(Op::Clear),
        1 => Just(Op::Flush),
        1 => Just(Op::Sync),
        1 => Just(Op::Restart),
    ]
}

fn config(dir: &std::path::Path, write_through: bool, policy: PolicyKind) -> StoreConfig {
    StoreConfig {
        // 16 slots of 64 KiB: far fewer than the keys, so blocks move between the tiers.
        capacity_bytes: 1 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10],
        shards: 4,
        policy,
        populate: kvstore::Populate::Lazy,
        disk: Some(DiskConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: 16 << 20,
            files: 1,
            io: IoConfig {
                kind: IoEngineKind::Auto,
                queue_depth: 4,
                ..Default::default()
            },
            policy,
            admission: Admission::Always,
            admit_all_below: kvstore::DEFAULT_ADMIT_ALL_BELOW,
            write_through,
            max_batch_bytes: 256 << 10,
            // Reads go through bounce buffers (as with an arena in 4 KiB pages): 8 slots of
            // 64 KiB, reused within a load.
            bounce_bytes: 4 << 20,
        }),
        // A put into a full host tier of dirty blocks waits for the writer: on a busy disk
        // that may take longer than the default 5 s (a put refused for room fails the model).
        wait: Duration::from_secs(60),
        ..Default::default()
    }
}

fn namespaces(store: &Store) -> [NsId; 2] {
    let ns = |t: &str| Namespace {
        model: "model-tiers".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: t.into(),
        lora: String::new(),
    };
    [
        store.register_namespace(&ns("a")).unwrap(),
        store.register_namespace(&ns("b")).unwrap(),
    ]
}

fn check_get(store: &Store, i: u32, maybe: &HashSet<u32>) {
    if let Some(b) = store.get(&key(i)) {
        assert!(maybe.contains(&i), "key {i} reappeared after its removal");
        assert!(*b == bytes_of(i)[..], "key {i}: wrong bytes");
    }
}

fn run(write_through: bool, policy: PolicyKind, ops: Vec<Op>, case: u64) {
    // Removed when the case ends, failed or not (proptest runs hundreds of cases).
    let tmp = tempfile::Builder::new()
        .prefix(&format!("model-tiers-{case}-{write_through}-"))
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let dir = tmp.path();
    let mut store = config(dir, write_through, policy).build().unwrap();
    let mut ns = namespaces(&store);
    // Keys that may be present (put and not removed since).
    let mut maybe: HashSet<u32> = HashSet::new();
    // Keys that must survive a restart (durable, not removed since).
    let mut durable: HashSet<u32> = HashSet::new();
    for op in ops {
        match op {
            Op::Put(i) => {
                store
                    .put(ns[(i % 2) as usize], key(i), &bytes_of(i))
                    .unwrap();
                maybe.insert(i);
            }
            Op::Get(i) => check_get(&store, i, &maybe),
            Op::Load(a, n) => {
                let ids: Vec<u32> = (a..(a + n).min(KEYS)).collect();
                let keys: Vec<BlockKey> = ids.iter().map(|&i| key(i)).collect();
                let l = store.load(&keys).unwrap();
                for (j, &i) in ids.iter().enumerate().take(l.len()) {
                    assert!(maybe.contains(&i), "key {i} reappeared (load)");
                    assert!(
                        l.block(j) == &bytes_of(i)[..],
                        "key {i}: wrong bytes (load)"
                    );
                }
            }
            Op::Remove(i) => {
                store.remove(&key(i));
                maybe.remove(&i);
                durable.remove(&i);
            }
            Op::Clear(t) => {
                store.clear_namespace(ns[t as usize]);
                maybe.retain(|i| i % 2 != t);
                durable.retain(|i| i % 2 != t);
            }
            Op::Flush => {
                store.flush();
                durable = maybe.clone();
            }
            Op::Sync => {
                assert!(store.sync(SYNC));
                if write_through {
                    durable = maybe.clone();
                }
            }
            Op::Restart => {
                drop(store);
                store = config(dir, write_through, policy).build().unwrap();
                ns = namespaces(&store);
                let present: HashSet<u32> =
                    (0..KEYS).filter(|&i| store.contains(&key(i))).collect();
                for i in &durable {
                    assert!(present.contains(i), "durable key {i} lost in a restart");
                }
                for i in &present {
                    assert!(
                        maybe.contains(i),
                        "removed key {i} came back after a restart"
                    );
                }
                maybe = present;
            }
        }
        let st = store.stats();
        assert!(st.used_bytes <= st.capacity_bytes);
        assert_eq!(st.checksum_failures, 0);
    }
    for i in 0..KEYS {
        check_get(&store, i, &maybe);
    }
    drop(store);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn host_and_disk_against_a_model_write_back(ops in prop::collection::vec(op(), 1..70), case in any::<u64>()) {
        run(false, PolicyKind::Duel, ops, case);
    }

    #[test]
    fn host_and_disk_against_a_model_write_through(ops in prop::collection::vec(op(), 1..70), case in any::<u64>()) {
        run(true, PolicyKind::Lru, ops, case);
    }
}

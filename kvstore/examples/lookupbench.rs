//! 64-key `match_prefix` latency (p50 of N lookups at random places, µs) in a store of 65,536
//! blocks and in one of 10 M, built in one process, three rounds alternating: what
//! `kvtier-bench host`'s case `lookup 64 keys p50 at 10M blocks` measures once, for profiling
//! the lookup alone. `cargo run --release -p kvstore --example lookupbench [BLOCKS] [N]`.
use kvstore::{BlockKey, Namespace, PolicyKind, Reserve, StoreConfig, TpShard};
use std::time::Instant;

fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ 0x5555)
}

fn store(blocks: u64) -> kvstore::Store {
    let seg: u64 = 64 << 20;
    let s = StoreConfig {
        capacity_bytes: (blocks * 4096).div_ceil(seg) * seg,
        segment_bytes: seg,
        size_classes: vec![4096],
        populate: kvstore::Populate::Lazy,
        policy: PolicyKind::default(),
        ..Default::default()
    }
    .build()
    .unwrap();
    let ns = s
        .register_namespace(&Namespace {
            model: "x".into(),
            dtype: "bfloat16".into(),
            layout: "nhd".into(),
            block_tokens: 16,
            tp: TpShard::Rank { size: 1, rank: 0 },
            tenant: String::new(),
            lora: String::new(),
        })
        .unwrap();
    for i in 0..blocks {
        if let Reserve::Slot(r) = s.reserve(ns, key(i), 4096).unwrap() {
            r.commit_with_checksum(0).unwrap();
        }
    }
    s
}

fn lat(s: &kvstore::Store, blocks: u64, n: usize) -> f64 {
    let mut x = blocks | 1;
    let mut v = Vec::new();
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let start = x % (blocks - 64);
        let keys: Vec<_> = (start..start + 64).map(key).collect();
        let t = Instant::now();
        let m = s.match_prefix(&keys);
        v.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(m.n, 64);
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let big: u64 = std::env::args()
        .nth(1)
        .map_or(10_000_000, |a| a.parse().unwrap());
    let n: usize = std::env::args().nth(2).map_or(4000, |a| a.parse().unwrap());
    let small = store(65_536);
    let large = store(big);
    for _ in 0..3 {
        let a = lat(&small, 65_536, n);
        let b = lat(&large, big, n);
        println!("p50 65536: {a:.2} us  {big}: {b:.2} us  ratio {:.2}", b / a);
    }
}

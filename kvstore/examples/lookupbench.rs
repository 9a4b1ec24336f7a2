//! 64-key `match_prefix` latency (p50 of N lookups at random places, µs) in a store of 65,536
//! blocks and in one of 10 M, built in one process, three rounds alternating: what
//! `kvtier-bench host`'s case `lookup 64 keys p50 at 10M blocks` measures once, for profiling
//! the lookup alone. `cargo run --release -p kvstore --example lookupbench [BLOCKS] [N]`.
//! `SHARDS=S` builds both stores with S index shards (64 by default): each shard's table is
//! then as full as its growth steps leave it at BLOCKS / S keys, and a lookup's time at 10 M
//! blocks follows that fill (79% full at 8 shards, 84% at 64). `PRE=N` builds and drops a
//! store of N blocks first (as the bench's 1 M case runs before its 10 M one); the process's
//! RSS and transparent huge pages are printed once both stores are built. `LOAD=1` times
//! `Store::load` (pins, the policy's access, unpins) in place of `match_prefix`.
//!
//! `lookupbench chain [SECONDS]`: `match_prefix` over one chain of 1,000 present keys, again
//! and again (the index in cache): what the case `match_prefix chain 1000` measures, for
//! profiling the walk alone.
use kvstore::{BlockKey, Namespace, PolicyKind, Reserve, StoreConfig, TpShard};
use std::time::{Duration, Instant};

fn namespace() -> Namespace {
    Namespace {
        model: "x".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

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
        shards: std::env::var("SHARDS")
            .ok()
            .map_or(64, |v| v.parse().unwrap()),
        ..Default::default()
    }
    .build()
    .unwrap();
    let ns = s.register_namespace(&namespace()).unwrap();
    for i in 0..blocks {
        if let Reserve::Slot(r) = s.reserve(ns, key(i), 4096).unwrap() {
            r.commit_with_checksum(0).unwrap();
        }
    }
    s
}

fn lat(s: &kvstore::Store, blocks: u64, n: usize) -> f64 {
    let load = std::env::var("LOAD").is_ok_and(|v| v == "1");
    let mut x = blocks | 1;
    let mut v = Vec::new();
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let start = x % (blocks - 64);
        let keys: Vec<_> = (start..start + 64).map(key).collect();
        let t = Instant::now();
        if load {
            let l = s.load(&keys).unwrap();
            v.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(l.len(), 64);
        } else {
            let m = s.match_prefix(&keys);
            v.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(m.n, 64);
        }
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Keys/s of `match_prefix` over a chain of 1,000 present keys for `secs` seconds.
fn chain(secs: f64) {
    let s = StoreConfig {
        capacity_bytes: 4 << 20,
        segment_bytes: 4 << 20,
        size_classes: vec![4096],
        ..Default::default()
    }
    .build()
    .unwrap();
    let ns = s.register_namespace(&namespace()).unwrap();
    let keys: Vec<BlockKey> = (0..1000u64).map(key).collect();
    for k in &keys {
        s.put(ns, *k, &[1u8; 4096]).unwrap();
    }
    let (start, mut n) = (Instant::now(), 0u64);
    while start.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..100 {
            assert_eq!(s.match_prefix(&keys).n, keys.len());
        }
        n += 100;
    }
    let t = start.elapsed().as_secs_f64();
    let per = n as f64 * keys.len() as f64;
    println!("{:.1} Mkeys/s, {:.2} ns/key", per / t / 1e6, t * 1e9 / per);
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("chain") {
        chain(std::env::args().nth(2).map_or(3.0, |a| a.parse().unwrap()));
        return;
    }
    let big: u64 = std::env::args()
        .nth(1)
        .map_or(10_000_000, |a| a.parse().unwrap());
    let n: usize = std::env::args().nth(2).map_or(4000, |a| a.parse().unwrap());
    if let Some(pre) = std::env::var("PRE").ok().and_then(|v| v.parse().ok()) {
        drop(store(pre));
    }
    let small = store(65_536);
    let large = store(big);
    let thp = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    println!(
        "{}",
        thp.lines()
            .filter(|l| l.starts_with("AnonHugePages") || l.starts_with("Rss"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for _ in 0..3 {
        let a = lat(&small, 65_536, n);
        let b = lat(&large, big, n);
        println!("p50 65536: {a:.2} us  {big}: {b:.2} us  ratio {:.2}", b / a);
    }
}

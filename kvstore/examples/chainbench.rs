//! `match_prefix` over one chain of 1,000 present keys, repeated: what `kvtier-bench host`'s
//! case `match_prefix chain 1000` measures, for profiling the walk alone.
//! `cargo run --release -p kvstore --example chainbench [SECONDS]`.
use kvstore::{BlockKey, Namespace, StoreConfig, TpShard};
use std::time::{Duration, Instant};

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let s = StoreConfig {
        capacity_bytes: 4 << 20,
        segment_bytes: 4 << 20,
        size_classes: vec![4096],
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
    let chain: Vec<BlockKey> = (0..1000u64)
        .map(|i| BlockKey(u128::from((i + 1) << 32)))
        .collect();
    for k in &chain {
        s.put(ns, *k, &[1u8; 4096]).unwrap();
    }
    let (start, mut n) = (Instant::now(), 0u64);
    while start.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..100 {
            assert_eq!(s.match_prefix(&chain).n, chain.len());
        }
        n += 100;
    }
    let t = start.elapsed().as_secs_f64();
    println!(
        "{:.1} Mkeys/s, {:.2} ns/key",
        n as f64 * 1000.0 / t / 1e6,
        t * 1e9 / (n as f64 * 1000.0)
    );
}

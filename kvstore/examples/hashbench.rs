//! Checksum throughput on this machine, against a memcpy of the same bytes:
//! `cargo run --release -p kvstore --example hashbench`. One-shot XXH3-64 (twox-hash, AVX2
//! chosen at run time) on data in cache and in DRAM, the streaming `Checksummer` (xxhash-rust),
//! and the fused copy-and-hash helpers the store and the connector use.

use std::time::Instant;

fn gbps(bytes: usize, t: Instant) -> f64 {
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let n = 256usize << 20;
    let src: Vec<u8> = (0..n).map(|i| (i * 31 + i / 4096) as u8).collect();
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let small = &src[..64 << 10];
    let mut x = 0u64;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        let memcpy = gbps(n, t);
        let t = Instant::now();
        x ^= kvstore::checksum(&src);
        let dram = gbps(n, t);
        let t = Instant::now();
        for _ in 0..4096 {
            x ^= kvstore::checksum(small);
        }
        let cache = gbps(small.len() * 4096, t);
        let t = Instant::now();
        let mut c = kvstore::Checksummer::new();
        for _ in 0..4096 {
            c.update(small);
        }
        x ^= c.finish();
        let streaming = gbps(small.len() * 4096, t);
        let t = Instant::now();
        x ^= kvstore::copy_out_hashed(&mut dst, &src);
        let copy_out = gbps(n, t);
        let t = Instant::now();
        x ^= kvstore::copy_hashed(&mut dst, &src);
        let copy_in = gbps(n, t);
        let t = Instant::now();
        kvstore::copy_nt(&mut dst, &src);
        let nt = gbps(n, t);
        println!(
            "GB/s: memcpy {memcpy:.1} | one-shot hash: DRAM {dram:.1}, in cache {cache:.1} | \
             streaming hash in cache {streaming:.1} | copy_out_hashed {copy_out:.1} | \
             copy_hashed {copy_in:.1} | copy_nt {nt:.1}"
        );
    }
    // As a get: 256 KiB blocks out of a 1 GiB ring (DRAM) into one buffer that stays in cache.
    // `RING_MB=64`: a ring the last-level cache may hold (260 MiB on some Xeons), read as
    // many times as 1 GiB takes.
    let ring_mb: usize = std::env::var("RING_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&m| m > 0)
        .unwrap_or(1024);
    let passes = (1024 / ring_mb).max(1);
    // `HUGE=1`: the ring on transparent huge pages (where private memory may have them).
    let mut ring = if std::env::var("HUGE").is_ok_and(|v| v == "1") {
        kvstore::AlignedBuf::new_huge(ring_mb << 20).expect("ring")
    } else {
        kvstore::AlignedBuf::new(ring_mb << 20).expect("ring")
    };
    for (i, b) in ring.iter_mut().enumerate() {
        *b = (i * 7 + i / 4096) as u8;
    }
    let blk = 256usize << 10;
    // Aligned as the ring is: glibc's memcpy (`rep movsb` on this size) runs slower when
    // source and destination differ in their alignment, and a get's slot and an engine's
    // buffer are both 4096-aligned.
    let mut out = kvstore::AlignedBuf::new(blk).expect("buffer");
    for _ in 0..3 {
        let t = Instant::now();
        for b in (0..passes).flat_map(|_| ring.chunks(blk)) {
            out.copy_from_slice(b);
            x ^= u64::from(out[7]);
        }
        let memcpy = gbps(ring.len() * passes, t);
        let t = Instant::now();
        for b in (0..passes).flat_map(|_| ring.chunks(blk)) {
            x ^= kvstore::copy_out_hashed(&mut out, b);
        }
        let fused = gbps(ring.len() * passes, t);
        let t = Instant::now();
        for b in (0..passes).flat_map(|_| ring.chunks(blk)) {
            out.copy_from_slice(b);
            x ^= kvstore::checksum(&out);
        }
        let two_pass = gbps(ring.len() * passes, t);
        println!(
            "256 KiB blocks out of {ring_mb} MiB -> cached buffer, GB/s: memcpy {memcpy:.1} | copy_out_hashed \
             {fused:.1} | copy then hash {two_pass:.1}"
        );
    }
    println!("({})", x & 1);
}

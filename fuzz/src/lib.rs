//! A small mutation fuzzer that runs as an ordinary `#[test]` on stable Rust (cargo-fuzz needs
//! nightly, which this project cannot fetch). A target is a closure over bytes that must not
//! panic (it returns an error for bad input, as the code under test does). Each run replays
//! the target's corpus (`fuzz/corpus/<target>/*`, kept in the repository), then mutates corpus
//! entries and random bytes (bit flips, byte sets, truncations, insertions, splices with another
//! entry, interesting integers) until its time budget is spent: `KVTIER_FUZZ_SECS` seconds
//! (default 2; the README's test command gives each target 20). A failing input is written to
//! `target/fuzz-failures/<target>-<hash>` before the panic goes on, to be added to the corpus
//! once fixed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

/// Where corpora live.
pub fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

/// The time budget of one target.
pub fn budget() -> Duration {
    let secs = std::env::var("KVTIER_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs.max(0.0))
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(corpus_dir(target))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read(e.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    if out.is_empty() {
        out.push(Vec::new());
    }
    out
}

const INTERESTING: [u64; 10] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

fn mutate(rng: &mut impl Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..rng.gen_range(1..=4) {
        match rng.gen_range(0..8) {
            0 if !v.is_empty() => {
                let i = rng.gen_range(0..v.len());
                v[i] ^= 1 << rng.gen_range(0..8);
            }
            1 if !v.is_empty() => {
                let i = rng.gen_range(0..v.len());
                v[i] = rng.gen();
            }
            2 if !v.is_empty() => {
                let n = rng.gen_range(0..v.len());
                v.truncate(n);
            }
            3 => {
                let i = rng.gen_range(0..=v.len());
                let n = rng.gen_range(1..=16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                v.splice(i..i, bytes);
            }
            4 if !other.is_empty() => {
                let i = rng.gen_range(0..=v.len());
                let a = rng.gen_range(0..other.len());
                let b = rng.gen_range(a..=other.len());
                v.splice(i..i, other[a..b].iter().copied());
            }
            5 if v.len() >= 8 => {
                let i = rng.gen_range(0..=v.len() - 8);
                let x = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                let w = if rng.gen() {
                    x.to_le_bytes()
                } else {
                    x.to_be_bytes()
                };
                let n = [1, 2, 4, 8][rng.gen_range(0..4)];
                v[i..i + n].copy_from_slice(&w[..n]);
            }
            6 if v.len() >= 2 => {
                let a = rng.gen_range(0..v.len());
                let b = rng.gen_range(0..v.len());
                v.swap(a, b);
            }
            _ => {
                let n = rng.gen_range(0..64);
                v.extend((0..n).map(|_| rng.gen::<u8>()));
            }
        }
    }
    v
}

/// Runs `f` on the corpus, then on mutated inputs until the budget is spent; returns how many
/// inputs ran. A panic is reported with the input saved under `target/fuzz-failures/`.
pub fn run(target: &str, mut f: impl FnMut(&[u8])) -> u64 {
    let seeds = corpus(target);
    let mut check = |input: &[u8]| {
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| f(input))) {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("target")
                .join("fuzz-failures");
            let _ = std::fs::create_dir_all(&dir);
            let name = format!("{target}-{:016x}", fnv(input));
            let _ = std::fs::write(dir.join(&name), input);
            eprintln!(
                "fuzz target {target}: input saved as target/fuzz-failures/{name} ({} bytes)",
                input.len()
            );
            std::panic::resume_unwind(e);
        }
    };
    let mut n = 0u64;
    for s in &seeds {
        check(s);
        n += 1;
    }
    let seed = std::env::var("KVTIER_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let until = Instant::now() + budget();
    while Instant::now() < until {
        let a = &seeds[rng.gen_range(0..seeds.len())];
        let b = &seeds[rng.gen_range(0..seeds.len())];
        let input = mutate(&mut rng, a, b);
        check(&input);
        n += 1;
    }
    eprintln!("fuzz target {target}: {n} inputs (seed {seed})");
    n
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

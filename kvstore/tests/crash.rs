//! Crash test: a writer process stores blocks with write-through (each `put` returns only once
//! the block is durable) and reports each one; it is killed with SIGKILL mid-load. Reopening must
//! recover every acknowledged block, and every block served must be byte-identical to what was
//! written.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvstore::io::{IoConfig, IoEngineKind};
use kvstore::{fill_pattern, Admission, BlockKey, DiskConfig, Namespace, StoreConfig, TpShard};

const CHILD: &str = "KVTIER_CRASH_CHILD_DIR";

fn config(dir: PathBuf) -> StoreConfig {
    StoreConfig {
        capacity_bytes: 8 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10, 128 << 10],
        shards: 4,
        disk: Some(DiskConfig {
            dir,
            capacity_bytes: 256 << 20,
            files: 1,
            io: IoConfig {
                kind: IoEngineKind::Auto,
                queue_depth: 8,
                ..Default::default()
            },
            admission: Admission::Always,
            write_through: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn namespace() -> Namespace {
    Namespace {
        model: "crash".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn data(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; 30_000 + (i as usize % 29) * 3_001];
    fill_pattern(&mut v, i);
    v
}

/// The writer: runs until killed (or 60 s, as a safety net).
fn child(dir: PathBuf) {
    let store = config(dir).build().unwrap();
    let ns = store.register_namespace(&namespace()).unwrap();
    let mut out = std::io::stdout().lock();
    let start = Instant::now();
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(60) {
        store.put(ns, key(i), &data(i)).unwrap();
        // Write-through queues the block for the tiering worker; sync waits until it is
        // durable.
        assert!(store.sync(Duration::from_secs(30)));
        writeln!(out, "stored {i}").unwrap();
        out.flush().unwrap();
        i += 1;
    }
}

#[test]
fn sigkill_mid_load_recovers_every_acknowledged_block() {
    if let Some(dir) = std::env::var_os(CHILD) {
        child(PathBuf::from(dir));
        return;
    }
    // Removed when the test ends, failed or not.
    let tmp = tempfile::Builder::new()
        .prefix("crash-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let dir = tmp.path().to_path_buf();
    let mut proc = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigkill_mid_load_recovers_every_acknowledged_block",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut acked = None;
    let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(n) = line.strip_prefix("stored ") {
            let n: u64 = n.parse().unwrap();
            acked = Some(n);
            if n >= 300 {
                break;
            }
        }
    }
    // Let it run a few more puts, then kill it mid-write.
    std::thread::sleep(Duration::from_millis(37));
    proc.kill().unwrap(); // SIGKILL
    proc.wait().unwrap();
    for line in lines.map_while(Result::ok) {
        if let Some(n) = line.strip_prefix("stored ") {
            acked = Some(n.parse().unwrap());
        }
    }
    let acked = acked.expect("the writer stored nothing");

    let store = config(dir.clone()).build().unwrap();
    let recovered = store.stats().disk().unwrap().recovered_blocks;
    let mut served = 0;
    for i in 0..acked + 50 {
        match store.get(&key(i)) {
            Some(b) => {
                assert!(*b == data(i)[..], "block {i}: wrong bytes after crash");
                served += 1;
            }
            None => assert!(
                i > acked,
                "acknowledged block {i} lost (acked up to {acked})"
            ),
        }
    }
    println!(
        "crash test: acknowledged {} blocks, recovered {recovered}, served {served}",
        acked + 1
    );
    assert!(served > acked);
    drop(store);
}

//! The `kvtier-bench` binary runs and ends with the JSON report line.

use std::process::Command;

#[test]
fn host_bench_prints_json_last_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "host",
            "--sizes",
            "256K",
            "--threads",
            "1,2",
            "--working-set",
            "8M",
            "--rounds",
            "1",
            "--chain",
            "100",
            "--metadata-blocks",
            "10000",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout.lines().last().unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["bench"], "host");
    let rows = v["results"].as_array().unwrap();
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    assert_eq!(
        cases,
        [
            "put 256KiB x1t",
            "get 256KiB x1t",
            "put 256KiB x2t",
            "get 256KiB x2t",
            "match_prefix chain 100 x1t",
            "metadata 10000 blocks"
        ]
    );
    for r in rows {
        for f in ["value", "baseline", "ratio"] {
            let x = r[f].as_f64().unwrap();
            assert!(x.is_finite() && x > 0.0, "{r}");
        }
    }
}

#[test]
fn bad_size_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["host", "--sizes", "12Q"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a size"));
}

#[test]
fn disk_bench_prints_json_last_line() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bench-disk-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["disk", "--dir"])
        .arg(&dir)
        .args([
            "--sizes",
            "256K",
            "--depths",
            "2",
            "--bytes",
            "4M",
            "--rounds",
            "1",
            "--prefix-tokens",
            "64",
            "--bytes-per-token",
            "16K",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["bench"], "disk");
    let cases: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["case"].as_str().unwrap())
        .collect();
    assert_eq!(
        cases,
        [
            "write 256KiB qd2",
            "read 256KiB qd2",
            "prefix load 0k tokens (1 MiB)"
        ]
    );
    assert!(!dir.exists(), "the bench must clean up its data directory");
}

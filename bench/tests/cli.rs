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

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
            "get 256KiB x1t vs memcpy of its slots",
            "put 256KiB x2t",
            "get 256KiB x2t",
            "get 256KiB x2t vs memcpy of its slots",
            "match_prefix chain 100 x1t",
            "match_prefix chain 100 x2t",
            "metadata 10000 blocks",
            "metadata 10000 blocks evicting",
            "lookup 64 keys p50 at 10000 blocks",
            "lookup 64 keys p99 at 10000 blocks",
            "metadata 10000 blocks, duel-clock",
            "metadata 10000 blocks, lru"
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

fn last_json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn replay_bench_on_a_small_trace_with_report() {
    let tmp = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bench-replay-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let trace = tmp.join("trace.jsonl");
    let mut text = String::new();
    for i in 0..40u64 {
        // Two shared prefixes and a unique tail per request.
        let prefix = if i % 2 == 0 { "1, 2, 3" } else { "10, 11" };
        text.push_str(&format!(
            "{{\"timestamp\": {i}, \"input_length\": 2000, \"output_length\": 10, \"hash_ids\": [{prefix}, {}]}}\n",
            1000 + i
        ));
    }
    std::fs::write(&trace, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "replay",
            "--block-bytes",
            "16K",
            "--host",
            "20%",
            "--disk",
            "50%",
            "--sweep",
            "10,50",
            "--synthetic",
            "none",
        ])
        .arg("--trace")
        .arg(&trace)
        .arg("--dir")
        .arg(tmp.join("data"))
        .arg("--report")
        .arg(tmp.join("report"))
        .arg("--json")
        .output()
        .unwrap();
    let v = last_json(&out);
    assert_eq!(v["bench"], "replay");
    let rows = v["results"].as_array().unwrap();
    let hit = rows
        .iter()
        .find(|r| r["case"].as_str().unwrap().starts_with("block hit ratio"))
        .unwrap();
    // Infinite cache: 19 + 19 later requests hit their 3 or 2 prefix blocks, of 80 + 60 refs.
    let inf = hit["baseline"].as_f64().unwrap();
    assert!((inf - 95.0 / 140.0).abs() < 1e-9, "{inf}");
    assert!(hit["value"].as_f64().unwrap() > 0.3);
    let sims: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| r["case"].as_str().unwrap().starts_with("sim "))
        .collect();
    // Two capacities × every policy × prefix and block hits, on this trace only.
    assert_eq!(sims.len(), 2 * kvstore::PolicyKind::ALL.len() * 2);
    for s in sims {
        assert_eq!(s["trace"], "trace");
        if s["metric"] == "block" {
            assert!(
                s["ratio"].as_f64().unwrap() <= 1.0 + 1e-12,
                "a policy beat MIN: {s}"
            );
        }
    }
    assert!(tmp.join("report/replay.md").exists());
    assert!(tmp.join("report/hit_ratio_vs_capacity_trace.png").exists());
    // The same trace through a kvtierd gets the same prefix hits while nothing is evicted.
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "replay",
            "--mode",
            "kvtierd",
            "--block-bytes",
            "16K",
            "--host",
            "100%",
            "--disk",
            "0",
            "--no-sweep",
        ])
        .arg("--trace")
        .arg(&trace)
        .arg("--dir")
        .arg(tmp.join("data2"))
        .arg("--json")
        .output()
        .unwrap();
    let v = last_json(&out);
    let hit = &v["results"][0];
    assert!(hit["case"].as_str().unwrap().contains("kvtierd"));
    assert!(
        (hit["value"].as_f64().unwrap() - 95.0 / 140.0).abs() < 1e-9,
        "{hit}"
    );
    // A malformed trace names the line.
    std::fs::write(&trace, "{\"timestamp\": 0}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["replay", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 1"));
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn replay_with_hints_reports_hidden_and_hideable_disk_time() {
    let tmp = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bench-replay-hints-{}", std::process::id()));
    // A synthetic trace with parameters far from the defaults, sped up so requests queue.
    let args = |extra: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"));
        c.args([
            "replay",
            "--trace",
            "gen:chat:think=2000,turns=6,burst=4",
            "--synthetic-requests",
            "400",
            "--pace",
            "timestamps",
            "--speedup",
            "3000",
            "--hints",
            "--no-sweep",
            "--json",
        ])
        .args(extra)
        .arg("--dir")
        .arg(tmp.join("data"));
        c
    };
    let out = args(&["--preload-held", "25%"]).output().unwrap();
    let v = last_json(&out);
    let rows = v["results"].as_array().unwrap();
    let case = |name: &str| {
        rows.iter()
            .find(|r| r["case"] == name)
            .unwrap_or_else(|| panic!("no case {name}: {v}"))
    };
    let with = case("disk load time on the critical path with hints");
    let hideable = case("load time hideable");
    let vs = case("load time hidden by hints vs hideable");
    // Without hints, disk time on the critical path is what the hideable share is of.
    assert_eq!(hideable["baseline"], with["baseline"]);
    assert!(hideable["value"].as_f64().unwrap() <= with["baseline"].as_f64().unwrap() + 1e-9);
    assert_eq!(vs["baseline"], hideable["value"]);
    for r in [with, hideable, vs] {
        assert!(r["value"].as_f64().unwrap() >= 0.0, "{r}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the loads' waits for disk, as the store measured them"),
        "{stderr}"
    );
    // Bad values are named.
    let out = args(&["--preload-held", "0.25"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--preload-held"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["replay", "--trace", "gen:chat:think=soon", "--no-sweep"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("think"));
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn peers_bench_against_redis() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "peers", "--peers", "redis", "--sizes", "256K", "--bytes", "4M", "--rounds", "1",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    let cases: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["case"].as_str().unwrap())
        .collect();
    assert_eq!(cases, ["put 256KiB vs redis", "get 256KiB vs redis"]);
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "peers",
            "--peers",
            "memcached",
            "--sizes",
            "256K",
            "--bytes",
            "1M",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown peer"));
}

#[test]
fn remote_bench_against_iperf3_and_redis() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "remote",
            "--sizes",
            "1M",
            "--bytes",
            "8M",
            "--rounds",
            "1",
            "--lookups",
            "50",
            "--trace",
            "gen:chat",
            "--trace-requests",
            "300",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    let rows = v["results"].as_array().unwrap();
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    assert_eq!(
        cases,
        [
            "put 1MiB vs iperf3",
            "get 1MiB vs iperf3",
            "put 1MiB vs redis",
            "get 1MiB vs redis",
            "put 1MiB vs kvtier-redis",
            "get 1MiB vs kvtier-redis",
            "lookup 64 keys p50 vs 2xRTT+30us",
            "lookup 64 keys p99 vs 2xRTT+30us",
            "put 2MiB with a stalled peer",
            "get 2MiB with a stalled peer",
            "replay chat 3 nodes hit ratio pooled vs alone",
            "hits after a join",
            "replay chat 3 nodes remote share of hits"
        ]
    );
    assert!(rows
        .iter()
        .all(|r| r["value"].as_f64().unwrap() > 0.0 && r["baseline"].as_f64().unwrap() > 0.0));
    // Pooling three nodes' memory never loses hits against the same nodes alone.
    let pooled = rows
        .iter()
        .find(|r| r["case"] == "replay chat 3 nodes hit ratio pooled vs alone")
        .unwrap();
    assert!(pooled["ratio"].as_f64().unwrap() >= 1.0, "{pooled}");
}

#[test]
fn cluster_sim_reports_churn_moves_and_skew() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "cluster-sim",
            "--nodes",
            "4,16",
            "--trace",
            "gen:chat",
            "--trace-requests",
            "300",
            "--skew-keys",
            "20000",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    let rows = v["results"].as_array().unwrap();
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    let mut want = Vec::new();
    for n in [4, 16] {
        want.extend([
            format!("hit ratio with churn, {n} nodes"),
            format!("keys moved per change, {n} nodes"),
            format!("bytes moved per leave, {n} nodes"),
            format!("load skew, {n} nodes, gen:chat blocks"),
            format!("owner of a key, {n} nodes"),
            format!("load skew, {n} nodes, 20000 blocks"),
        ]);
    }
    assert_eq!(cases, want);
    for r in rows {
        let case = r["case"].as_str().unwrap();
        if case.starts_with("keys moved") {
            // Rendezvous hashing moves exactly the changed node's share.
            let ratio = r["ratio"].as_f64().unwrap();
            assert!((ratio - 1.0).abs() < 1e-9, "{r}");
        }
    }
}

#[test]
fn replay_over_nodes_compares_routings() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "replay",
            "--trace",
            "gen:chat",
            "--synthetic-requests",
            "400",
            "--nodes",
            "3",
            "--host",
            "10%",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    let rows = v["results"].as_array().unwrap();
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    assert_eq!(
        cases,
        [
            "chat 3 nodes prefix vs round-robin block hit ratio",
            "chat 3 nodes prefix vs round-robin prefill tokens saved"
        ]
    );
    // Routing by kvtier's lookup finds at least the hits round-robin finds.
    assert!(rows[0]["ratio"].as_f64().unwrap() >= 1.0, "{}", rows[0]);
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "replay",
            "--trace",
            "gen:chat",
            "--nodes",
            "2",
            "--routing",
            "random",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--routing"));
}

#[test]
fn ipc_bench_against_the_sidecar() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "ipc",
            "--bytes",
            "8M",
            "--rounds",
            "1",
            "--lookups",
            "20",
            "--batch",
            "4",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    let cases: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["case"].as_str().unwrap())
        .collect();
    assert_eq!(
        cases,
        [
            "put 2MiB batch 4",
            "get 2MiB batch 4",
            "lookup+lease 64 keys p50",
            "lookup+lease 64 keys p99",
            "lookup+lease 64 keys overhead p50",
            "lookup+lease 64 keys overhead p99"
        ]
    );
}

#[test]
fn connector_bench_both_modes() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "connector",
            "--tokens",
            "256",
            "--layers",
            "4",
            "--layout",
            "blocks-first",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    assert_eq!(v["bench"], "connector");
    let rows = v["results"].as_array().unwrap();
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    assert_eq!(
        cases,
        [
            "save 256 tokens, embedded",
            "load 256 tokens, embedded",
            "save 256 tokens layer by layer, embedded",
            "save 256 tokens, kvtierd",
            "load 256 tokens, kvtierd",
            "save 256 tokens layer by layer, kvtierd",
        ]
    );
    for r in rows {
        assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn connector_bench_refuses_a_prefix_shorter_than_a_block() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["connector", "--tokens", "8", "--embedded-only"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tokens"), "{err}");
}

/// The soak, 2 minutes: engine processes against a kvtierd that is killed (-9) and stopped
/// (SIGTERM) at random; every byte loaded is checked, and every block acknowledged before a
/// clean shutdown must come back.
#[test]
fn soak_two_minutes_serves_no_wrong_bytes_and_loses_nothing_durable() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "soak",
            "--minutes",
            "2",
            "--engines",
            "3",
            "--restart-every",
            "10",
            "--keys",
            "128",
            "--json",
        ])
        .output()
        .unwrap();
    let v = last_json(&out);
    assert_eq!(v["bench"], "soak");
    let row = |case: &str| {
        v["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["case"] == case)
            .unwrap_or_else(|| panic!("no row {case:?}: {v}"))
            .clone()
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(row("wrong bytes served")["value"], 0.0, "{stderr}");
    assert_eq!(
        row("lost acknowledged durable blocks")["value"],
        0.0,
        "{stderr}"
    );
    assert_eq!(row("unclean SIGTERM exits")["value"], 0.0, "{stderr}");
    let c = &v["counts"];
    let n = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("no count {k}: {c}"));
    // (Each restart also waits for the engines and checks the durable blocks: on a loaded
    // machine that takes tens of seconds.)
    assert!(n("restarts_kill9") + n("restarts_sigterm") >= 3.0, "{c}");
    assert!(n("blocks_verified") > 100.0, "{c}");
    assert!(n("durable_checks") > 0.0, "{c}");
    assert!(n("engine_reconnects") >= 3.0, "{c}");
}

#[test]
fn events_bench_counts_every_stored_block_through_a_subscriber() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["events", "--blocks", "3000", "--rounds", "1", "--json"])
        .output()
        .unwrap();
    let v = last_json(&out);
    assert_eq!(v["bench"], "events");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows[1]["case"]
        .as_str()
        .unwrap()
        .starts_with("events/s at 3000 blocks"));
    // The clear at the end: every block the daemon held announced removed.
    assert_eq!(rows[2]["case"], "removal events/s at 3000 blocks");
    for r in rows {
        assert!(r["value"].as_f64().unwrap() > 0.0, "{r}");
    }
}

#[test]
fn tracegen_writes_a_mooncake_trace() {
    let dir = std::env::temp_dir().join(format!("kvtier-tracegen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("chat.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args([
            "tracegen",
            "--kind",
            "chat:turns=6",
            "--requests",
            "80",
            "--json",
        ])
        .arg("--out")
        .arg(&path)
        .output()
        .unwrap();
    let v = last_json(&out);
    assert_eq!(v["bench"], "tracegen");
    assert_eq!(v["counts"]["requests"], 80.0);
    let text = std::fs::read_to_string(&path).unwrap();
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 80);
    let blocks: usize = rows
        .iter()
        .map(|r| r["hash_ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(v["counts"]["blocks"], blocks as f64);
    // Multi-turn: later turns repeat earlier block ids (shared prefixes).
    assert!(v["counts"]["distinct_blocks"].as_f64().unwrap() < blocks as f64);
    for r in &rows {
        for k in ["timestamp", "input_length", "output_length"] {
            assert!(r[k].is_u64(), "{k} in {r}");
        }
    }
    // The same seed writes the same trace; an unknown generator is named.
    let again = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["tracegen", "--kind", "chat:turns=6", "--requests", "80"])
        .output()
        .unwrap();
    assert!(again.status.success());
    assert_eq!(String::from_utf8(again.stdout).unwrap(), text);
    let bad = Command::new(env!("CARGO_BIN_EXE_kvtier-bench"))
        .args(["tracegen", "--kind", "chats"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("\"chats\""));
    let _ = std::fs::remove_dir_all(&dir);
}

//! The `kvtier` CLI against a real kvtierd (built alongside it in the same target directory).

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

struct Daemon {
    child: Child,
    dir: PathBuf,
    grpc: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn kvtierd() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_kvtier")).with_file_name("kvtierd");
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build -p kvtierd)",
        p.display()
    );
    p
}

fn start(token: Option<&str>) -> Daemon {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "cli-{}-{}",
        std::process::id(),
        token.is_some()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cmd = Command::new(kvtierd());
    cmd.arg("--data-dir").arg(&dir).args([
        "--host-capacity",
        "16M",
        "--no-disk",
        "--grpc",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
        "--set",
        "host.segment=4M",
        "--set",
        "log=warn",
    ]);
    match token {
        Some(t) => cmd.args(["--set", &format!("server.token={t}")]),
        None => cmd.args(["--set", "server.allow_unauthenticated_admin=true"]),
    };
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let grpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .unwrap_or_else(|| panic!("no grpc= in {line:?}"))
        .to_string();
    Daemon { child, dir, grpc }
}

fn kvtier(addr: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["--addr", addr])
        .args(args)
        .env_remove("KVTIER_TOKEN")
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn status_stats_lookup_pin_and_clear() {
    let d = start(None);
    let st = ok(&kvtier(&d.grpc, &["status"]));
    assert!(st.contains("kvtierd") && st.contains("populated"), "{st}");
    // The arena is populated in the background: status says how far, and it gets there.
    let mut done = false;
    for _ in 0..100 {
        let v: serde_json::Value =
            serde_json::from_str(ok(&kvtier(&d.grpc, &["status", "--json"])).trim()).unwrap();
        assert!(v["total_segments"].as_u64().unwrap() > 0);
        if v["populated_segments"] == v["total_segments"] {
            done = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(done, "the host arena never finished populating");
    let v: serde_json::Value =
        serde_json::from_str(ok(&kvtier(&d.grpc, &["stats", "--json"])).trim()).unwrap();
    assert_eq!(v["tiers"][0]["tier"], "host");
    assert_eq!(v["tiers"][0]["capacity_bytes"], 16 << 20);
    assert!(ok(&kvtier(&d.grpc, &["stats"])).contains("capacity"));
    let key = "000102030405060708090a0b0c0d0e0f";
    let v: serde_json::Value =
        serde_json::from_str(ok(&kvtier(&d.grpc, &["lookup", key, "--json"])).trim()).unwrap();
    assert_eq!(v["n"], 0);
    assert!(ok(&kvtier(&d.grpc, &["pin", key])).contains("nothing to pin"));
    let v: serde_json::Value = serde_json::from_str(
        ok(&kvtier(
            &d.grpc,
            &["prefetch", key, "--priority", "3", "--json"],
        ))
        .trim(),
    )
    .unwrap();
    assert_eq!(
        (v["present"].as_u64(), v["queued"].as_u64()),
        (Some(0), Some(0))
    );
    let e = kvtier(&d.grpc, &["prefetch", key, "--priority", "300"]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("0..=255"));
    let v: serde_json::Value =
        serde_json::from_str(ok(&kvtier(&d.grpc, &["stats", "--json"])).trim()).unwrap();
    assert_eq!(v["prefetch"]["hinted"], 0);
    // Retain and demote: answered (nothing stored here: nothing retained or moved).
    let v: serde_json::Value = serde_json::from_str(
        ok(&kvtier(
            &d.grpc,
            &[
                "retain",
                key,
                "--session",
                "chat-1",
                "--ttl",
                "7200",
                "--json",
            ],
        ))
        .trim(),
    )
    .unwrap();
    assert_eq!(
        (v["present"].as_u64(), v["retained"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(v["ttl_ms"], 3_600_000, "clipped to preload.max_retain_ms");
    assert_eq!(v["clipped_by"][0], "preload.max_retain_ms");
    let v: serde_json::Value = serde_json::from_str(
        ok(&kvtier(
            &d.grpc,
            &["demote", "--session", "chat-1", "--json"],
        ))
        .trim(),
    )
    .unwrap();
    assert_eq!(v["released"], 0);
    let e = kvtier(&d.grpc, &["demote"]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("name a session"));
    let v: serde_json::Value =
        serde_json::from_str(ok(&kvtier(&d.grpc, &["stats", "--json"])).trim()).unwrap();
    assert_eq!(v["retention"]["retains"], 1);
    assert_eq!(v["retention"]["demotes"], 1);
    assert_eq!(
        v["retention"]["max_bytes"],
        4 << 20,
        "a quarter of the host tier"
    );
    let e = kvtier(&d.grpc, &["clear", "7"]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("not registered"));
    let e = kvtier(&d.grpc, &["lookup", "xyz"]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("32 hex digits"));
}

#[test]
fn errors_say_what_to_do_when_the_daemon_is_down_or_the_token_is_wrong() {
    // Port 1 (tcpmux): nothing listens there (a port freed by this test could be taken by a
    // daemon another test starts meanwhile).
    let e = kvtier("127.0.0.1:1", &["status"]);
    assert!(!e.status.success());
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(msg.contains("is it running"), "{msg}");
    let d = start(Some("t0ken"));
    let e = kvtier(&d.grpc, &["status"]);
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(msg.contains("--token"), "{msg}");
    let e = kvtier(&d.grpc, &["--token", "wrong", "status"]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("wrong bearer token"));
    assert!(ok(&kvtier(&d.grpc, &["--token", "t0ken", "status"])).contains("kvtierd"));
}

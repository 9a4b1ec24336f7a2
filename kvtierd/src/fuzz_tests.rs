//! Fuzz targets of the daemon (see `kvtier-fuzz`): the engine request handler, fed frames of any
//! bytes after a valid Hello over a socket pair, answers or closes but never panics, never
//! hangs, and leaves the store consistent; the configuration loader, fed any file and any
//! `--set` lines, loads or names the problem but never panics.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{self, Sources};
use crate::ipc_server::Conn;
use crate::Daemon;

fn daemon() -> Arc<Daemon> {
    let store: &'static kvstore::Store = Box::leak(Box::new(
        kvstore::StoreConfig {
            capacity_bytes: 8 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![64 << 10, 256 << 10],
            shards: 4,
            populate: kvstore::Populate::Lazy,
            wait: Duration::from_millis(20),
            ..Default::default()
        }
        .build()
        .unwrap(),
    ));
    let mut cfg = config::Config::default();
    cfg.server.reservation_ttl_ms = 1_000;
    Arc::new(Daemon::new(store, Vec::new(), cfg, Default::default()))
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

/// A fuzz input as frames: `[u16 little-endian length][body]` after each other (a length past
/// the end takes what is left).
fn frames(bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 2 <= bytes.len() {
        let n = u16::from_le_bytes([bytes[at], bytes[at + 1]]) as usize;
        at += 2;
        let end = (at + n).min(bytes.len());
        out.push(&bytes[at..end]);
        at = end;
    }
    out
}

#[test]
fn fuzz_engine_requests() {
    use prost::Message;
    let d = daemon();
    kvtier_fuzz::run("ipc-requests", |bytes| {
        let (client, server) = UnixStream::pair().unwrap();
        let dd = d.clone();
        let t = std::thread::spawn(move || {
            d_run(&dd, server);
        });
        let hello = kvtier_proto::ipc::Request {
            id: 1,
            body: Some(kvtier_proto::ipc::request::Body::Hello(
                kvtier_proto::ipc::Hello {
                    version: kvtier_proto::IPC_VERSION,
                    client: "fuzz".into(),
                    tenant_secret: String::new(),
                },
            )),
        };
        let mut c = &client;
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut input = frame(&hello.encode_to_vec());
        for f in frames(bytes) {
            input.extend(frame(f));
        }
        // Written from another thread: the daemon's replies are read meanwhile.
        let w = client.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let _ = (&w).write_all(&input);
            let _ = w.shutdown(std::net::Shutdown::Write);
        });
        let mut sink = Vec::new();
        let r = c.read_to_end(&mut sink);
        assert!(
            !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "the daemon hung on an input"
        );
        writer.join().unwrap();
        t.join().expect("the request handler panicked");
    });
    // Whatever came in, the store is consistent and still serves.
    let s = d.store.stats();
    assert!(s.used_bytes <= s.capacity_bytes);
    assert_eq!(s.leases, 0, "a closed connection left leases behind");
}

fn d_run(d: &Daemon, server: UnixStream) {
    if let Ok(mut c) = Conn::new(d, server) {
        let _ = c.run();
    }
}

#[test]
fn fuzz_configuration() {
    let dir = std::env::temp_dir().join(format!("kvtierd-fuzz-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvtierd.toml");
    kvtier_fuzz::run("config", |bytes| {
        let text = String::from_utf8_lossy(bytes);
        std::fs::write(&path, text.as_bytes()).unwrap();
        // Loading only (building the store would create the directories the input names).
        let _ = config::load(Sources {
            file: Some(&path),
            env: Vec::new(),
            sets: Vec::new(),
        });
        // The same text as --set lines and environment variables.
        let sets: Vec<String> = text.lines().map(str::to_string).collect();
        let env: Vec<(String, String)> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| {
                (
                    format!("KVTIERD_{}", k.trim().to_ascii_uppercase()),
                    v.to_string(),
                )
            })
            .collect();
        let _ = config::load(Sources {
            file: None,
            env,
            sets,
        });
    });
    let _ = std::fs::remove_dir_all(&dir);
}

//! The real `kvtierd` binary on temporary directories and ports: engine IPC through the shared
//! arena, leases of killed clients, SIGTERM and restart, malformed frames, the admin API's
//! limits and token, metrics and events.

// tonic fixes `Status` as the error type of interceptors.
#![allow(clippy::result_large_err)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvstore::{BlockKey, NsId, Tier};
use kvtier_ipc::{IpcClient, SlotStatus};
use kvtier_proto::admin as pb;
use kvtier_proto::admin::admin_client::AdminClient;

#[test]
fn engine_ipc_roundtrip_through_the_shared_arena() {
    let d = Kvtierd::start("ipc", &[], true);
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..20);
    // A second client (another engine process) sees the same blocks, byte-exact.
    let mut c2 = d.client();
    assert_eq!(c2.register_namespace(&namespace()).unwrap(), ns);
    assert_eq!(get_all(&mut c2, 0..20), 20);
    let keys: Vec<BlockKey> = (0..25).map(key).collect();
    let l = c2.lookup(&keys, None).unwrap();
    assert_eq!((l.n, l.lease), (20, None));
    assert!(l.tiers.iter().all(|t| *t == Tier::Host));
    // Re-putting a stored key is "present"; an unknown namespace is a clear error.
    assert_eq!(
        c.reserve(ns, &[key(0)], &[10]).unwrap(),
        vec![SlotStatus::Present]
    );
    let e = c
        .reserve(NsId(77), &[key(99)], &[10])
        .unwrap_err()
        .to_string();
    assert!(e.contains("namespace"), "{e}");
    let st = c.stats().unwrap();
    assert_eq!(st.blocks, 20);
    // A lease that lapses before release is reported, so the engine discards what it copied.
    let l = c2.load(&keys[..2], Duration::from_millis(1), None).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    c.lookup(&keys[..1], Some(Duration::from_secs(5))).unwrap(); // reaps expired leases
    let e = c2.release(l.lease.unwrap()).unwrap_err().to_string();
    assert!(e.contains("expired"), "{e}");
    // Writes go only into slots this client reserved, at their exact length.
    assert!(c2.write(12345, &[0u8; 10]).is_err());
}

#[test]
fn killed_client_releases_leases_and_reservations() {
    if let Ok(sock) = std::env::var("KVTIERD_TEST_VICTIM") {
        // The victim: hold a lease and a reservation, say so, then wait to be killed.
        let mut c = IpcClient::connect(sock.as_ref(), "victim").unwrap();
        let ns = c.register_namespace(&namespace()).unwrap();
        let l = c.lookup(&[key(0)], Some(Duration::from_secs(600))).unwrap();
        assert!(l.n == 1 && l.lease.is_some());
        let s = c.reserve(ns, &[key(500)], &[1000]).unwrap();
        assert!(matches!(s[0], SlotStatus::Slot { .. }));
        println!("holding");
        std::io::stdout().flush().unwrap();
        std::thread::sleep(Duration::from_secs(600));
        return;
    }
    let d = Kvtierd::start("kill", &[], true);
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..1);
    let mut victim = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "killed_client_releases_leases_and_reservations",
            "--nocapture",
        ])
        .env("KVTIERD_TEST_VICTIM", &d.socket)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(victim.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("holding") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "victim exited early");
    }
    assert_eq!(c.stats().unwrap().leases, 1);
    assert_eq!(
        c.reserve(ns, &[key(500)], &[1000]).unwrap(),
        vec![SlotStatus::InFlight]
    );
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().unwrap().leases != 0 {
        assert!(
            Instant::now() < deadline,
            "the killed client's lease was not released"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its reservation was freed too: the key can be written now.
    assert!(matches!(
        c.reserve(ns, &[key(500)], &[1000]).unwrap()[0],
        SlotStatus::Slot { .. }
    ));
}

#[test]
fn sigterm_then_restart_keeps_disk_blocks() {
    let args = ["--set", "disk.admission=always"];
    let d = Kvtierd::start("restart", &args, true);
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..30);
    drop(c);
    assert!(d.term().success(), "kvtierd did not exit 0 on SIGTERM");
    let d = Kvtierd::start("restart", &args, false);
    let mut c = d.client();
    assert_eq!(
        c.register_namespace(&namespace()).unwrap(),
        ns,
        "namespace id changed"
    );
    let keys: Vec<BlockKey> = (0..30).map(key).collect();
    let l = c.lookup(&keys, None).unwrap();
    assert_eq!(l.n, 30);
    assert!(l.tiers.iter().all(|t| *t == Tier::Disk), "{:?}", l.tiers);
    assert_eq!(get_all(&mut c, 0..30), 30);
}

#[test]
fn a_session_retained_before_sigterm_is_retained_after_the_restart() {
    // Seen-twice admission from the first block (by default it admits every block while
    // the disk has room): blocks put once would not go to disk at the shutdown's flush;
    // retained ones do, and the retention comes back with them.
    let args = ["--set", "disk.admit_all_below=0"];
    let d = Kvtierd::start("retain-restart", &args, true);
    let keys: Vec<BlockKey> = (0..12).map(key).collect();
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..16);
    let r = c
        .retain(&keys, "agent-3", Duration::from_secs(600), 2)
        .unwrap();
    assert_eq!(r.retained, 12, "{r:?}");
    drop(c);
    assert!(d.term().success(), "kvtierd did not exit 0 on SIGTERM");
    let d = Kvtierd::start("retain-restart", &args, false);
    assert_eq!(metric(&d.metrics, "kvtier_retentions"), 1.0);
    let bytes: u64 = (0..12).map(|i| data(i).len() as u64).sum();
    assert_eq!(metric(&d.metrics, "kvtier_retained_bytes"), bytes as f64);
    let mut c = d.client();
    c.register_namespace(&namespace()).unwrap();
    let l = c.lookup(&keys, None).unwrap();
    assert_eq!(l.n, 12);
    assert!(l.tiers.iter().all(|t| *t == Tier::Disk), "{:?}", l.tiers);
    assert_eq!(get_all(&mut c, 0..12), 12);
    // The blocks put once and not retained were not written.
    assert_eq!(c.lookup(&[key(12)], None).unwrap().n, 0);
}

#[test]
fn malformed_frames_are_rejected_while_others_keep_working() {
    let d = Kvtierd::start("malformed", &[], true);
    let mut good = d.client();
    let ns = good.register_namespace(&namespace()).unwrap();
    let mut bad = UnixStream::connect(&d.socket).unwrap();
    bad.write_all(&frame(&[0xff, 0xff, 0xff, 0x01, 0x02]))
        .unwrap();
    let e = read_reply(&mut bad);
    assert!(e.contains("malformed"), "{e}");
    // A well-formed request before Hello.
    use prost::Message;
    let stats = kvtier_proto::ipc::Request {
        id: 5,
        body: Some(kvtier_proto::ipc::request::Body::Stats(Default::default())),
    };
    bad.write_all(&frame(&stats.encode_to_vec())).unwrap();
    assert!(read_reply(&mut bad).contains("Hello"));
    // An oversized frame: an error that says why, then the connection closes.
    bad.write_all(&(u32::MAX).to_le_bytes()).unwrap();
    assert!(read_reply(&mut bad).contains("exceeds"));
    let mut rest = Vec::new();
    assert_eq!(
        bad.read_to_end(&mut rest).unwrap(),
        0,
        "connection still open"
    );
    // Keys of the wrong length are named.
    let e = good
        .lookup(&[key(1)], None)
        .map(|_| ())
        .and_then(|_| good.reserve(ns, &[key(2)], &[0, 1]).map(|_| ()));
    assert!(e.unwrap_err().to_string().contains("lengths"));
    // The good client is unaffected.
    put_all(&mut good, ns, 0..3);
    assert_eq!(get_all(&mut good, 0..3), 3);
}

#[test]
fn admin_api_limits_token_metrics_and_events() {
    let d = Kvtierd::start(
        "admin",
        &[
            "--set",
            "server.token=s3cret",
            "--set",
            "server.max_message_bytes=64K",
        ],
        true,
    );
    let rt = rt();
    rt.block_on(async {
        let url = format!("http://{}", d.grpc);
        // No token: refused, with a message that says so.
        let mut anon = AdminClient::connect(url.clone()).await.unwrap();
        let e = anon.health(pb::HealthRequest {}).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("token"), "{}", e.message());
        let chan = tonic::transport::Endpoint::from_shared(url)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let token: tonic::metadata::MetadataValue<_> = "Bearer s3cret".parse().unwrap();
        let mut c = AdminClient::with_interceptor(chan, move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", token.clone());
            Ok(r)
        });
        let h = c.health(pb::HealthRequest {}).await.unwrap().into_inner();
        assert!(!h.version.is_empty());
        // Oversized: 10,000 keys × 18 bytes > 64 KiB.
        let big = pb::LookupRequest {
            keys: vec![vec![0u8; 16]; 10_000],
            ..Default::default()
        };
        let e = c.lookup(big).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
        // A key of the wrong length is named.
        let e = c
            .lookup(pb::LookupRequest {
                keys: vec![vec![1u8; 15]],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(e.message().contains("key 0"), "{}", e.message());
        // Events: watch, then store a block through the engine socket.
        let mut events = c
            .watch(pb::WatchRequest::default())
            .await
            .unwrap()
            .into_inner();
        let mut ipc = d.client();
        let ns = ipc.register_namespace(&namespace()).unwrap();
        put_all(&mut ipc, ns, 0..2);
        let ev = tokio::time::timeout(
            Duration::from_secs(10),
            tokio_stream::StreamExt::next(&mut events),
        )
        .await
        .unwrap()
        .unwrap()
        .unwrap();
        assert_eq!(ev.kind, pb::block_event::Kind::Stored as i32);
        assert_eq!(ev.key, key(0).to_bytes().to_vec());
        assert_eq!(ev.tier, pb::Tier::Host as i32);
        let s = c
            .stats(pb::StatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(s.namespaces.len(), 1);
        assert_eq!(s.namespaces[0].host_blocks, 2);
        let r = c
            .lookup(pb::LookupRequest {
                keys: vec![key(0).to_bytes().to_vec(), key(1).to_bytes().to_vec()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.n, 2);
        let p = c
            .pin(pb::PinRequest {
                keys: vec![key(0).to_bytes().to_vec()],
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p.n, 1);
        assert!(
            c.unpin(pb::UnpinRequest {
                lease_id: p.lease_id,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .released
        );
        let r = c
            .clear_namespace(pb::ClearRequest {
                namespace_id: ns.0,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.removed, 2);
    });
    // Metrics: refused without the token, served with it.
    let get = |auth: bool| {
        let mut s = std::net::TcpStream::connect(&d.metrics).unwrap();
        let hdr = if auth {
            "Authorization: Bearer s3cret\r\n"
        } else {
            ""
        };
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{hdr}\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(get(false).starts_with("HTTP/1.1 401"));
    let m = get(true);
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(
        m.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{m}"
    );
    for name in [
        "kvtier_hits_total ",
        "kvtier_tier_hits_total{tier=\"disk\"}",
        "kvtier_blocks{tier=\"disk\"}",
        "kvtier_checksum_failures_total ",
        "kvtier_leases ",
        // In front of the disk tier the host's default policy is LRU (no duel); the disk's is
        // the duel, which starts with S3-FIFO leading.
        "kvtier_policy_lru_leading_classes 0",
        "kvtier_tier_policy_lru_leading{tier=\"disk\"} 0",
        "# TYPE kvtier_ipc_request_seconds histogram",
        "kvtier_ipc_request_seconds_bucket{le=\"+Inf\",op=\"commit\"}",
        "kvtier_ipc_requests_total{op=\"commit\"}",
        "kvtier_disk_latency_seconds_count{op=\"write\"}",
    ] {
        assert!(m.contains(name), "metrics lack {name}:\n{m}");
    }
    assert!(m.trim_end().ends_with("# EOF"), "{m}");
    // Histogram buckets are cumulative and end at the request count.
    let sample = |prefix: &str| -> Vec<f64> {
        m.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect()
    };
    let buckets = sample("kvtier_ipc_request_seconds_bucket{");
    let put: Vec<f64> = m
        .lines()
        .filter(|l| {
            l.starts_with("kvtier_ipc_request_seconds_bucket{") && l.contains("op=\"commit\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(buckets.len() >= 17 && put.len() == 17, "{m}");
    assert!(put.windows(2).all(|w| w[0] <= w[1]), "{put:?}");
    let count = sample("kvtier_ipc_requests_total{op=\"commit\"}");
    assert!(put[16] > 0.0 && count == vec![put[16]], "{put:?} {count:?}");
}

#[test]
fn bad_config_is_a_startup_error_naming_the_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .args(["--set", "host.capacty=1G", "--grpc", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("capacty"), "{e}");
}

#[test]
fn uncommitted_reservations_expire_and_are_bounded() {
    let d = Kvtierd::start("resv", &["--set", "server.reservation_ttl_ms=2000"], true);
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    let mut other = d.client();
    let s = c.reserve(ns, &[key(1)], &[1000]).unwrap();
    let SlotStatus::Slot { token, .. } = s[0] else {
        panic!("no slot: {s:?}")
    };
    assert_eq!(
        other.reserve(ns, &[key(1)], &[1000]).unwrap(),
        vec![SlotStatus::InFlight]
    );
    // The idle connection drops its stale reservation (past the TTL, checked every 200 ms):
    // the key is writable again, and the late commit is refused (named as expired), never a
    // success.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = other.reserve(ns, &[key(1)], &[1000]).unwrap();
        if matches!(s[0], SlotStatus::Slot { .. }) {
            break;
        }
        assert_eq!(s, vec![SlotStatus::InFlight]);
        assert!(
            std::time::Instant::now() < until,
            "the reservation never expired"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = c.commit(&[token]).unwrap();
    assert_eq!((r.committed, r.expired), (0, vec![token]));
    // One connection may not reserve more than half the host tier (64 MiB here).
    let keys: Vec<BlockKey> = (100..140).map(key).collect();
    let e = c
        .reserve(ns, &keys, &[1 << 20; 40])
        .unwrap_err()
        .to_string();
    assert!(e.contains("half the host tier"), "{e}");
}

/// The next event of a Watch stream, within 10 s.
async fn next_event(s: &mut tonic::Streaming<pb::BlockEvent>) -> pb::BlockEvent {
    tokio::time::timeout(Duration::from_secs(10), tokio_stream::StreamExt::next(s))
        .await
        .expect("an event within 10 s")
        .expect("the stream goes on")
        .expect("an event, not an error")
}

/// A Watch with a snapshot starts with every block the node holds, host memory and disk
/// alike, as Stored events, then one SNAPSHOT_END, then the events from the subscription on;
/// one without a snapshot gets only the events; WatchBatched the same, in batches.
#[test]
fn a_watch_with_a_snapshot_starts_with_every_block_held() {
    use std::collections::BTreeSet;
    let d = Kvtierd::start(
        "watch-snapshot",
        &["--set", "disk.write_through=true"],
        true,
    );
    let mut ipc = d.client();
    let ns = ipc.register_namespace(&namespace()).unwrap();
    let want: BTreeSet<(Vec<u8>, i32)> = (0..5)
        .flat_map(|i| {
            let k = key(i).to_bytes().to_vec();
            [
                (k.clone(), pb::Tier::Host as i32),
                (k, pb::Tier::Disk as i32),
            ]
        })
        .collect();
    rt().block_on(async {
        let mut c = AdminClient::connect(format!("http://{}", d.grpc))
            .await
            .unwrap();
        // A watcher from the start sees the five stored in host memory, then on disk
        // (write-through): once it has seen all ten, a snapshot must hold them too.
        let mut plain = c
            .watch(pb::WatchRequest::default())
            .await
            .unwrap()
            .into_inner();
        put_all(&mut ipc, ns, 0..5);
        let mut live = BTreeSet::new();
        while live.len() < want.len() {
            let ev = next_event(&mut plain).await;
            assert_eq!(ev.kind, pb::block_event::Kind::Stored as i32);
            assert!(live.insert((ev.key, ev.tier)), "an event twice");
        }
        assert_eq!(live, want);
        let mut snap = c
            .watch(pb::WatchRequest {
                snapshot: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut seen = BTreeSet::new();
        loop {
            let ev = next_event(&mut snap).await;
            if ev.kind == pb::block_event::Kind::SnapshotEnd as i32 {
                assert!(ev.key.is_empty());
                break;
            }
            assert_eq!(ev.kind, pb::block_event::Kind::Stored as i32);
            assert_eq!(ev.namespace_id, ns.0);
            assert!(seen.insert((ev.key, ev.tier)), "a block sent twice");
        }
        assert_eq!(
            seen, want,
            "the snapshot is every block in each tier it is in"
        );
        // The same in batches (WatchBatched): the snapshot, its end, then the events.
        let mut batched = c
            .watch_batched(pb::WatchRequest {
                snapshot: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let (mut got, mut ended) = (BTreeSet::new(), false);
        while !ended {
            let b = tokio::time::timeout(
                Duration::from_secs(10),
                tokio_stream::StreamExt::next(&mut batched),
            )
            .await
            .expect("a batch within 10 s")
            .expect("the stream goes on")
            .expect("a batch, not an error");
            assert!(!b.events.is_empty() && b.events.len() <= 1024);
            for ev in b.events {
                assert!(
                    !ended,
                    "an event in the snapshot's last batch after its end"
                );
                if ev.kind == pb::block_event::Kind::SnapshotEnd as i32 {
                    ended = true;
                } else {
                    assert!(got.insert((ev.key, ev.tier)), "a block sent twice");
                }
            }
        }
        assert_eq!(got, want, "the batched snapshot");
        // After the snapshot, the events: a block stored now reaches every watcher, and it
        // is the first thing the plain one sees.
        put_all(&mut ipc, ns, 5..6);
        for s in [&mut snap, &mut plain] {
            let ev = next_event(s).await;
            assert_eq!(ev.kind, pb::block_event::Kind::Stored as i32);
            assert_eq!(ev.key, key(5).to_bytes().to_vec());
            assert_eq!(ev.tier, pb::Tier::Host as i32);
        }
        let b = tokio::time::timeout(
            Duration::from_secs(10),
            tokio_stream::StreamExt::next(&mut batched),
        )
        .await
        .unwrap()
        .unwrap()
        .unwrap();
        assert_eq!(b.events[0].key, key(5).to_bytes().to_vec());
    });
}

#[test]
fn watch_streams_are_capped() {
    let d = Kvtierd::start("watchers", &["--set", "server.max_watchers=2"], true);
    rt().block_on(async {
        let mut c = AdminClient::connect(format!("http://{}", d.grpc))
            .await
            .unwrap();
        let a = c
            .watch(pb::WatchRequest::default())
            .await
            .unwrap()
            .into_inner();
        let b = c
            .watch(pb::WatchRequest::default())
            .await
            .unwrap()
            .into_inner();
        let e = c.watch(pb::WatchRequest::default()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("max_watchers"), "{}", e.message());
        drop((a, b));
        // The watch threads notice their streams closed within their poll interval.
        let mut ok = false;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if c.watch(pb::WatchRequest::default()).await.is_ok() {
                ok = true;
                break;
            }
        }
        assert!(ok, "closed watches were never counted down");
    });
}

/// The connector's sidecar backend rides out a daemon restart: while the daemon is away every
/// call is a miss (no error, nothing stored), and after it comes back the connection is made
/// again, the namespace registered again, and the blocks (flushed to disk at its SIGTERM) hit.
#[test]
fn a_sidecar_backend_rides_out_a_daemon_restart() {
    use kvtier_connector::Backend;
    let args = ["--set", "disk.admission=always"];
    let d = Kvtierd::start("ride-out", &args, true);
    let b = Backend::sidecar_as(&d.socket, "ride-out", "");
    let ns = b.register_namespace(&namespace()).unwrap();
    let keys: Vec<BlockKey> = (0..4).map(key).collect();
    let blocks: Vec<Vec<u8>> = (0..4).map(data).collect();
    let pages: Vec<Vec<&[u8]>> = blocks.iter().map(|v| vec![&v[..]]).collect();
    assert_eq!(b.write_segments(ns, &keys, &pages).unwrap(), vec![true; 4]);
    assert_eq!(b.match_prefix(&keys).unwrap(), 4);
    let st = d.term();
    assert!(st.success());
    // Away: misses, not errors.
    assert_eq!(b.match_prefix(&keys).unwrap(), 0);
    assert_eq!(b.write_segments(ns, &keys, &pages).unwrap(), vec![false; 4]);
    let mut out: Vec<Vec<u8>> = blocks.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut dst: Vec<Vec<&mut [u8]>> = out.iter_mut().map(|v| vec![&mut v[..]]).collect();
    assert_eq!(
        b.read_segments(&keys, &mut dst, Duration::from_secs(5))
            .unwrap(),
        vec![false; 4]
    );
    drop(dst);
    let s = b.sidecar_stats().unwrap();
    assert_eq!(s.outages, 1);
    assert!(s.missed_calls >= 3);
    // Back: hits resume once the backoff allows the next attempt (at most 2 s).
    let d = Kvtierd::start("ride-out", &args, false);
    let until = Instant::now() + Duration::from_secs(10);
    while b.match_prefix(&keys).unwrap() < 4 {
        assert!(
            Instant::now() < until,
            "never reconnected: {:?}, direct: {:?}",
            b.sidecar_stats(),
            IpcClient::connect(&d.socket, "probe")
                .and_then(|mut c| c.lookup(&keys, None).map(|l| l.n))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut dst: Vec<Vec<&mut [u8]>> = out.iter_mut().map(|v| vec![&mut v[..]]).collect();
    assert_eq!(
        b.read_segments(&keys, &mut dst, Duration::from_secs(5))
            .unwrap(),
        vec![true; 4]
    );
    drop(dst);
    assert_eq!(out, blocks);
    assert_eq!(b.sidecar_stats().unwrap().reconnects, 1);
    drop(d);
}

/// Paged KV tensors for the connector's transfers: `layers` tensors of (blocks, 2, 16 tokens,
/// `inner` bf16), contiguous, filled with a pattern per seed.
fn kv_tensors(seed: u64, layers: usize, blocks: usize, inner: usize) -> Vec<Vec<u8>> {
    (0..layers)
        .map(|l| {
            let mut v = vec![0u8; blocks * 2 * 16 * inner * 2];
            kvstore::fill_pattern(&mut v, seed * 100 + l as u64);
            v
        })
        .collect()
}

fn kv_paged(mem: &mut [Vec<u8>], blocks: usize, inner: usize) -> kvtier_connector::PagedKv {
    use kvtier_connector::{Dim, LayerView};
    let shape = vec![blocks, 2, 16, inner];
    let strides = vec![
        (2 * 16 * inner) as isize,
        (16 * inner) as isize,
        inner as isize,
        1,
    ];
    let views = mem
        .iter_mut()
        .map(|m| LayerView {
            ptr: m.as_mut_ptr() as usize,
            shape: shape.clone(),
            strides: strides.clone(),
            dims: vec![Dim::Blocks, Dim::Kv, Dim::Tokens, Dim::Inner],
            elem: 2,
        })
        .collect();
    // SAFETY: each view covers exactly its own Vec (contiguous strides, 2-byte elements); the
    // Vecs outlive the PagedKv and nothing else touches them during a copy.
    unsafe { kvtier_connector::PagedKv::new(views).unwrap() }
}

/// Loads every key into engine blocks `into` of `pd` (checksums verified on the way) and
/// checks each is byte for byte engine blocks `ids` of `ps`.
fn loads_back(
    b: &kvtier_connector::Backend,
    ps: &kvtier_connector::PagedKv,
    pd: &kvtier_connector::PagedKv,
    keys: &[BlockKey],
    ids: &[Vec<usize>],
    into: &[Vec<usize>],
) {
    assert_eq!(
        b.load(pd, keys, into, Duration::from_secs(10)).unwrap(),
        keys.len()
    );
    for i in 0..keys.len() {
        let mut a = vec![0u8; ps.block_bytes()];
        let mut c = vec![0u8; pd.block_bytes()];
        ps.gather(&ids[i], &mut a).unwrap();
        pd.gather(&into[i], &mut c).unwrap();
        assert!(a == c, "block {i} differs");
    }
}

/// A layer-by-layer save through kvtierd: the slots are reserved at the begin (as many as the
/// connection may hold; the rest are saved whole at the finish), no block is visible before
/// every layer is in, the blocks load back byte-exact (checksums verified); a save whose
/// daemon restarted in the middle stores nothing and fails nothing.
#[test]
fn a_layerwise_save_through_the_sidecar_commits_whole_blocks() {
    use kvtier_connector::Backend;
    let args = ["--set", "disk.admission=always"];
    let d = Kvtierd::start("layer-save", &args, true);
    let b = Backend::sidecar_as(&d.socket, "layer-save", "");
    let ns = b.register_namespace(&namespace()).unwrap();
    // 2 MiB blocks (2 layers of 1 MiB), 20 of them: more than the 32 MiB a connection of a
    // 64 MiB store may hold reserved.
    let (layers, blocks, inner) = (2, 24, 16384);
    let mut src = kv_tensors(1, layers, blocks, inner);
    let ps = kv_paged(&mut src, blocks, inner);
    let keys: Vec<BlockKey> = (0..20).map(key).collect();
    let ids: Vec<Vec<usize>> = (0..20).map(|i| vec![i]).collect();
    let mut s = b.begin_layer_save(ns, &ps, &keys, &ids, &[]).unwrap();
    assert!(s.held() > 0 && s.held() < 20, "held {}", s.held());
    b.save_layer(&mut s, &ps, 1).unwrap();
    b.save_layer(&mut s, &ps, 0).unwrap();
    assert_eq!(
        b.match_prefix(&keys).unwrap(),
        0,
        "visible before the finish"
    );
    assert_eq!(b.finish_layer_save(s, &ps).unwrap(), 20);
    assert_eq!(b.match_prefix(&keys).unwrap(), 20);
    let mut dst = kv_tensors(2, layers, blocks, inner);
    let pd = kv_paged(&mut dst, blocks, inner);
    let into: Vec<Vec<usize>> = (0..20).map(|i| vec![23 - i]).collect();
    loads_back(&b, &ps, &pd, &keys, &ids, &into);
    // The daemon restarts between the begin and the finish: the reservations went with the
    // connection; the finish stores nothing (no error), and a save afterwards stores them.
    let more: Vec<BlockKey> = (100..102).map(key).collect();
    let mids = vec![vec![0], vec![1]];
    let mut s = b.begin_layer_save(ns, &ps, &more, &mids, &[]).unwrap();
    assert_eq!(s.held(), 2);
    b.save_layer(&mut s, &ps, 0).unwrap();
    assert!(d.term().success());
    let d = Kvtierd::start("layer-save", &args, false);
    let until = Instant::now() + Duration::from_secs(10);
    while b.match_prefix(&keys[..1]).unwrap() < 1 {
        assert!(Instant::now() < until, "never reconnected");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(b.finish_layer_save(s, &ps).unwrap(), 0);
    assert_eq!(b.match_prefix(&more).unwrap(), 0);
    assert_eq!(b.save(ns, &ps, &more, &mids).unwrap(), 2);
    drop(d);
}

/// A layer-by-layer save through kvtierd of layers smaller than a checksum piece (32 KiB of a
/// block each, as Qwen2.5-7B's 4 KV heads): each piece's hash is carried from layer to layer
/// as the layers are copied into the daemon's slots (`PieceHash`), and the blocks load back
/// verified against those checksums.
#[test]
fn a_layerwise_save_of_half_piece_layers_through_the_sidecar_loads_back() {
    use kvtier_connector::Backend;
    let d = Kvtierd::start("layer-save-parts", &[], true);
    let b = Backend::sidecar_as(&d.socket, "layer-save-parts", "");
    let ns = b.register_namespace(&namespace()).unwrap();
    let (layers, blocks, inner) = (4, 8, 512);
    let mut src = kv_tensors(3, layers, blocks, inner);
    let ps = kv_paged(&mut src, blocks, inner);
    assert_eq!(ps.block_bytes(), layers * (32 << 10));
    let keys: Vec<BlockKey> = (200..206).map(key).collect();
    let ids: Vec<Vec<usize>> = (0..6).map(|i| vec![i]).collect();
    let mut s = b.begin_layer_save(ns, &ps, &keys, &ids, &[]).unwrap();
    assert_eq!(s.held(), 6);
    for layer in 0..layers {
        b.save_layer(&mut s, &ps, layer).unwrap();
    }
    assert_eq!(b.finish_layer_save(s, &ps).unwrap(), 6);
    let mut dst = kv_tensors(4, layers, blocks, inner);
    let pd = kv_paged(&mut dst, blocks, inner);
    let into: Vec<Vec<usize>> = (0..6).map(|i| vec![7 - i]).collect();
    loads_back(&b, &ps, &pd, &keys, &ids, &into);
    drop(d);
}

/// A layer-by-layer save that outlives half the daemon's reservation TTL gives its slots up
/// (after the TTL the daemon hands them to others) and saves its blocks whole at the finish:
/// all stored, byte-exact.
#[test]
fn a_layerwise_save_past_half_the_reservation_ttl_is_redone_whole() {
    use kvtier_connector::Backend;
    let d = Kvtierd::start(
        "layer-save-ttl",
        &["--set", "server.reservation_ttl_ms=400"],
        true,
    );
    let b = Backend::sidecar_as(&d.socket, "layer-save-ttl", "");
    let ns = b.register_namespace(&namespace()).unwrap();
    let (layers, blocks, inner) = (2, 8, 1024);
    let mut src = kv_tensors(3, layers, blocks, inner);
    let ps = kv_paged(&mut src, blocks, inner);
    let keys: Vec<BlockKey> = (200..204).map(key).collect();
    let ids: Vec<Vec<usize>> = (0..4).map(|i| vec![i]).collect();
    let mut s = b.begin_layer_save(ns, &ps, &keys, &ids, &[]).unwrap();
    assert_eq!(s.held(), 4);
    b.save_layer(&mut s, &ps, 0).unwrap();
    std::thread::sleep(Duration::from_millis(250));
    b.save_layer(&mut s, &ps, 1).unwrap();
    assert_eq!(s.held(), 0, "the late save kept its slots");
    assert_eq!(b.finish_layer_save(s, &ps).unwrap(), 4);
    let mut dst = kv_tensors(4, layers, blocks, inner);
    let pd = kv_paged(&mut dst, blocks, inner);
    let into: Vec<Vec<usize>> = (0..4).map(|i| vec![7 - i]).collect();
    loads_back(&b, &ps, &pd, &keys, &ids, &into);
}

/// Over the socket, a tagged hint whose prefix ends at a block not stored yet (an earlier
/// request is computing it) holds the blocks saved after it, until its engine cancels it; an
/// untagged hint (SGLang's, never cancelled) takes only what is stored when it arrives, so it
/// cannot hold its own request's saves in host memory until its deadline.
#[test]
fn a_tagged_hint_holds_the_blocks_saved_after_it_an_untagged_one_does_not() {
    let d = Kvtierd::start("hint-watch", &[], true);
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    let keys = |r: std::ops::Range<u64>| r.map(key).collect::<Vec<_>>();
    let bytes = |r: std::ops::Range<u64>| r.map(|i| data(i).len() as f64).sum::<f64>();
    put_all(&mut c, ns, 10..11);
    put_all(&mut c, ns, 20..21);
    let long = Duration::from_secs(600);
    let untagged = c.prefetch(&keys(10..14), 0, long, 0).unwrap();
    let tagged = c.prefetch(&keys(20..24), 0, long, 7).unwrap();
    assert_eq!((untagged.present, untagged.held), (1, 1));
    assert_eq!((tagged.present, tagged.held), (1, 1));
    put_all(&mut c, ns, 11..14);
    put_all(&mut c, ns, 21..24);
    // The tagged hint takes its blocks as they arrive (its reader resumes it); the untagged
    // one keeps its first block only. Polled with a deadline: the hold is taken by a reader.
    let held = "kvtier_prefetch_held_bytes";
    let want = bytes(10..11) + bytes(20..24);
    let until = Instant::now() + Duration::from_secs(30);
    let mut now = metric(&d.metrics, held);
    while now < want {
        assert!(Instant::now() < until, "held {now} bytes, want {want}");
        std::thread::yield_now();
        now = metric(&d.metrics, held);
    }
    assert_eq!(now, want, "the untagged hint held blocks saved after it");
    // Cancelled: the tagged hint's holds end; the untagged one's stays to its deadline.
    assert_eq!(c.cancel_prefetch(7).unwrap(), 4);
    assert_eq!(metric(&d.metrics, held), bytes(10..11));
}

#[test]
fn retain_demote_and_pin_over_the_engine_socket() {
    let d = Kvtierd::start(
        "retain",
        &[
            "--set",
            "preload.max_retained_bytes=3M",
            "--set",
            "preload.max_retain_ms=600000",
            "--set",
            "server.max_pinned_per_connection=30",
        ],
        true,
    );
    let keys = |r: std::ops::Range<u64>| r.map(key).collect::<Vec<_>>();
    let bytes = |r: std::ops::Range<u64>| r.map(|i| data(i).len() as u64).sum::<u64>();
    let minute = Duration::from_secs(60);
    {
        // Engine A serves a session's turn, retains it, and goes away: the retention stays.
        let mut a = d.client();
        let ns = a.register_namespace(&namespace()).unwrap();
        put_all(&mut a, ns, 0..20);
        let r = a.retain(&keys(0..20), "chat-7", minute, 3).unwrap();
        assert_eq!((r.present, r.retained, r.clipped), (20, 20, 0), "{r:?}");
        assert_eq!(r.retained_bytes, bytes(0..20));
        assert!(r.refused.is_empty() && r.clipped_by.is_empty(), "{r:?}");
        assert_eq!(r.ttl_ms, 60_000);
        // Past the bytes bound: the leading blocks that fit, and the bound named. A TTL past
        // preload.max_retain_ms is shortened, and said so.
        put_all(&mut a, ns, 100..140);
        let big = a
            .retain(&keys(100..140), "big", Duration::from_secs(7200), 0)
            .unwrap();
        assert!(big.retained > 0 && big.clipped > 0, "{big:?}");
        assert_eq!(big.retained + big.clipped, 40);
        assert_eq!(
            big.clipped_by,
            vec!["preload.max_retain_ms", "preload.max_retained_bytes"]
        );
        assert_eq!(big.ttl_ms, 600_000);
        // A higher priority ends the lowest-priority retention to make room.
        put_all(&mut a, ns, 200..205);
        let vip = a.retain(&keys(200..205), "vip", minute, 9).unwrap();
        assert_eq!((vip.retained, vip.clipped), (5, 0), "{vip:?}");
        assert_eq!(vip.displaced, big.retained, "{vip:?}");
        // Bad input: refused with the reason, nothing changed.
        let bad = a.retain(&keys(0..1), &"x".repeat(300), minute, 1).unwrap();
        assert!(bad.refused.contains("session name"), "{bad:?}");
        assert_eq!(bad.retained, 0);
        // A control set, not retained.
        put_all(&mut a, ns, 300..320);
    }
    let retained = metric(&d.metrics, "kvtier_retained_bytes");
    assert_eq!(retained, (bytes(0..20) + bytes(200..205)) as f64);
    // Engine B's traffic: three times the host tier.
    let mut b = d.client();
    let ns = b.register_namespace(&namespace()).unwrap();
    for i in 0..20 {
        put_all(&mut b, ns, 1000 + i * 100..1100 + i * 100);
    }
    let host = |c: &mut IpcClient, r: std::ops::Range<u64>| {
        let l = c.lookup(&keys(r), None).unwrap();
        l.tiers.iter().take_while(|t| **t == Tier::Host).count()
    };
    assert_eq!(host(&mut b, 0..20), 20, "a retained session was evicted");
    assert_eq!(host(&mut b, 200..205), 5);
    assert!(
        host(&mut b, 300..320) < 20,
        "the control set was not evicted"
    );
    // Done with the session: it goes to disk at once, host memory is freed.
    let r = b.demote(&[], "chat-7").unwrap();
    assert_eq!(
        (r.released, r.queued + r.freed, r.busy),
        (20, 20, 0),
        "{r:?}"
    );
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let l = b.lookup(&keys(0..20), None).unwrap();
        if l.n == 20 && l.tiers.iter().all(|t| *t == Tier::Disk) {
            break;
        }
        assert!(Instant::now() < until, "demoted blocks: {:?}", l.tiers);
        std::thread::yield_now();
    }
    assert_eq!(
        metric(&d.metrics, "kvtier_retained_bytes"),
        bytes(200..205) as f64
    );
    // And back, byte-exact.
    assert_eq!(get_all(&mut b, 0..20), 20);
    // Engine Pin: bounded per connection, answered.
    let p = b.pin(&keys(0..40), Duration::from_secs(7200)).unwrap();
    assert_eq!((p.n, p.clipped), (20, 10), "{p:?}");
    assert_eq!(
        p.clipped_by,
        vec!["ttl", "server.max_pinned_per_connection"]
    );
    assert_eq!(p.ttl_ms, 3_600_000);
    assert_ne!(p.lease_id, 0);
    // 20 pinned: room for 10 more.
    let mut ks = keys(200..205);
    ks.extend(keys(0..10));
    let q = b.pin(&ks, minute).unwrap();
    assert_eq!((q.n, q.clipped), (10, 5), "{q:?}");
    let q = b.pin(&keys(200..201), minute).unwrap();
    assert_eq!(q.n, 0);
    assert!(q.refused.contains("max_pinned_per_connection"), "{q:?}");
    b.release(kvstore::LeaseId(p.lease_id)).unwrap();
    let q = b.pin(&keys(200..205), minute).unwrap();
    assert_eq!((q.n, q.clipped), (5, 0), "{q:?}");
    assert!(q.refused.is_empty());
}

#[test]
fn a_load_reads_another_engines_writes_once_committed_and_an_abort_is_a_miss() {
    let d = Kvtierd::start("ryw", &[], true);
    let keys = |r: std::ops::Range<u64>| r.map(key).collect::<Vec<_>>();
    let mut a = d.client();
    let ns = a.register_namespace(&namespace()).unwrap();
    put_all(&mut a, ns, 0..10);
    // Engine A saves the next 20 blocks of the prefix, slowly: reserved and written, not
    // committed yet.
    let tokens = reserve_slots(&mut a, ns, 10..30);
    for (t, i) in tokens.iter().zip(10..30) {
        a.write(*t, &data(i)).unwrap();
    }
    // Engine B (the next turn, routed to another engine) looks the prefix up mid-save.
    let mut b = d.client();
    b.register_namespace(&namespace()).unwrap();
    let l = b.lookup(&keys(0..40), None).unwrap();
    assert_eq!((l.n, l.pending), (10, 20), "{l:?}");
    let waits = |d: &Kvtierd| metric(&d.metrics, "kvtier_waits_total");
    std::thread::scope(|sc| {
        let before = waits(&d);
        let loader = sc.spawn(|| {
            let mut b = b;
            // Its load waits for the commit (within its wait_ms), then reads A's bytes.
            let n = get_all_waiting(&mut b, 0..30, Some(Duration::from_secs(60)));
            (n, b)
        });
        let until = Instant::now() + Duration::from_secs(30);
        while waits(&d) == before {
            assert!(Instant::now() < until, "B's load never waited");
            std::thread::yield_now();
        }
        assert_eq!(a.commit(&tokens).unwrap().committed, 20);
        let (n, mut b) = loader.join().unwrap();
        assert_eq!(n, 30, "B did not get A's blocks once committed");
        // A save that is aborted: B's load ends where it was (a miss, never wrong bytes).
        let tokens = reserve_slots(&mut a, ns, 30..35);
        assert_eq!(b.lookup(&keys(0..35), None).unwrap().pending, 5);
        let before = waits(&d);
        let loader =
            sc.spawn(move || get_all_waiting(&mut b, 0..35, Some(Duration::from_secs(60))));
        while waits(&d) == before {
            assert!(Instant::now() < until, "B's second load never waited");
            std::thread::yield_now();
        }
        a.abort(&tokens).unwrap();
        assert_eq!(loader.join().unwrap(), 30);
    });
}

/// Reserves slots for blocks `ids` (nothing written): their tokens.
fn reserve_slots(c: &mut IpcClient, ns: NsId, ids: std::ops::Range<u64>) -> Vec<u64> {
    let keys: Vec<BlockKey> = ids.clone().map(key).collect();
    let lens: Vec<u32> = ids.map(|i| data(i).len() as u32).collect();
    c.reserve(ns, &keys, &lens)
        .unwrap()
        .into_iter()
        .map(|s| match s {
            SlotStatus::Slot { token, .. } => token,
            other => panic!("no slot: {other:?}"),
        })
        .collect()
}

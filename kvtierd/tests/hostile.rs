//! A hostile or broken local client, and a daemon under faults: every attack that once worked
//! (or was tried) is kept here as a regression test. Each test starts its own real `kvtierd`.

mod common;

use std::io::Write;
use std::time::Duration;

use common::*;
use kvtier_ipc::SlotStatus;

#[test]
fn a_client_cannot_resize_the_arena_under_the_daemon() {
    let d = Kvtierd::start("seal", &[], true);
    let mut good = d.client();
    let ns = good.register_namespace(&namespace()).unwrap();
    put_all(&mut good, ns, 0..4);
    let (_s, fd) = raw_hello(&d.socket);
    let f = std::fs::File::from(fd);
    // Shrinking it would SIGBUS the daemon's next access to the arena; growing is refused too.
    for len in [0, 4096, 1 << 40] {
        let e = f.set_len(len).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "set_len({len}): {e}");
    }
    // The seals cannot be lifted.
    // SAFETY: fcntl on a valid fd.
    let r = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_ADD_SEALS, 0) };
    assert_eq!(r, -1);
    // The daemon still serves every block, and more.
    assert_eq!(get_all(&mut good, 0..4), 4);
    put_all(&mut good, ns, 4..8);
    assert_eq!(get_all(&mut good, 0..8), 8);
    let dir = d.dir.clone();
    assert!(d.term().success());
    let _ = std::fs::remove_dir_all(dir);
}

/// A writer stalled past its reservation's TTL still has the slot mapped. If it writes after
/// the slot went to another block, that block's bytes no longer match its commit checksum:
/// every reader sees a miss (never the damaged bytes), it is never written to disk, and the
/// late commit is refused.
#[test]
fn a_late_writer_into_an_expired_slot_damages_nothing_that_is_served() {
    let d = Kvtierd::start(
        "late-writer",
        &["--set", "server.reservation_ttl_ms=300"],
        true,
    );
    let mut stale = d.client();
    let ns = stale.register_namespace(&namespace()).unwrap();
    let len = data(1).len() as u32;
    let slots = stale.reserve(ns, &[key(1)], &[len]).unwrap();
    let SlotStatus::Slot { token, offset } = slots[0] else {
        panic!("{slots:?}")
    };
    // The stalled writer does nothing past the TTL; the daemon reclaims the slot.
    std::thread::sleep(Duration::from_millis(700));
    // Its connection expires reservations at the top of its loop, before it reads the next
    // request: the second request is read after a loop top that came after the TTL.
    stale.stats().unwrap();
    stale.stats().unwrap();
    let mut good = d.client();
    // The freed slot goes to another engine's block (same size class, the only free slot
    // reused first).
    let len2 = data(2).len() as u32;
    let slots = good.reserve(ns, &[key(2)], &[len2]).unwrap();
    let SlotStatus::Slot {
        token: t2,
        offset: o2,
    } = slots[0]
    else {
        panic!("{slots:?}")
    };
    assert_eq!(o2, offset, "the test needs the slot to be reused");
    good.write(t2, &data(2)).unwrap();
    assert_eq!(good.commit(&[t2]).unwrap().committed, 1);
    // Now the stalled writer wakes up and writes its block into the slot it still maps.
    stale.write(token, &data(1)).unwrap();
    let r = stale.commit(&[token]).unwrap();
    assert_eq!((r.committed, r.expired), (0, vec![token]));
    // Block 2's bytes were overwritten: a reader gets an error saying so, never the bytes.
    let mut reader = d.client();
    let l = reader
        .load(&[key(2)], Duration::from_secs(10), None)
        .unwrap();
    assert_eq!(l.n, 1);
    let mut buf = vec![0u8; len2 as usize];
    let e = reader.read(&l, 0, &mut buf).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    reader.release(l.lease.unwrap()).unwrap();
    // It is never written to disk: a clean shutdown flushes, and after the restart it is gone.
    assert!(d.term().success());
    let d = Kvtierd::start(
        "late-writer",
        &["--set", "server.reservation_ttl_ms=300"],
        false,
    );
    let mut c = d.client();
    assert_eq!(
        c.lookup(&[key(2)], None).unwrap().n,
        0,
        "damaged block reached disk"
    );
}

/// stderr a closed pipe (or a full log file system): every log write fails. Engines must keep
/// being served, and SIGTERM must still flush and exit cleanly.
#[test]
fn a_closed_stderr_never_stops_the_daemon() {
    let mut d = Kvtierd::start_with(
        "closed-stderr",
        &["--set", "log=debug"],
        true,
        std::process::Stdio::piped(),
    );
    drop(d.child.stderr.take()); // nobody reads it any more: writes fail with EPIPE
    for round in 0..5 {
        let mut c = d.client();
        let ns = c.register_namespace(&namespace()).unwrap();
        put_all(&mut c, ns, round * 4..round * 4 + 4);
        assert_eq!(get_all(&mut c, round * 4..round * 4 + 4), 4);
    }
    let st = d.term();
    assert!(st.success(), "SIGTERM ended with {st:?}");
    let d = Kvtierd::start("closed-stderr", &[], false);
    let mut c = d.client();
    assert_eq!(
        get_all(&mut c, 0..20),
        20,
        "blocks were not flushed at SIGTERM"
    );
}

/// One key repeated hundreds of thousands of times: refused beyond server.max_keys; below it,
/// pinned once, so a request costs memory by distinct keys only.
#[test]
fn repeated_keys_cost_nothing_and_huge_requests_are_refused() {
    // (No background population of the arena: it would grow the RSS measured below.)
    let d = Kvtierd::start(
        "repeated-keys",
        &[
            "--set",
            "server.max_keys=100000",
            "--set",
            "host.populate=false",
        ],
        true,
    );
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..1);
    let e = c
        .load(&vec![key(0); 460_000], Duration::from_secs(5), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("server.max_keys"), "{e}");
    let mut c = d.client();
    let before = rss(d.child.id());
    let mut leases = Vec::new();
    for _ in 0..20 {
        let l = c
            .load(&vec![key(0); 90_000], Duration::from_secs(60), None)
            .unwrap();
        assert_eq!(l.n, 1, "a repeated key is one block");
        let l2 = c
            .lookup(&vec![key(0); 90_000], Some(Duration::from_secs(60)))
            .unwrap();
        assert_eq!(l2.n, 1);
        leases.extend(l.lease);
        leases.extend(l2.lease);
    }
    let grown = rss(d.child.id()).saturating_sub(before);
    assert!(
        grown < 32 << 20,
        "20 held requests of 90k keys grew the daemon by {grown} bytes"
    );
    for l in leases {
        c.release(l).unwrap();
    }
}

/// Two daemons with different data directories and one disk directory: the second refuses to
/// start instead of destroying the first one's blocks.
#[test]
fn two_daemons_cannot_share_a_disk_directory() {
    let shared = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("shared-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&shared);
    let disk = format!("disk.dir={}", shared.display());
    let a = Kvtierd::start("disk-owner", &["--set", &disk], true);
    let intruder = a
        .dir
        .with_file_name(format!("disk-intruder-{}", std::process::id()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtierd"))
        .arg("--data-dir")
        .arg(&intruder)
        .args(["--host-capacity", "64M", "--disk-capacity", "128M"])
        .args(["--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
        .args(["--set", "host.segment=4M", "--set", &disk])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("in use by another process"), "{e}");
    let mut c = a.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..3);
    assert_eq!(get_all(&mut c, 0..3), 3);
    drop(a);
    let _ = std::fs::remove_dir_all(&shared);
    let _ = std::fs::remove_dir_all(&intruder);
}

fn ns_named(i: u32) -> kvstore::Namespace {
    kvstore::Namespace {
        model: format!("m{i}"),
        ..namespace()
    }
}

/// One client cannot fill the namespace table for good: registrations are bounded per
/// connection, and ids of namespaces without blocks that no connection holds are reclaimed.
#[test]
fn the_namespace_table_is_bounded_and_reclaimed() {
    let d = Kvtierd::start(
        "namespaces",
        &[
            "--no-disk",
            "--set",
            "server.max_namespaces_per_connection=4096",
        ],
        true,
    );
    let mut keeper = d.client();
    let kept = keeper.register_namespace(&namespace()).unwrap();
    put_all(&mut keeper, kept, 0..2);
    let mut c = d.client();
    for i in 0..4096 {
        c.register_namespace(&ns_named(i)).unwrap();
    }
    let e = c
        .register_namespace(&ns_named(99_999))
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_namespaces_per_connection"), "{e}");
    drop(c);
    // 16 connections fill the whole table (65,536 ids), each then going away.
    let mut n = 4096;
    while n < 65_536 {
        let mut c = d.client();
        for _ in 0..4096 {
            if c.register_namespace(&ns_named(n)).is_err() {
                break;
            }
            n += 1;
        }
    }
    // Full now; a new namespace still gets an id (one with no blocks is reclaimed), and the
    // namespace with blocks keeps its id and its blocks.
    let mut c = d.client();
    c.register_namespace(&ns_named(1_000_000)).unwrap();
    assert_eq!(c.register_namespace(&namespace()).unwrap(), kept);
    assert_eq!(get_all(&mut c, 0..2), 2);
}

/// Connections that never say Hello time out, and their own cap keeps them from taking every
/// connection; engines already connected are not disturbed.
#[test]
fn idle_handshakes_time_out() {
    let d = Kvtierd::start(
        "handshakes",
        &[
            "--set",
            "server.max_clients=8",
            "--set",
            "server.hello_timeout_ms=400",
        ],
        true,
    );
    let mut engine = d.client();
    let ns = engine.register_namespace(&namespace()).unwrap();
    let idle: Vec<_> = (0..40)
        .map(|_| std::os::unix::net::UnixStream::connect(&d.socket).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    // The engine that said Hello keeps working while idle sockets crowd the door.
    put_all(&mut engine, ns, 0..2);
    assert_eq!(get_all(&mut engine, 0..2), 2);
    // The idle ones are closed (400 ms, checked every 200 ms): a new engine gets in.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        match kvtier_ipc::IpcClient::connect(&d.socket, "test") {
            Ok(c) => break c,
            Err(e) => assert!(std::time::Instant::now() < until, "still refused: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(get_all(&mut c, 0..2), 2);
    drop(idle);
}

/// Clients that each start a maximal frame and trickle it cannot make the daemon hold
/// gigabytes: frame bytes in flight are bounded over all connections.
#[test]
fn partial_frames_cannot_pin_the_daemons_memory() {
    let d = Kvtierd::start(
        "partial-frames",
        &["--set", "server.max_inflight_frame_bytes=16M"],
        true,
    );
    let mut socks = Vec::new();
    for _ in 0..8 {
        let (mut s, _fd) = raw_hello(&d.socket);
        // Say Hello's reply was read by raw_hello; start an 8 MiB frame, send one byte of it.
        // A refusal may come (and the connection close) as soon as the length is read: a write
        // that finds the socket closed is a refusal too.
        let sent = s.write_all(&(8u32 << 20).to_le_bytes()).is_ok() && s.write_all(&[1]).is_ok();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        socks.push((s, !sent));
    }
    // Each refusal is a reply (or a closed socket); look until six came, or 10 s passed.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let mut refused = socks.iter().filter(|s| s.1).count();
    while refused < 6 && std::time::Instant::now() < until {
        for (s, r) in socks.iter_mut().filter(|s| !s.1) {
            let mut len = [0u8; 4];
            match std::io::Read::read(s, &mut len) {
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                _ => *r = true,
            }
        }
        refused = socks.iter().filter(|s| s.1).count();
    }
    assert!(refused >= 6, "only {refused} of 8 frames were refused");
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..2);
    assert_eq!(get_all(&mut c, 0..2), 2);
    drop(socks);
}

/// One client cannot take every lease: each connection gets a fair share of host.max_leases,
/// and the others can still lease.
#[test]
fn one_client_cannot_take_every_lease() {
    let d = Kvtierd::start("leases", &["--set", "host.max_leases=256"], true);
    let mut greedy = d.client();
    let mut other = d.client();
    let ns = greedy.register_namespace(&namespace()).unwrap();
    put_all(&mut greedy, ns, 0..1);
    let mut held = 0;
    loop {
        match greedy.lookup(&[key(0)], Some(Duration::from_secs(60))) {
            Ok(l) if l.lease.is_some() => held += 1,
            Ok(_) => panic!("nothing leased"),
            Err(e) => {
                assert!(e.to_string().contains("share"), "{e}");
                break;
            }
        }
        assert!(held <= 256);
    }
    assert!((64..256).contains(&held), "greedy held {held}");
    let l = other
        .lookup(&[key(0)], Some(Duration::from_secs(60)))
        .unwrap();
    assert!(l.lease.is_some(), "another engine was locked out of leases");
}

/// Admin writes need a token (unless allowed explicitly), and an admin unpin cannot release an
/// engine's lease.
#[test]
fn admin_writes_need_a_token_and_cannot_touch_engine_leases() {
    use kvtier_proto::admin as pb;
    let d = Kvtierd::start("admin-writes", &[], true);
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..1);
    let lease = c
        .lookup(&[key(0)], Some(Duration::from_secs(60)))
        .unwrap()
        .lease
        .unwrap();
    let rt = rt();
    rt.block_on(async {
        let mut a = pb::admin_client::AdminClient::connect(format!("http://{}", d.grpc))
            .await
            .unwrap();
        let e = a
            .clear_namespace(pb::ClearRequest {
                namespace_id: ns.0,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("allow_unauthenticated_admin"),
            "{}",
            e.message()
        );
        let e = a
            .unpin(pb::UnpinRequest {
                lease_id: lease.0,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        // Reads need no token on loopback.
        a.stats(pb::StatsRequest::default()).await.unwrap();
    });
    drop(d);
    let d = Kvtierd::start(
        "admin-writes-allowed",
        &["--set", "server.allow_unauthenticated_admin=true"],
        true,
    );
    let mut c = d.client();
    let ns = c.register_namespace(&namespace()).unwrap();
    put_all(&mut c, ns, 0..1);
    let lease = c
        .lookup(&[key(0)], Some(Duration::from_secs(60)))
        .unwrap()
        .lease
        .unwrap();
    rt.block_on(async {
        let mut a = pb::admin_client::AdminClient::connect(format!("http://{}", d.grpc))
            .await
            .unwrap();
        let r = a
            .unpin(pb::UnpinRequest {
                lease_id: lease.0,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!r.released, "an admin unpin released an engine's lease");
        let p = a
            .pin(pb::PinRequest {
                keys: vec![key(0).to_bytes().to_vec()],
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            a.unpin(pb::UnpinRequest {
                lease_id: p.lease_id,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .released
        );
    });
    // The engine's lease is still its own.
    c.release(lease).unwrap();
}

/// `server.isolation = "tenant"`: each tenant has its own arena; a client receives only its
/// tenant's, so a client of tenant B can neither read nor alter tenant A's blocks.
#[test]
fn tenants_cannot_read_or_alter_each_others_blocks() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tenants-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let cfg = dir.join("kvtierd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nisolation = \"tenant\"\n\
             [[tenants]]\nname = \"a\"\nsecret = \"secret-a\"\nhost_capacity = \"32M\"\ndisk_capacity = \"64M\"\n\
             [[tenants]]\nname = \"b\"\nsecret = \"secret-b\"\nhost_capacity = \"16M\"\n\
             [[tenants]]\nname = \"c\"\nuids = [{uid}]\nhost_capacity = \"8M\"\n"
        ),
    )
    .unwrap();
    let d = Kvtierd::start("tenants", &["--config", cfg.to_str().unwrap()], true);
    let mut a = kvtier_ipc::IpcClient::connect_as(&d.socket, "a", "secret-a").unwrap();
    assert_eq!(a.tenant(), "a");
    assert_eq!(a.arena().1, 32 << 20);
    let ns = a.register_namespace(&namespace()).unwrap();
    put_all(&mut a, ns, 0..4);
    let mut b = kvtier_ipc::IpcClient::connect_as(&d.socket, "b", "secret-b").unwrap();
    assert_eq!(b.tenant(), "b");
    assert_eq!(b.arena().1, 16 << 20, "b got another tenant's arena");
    let nb = b.register_namespace(&namespace()).unwrap();
    let keys: Vec<kvstore::BlockKey> = (0..4).map(key).collect();
    assert_eq!(b.lookup(&keys, None).unwrap().n, 0, "b sees a's blocks");
    assert_eq!(b.load(&keys, Duration::from_secs(5), None).unwrap().n, 0);
    // B maps what it was given: none of A's bytes are in it; it scribbles over all of it.
    let (_s, fd) = raw_hello_as(&d.socket, "secret-b");
    let f = std::fs::File::from(fd);
    // SAFETY: a test-only mapping of the memfd b received; nothing else in this process uses it.
    let mut m = unsafe { memmap2::MmapOptions::new().map_mut(&f) }.unwrap();
    let probe = &data(0)[4096..4160];
    assert!(
        !m.windows(probe.len()).step_by(64).any(|w| w == probe),
        "a's block bytes are visible in b's mapping"
    );
    m.fill(0xff);
    drop(m);
    // A's blocks are intact, byte for byte.
    assert_eq!(get_all(&mut a, 0..4), 4);
    // B's own blocks work in its own arena.
    put_all(&mut b, nb, 10..12);
    assert_eq!(get_all(&mut b, 10..12), 2);
    // The peer's uid maps to tenant c; unknown secrets are refused.
    let c = kvtier_ipc::IpcClient::connect(&d.socket, "c").unwrap();
    assert_eq!((c.tenant(), c.arena().1), ("c", 8 << 20));
    let e = kvtier_ipc::IpcClient::connect_as(&d.socket, "x", "guess")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no tenant has this secret"), "{e}");
    // Per-tenant usage and quota through the admin API.
    rt().block_on(async {
        use kvtier_proto::admin as pb;
        let mut adm = pb::admin_client::AdminClient::connect(format!("http://{}", d.grpc))
            .await
            .unwrap();
        let s = adm
            .stats(pb::StatsRequest { tenant: "a".into() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(s.tiers[0].blocks, 4);
        let names: Vec<_> = s.tenants.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(s.tenants[1].host_capacity_bytes, 16 << 20);
        assert_eq!(s.tenants[1].host_blocks, 2);
    });
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GET of /metrics from a socket bound to `from` (another loopback address: a different
/// peer for the daemon's per-address caps), with deadlines.
fn metrics_from(from: &str, addr: &str) -> String {
    rt().block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{from}:0").parse().unwrap()).unwrap();
        let mut c = s.connect(addr.parse().unwrap()).await.unwrap();
        let t = Duration::from_secs(30);
        tokio::time::timeout(t, c.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n"))
            .await
            .expect("write in time")
            .unwrap();
        let mut out = String::new();
        tokio::time::timeout(t, c.read_to_string(&mut out))
            .await
            .expect("answered in time")
            .unwrap();
        out
    })
}

/// Idle TCP connections to the admin gRPC and metrics listeners (a slowloris, half-open
/// peers): past the per-address cap they are closed at accept, and the rest after 10 s of
/// silence, so file descriptors and slots come back; peers from other addresses are answered
/// meanwhile. Neither tonic nor hyper bounded the wait for a connection's first byte.
#[test]
fn idle_connections_cannot_hold_the_admin_and_metrics_listeners() {
    use std::io::Read;
    let d = Kvtierd::start("idle-tcp", &[], true);
    for (listener, addr, cap) in [("metrics", &d.metrics, 64), ("admin", &d.grpc, 256)] {
        let mut idle: Vec<std::net::TcpStream> = (0..cap + 20)
            .map(|_| std::net::TcpStream::connect(addr.as_str()).unwrap())
            .collect();
        // Another address is served while they sit there.
        let m = metrics_from("127.0.0.2", &d.metrics);
        assert!(m.contains("kvtier_connections_closed_total"), "{m}");
        // Each is closed: at once past the cap, at the deadline for the others (after what
        // the server says first: HTTP/2's settings).
        for s in &mut idle {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut b = Vec::new();
            match s.read_to_end(&mut b) {
                Ok(_) => assert!(b.len() < 1024, "{listener}: {} bytes", b.len()),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                Err(e) => panic!("{listener}: an idle connection was not closed: {e}"),
            }
        }
        let m = metrics_from("127.0.0.2", &d.metrics);
        let sample = |reason: &str| {
            let name = format!(
                "kvtier_connections_closed_total{{listener=\"{listener}\",reason=\"{reason}\"}}"
            );
            m.lines()
                .find_map(|l| l.strip_prefix(name.as_str())?.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no {name} in {m}"))
        };
        assert!(
            sample("refused") >= 20.0,
            "{listener}: {}",
            sample("refused")
        );
        assert!(
            sample("silent") >= cap as f64,
            "{listener}: {}",
            sample("silent")
        );
    }
    // Slots came back: from 127.0.0.1 again, both answer.
    assert!(metrics(&d.metrics).contains("kvtier_connections_closed_total"));
    rt().block_on(async {
        let mut a =
            kvtier_proto::admin::admin_client::AdminClient::connect(format!("http://{}", d.grpc))
                .await
                .unwrap();
        a.health(kvtier_proto::admin::HealthRequest::default())
            .await
            .unwrap();
    });
}

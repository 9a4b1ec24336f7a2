//! The Redis-backed remote tier against a real redis-server on loopback (Debian's, installed by
//! scripts/test.sh): two stores share a prefix through it, byte-exact; a damaged value is a
//! miss; blocks carry a TTL; a dead Redis, or one that trickles its replies, costs misses
//! within the deadline.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::{Fault, Proxy};
use common::{answered, wait_until};
use kvstore::{LowerTier, Namespace, Store, StoreConfig, Tier, TpShard};
use kvtier_cluster::{RedisConfig, RedisTier};

struct Redis(Child, u16);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A missing service skips a test, unless `var` is set (the test command sets it, having
/// installed the service): then it fails.
fn missing(what: &str, var: &str) {
    if std::env::var_os(var).is_some() {
        panic!("{what} is missing and {var} is set: the test command installs it");
    }
    eprintln!("SKIPPED: {what} is not installed (scripts/test.sh installs it)");
}

fn redis() -> Option<Redis> {
    redis_with(&[])
}

/// A redis-server with `extra` arguments.
fn redis_with(extra: &[&str]) -> Option<Redis> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        missing("redis-server", "KVTIER_REQUIRE_REDIS");
        return None;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let c = Command::new("redis-server")
        .args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "redis-server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(Redis(c, port))
}

fn ns() -> Namespace {
    Namespace {
        model: "redis-test".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

fn store(port: u16) -> (Store, Arc<RedisTier>) {
    store_at(&format!("127.0.0.1:{port}"))
}

/// A store whose remote tier is the Redis at `addr` (`host:port`), with 800 ms deadlines.
fn store_at(addr: &str) -> (Store, Arc<RedisTier>) {
    store_url(&format!("redis://{addr}/"))
}

/// A store whose remote tier is the Redis `url` names, with 800 ms deadlines.
fn store_url(url: &str) -> (Store, Arc<RedisTier>) {
    let t = Arc::new(
        RedisTier::new(RedisConfig {
            urls: vec![url.to_string()],
            cluster: false,
            prefix: "kvtier:".into(),
            ttl_s: 600,
            timeout: Duration::from_millis(800),
        })
        .unwrap(),
    );
    let s = StoreConfig {
        capacity_bytes: 32 << 20,
        segment_bytes: 16 << 20,
        remote: Some(kvstore::SharedTier(t.clone())),
        ..Default::default()
    }
    .build()
    .unwrap();
    s.register_namespace(&ns()).unwrap();
    (s, t)
}

/// Puts `data` under `keys` into `s` and waits until every block was pushed to Redis (a push
/// that timed out is tried again 1, 4 and 16 s later).
fn put_pushed(s: &Store, id: kvstore::NsId, keys: &[kvstore::BlockKey], data: &[Vec<u8>]) {
    let before = s.stats().pushes;
    for (k, d) in keys.iter().zip(data) {
        s.put(id, *k, d).unwrap();
    }
    wait_until("the blocks pushed to Redis", 60, || {
        s.stats().pushes >= before + data.len() as u64
    });
}

fn raw(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn two_stores_share_a_prefix_through_redis_and_damage_is_a_miss() {
    let Some(r) = redis() else { return };
    let (a, _) = store(r.1);
    let (b, bt) = store(r.1);
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[9; 16 * 6], &[]);
    let data: Vec<Vec<u8>> = (0..6)
        .map(|i| vec![i as u8 + 1; 70_000 + i * 100])
        .collect();
    put_pushed(&a, id, &keys, &data);
    let m = b.match_prefix(&keys);
    assert_eq!(m.n, 6);
    assert!(m.tiers.iter().all(|t| *t == Tier::Remote));
    let l = b.load(&keys).unwrap();
    assert_eq!(l.len(), 6);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(l.block(i), &d[..]);
    }
    drop(l);
    // Every block carries its TTL.
    let ttl: i64 = raw(r.1, &["TTL", &format!("kvtier:{}", keys[0])])
        .parse()
        .unwrap();
    assert!(ttl > 0 && ttl <= 600, "{ttl}");
    // A value damaged inside Redis (its header intact, one payload byte changed): a miss.
    let (c, ct) = store(r.1);
    let name = format!("kvtier:{}", keys[2]);
    assert_eq!(
        raw(r.1, &["SETRANGE", &name, "100", "Z"]),
        (32 + 70_200).to_string()
    );
    let l = c.load(&keys).unwrap();
    assert_eq!(l.len(), 2, "the prefix ends before the damaged block");
    drop(l);
    assert_eq!(ct.stats().checksum_failures, 1);
    assert!(!c.in_host(&keys[2]));
    assert_eq!(bt.stats().checksum_failures, 0);
}

#[test]
fn a_dead_redis_costs_misses_within_the_deadline() {
    let Some(r) = redis() else { return };
    let (a, _) = store(r.1);
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[3; 16 * 4], &[]);
    for k in &keys {
        a.put(id, *k, &[1u8; 5000]).unwrap();
    }
    let (b, bt) = store(r.1);
    let b = Arc::new(b);
    drop(r);
    for _ in 0..5 {
        // Answered (a miss at the 800 ms deadline), not hung on the dead server: a hang
        // fails once 30 s passed.
        let (tx, rx) = std::sync::mpsc::channel();
        let (b, keys) = (b.clone(), keys.clone());
        std::thread::spawn(move || {
            let _ = tx.send(b.load(&keys).map(|l| l.len()));
        });
        let n = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a load against a dead Redis answered")
            .unwrap();
        assert_eq!(n, 0);
    }
    assert_eq!(bt.stats().checksum_failures, 0);
}

/// The URL's user, password and database are used: blocks land in that database, and a wrong
/// password or none costs misses, nothing else.
#[test]
fn a_password_and_a_database_in_the_url_are_used() {
    let Some(r) = redis_with(&["--requirepass", "s3cret"]) else {
        return;
    };
    let (a, _) = store_url(&format!("redis://default:s3cret@127.0.0.1:{}/3", r.1));
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[6; 16], &[]);
    put_pushed(&a, id, &keys, &[vec![7u8; 3000]]);
    let name = format!("kvtier:{}", keys[0]);
    let in_db = |db: &str| {
        raw(
            r.1,
            &[
                "-a",
                "s3cret",
                "--no-auth-warning",
                "-n",
                db,
                "EXISTS",
                &name,
            ],
        )
    };
    assert_eq!(in_db("3"), "1");
    assert_eq!(in_db("0"), "0");
    let (b, _) = store_url(&format!("redis://:s3cret@127.0.0.1:{}/3", r.1));
    let l = b.load(&keys).unwrap();
    assert_eq!(l.len(), 1);
    assert_eq!(l.block(0), &[7u8; 3000][..]);
    drop(l);
    let (c, ct) = store_url(&format!("redis://:wrong@127.0.0.1:{}/3", r.1));
    assert_eq!(c.load(&keys).unwrap().len(), 0);
    let (d, dt) = store_url(&format!("redis://127.0.0.1:{}/3", r.1));
    assert_eq!(d.load(&keys).unwrap().len(), 0);
    for t in [&ct, &dt] {
        let s = t.stats();
        assert_eq!(s.bytes_read, 0, "{s:?}");
        assert_eq!(s.checksum_failures, 0, "{s:?}");
    }
}

/// A block whose slot no longer holds the bytes of its commit checksum (an engine wrote into
/// it after its commit) is never stored: its SET is cut off before its last bytes, so Redis
/// never runs it, and the block says `Corrupt`. The good blocks of the same call are stored,
/// and the cut-off counts no failure against Redis.
#[test]
fn a_slot_changed_after_its_commit_is_never_stored() {
    let Some(r) = redis() else { return };
    let (_, t) = store(r.1);
    t.note_namespace(0, ns().fingerprint()).unwrap();
    let keys = ns().token_keys(&[8; 16 * 3], &[]);
    // Three pieces of the value and a part, so the check comes after most of it was sent.
    let len = (3 << 20) + 4096;
    let mut bufs: Vec<kvstore::AlignedBuf> = (0..3)
        .map(|i| {
            let mut b = kvstore::AlignedBuf::new(len).unwrap();
            b.fill_pattern(i);
            b
        })
        .collect();
    let sums: Vec<u64> = bufs.iter().map(|b| kvstore::checksum(b)).collect();
    // The middle block's bytes changed after its checksum was taken.
    bufs[1][12345] ^= 0xFF;
    let items = bufs
        .iter_mut()
        .zip(&sums)
        .zip(&keys)
        .map(|((b, &sum), &k)| kvstore::WriteItem {
            key: k,
            ns: 0,
            // SAFETY: the buffer outlives the call and nothing else touches it meanwhile.
            buf: unsafe { kvstore::io::IoBuf::from_raw(b.as_mut_ptr(), len) },
            len: len as u32,
            checksum: sum,
        })
        .collect();
    use kvstore::WriteOutcome::{Corrupt, Written};
    assert_eq!(t.write(items, &|_| true), vec![Written, Corrupt, Written]);
    let exists = |k: &kvstore::BlockKey| raw(r.1, &["EXISTS", &format!("kvtier:{k}")]);
    assert_eq!(exists(&keys[1]), "0", "a changed slot was stored");
    assert_eq!(
        (exists(&keys[0]), exists(&keys[2])),
        ("1".into(), "1".into())
    );
    assert_eq!(t.stats().write_errors, 0, "{:?}", t.stats());
    // The good blocks read back whole.
    let (b, _) = store(r.1);
    for i in [0, 2] {
        let l = b.load(&keys[i..=i]).unwrap();
        assert_eq!(l.len(), 1);
        assert!(l.block(0) == &bufs[i][..]);
    }
}

/// An error reply among a read's replies (a key holding a list: WRONGTYPE) ends the call:
/// the blocks verified before it stay hits, the rest are misses, the error is counted, and
/// the next call runs on a sound connection. The server is named `localhost`, which may
/// resolve to `::1` first while Redis listens on 127.0.0.1 only: every address is tried.
#[test]
fn an_error_reply_mid_read_keeps_the_hits_before_it() {
    let Some(r) = redis() else { return };
    let (a, _) = store(r.1);
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[9; 16 * 3], &[]);
    let data: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 50_000]).collect();
    put_pushed(&a, id, &keys, &data);
    let name = format!("kvtier:{}", keys[1]);
    assert_eq!(raw(r.1, &["DEL", &name]), "1");
    assert_eq!(raw(r.1, &["RPUSH", &name, "x"]), "1");
    let (_, t) = store_url(&format!("redis://localhost:{}/", r.1));
    let mut bufs: Vec<kvstore::AlignedBuf> = (0..3)
        .map(|_| kvstore::AlignedBuf::new(64 << 10).unwrap())
        .collect();
    let read = |bufs: &mut [kvstore::AlignedBuf], which: &[usize]| {
        let items = which
            .iter()
            .map(|&i| kvstore::ReadItem {
                key: keys[i],
                // SAFETY: the buffer outlives the call; each item has its own.
                buf: unsafe { kvstore::io::IoBuf::from_raw(bufs[i].as_mut_ptr(), 64 << 10) },
            })
            .collect();
        t.read(items)
    };
    let out = read(&mut bufs, &[0, 1, 2]);
    assert!(matches!(out[0], kvstore::ReadOutcome::Hit(_)), "{out:?}");
    assert!(
        matches!(
            out[1..],
            [kvstore::ReadOutcome::Miss, kvstore::ReadOutcome::Miss]
        ),
        "{out:?}"
    );
    assert_eq!(&bufs[0][..50_000], &data[0][..]);
    assert_eq!(t.stats().read_errors, 1, "{:?}", t.stats());
    let out = read(&mut bufs, &[2]);
    assert!(matches!(out[..], [kvstore::ReadOutcome::Hit(_)]), "{out:?}");
    assert_eq!(&bufs[2][..50_000], &data[2][..]);
    assert_eq!(t.stats().checksum_failures, 0);
}

/// A Redis that answers a few bytes at a time costs a read its deadline: the read ends as a
/// counted error and the load is a miss, with nothing partial kept; at speed again, the block
/// loads whole. (With a timeout per socket read only, as the `redis` crate's connection sets,
/// the read ran on for as long as the trickle lasted, and then succeeded.)
#[test]
fn a_redis_that_trickles_its_replies_costs_a_miss_by_the_deadline() {
    let Some(r) = redis() else { return };
    let (a, _) = store(r.1);
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[5; 16 * 2], &[]);
    let data: Vec<Vec<u8>> = (0..2usize)
        .map(|i| {
            (0..100_000usize)
                .map(|j| (j ^ (i * 7 + j / 251)) as u8)
                .collect()
        })
        .collect();
    put_pushed(&a, id, &keys, &data);
    let proxy = Proxy::start(format!("127.0.0.1:{}", r.1));
    let (b, bt) = store_at(&proxy.addr);
    let b = Arc::new(b);
    // Replies come back at 256 bytes per 20 ms (12.8 KB/s): a lookup's 32-byte headers at
    // once, well within the 800 ms deadline; a block of 100 KB in 8 s.
    proxy.set(Fault::Trickle {
        bytes: 256,
        every: Duration::from_millis(20),
    });
    let l = answered("a load from a trickling Redis", Duration::from_secs(30), {
        let (b, k) = (b.clone(), keys[0]);
        move || b.load(&[k]).unwrap().len()
    });
    assert_eq!(l, 0, "a block that never arrived whole was served");
    wait_until("the trickled read ends as an error", 30, || {
        bt.stats().read_errors > 0
    });
    assert_eq!(bt.stats().checksum_failures, 0);
    assert!(!b.in_host(&keys[0]), "part of a block was kept");
    // At speed again: the block loads whole.
    proxy.set(Fault::None);
    wait_until("Redis serves at speed again", 60, || {
        let l = b.load(&keys[1..]).unwrap();
        l.len() == 1 && l.block(0) == &data[1][..]
    });
}

#[test]
fn a_redis_cluster_works_the_same() {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        missing("redis-server", "KVTIER_REQUIRE_REDIS");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvtier-redis-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut nodes = Vec::new();
    for i in 0..3 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = dir.join(i.to_string());
        std::fs::create_dir_all(&d).unwrap();
        let c = Command::new("redis-server")
            .current_dir(&d)
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
                "--cluster-enabled",
                "yes",
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        nodes.push(Redis(c, port));
    }
    for n in &nodes {
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", n.1)).is_err() {
            assert!(Instant::now() < until);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.1)).collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let until = Instant::now() + Duration::from_secs(20);
    while !raw(nodes[0].1, &["CLUSTER", "INFO"]).contains("cluster_state:ok") {
        assert!(Instant::now() < until, "cluster not ok");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mk = || {
        let t = Arc::new(
            RedisTier::new(RedisConfig {
                urls: addrs.iter().map(|a| format!("redis://{a}/")).collect(),
                cluster: true,
                prefix: "kvtier:".into(),
                ttl_s: 0,
                timeout: Duration::from_secs(2),
            })
            .unwrap(),
        );
        let s = StoreConfig {
            capacity_bytes: 32 << 20,
            segment_bytes: 16 << 20,
            remote: Some(kvstore::SharedTier(t)),
            ..Default::default()
        }
        .build()
        .unwrap();
        s.register_namespace(&ns()).unwrap();
        s
    };
    let (a, b) = (mk(), mk());
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[4; 16 * 12], &[]);
    for (i, k) in keys.iter().enumerate() {
        a.put(id, *k, &vec![i as u8; 9000]).unwrap();
    }
    // (A push that timed out is tried again 1, 4 and 16 s later.)
    let until = Instant::now() + Duration::from_secs(60);
    while a.stats().pushes < 12 {
        assert!(Instant::now() < until, "not pushed: {:?}", a.stats().tiers);
        std::thread::sleep(Duration::from_millis(10));
    }
    let l = b.load(&keys).unwrap();
    assert_eq!(l.len(), 12);
    for i in 0..12 {
        assert_eq!(l.block(i), &vec![i as u8; 9000][..]);
    }
    drop(l);
    drop(nodes);
    let _ = std::fs::remove_dir_all(&dir);
}

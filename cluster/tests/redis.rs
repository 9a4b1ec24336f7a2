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
    store_on(RedisConfig {
        urls: vec![url.to_string()],
        cluster: false,
        prefix: "kvtier:".into(),
        ttl_s: 600,
        timeout: Duration::from_millis(800),
    })
}

/// A store whose remote tier is a Redis tier of `cfg`.
fn store_on(cfg: RedisConfig) -> (Store, Arc<RedisTier>) {
    let t = Arc::new(RedisTier::new(cfg).unwrap());
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

/// `n` blocks of 100 KB, each with a pattern of its own.
fn patterned(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            (0..100_000usize)
                .map(|j| (j ^ (i * 7 + j / 251)) as u8)
                .collect()
        })
        .collect()
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
        (48 + 70_200).to_string()
    );
    let l = c.load(&keys).unwrap();
    assert_eq!(l.len(), 2, "the prefix ends before the damaged block");
    drop(l);
    assert_eq!(ct.stats().checksum_failures, 1);
    assert!(!c.in_host(&keys[2]));
    assert_eq!(bt.stats().checksum_failures, 0);
}

/// A value found under a block's name that is another block's (whole, its checksum right:
/// copied there by a script, a restore, a misrouted reply) is a miss, counted, and never
/// served as this block. (Values carried no key before `KVT2`: it was served.)
#[test]
fn another_blocks_value_under_a_blocks_name_is_a_miss() {
    let Some(r) = redis() else { return };
    let (a, _) = store(r.1);
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[3; 16 * 2], &[]);
    let data: Vec<Vec<u8>> = (0..2).map(|i| vec![i as u8 + 1; 50_000]).collect();
    put_pushed(&a, id, &keys, &data);
    let (n0, n1) = (format!("kvtier:{}", keys[0]), format!("kvtier:{}", keys[1]));
    assert_eq!(raw(r.1, &["COPY", &n0, &n1, "REPLACE"]), "1");
    let (b, bt) = store(r.1);
    let l = b.load(&keys[1..]).unwrap();
    assert_eq!(l.len(), 0, "block 0's value served as block 1");
    drop(l);
    assert!(!b.in_host(&keys[1]));
    // Read from the tier itself (as after a lookup that found block 1's own value, replaced
    // since): a miss, counted.
    let mut buf = kvstore::AlignedBuf::new(64 << 10).unwrap();
    let item = kvstore::ReadItem {
        key: keys[1],
        // SAFETY: the buffer outlives the call.
        buf: unsafe { kvstore::io::IoBuf::from_raw(buf.as_mut_ptr(), 64 << 10) },
    };
    let out = bt.read(vec![item]);
    assert!(matches!(out[..], [kvstore::ReadOutcome::Miss]), "{out:?}");
    assert_eq!(bt.stats().checksum_failures, 1);
    // Block 0 itself still loads.
    let l = b.load(&keys[..1]).unwrap();
    assert_eq!((l.len(), l.block(0)), (1, &data[0][..]));
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
    let data = patterned(2);
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Redis Cluster of three masters on loopback, slots 0–5460 on node 0 (as `redis-cli
/// --cluster create` deals them).
struct RedisCluster {
    nodes: Vec<Redis>,
    dir: std::path::PathBuf,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl RedisCluster {
    /// Its nodes' `host:port`s.
    fn addrs(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.1))
            .collect()
    }

    /// A store whose remote tier is this cluster (its nodes' URLs as seeds), with deadlines
    /// of `timeout`.
    fn store(&self, timeout: Duration) -> (Store, Arc<RedisTier>) {
        store_on(RedisConfig {
            urls: self
                .addrs()
                .iter()
                .map(|a| format!("redis://{a}/"))
                .collect(),
            cluster: true,
            prefix: "kvtier:".into(),
            ttl_s: 0,
            timeout,
        })
    }

    /// The port of the master serving `slot`, as each node says of itself.
    fn slot_owner(&self, slot: u16) -> u16 {
        let owners: Vec<u16> = self
            .nodes
            .iter()
            .map(|n| n.1)
            .filter(|&p| {
                let nodes = raw(p, &["CLUSTER", "NODES"]);
                let me = nodes.lines().find(|l| l.contains("myself")).unwrap();
                // Fields 9 on: `a-b` ranges, single slots, and `[s->-id]` migrations.
                me.split(' ').skip(8).any(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    match (a.parse::<u16>(), b.parse::<u16>()) {
                        (Ok(a), Ok(b)) => a <= slot && slot <= b,
                        _ => false,
                    }
                })
            })
            .collect();
        assert_eq!(owners.len(), 1, "slot {slot} served by {owners:?}");
        owners[0]
    }

    /// The port of the master holding `key`'s block.
    fn owner(&self, key: &kvstore::BlockKey) -> u16 {
        let name = format!("kvtier:{key}");
        let held: Vec<u16> = self
            .nodes
            .iter()
            .map(|n| n.1)
            .filter(|&p| raw(p, &["EXISTS", &name]) == "1")
            .collect();
        assert_eq!(held.len(), 1, "{name} held by {held:?}");
        held[0]
    }
}

/// A Redis Cluster of three masters; node `i` announces the port `announce(i, port)` names
/// (a proxy's in front of it) where that is `Some`. `None` when Redis is not installed.
fn redis_cluster(announce: impl Fn(usize, u16) -> Option<u16>) -> Option<RedisCluster> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        missing("redis-server", "KVTIER_REQUIRE_REDIS");
        return None;
    }
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvtier-redis-cluster-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = RedisCluster {
        nodes: Vec::new(),
        dir: dir.clone(),
    };
    for i in 0..3 {
        // The bus on a port of its own (port + 10,000 can be past 65,535).
        let (port, bus) = (free_port(), free_port());
        let d = dir.join(i.to_string());
        std::fs::create_dir_all(&d).unwrap();
        let mut args: Vec<String> = [
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--cluster-port",
            &bus.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--cluster-enabled",
            "yes",
            // A master killed by a test stays the owner of its slots (no failover to wait
            // for), and the others keep serving theirs.
            "--cluster-node-timeout",
            "600000",
            "--cluster-require-full-coverage",
            "no",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        if let Some(p) = announce(i, port) {
            args.extend(["--cluster-announce-port".into(), p.to_string()]);
            args.extend(["--cluster-announce-bus-port".into(), bus.to_string()]);
        }
        let child = Command::new("redis-server")
            .current_dir(&d)
            .args(&args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        c.nodes.push(Redis(child, port));
    }
    for n in &c.nodes {
        wait_until("a cluster node listens", 10, || {
            std::net::TcpStream::connect(("127.0.0.1", n.1)).is_ok()
        });
    }
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(c.addrs())
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_until("the cluster is ok", 20, || {
        c.nodes
            .iter()
            .all(|n| raw(n.1, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
    });
    // Every node names the announced ports in its slot table.
    for i in 0..3 {
        if let Some(p) = announce(i, c.nodes[i].1) {
            wait_until("the announced port is known", 20, || {
                c.nodes
                    .iter()
                    .all(|n| raw(n.1, &["CLUSTER", "SLOTS"]).contains(&p.to_string()))
            });
        }
    }
    Some(c)
}

#[test]
fn a_redis_cluster_works_the_same() {
    let Some(c) = redis_cluster(|_, _| None) else {
        return;
    };
    let (a, _) = c.store(Duration::from_secs(2));
    let (b, bt) = c.store(Duration::from_secs(2));
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[4; 16 * 12], &[]);
    let data: Vec<Vec<u8>> = (0..12).map(|i| vec![i as u8; 9000]).collect();
    put_pushed(&a, id, &keys, &data);
    // The blocks landed on every master (routed by slot, not all to one node).
    let owners: std::collections::BTreeSet<u16> = keys.iter().map(|k| c.owner(k)).collect();
    assert_eq!(owners.len(), 3, "12 blocks on {owners:?}");
    let l = b.load(&keys).unwrap();
    assert_eq!(l.len(), 12);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(l.block(i), &d[..]);
    }
    assert_eq!(bt.stats().read_errors, 0);
}

/// A master that trickles its replies costs the blocks it serves a miss by the deadline; the
/// other masters' blocks load, and once it is at speed again, so do its. (Through the
/// `redis` crate's cluster connection, whose timeout bounds each socket read only, the read
/// ran on for as long as the trickle lasted, and then succeeded.)
#[test]
fn a_cluster_master_that_trickles_costs_its_blocks_a_miss_by_the_deadline() {
    // Node 0 announces a proxy's port: the tier reaches it only through the proxy.
    let proxy = std::sync::OnceLock::new();
    let Some(c) = redis_cluster(|i, port| {
        (i == 0).then(|| {
            let p = proxy.get_or_init(|| Proxy::start(format!("127.0.0.1:{port}")));
            p.addr.rsplit_once(':').unwrap().1.parse().unwrap()
        })
    }) else {
        return;
    };
    let proxy = proxy.get().unwrap();
    let (a, _) = c.store(Duration::from_millis(800));
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[6; 16 * 12], &[]);
    let data = patterned(12);
    put_pushed(&a, id, &keys, &data);
    let slow: Vec<bool> = keys.iter().map(|k| c.owner(k) == c.nodes[0].1).collect();
    assert!(
        slow.iter().any(|&s| s) && slow.iter().any(|&s| !s),
        "no block on node 0, or all: {slow:?}"
    );
    let (b, bt) = c.store(Duration::from_millis(800));
    let b = Arc::new(b);
    // 256 bytes per 20 ms (12.8 KB/s): headers at once, a block of 100 KB in 8 s.
    proxy.set(Fault::Trickle {
        bytes: 256,
        every: Duration::from_millis(20),
    });
    for (i, k) in keys.iter().enumerate() {
        let l = answered("a load from a cluster", Duration::from_secs(30), {
            let (b, k) = (b.clone(), *k);
            move || {
                let l = b.load(&[k]).unwrap();
                (l.len() == 1).then(|| l.block(0).to_vec())
            }
        });
        match (slow[i], l) {
            (true, None) => assert!(!b.in_host(k), "part of a block was kept"),
            (true, Some(_)) => panic!("block {i} came whole through a trickle by the deadline"),
            (false, Some(got)) => assert!(got == data[i], "block {i} differs"),
            // On a master at speed: a hit (asked again should a loaded machine have missed
            // the deadline once).
            (false, None) => wait_until("a block on a master at speed loads", 30, || {
                let l = b.load(std::slice::from_ref(k)).unwrap();
                l.len() == 1 && l.block(0) == &data[i][..]
            }),
        }
    }
    wait_until("the trickled reads end as errors", 30, || {
        bt.stats().read_errors > 0
    });
    assert_eq!(bt.stats().checksum_failures, 0);
    // A prefix whose first block is on a master at speed and its second on the slow one:
    // the first loads (its master is asked first), the second misses.
    let fast = slow.iter().position(|&s| !s).unwrap();
    let slowest = slow.iter().position(|&s| s).unwrap();
    // (Asked again, by a fresh store each time, should a loaded machine make the fast
    // master miss the deadline once.)
    wait_until("a prefix across masters loads its first block", 60, || {
        let (d, _) = c.store(Duration::from_millis(800));
        let l = d.load(&[keys[fast], keys[slowest]]).unwrap();
        assert!(
            l.len() <= 1,
            "the slow master's block came whole by the deadline"
        );
        l.len() == 1 && l.block(0) == &data[fast][..]
    });
    // At speed again: the slow master's blocks load whole.
    proxy.set(Fault::None);
    let i = slow.iter().position(|&s| s).unwrap();
    wait_until("the master serves at speed again", 60, || {
        let l = b.load(&keys[i..=i]).unwrap();
        l.len() == 1 && l.block(0) == &data[i][..]
    });
}

/// Blocks whose slot is migrating (`ASK`) or has moved (`MOVED`) since a store read the slot
/// table are followed to their new master, within the call.
#[test]
fn a_cluster_slot_migrating_or_moved_is_followed() {
    let Some(c) = redis_cluster(|_, _| None) else {
        return;
    };
    let (a, _) = c.store(Duration::from_secs(2));
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[8; 16 * 12], &[]);
    let data: Vec<Vec<u8>> = (0..12).map(|i| vec![i as u8 + 1; 9000]).collect();
    put_pushed(&a, id, &keys, &data);
    let (b, bt) = c.store(Duration::from_secs(2));
    // `b` reads the slot table with its first call (`a` read it with its first push).
    assert_eq!(b.load(&keys[..1]).unwrap().len(), 1);
    let more = ns().token_keys(&[9; 16 * 12], &[]);
    let more_data: Vec<Vec<u8>> = (0..12).map(|i| vec![i as u8 + 100; 9000]).collect();
    let slot_of = |k: &kvstore::BlockKey| {
        raw(
            c.nodes[0].1,
            &["CLUSTER", "KEYSLOT", &format!("kvtier:{k}")],
        )
    };
    // Reads through ASK and MOVED, then writes through each.
    let (ask, moved, ask_w, moved_w) = (&keys[3], &keys[7], &more[1], &more[4]);
    let slots: std::collections::BTreeSet<String> = [ask, moved, ask_w, moved_w]
        .iter()
        .map(|k| slot_of(k))
        .collect();
    assert_eq!(slots.len(), 4, "pick other keys");
    let id_of = |port: u16| raw(port, &["CLUSTER", "MYID"]);
    // Starts moving key `k`'s slot (and its block, if stored) to another master, and with
    // `finish` settles the move on every node (else the slot is left migrating). Returns the
    // new master's port.
    let migrate = |k: &kvstore::BlockKey, finish: bool| -> u16 {
        let (name, slot) = (format!("kvtier:{k}"), slot_of(k));
        let src = c.slot_owner(slot.parse().unwrap());
        let dst = c.nodes.iter().map(|n| n.1).find(|&p| p != src).unwrap();
        let (sid, did) = (id_of(src), id_of(dst));
        assert_eq!(
            raw(dst, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &sid]),
            "OK"
        );
        assert_eq!(
            raw(src, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &did]),
            "OK"
        );
        if raw(src, &["EXISTS", &name]) == "1" {
            let dst_port = dst.to_string();
            let m = [
                "MIGRATE",
                "127.0.0.1",
                &dst_port,
                "",
                "0",
                "5000",
                "KEYS",
                &name,
            ];
            assert_eq!(raw(src, &m), "OK");
        }
        if finish {
            for n in &c.nodes {
                assert_eq!(raw(n.1, &["CLUSTER", "SETSLOT", &slot, "NODE", &did]), "OK");
            }
        }
        dst
    };
    // Migrating: the old master answers ASK for the key it no longer has.
    migrate(ask, false);
    let l = b.load(std::slice::from_ref(ask)).unwrap();
    assert_eq!(l.len(), 1, "a block in a migrating slot missed");
    assert_eq!(l.block(0), &data[3][..]);
    drop(l);
    // Moved: the old master answers MOVED.
    migrate(moved, true);
    let l = b.load(std::slice::from_ref(moved)).unwrap();
    assert_eq!(l.len(), 1, "a block in a moved slot missed");
    assert_eq!(l.block(0), &data[7][..]);
    drop(l);
    assert_eq!(bt.stats().read_errors, 0);
    // Writes from `a`, whose table predates these: one slot migrating (the old master
    // answers ASK for a key it does not have), one moved (MOVED).
    let ask_dst = migrate(ask_w, false);
    let moved_dst = migrate(moved_w, true);
    put_pushed(&a, id, &more, &more_data);
    // The migration settled, the block written through ASK is on the new master.
    let did = id_of(ask_dst);
    for n in &c.nodes {
        let slot = slot_of(ask_w);
        assert_eq!(raw(n.1, &["CLUSTER", "SETSLOT", &slot, "NODE", &did]), "OK");
    }
    for (k, dst) in [(ask_w, ask_dst), (moved_w, moved_dst)] {
        assert_eq!(raw(dst, &["EXISTS", &format!("kvtier:{k}")]), "1");
    }
    let l = b.load(&more).unwrap();
    assert_eq!(l.len(), 12);
    for (i, d) in more_data.iter().enumerate() {
        assert_eq!(l.block(i), &d[..]);
    }
}

/// A master that is down fails the commands for its slots only: after it failed three calls
/// in a row, the other masters' blocks still load (one breaker a master, where one breaker
/// for the whole cluster paused every read for a second).
#[test]
fn a_dead_cluster_master_pauses_only_its_own_slots() {
    let Some(mut c) = redis_cluster(|_, _| None) else {
        return;
    };
    let (a, _) = c.store(Duration::from_secs(2));
    let id = a.register_namespace(&ns()).unwrap();
    let keys = ns().token_keys(&[11; 16 * 12], &[]);
    let data: Vec<Vec<u8>> = (0..12).map(|i| vec![i as u8 + 7; 9000]).collect();
    put_pushed(&a, id, &keys, &data);
    let dead_port = c.nodes[2].1;
    let on_dead: Vec<bool> = keys.iter().map(|k| c.owner(k) == dead_port).collect();
    let dead = on_dead.iter().position(|&d| d).expect("a block on node 2");
    let live: Vec<usize> = (0..12).filter(|&i| !on_dead[i]).collect();
    assert!(live.len() >= 3, "{on_dead:?}");
    let (b, _) = c.store(Duration::from_millis(800));
    // `b` reads the slot table.
    assert_eq!(b.load(&keys[live[0]..=live[0]]).unwrap().len(), 1);
    c.nodes[2].0.kill().unwrap();
    c.nodes[2].0.wait().unwrap();
    for _ in 0..4 {
        assert_eq!(b.load(&keys[dead..=dead]).unwrap().len(), 0);
    }
    let l = b.load(&keys[live[1]..=live[1]]).unwrap();
    assert_eq!(
        l.len(),
        1,
        "a live master's block missed while another master is down"
    );
    assert_eq!(l.block(0), &data[live[1]][..]);
    drop(l);
    // A prefix across a live master and the dead one: its first block loads (the lookup
    // keeps the headers the live masters gave).
    let l = b.load(&[keys[live[2]], keys[dead]]).unwrap();
    assert_eq!(l.len(), 1, "a prefix lost its live block to a dead master");
    assert_eq!(l.block(0), &data[live[2]][..]);
}

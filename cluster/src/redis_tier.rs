//! The remote tier on an existing Redis or Valkey (standalone, or Redis Cluster) for operators
//! who already run one: each block is one binary value `KVT1 | len u32 | xxh3-64 u64 |
//! namespace fingerprint 16 B | payload` under `prefix + hex(key)` with a TTL. Lookups read
//! only the 32-byte headers (GETRANGE), reads and writes are pipelined (one round trip per
//! batch); a value whose header or checksum does not match is a miss, counted. The same
//! [`LowerTier`] seam as the kvtierd peers' tier, so the store does not know which it has.
//!
//! A standalone server is spoken to on sockets of our own: the `redis` crate parses the URL,
//! packs the pipelines and parses the replies, and every pipeline is written and its replies
//! read within one deadline ([`Deadlined`]), so a server that trickles a reply (or reads a
//! request slowly) costs a call its deadline, never a reader held for as long as it likes.
//! The crate's own connection sets a timeout per read only. A Redis Cluster goes through the
//! crate's cluster connection (slot routing, redirections), with that timeout per read.

use std::io::{self, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use kvstore::{
    BlockInfo, BlockKey, Fingerprint, LowerTier, NsUsage, ReadItem, ReadOutcome, Tier, TierStats,
    WriteItem, WriteOutcome,
};
use parking_lot::Mutex;

use crate::deadline::{remaining, resolve, Deadlined};

const MAGIC: &[u8; 4] = b"KVT1";
const HEADER: usize = 32;
/// Consecutive failures that open the breaker, and its pause.
const BREAKER_FAILURES: u32 = 3;
const BREAKER_PAUSE: Duration = Duration::from_secs(1);

/// Where the blocks go.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://host:port[/db]` URLs: one for a standalone server, the seeds of a Redis Cluster
    /// with `cluster`.
    pub urls: Vec<String>,
    /// A Redis Cluster (commands routed by key slot).
    pub cluster: bool,
    /// Key prefix.
    pub prefix: String,
    /// Time to live of each block, seconds (0: none).
    pub ttl_s: u64,
    /// Deadline of every call (connect, pipeline).
    pub timeout: Duration,
}

enum Conn {
    Single(Link),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

/// A connection to a standalone server, authenticated and on its database.
struct Link {
    s: TcpStream,
    /// Holds what was read past a reply until the next is parsed (one parser a connection).
    parser: redis::Parser,
}

impl Link {
    /// Writes the packed commands and reads `n` replies, all by `deadline`. A reply that is an
    /// error fails the call, as the crate's pipelines do.
    fn query(
        &mut self,
        packed: &[u8],
        n: usize,
        deadline: Instant,
    ) -> io::Result<Vec<redis::Value>> {
        Deadlined::new(&self.s, deadline).write_all(packed)?;
        let mut rd = BufReader::with_capacity(64 << 10, Deadlined::new(&self.s, deadline));
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            match self.parser.parse_value(&mut rd).map_err(err)? {
                redis::Value::ServerError(e) => {
                    return Err(io::Error::other(format!(
                        "redis: {}",
                        redis::RedisError::from(e)
                    )))
                }
                v => out.push(v),
            }
        }
        Ok(out)
    }
}

/// A new connection to `info`'s server by `deadline`: connected, authenticated (`AUTH`, when
/// the URL has a password) and on the URL's database (`SELECT`). RESP2 is spoken.
fn connect_single(info: &redis::ConnectionInfo, deadline: Instant) -> io::Result<Link> {
    let redis::ConnectionAddr::Tcp(host, port) = &info.addr else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "cluster.redis: only redis:// URLs (plain TCP) are supported",
        ));
    };
    let name = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let addr = resolve(&name, deadline)?;
    let s = TcpStream::connect_timeout(&addr, remaining(deadline)?)?;
    s.set_nodelay(true)?;
    crate::wire::keepalive(&s)?;
    let mut link = Link {
        s,
        parser: redis::Parser::new(),
    };
    let r = &info.redis;
    let mut setup = redis::pipe();
    if let Some(pw) = &r.password {
        let auth = setup.cmd("AUTH");
        if let Some(user) = &r.username {
            auth.arg(user);
        }
        auth.arg(pw);
    }
    if r.db != 0 {
        setup.cmd("SELECT").arg(r.db);
    }
    let n = (r.password.is_some() as usize) + (r.db != 0) as usize;
    if n > 0 {
        link.query(&setup.get_packed_pipeline(), n, deadline)?;
    }
    Ok(link)
}

/// One pipelined command.
enum Cmd<'a> {
    Header(&'a str),
    Get(&'a str),
    Set(&'a str, Vec<u8>),
}

#[derive(Default)]
struct Breaker {
    failures: u32,
    open_until: Option<Instant>,
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    checksum_failures: AtomicU64,
}

/// The Redis-backed remote tier.
pub struct RedisTier {
    cfg: RedisConfig,
    single: Option<redis::ConnectionInfo>,
    cluster: Option<redis::cluster::ClusterClient>,
    pool: Mutex<Vec<Conn>>,
    breaker: Mutex<Breaker>,
    ns: crate::nsmap::NsMap,
    stats: Counters,
}

fn err(e: redis::RedisError) -> io::Error {
    io::Error::other(e.to_string())
}

impl RedisTier {
    /// A tier on `cfg.urls` (nothing is connected until the first call).
    pub fn new(cfg: RedisConfig) -> io::Result<Self> {
        if cfg.urls.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no Redis URL"));
        }
        let (single, cluster) = if cfg.cluster {
            let c = redis::cluster::ClusterClientBuilder::new(cfg.urls.clone())
                .connection_timeout(cfg.timeout)
                .response_timeout(cfg.timeout)
                .build()
                .map_err(err)?;
            (None, Some(c))
        } else {
            let c = redis::Client::open(cfg.urls[0].as_str()).map_err(err)?;
            (Some(c.get_connection_info().clone()), None)
        };
        Ok(Self {
            cfg,
            single,
            cluster,
            pool: Mutex::default(),
            breaker: Mutex::default(),
            ns: Default::default(),
            stats: Counters::default(),
        })
    }

    fn name(&self, key: &BlockKey) -> String {
        format!("{}{key}", self.cfg.prefix)
    }

    fn connect(&self, deadline: Instant) -> io::Result<Conn> {
        if let Some(c) = self.pool.lock().pop() {
            return Ok(c);
        }
        match (&self.single, &self.cluster) {
            (Some(info), _) => Ok(Conn::Single(connect_single(info, deadline)?)),
            (_, Some(c)) => Ok(Conn::Cluster(Box::new(c.get_connection().map_err(err)?))),
            _ => Err(io::Error::other("no client")),
        }
    }

    /// Runs the commands pipelined, at most ~32 MiB of values per round trip (the client
    /// buffers a whole pipeline); one reply per command (`None`: nil or empty).
    fn run(&self, cmds: &[Cmd<'_>]) -> io::Result<Vec<Option<Vec<u8>>>> {
        let mut out = Vec::with_capacity(cmds.len());
        let mut start = 0;
        while start < cmds.len() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < cmds.len() && (end == start || bytes < 32 << 20) {
                bytes += match &cmds[end] {
                    Cmd::Header(_) => HEADER,
                    Cmd::Get(_) => 2 << 20,
                    Cmd::Set(_, v) => v.len(),
                };
                end += 1;
            }
            out.extend(self.run_one(&cmds[start..end])?);
            start = end;
        }
        Ok(out)
    }

    /// One pipeline.
    fn run_one(&self, cmds: &[Cmd<'_>]) -> io::Result<Vec<Option<Vec<u8>>>> {
        {
            let b = self.breaker.lock();
            if b.open_until.is_some_and(|t| Instant::now() < t) {
                return Err(io::Error::other("redis breaker open"));
            }
        }
        // One deadline for the call: connecting, writing the pipeline and reading its replies.
        let deadline = Instant::now() + self.cfg.timeout;
        let res = self.connect(deadline).and_then(|mut c| {
            let out = match &mut c {
                Conn::Single(link) => {
                    let mut p = redis::pipe();
                    for cmd in cmds {
                        self.add(&mut p, cmd);
                    }
                    link.query(&p.get_packed_pipeline(), cmds.len(), deadline)
                }
                Conn::Cluster(con) => {
                    let mut p = redis::cluster::cluster_pipe();
                    for cmd in cmds {
                        match cmd {
                            Cmd::Header(k) => p.cmd("GETRANGE").arg(*k).arg(0).arg(HEADER - 1),
                            Cmd::Get(k) => p.cmd("GET").arg(*k),
                            Cmd::Set(k, v) => self.set_args(p.cmd("SET").arg(*k).arg(&v[..])),
                        };
                    }
                    p.query::<Vec<redis::Value>>(con).map_err(err)
                }
            };
            // Bulk strings are values; nil, "OK" and anything else are not.
            let out = out.map(|v| {
                v.into_iter()
                    .map(|x| match x {
                        redis::Value::BulkString(b) if !b.is_empty() => Some(b),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
            });
            if out.is_ok() {
                let mut pool = self.pool.lock();
                if pool.len() < 4 {
                    pool.push(c);
                }
            }
            out
        });
        let mut b = self.breaker.lock();
        match &res {
            Ok(_) => *b = Breaker::default(),
            Err(e) => {
                b.failures += 1;
                if b.failures >= BREAKER_FAILURES {
                    b.open_until = Some(Instant::now() + BREAKER_PAUSE);
                    tracing::warn!(error = %e, "redis tier: keeps failing: not asked for a second");
                }
            }
        }
        res
    }

    fn add(&self, p: &mut redis::Pipeline, cmd: &Cmd<'_>) {
        match cmd {
            Cmd::Header(k) => {
                p.cmd("GETRANGE").arg(*k).arg(0).arg(HEADER - 1);
            }
            Cmd::Get(k) => {
                p.cmd("GET").arg(*k);
            }
            Cmd::Set(k, v) => {
                let c = p.cmd("SET").arg(*k).arg(&v[..]);
                self.set_args(c);
            }
        }
    }

    fn set_args<'p, P: SetArgs>(&self, p: &'p mut P) -> &'p mut P {
        if self.cfg.ttl_s > 0 {
            p.ttl("EX", self.cfg.ttl_s);
        }
        p
    }

    fn header(&self, v: &[u8]) -> Option<(u32, u64, u16)> {
        if v.len() < HEADER || &v[..4] != MAGIC {
            return None;
        }
        let len = u32::from_le_bytes(v[4..8].try_into().ok()?);
        let sum = u64::from_le_bytes(v[8..16].try_into().ok()?);
        let fp = crate::wire::fingerprint(&v[16..32])?;
        let ns = self.ns.id_of(&fp)?;
        Some((len, sum, ns))
    }
}

/// What a pipeline's SET takes after its value.
trait SetArgs {
    fn ttl(&mut self, unit: &str, secs: u64);
}

impl SetArgs for redis::Pipeline {
    fn ttl(&mut self, unit: &str, secs: u64) {
        self.arg(unit).arg(secs);
    }
}

impl SetArgs for redis::cluster::ClusterPipeline {
    fn ttl(&mut self, unit: &str, secs: u64) {
        self.arg(unit).arg(secs);
    }
}

impl LowerTier for RedisTier {
    fn kind(&self) -> Tier {
        Tier::Remote
    }

    fn local(&self) -> bool {
        false
    }

    fn write_behind(&self) -> bool {
        true
    }

    fn lookup(&self, key: &BlockKey) -> Option<BlockInfo> {
        self.lookup_batch(std::slice::from_ref(key)).pop().flatten()
    }

    fn lookup_batch(&self, keys: &[BlockKey]) -> Vec<Option<BlockInfo>> {
        let names: Vec<String> = keys.iter().map(|k| self.name(k)).collect();
        let cmds: Vec<Cmd<'_>> = names.iter().map(|n| Cmd::Header(n)).collect();
        match self.run(&cmds) {
            Ok(v) => v
                .into_iter()
                .map(|h| {
                    let (len, checksum, ns) = self.header(h.as_deref()?)?;
                    Some(BlockInfo { len, ns, checksum })
                })
                .collect(),
            Err(e) => {
                tracing::debug!(error = %e, "redis tier: lookup failed (a miss)");
                vec![None; keys.len()]
            }
        }
    }

    fn pin(&self, _key: &BlockKey) -> bool {
        false
    }

    fn unpin(&self, _key: &BlockKey) {}

    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        self.stats.reads.fetch_add(1, Relaxed);
        let names: Vec<String> = items.iter().map(|it| self.name(&it.key)).collect();
        let cmds: Vec<Cmd<'_>> = names.iter().map(|n| Cmd::Get(n)).collect();
        let vals = match self.run(&cmds) {
            Ok(v) => v,
            Err(e) => {
                self.stats.read_errors.fetch_add(1, Relaxed);
                tracing::debug!(error = %e, "redis tier: read failed (misses)");
                return vec![ReadOutcome::Miss; items.len()];
            }
        };
        items
            .iter()
            .zip(vals)
            .map(|(it, v)| {
                let Some(v) = v else {
                    return ReadOutcome::Miss;
                };
                let Some((len, sum, ns)) = self.header(&v) else {
                    return ReadOutcome::Miss;
                };
                let payload = &v[HEADER..];
                if payload.len() != len as usize || payload.len() > it.buf.cap() {
                    self.stats.checksum_failures.fetch_add(1, Relaxed);
                    return ReadOutcome::Miss;
                }
                // SAFETY: the buffer is the block's reserved host slot (or an owned buffer),
                // `cap` >= len bytes, ours alone until this call returns.
                let dst = unsafe { std::slice::from_raw_parts_mut(it.buf.as_ptr(), payload.len()) };
                if kvstore::copy_hashed(dst, payload) != sum {
                    self.stats.checksum_failures.fetch_add(1, Relaxed);
                    tracing::warn!(key = %it.key, "redis tier: a block failed its checksum: a miss");
                    return ReadOutcome::Miss;
                }
                self.stats.bytes_read.fetch_add(u64::from(len), Relaxed);
                ReadOutcome::Hit(BlockInfo {
                    len,
                    ns,
                    checksum: sum,
                })
            })
            .collect()
    }

    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        self.stats.writes.fetch_add(1, Relaxed);
        let mut out = vec![WriteOutcome::Cancelled; items.len()];
        let mut names = Vec::new();
        let mut vals = Vec::new();
        let mut idx = Vec::new();
        for (i, it) in items.iter().enumerate() {
            if !still_wanted(&it.key) {
                continue;
            }
            let Some(fp) = self.ns.fp_of(it.ns) else {
                out[i] = WriteOutcome::Failed;
                continue;
            };
            // SAFETY: the block's slot is pinned by the caller for this call, `len` <= cap.
            let src = unsafe { std::slice::from_raw_parts(it.buf.as_ptr(), it.len as usize) };
            let mut v = Vec::with_capacity(HEADER + src.len());
            v.extend_from_slice(MAGIC);
            v.extend_from_slice(&it.len.to_le_bytes());
            v.extend_from_slice(&it.checksum.to_le_bytes());
            v.extend_from_slice(&crate::wire::fp_bytes(fp));
            v.resize(HEADER + src.len(), 0);
            // Checked against the commit checksum as it is copied: a slot an engine wrote
            // into after its commit is never stored.
            if kvstore::copy_hashed(&mut v[HEADER..], src) != it.checksum {
                out[i] = WriteOutcome::Corrupt;
                continue;
            }
            names.push(self.name(&it.key));
            vals.push(v);
            idx.push(i);
        }
        if idx.is_empty() {
            return out;
        }
        let cmds: Vec<Cmd<'_>> = names
            .iter()
            .zip(vals)
            .map(|(n, v)| Cmd::Set(n, v))
            .collect();
        let bytes: u64 = idx.iter().map(|&i| u64::from(items[i].len)).sum();
        match self.run(&cmds) {
            Ok(_) => {
                self.stats.bytes_written.fetch_add(bytes, Relaxed);
                for i in idx {
                    out[i] = WriteOutcome::Written;
                }
            }
            Err(e) => {
                self.stats.write_errors.fetch_add(1, Relaxed);
                tracing::debug!(error = %e, "redis tier: write failed");
                for i in idx {
                    out[i] = WriteOutcome::Failed;
                }
            }
        }
        out
    }

    fn remove(&self, _key: &BlockKey) -> bool {
        // Shared with other nodes: a node's removal is its own; the value ages out by its TTL.
        false
    }

    fn clear_namespace(&self, _ns: u16) -> Vec<BlockKey> {
        Vec::new()
    }

    fn namespace_usage(&self) -> Vec<NsUsage> {
        Vec::new()
    }

    fn stats(&self) -> TierStats {
        let s = &self.stats;
        TierStats {
            tier: Some(Tier::Remote),
            engine: "redis",
            reads: s.reads.load(Relaxed),
            writes: s.writes.load(Relaxed),
            bytes_read: s.bytes_read.load(Relaxed),
            bytes_written: s.bytes_written.load(Relaxed),
            read_errors: s.read_errors.load(Relaxed),
            write_errors: s.write_errors.load(Relaxed),
            checksum_failures: s.checksum_failures.load(Relaxed),
            ..Default::default()
        }
    }

    fn note_namespace(&self, id: u16, fp: Fingerprint) -> io::Result<()> {
        self.ns.note(id, fp);
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

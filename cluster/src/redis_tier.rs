//! The remote tier on an existing Redis or Valkey (standalone, or Redis Cluster) for operators
//! who already run one: each block is one binary value `KVT2 | len u32 | xxh3-64 u64 |
//! namespace fingerprint 16 B | block key 16 B | payload` under `prefix + hex(key)` with a
//! TTL. Lookups read only the 48-byte headers (GETRANGE), reads and writes are pipelined (a
//! round trip per batch, or per 32 MiB of values, 8 MiB of GET replies); a value whose header
//! or checksum does not match, or that names another key, is a miss, counted. The same
//! [`LowerTier`] seam as the kvtierd peers' tier, so the store does not know which it has.
//!
//! Servers are spoken to on sockets of our own (the `redis` crate parses the URLs): a call's
//! pipelines are written and their replies read within one deadline (`deadline::Deadlined`),
//! so a server that trickles a reply (or reads a request slowly) costs a call its deadline,
//! never a reader held for as long as it likes (the crate's connections set a timeout per
//! read only). Commands are framed here (RESP2 arrays of bulk strings); a GET's value is read
//! straight into its block's slot and a SET's is sent from its slot a piece at a time, where
//! the crate's pipelines copied each value three times (puts 3.3–4 × faster, gets 4.1 × at
//! 2 MiB and 1.7 × at 16 MiB, each at a plain client's rate: bench/RESULTS.md). A Redis
//! Cluster is routed here too ([`crate::redis_slots`]): each command goes to its slot's
//! master, a pipeline a master, and a `MOVED` or `ASK` reply sends the command on, all
//! within the same deadline.

use std::collections::HashMap;
use std::fmt::Display;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::{
    BlockInfo, BlockKey, Fingerprint, LowerTier, NsUsage, ReadItem, ReadOutcome, Tier, TierStats,
    WriteItem, WriteOutcome,
};
use parking_lot::Mutex;

use crate::deadline::{connect_any, resolve_all, Deadlined};
use crate::redis_slots::{redirect, slot, Redirect, SlotTable};

/// The value format: `KVT2` carries its block's key (`KVT1`, before it, did not: a value
/// found under another key's name passed as that block; such values read as misses and age
/// out by their TTL).
const MAGIC: &[u8; 4] = b"KVT2";
const HEADER: usize = 48;
/// The key of the breaker of reading a cluster's slot table (no server's address).
const SLOT_TABLE: &str = "CLUSTER SLOTS";
/// Consecutive failures that open a breaker, and its pause.
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

/// Redirections a command may take in one call (a slot migrating as it moves on).
const MAX_REDIRECTS: usize = 3;

/// Where the tier's servers are.
enum Backend {
    /// A standalone server.
    Single(redis::ConnectionInfo),
    Cluster(Cluster),
}

/// A Redis Cluster: the URLs' servers (to read the slot table from) and the slot table.
struct Cluster {
    seeds: Vec<redis::ConnectionInfo>,
    table: Mutex<Slots>,
}

/// What a [`Cluster`] knows of its slots.
#[derive(Default)]
struct Slots {
    /// The slot table as last read (`None`: read it before the next call)…
    table: Option<Arc<SlotTable>>,
    /// …and whether to read it again at the next call (a `MOVED`, a master that failed).
    stale: bool,
    /// The node that answered last: asked first next time.
    last: Option<String>,
}

impl Cluster {
    /// How to reach the master at `addr` (`host:port`, `[v6]:port`): its URL's credentials
    /// if it is a seed, else the first URL's; database 0 (a cluster has no other).
    fn node(&self, addr: &str) -> io::Result<redis::ConnectionInfo> {
        let parsed = addr.rsplit_once(':').and_then(|(h, p)| {
            let h = h
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(h);
            Some((h.to_string(), p.parse::<u16>().ok()?))
        });
        let Some((host, port)) = parsed.filter(|(h, _)| !h.is_empty()) else {
            return Err(bad(format!("a cluster node address {addr:?}")));
        };
        // A seed's own credentials, else the first URL's.
        let seed = self.seeds.iter().find(|s| addr_of(s) == addr);
        let mut redis = seed.unwrap_or(&self.seeds[0]).redis.clone();
        redis.db = 0;
        Ok(redis::ConnectionInfo {
            addr: redis::ConnectionAddr::Tcp(host, port),
            redis,
        })
    }
}

/// `r` with an address that names no host (`:6381`, as Redis answers with
/// `cluster-preferred-endpoint-type unknown-endpoint`) on the host of `addr`, the node that
/// answered it.
fn same_host(r: Redirect, addr: &str) -> Redirect {
    let port = |a: &str| {
        a.strip_prefix(':')
            .filter(|p| p.parse::<u16>().is_ok())
            .map(String::from)
    };
    let fix = |a: String| match (port(&a), addr.rsplit_once(':')) {
        (Some(port), Some((host, _))) => format!("{host}:{port}"),
        _ => a,
    };
    match r {
        Redirect::Moved(s, a) => Redirect::Moved(s, fix(a)),
        Redirect::Ask(s, a) => Redirect::Ask(s, fix(a)),
    }
}

/// The address a connection to `info` is pooled under.
fn addr_of(info: &redis::ConnectionInfo) -> String {
    match &info.addr {
        redis::ConnectionAddr::Tcp(h, p) if h.contains(':') => format!("[{h}]:{p}"),
        redis::ConnectionAddr::Tcp(h, p) => format!("{h}:{p}"),
        other => other.to_string(),
    }
}

/// A connection to a server, authenticated and on its database.
struct Link {
    s: TcpStream,
}

/// How one RESP2 reply starts (the replies the tier's commands get).
#[derive(Debug)]
enum Head {
    /// `-…`: an error (a redirection, in a cluster; else it fails the call).
    Error(String),
    /// `+…` (`OK`).
    Simple,
    /// `:n`.
    Int,
    /// `$-1`: no such key.
    Nil,
    /// `$n`: a value of `n` bytes follows.
    Bulk(usize),
}

/// The longest reply line read (a value's bytes are not a line).
const MAX_LINE: u64 = 4096;

fn bad(what: impl Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("redis: {what}"))
}

/// Reads the first line of a reply.
fn read_head(rd: &mut impl BufRead) -> io::Result<Head> {
    let mut line = Vec::with_capacity(32);
    rd.take(MAX_LINE).read_until(b'\n', &mut line)?;
    let Some(body) = line.strip_suffix(b"\r\n") else {
        return Err(match line.len() {
            0 => bad("the server closed the connection"),
            _ => bad("a reply line cut short or longer than 4 KiB"),
        });
    };
    let Some((&kind, rest)) = body.split_first() else {
        return Err(bad("an empty reply line"));
    };
    let text = String::from_utf8_lossy(rest);
    match kind {
        b'+' => Ok(Head::Simple),
        b':' => Ok(Head::Int),
        b'-' => Ok(Head::Error(text.into_owned())),
        b'$' => match text.parse::<i64>() {
            Ok(-1) => Ok(Head::Nil),
            Ok(n) => usize::try_from(n)
                .map(Head::Bulk)
                .map_err(|_| bad(format!("a value of length {n}"))),
            Err(_) => Err(bad(format!("a value length {text:?}"))),
        },
        k => Err(bad(format!("a reply of type {:?}", k as char))),
    }
}

/// Writes one command: an array of bulk strings.
fn frame(w: &mut dyn Write, parts: &[&[u8]]) -> io::Result<()> {
    write!(w, "*{}\r\n", parts.len())?;
    for p in parts {
        write!(w, "${}\r\n", p.len())?;
        w.write_all(p)?;
        w.write_all(b"\r\n")?;
    }
    Ok(())
}

/// What a caller does with each reply of a pipeline: its index, how it starts, and a reader
/// of its value's bytes (read as many as wanted; the rest are skipped).
type OnReply<'a> = dyn FnMut(usize, Head, &mut dyn Read) -> io::Result<()> + 'a;

/// What a caller does with an error reply (its index, its text): `true` if it took it (a
/// redirection), `false` to fail the call with it.
type OnError<'a> = dyn FnMut(usize, &str) -> bool + 'a;

/// Takes no error reply: each fails the call.
fn no_errors(_: usize, _: &str) -> bool {
    false
}

impl Link {
    /// Writes a pipeline (`write` frames its commands) and hands each of its `n` replies to
    /// `reply` (an error reply to `error`), all by `deadline`.
    fn exchange(
        &mut self,
        n: usize,
        deadline: Instant,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
        reply: &mut OnReply<'_>,
        error: &mut OnError<'_>,
    ) -> io::Result<()> {
        let mut w = BufWriter::with_capacity(64 << 10, Deadlined::new(&self.s, deadline));
        if let Err(e) = write(&mut w).and_then(|()| w.flush()) {
            // Not flushed on drop: a command cut off stays cut off.
            let _ = w.into_parts();
            return Err(e);
        }
        drop(w);
        let mut rd = BufReader::with_capacity(64 << 10, Deadlined::new(&self.s, deadline));
        for i in 0..n {
            let head = read_head(&mut rd)?;
            if let Head::Error(text) = &head {
                if error(i, text) {
                    continue;
                }
                return Err(io::Error::other(format!("redis: {text}")));
            }
            let Head::Bulk(len) = head else {
                reply(i, head, &mut io::empty())?;
                continue;
            };
            let mut body = (&mut rd).take(len as u64);
            reply(i, Head::Bulk(len), &mut body)?;
            io::copy(&mut body, &mut io::sink())?;
            let mut end = [0u8; 2];
            if body.limit() > 0 || rd.read_exact(&mut end).is_err() || &end != b"\r\n" {
                return Err(bad("a value cut short"));
            }
        }
        // Bytes past the last reply: the stream is not what this side thinks (the connection
        // is dropped, not pooled).
        if !rd.buffer().is_empty() {
            return Err(bad("bytes past the last reply"));
        }
        Ok(())
    }

    /// Sends one command (`parts`) that answers `+OK`, by `deadline`.
    fn ok(&mut self, parts: &[&[u8]], deadline: Instant) -> io::Result<()> {
        let what = String::from_utf8_lossy(parts.first().copied().unwrap_or_default());
        self.exchange(
            1,
            deadline,
            |w| frame(w, parts),
            &mut |_, head, _| match head {
                Head::Simple => Ok(()),
                _ => Err(bad(format!("{what} did not answer OK"))),
            },
            &mut no_errors,
        )
    }

    /// The cluster's slot table, asked of this node (`host`: its host, which a master that
    /// names no address is) by `deadline`.
    fn cluster_slots(&mut self, host: &str, deadline: Instant) -> io::Result<SlotTable> {
        let mut w = BufWriter::new(Deadlined::new(&self.s, deadline));
        frame(&mut w, &[b"CLUSTER", b"SLOTS"])?;
        w.flush()?;
        drop(w);
        let mut rd = BufReader::with_capacity(64 << 10, Deadlined::new(&self.s, deadline));
        let t = SlotTable::read(&mut rd, host)?;
        if !rd.buffer().is_empty() {
            return Err(bad("bytes past the last reply"));
        }
        Ok(t)
    }
}

/// A new connection to `info`'s server by `deadline`: connected, authenticated (`AUTH`, when
/// the URL has a password) and on the URL's database (`SELECT`). RESP2 is spoken.
fn connect_link(info: &redis::ConnectionInfo, deadline: Instant) -> io::Result<Link> {
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
    let s = connect_any(&resolve_all(&name, deadline)?, deadline)?;
    s.set_nodelay(true)?;
    crate::wire::keepalive(&s)?;
    let mut link = Link { s };
    let r = &info.redis;
    if let Some(pw) = &r.password {
        let mut auth: Vec<&[u8]> = vec![b"AUTH"];
        if let Some(user) = &r.username {
            auth.push(user.as_bytes());
        }
        auth.push(pw.as_bytes());
        match link.ok(&auth, deadline) {
            // A server older than Redis 6 takes a password only (as the crate did, again
            // without the user).
            Err(e) if auth.len() == 3 && e.to_string().contains("wrong number of arguments") => {
                link.ok(&[b"AUTH", pw.as_bytes()], deadline)?;
            }
            other => other?,
        }
    }
    if r.db != 0 {
        link.ok(&[b"SELECT", r.db.to_string().as_bytes()], deadline)?;
    }
    Ok(link)
}

/// One pipelined command.
enum Cmd<'a> {
    Header(&'a str),
    /// A value of at most this many bytes (the slot's size) is expected.
    Get(&'a str, usize),
    Set(&'a str, &'a Value<'a>),
}

impl Cmd<'_> {
    /// The key it reads or writes.
    fn name(&self) -> &str {
        match self {
            Cmd::Header(k) | Cmd::Get(k, _) | Cmd::Set(k, _) => k,
        }
    }
}

/// A SET's value: kvtier's header, then the block's bytes, read from its slot as they are
/// sent (and checked against `sum` before the last of them goes).
struct Value<'a> {
    head: [u8; HEADER],
    src: &'a [u8],
    sum: u64,
    /// Set when the slot no longer matched `sum`: the call failed before the SET was whole,
    /// so Redis never ran it.
    changed: std::cell::Cell<bool>,
}

impl Value<'_> {
    fn len(&self) -> usize {
        HEADER + self.src.len()
    }

    /// Writes the value's bytes, the slot's through `piece` ([`PIECE`] bytes at a time: each
    /// copied out of the slot once, hashed while in cache, sent from there, so what is hashed
    /// is what is sent). A slot written after its commit fails the write before its last
    /// piece: the command is never whole, and the connection is dropped with it.
    fn send(&self, w: &mut dyn Write, piece: &mut Vec<u8>) -> io::Result<()> {
        w.write_all(&self.head)?;
        piece.resize(PIECE.min(self.src.len()), 0);
        let mut h = kvstore::Checksummer::new();
        let mut at = 0;
        while at < self.src.len() {
            let n = PIECE.min(self.src.len() - at);
            piece[..n].copy_from_slice(&self.src[at..at + n]);
            h.update(&piece[..n]);
            at += n;
            if at == self.src.len() && h.finish() != self.sum {
                self.changed.set(true);
                return Err(bad("a block's slot changed after its commit: not stored"));
            }
            w.write_all(&piece[..n])?;
        }
        Ok(())
    }
}

/// Bytes of values a pipeline carries at most (the first command goes whatever its size).
const PIPELINE_BYTES: usize = 32 << 20;

/// …and of GET replies: more in one pipeline made Redis 7 answer slower (`kvtier-bench
/// remote`, 2 MiB values on loopback: 16 GETs a round trip 2.4 GB/s, 8 4.7–4.9, 4 5.2, 1
/// 3.3–4.4; a plain client's one at a time 4.6–5.0).
const GET_PIPELINE_BYTES: usize = 8 << 20;

/// The pieces a SET's value is sent in (half the L2 of the Xeons here, as the peers' pushes).
const PIECE: usize = 1 << 20;

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
    backend: Backend,
    /// Idle connections by server address, at most [`POOLED`] each.
    pool: Mutex<HashMap<String, Vec<Link>>>,
    /// A breaker a server (keyed as the pool is; [`SLOT_TABLE`] for reading a cluster's slot
    /// table): one failing master pauses only the commands for its slots.
    breakers: Mutex<HashMap<String, Breaker>>,
    ns: crate::nsmap::NsMap,
    stats: Counters,
}

fn err(e: redis::RedisError) -> io::Error {
    io::Error::other(e.to_string())
}

/// Idle connections kept a server.
const POOLED: usize = 4;
/// Servers with pooled connections or a breaker's count, at most (a cluster's masters, and
/// the addresses its redirections named).
const MAX_SERVERS: usize = 1024;

/// How to reach the server of `url` (plain TCP only).
fn parse_url(url: &str) -> io::Result<redis::ConnectionInfo> {
    let info = redis::Client::open(url)
        .map_err(err)?
        .get_connection_info()
        .clone();
    if !matches!(info.addr, redis::ConnectionAddr::Tcp(..)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{url}: only redis:// URLs (plain TCP) are supported"),
        ));
    }
    Ok(info)
}

impl RedisTier {
    /// A tier on `cfg.urls` (nothing is connected until the first call).
    pub fn new(cfg: RedisConfig) -> io::Result<Self> {
        if cfg.urls.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no Redis URL"));
        }
        let backend = if cfg.cluster {
            let seeds = cfg
                .urls
                .iter()
                .map(|u| parse_url(u))
                .collect::<io::Result<Vec<_>>>()?;
            if let Some(u) = cfg.urls.iter().zip(&seeds).find(|(_, s)| s.redis.db != 0) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{}: a Redis Cluster has database 0 only", u.0),
                ));
            }
            Backend::Cluster(Cluster {
                seeds,
                table: Mutex::default(),
            })
        } else {
            Backend::Single(parse_url(&cfg.urls[0])?)
        };
        Ok(Self {
            cfg,
            backend,
            pool: Mutex::default(),
            breakers: Mutex::default(),
            ns: Default::default(),
            stats: Counters::default(),
        })
    }

    fn name(&self, key: &BlockKey) -> String {
        format!("{}{key}", self.cfg.prefix)
    }

    /// A pooled connection to the server at `addr` (`info`), or a new one.
    fn connect(
        &self,
        addr: &str,
        info: &redis::ConnectionInfo,
        deadline: Instant,
    ) -> io::Result<Link> {
        if let Some(l) = self.pool.lock().get_mut(addr).and_then(Vec::pop) {
            return Ok(l);
        }
        connect_link(info, deadline)
    }

    /// Whether `addr`'s breaker is open (it failed [`BREAKER_FAILURES`] calls in a row less
    /// than [`BREAKER_PAUSE`] ago): it is not asked.
    fn paused(&self, addr: &str) -> bool {
        self.breakers
            .lock()
            .get(addr)
            .and_then(|b| b.open_until)
            .is_some_and(|t| Instant::now() < t)
    }

    /// Counts a call to `addr` that succeeded or failed (not when `changed`: a slot an engine
    /// changed after its commit is that engine's fault, not the server's).
    fn count(&self, addr: &str, res: Result<(), &io::Error>, changed: bool) {
        let mut breakers = self.breakers.lock();
        match res {
            Ok(()) => {
                breakers.remove(addr);
            }
            Err(_) if changed => {}
            Err(e) => {
                // Bounded against servers that redirect to ever new addresses.
                if breakers.len() >= MAX_SERVERS && !breakers.contains_key(addr) {
                    breakers.retain(|_, b| b.open_until.is_some());
                    if breakers.len() >= MAX_SERVERS {
                        return;
                    }
                }
                let b = breakers.entry(addr.to_string()).or_default();
                b.failures += 1;
                if b.failures >= BREAKER_FAILURES {
                    b.open_until = Some(Instant::now() + BREAKER_PAUSE);
                    tracing::warn!(error = %e, addr, "redis tier: keeps failing: not asked for a second");
                }
            }
        }
    }

    /// Keeps `link` (its exchanges all answered) for the next call.
    fn pool(&self, addr: &str, link: Link) {
        let mut pool = self.pool.lock();
        if pool.len() >= MAX_SERVERS && !pool.contains_key(addr) {
            return;
        }
        let idle = pool.entry(addr.to_string()).or_default();
        if idle.len() < POOLED {
            idle.push(link);
        }
    }

    /// Runs the commands pipelined, at most [`PIPELINE_BYTES`] of values per round trip
    /// ([`GET_PIPELINE_BYTES`] for GETs), and hands each reply to `reply` with the command's
    /// index (see [`OnReply`]).
    fn run(&self, cmds: &[Cmd<'_>], reply: &mut OnReply<'_>) -> io::Result<()> {
        // One deadline for the call: connecting, writing its pipelines, reading their replies.
        let deadline = Instant::now() + self.cfg.timeout;
        let mut start = 0;
        while start < cmds.len() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < cmds.len() && (end == start || bytes < PIPELINE_BYTES) {
                bytes += match &cmds[end] {
                    Cmd::Header(_) => HEADER,
                    Cmd::Get(_, n) => n * (PIPELINE_BYTES / GET_PIPELINE_BYTES),
                    Cmd::Set(_, v) => v.len(),
                };
                end += 1;
            }
            self.run_one(&cmds[start..end], deadline, &mut |i, h, r| {
                reply(start + i, h, r)
            })?;
            start = end;
        }
        Ok(())
    }

    /// One pipeline.
    fn run_one(
        &self,
        cmds: &[Cmd<'_>],
        deadline: Instant,
        reply: &mut OnReply<'_>,
    ) -> io::Result<()> {
        let idx: Vec<usize> = (0..cmds.len()).collect();
        match &self.backend {
            Backend::Single(info) => self.send(
                &addr_of(info),
                info,
                cmds,
                &idx,
                false,
                deadline,
                reply,
                &mut no_errors,
            ),
            Backend::Cluster(c) => self.run_cluster(c, cmds, idx, deadline, reply),
        }
    }

    /// Sends the commands `idx` of `cmds` to the server at `addr` (`info`) in one pipeline,
    /// each after `ASKING` with `asking`, and hands their replies to `reply` (under their
    /// indices in `cmds`), their error replies to `error`; not while the server's breaker is
    /// open, and counted by it.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        addr: &str,
        info: &redis::ConnectionInfo,
        cmds: &[Cmd<'_>],
        idx: &[usize],
        asking: bool,
        deadline: Instant,
        reply: &mut OnReply<'_>,
        error: &mut OnError<'_>,
    ) -> io::Result<()> {
        if Instant::now() >= deadline {
            // Another server took the call's time: no fault of this one's.
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("redis {addr}: the call's deadline passed before it was asked"),
            ));
        }
        if self.paused(addr) {
            return Err(io::Error::other(format!("redis {addr}: breaker open")));
        }
        let per = if asking { 2 } else { 1 };
        let out = self.connect(addr, info, deadline).and_then(|mut link| {
            let mut piece = Vec::new();
            let out = link.exchange(
                idx.len() * per,
                deadline,
                |w| {
                    idx.iter().try_for_each(|&i| {
                        if asking {
                            frame(w, &[b"ASKING"])?;
                        }
                        self.frame(w, &cmds[i], &mut piece)
                    })
                },
                &mut |p, head, body| match (asking && p % 2 == 0, head) {
                    (true, Head::Simple) => Ok(()),
                    (true, _) => Err(bad("ASKING did not answer OK")),
                    (false, head) => reply(idx[p / per], head, body),
                },
                &mut |p, text| (!asking || p % 2 == 1) && error(idx[p / per], text),
            );
            if out.is_ok() {
                self.pool(addr, link);
            }
            out
        });
        let changed = idx
            .iter()
            .any(|&i| matches!(&cmds[i], Cmd::Set(_, v) if v.changed.get()));
        self.count(addr, out.as_ref().copied(), changed);
        out
    }

    /// The cluster's slot table: as last read, or read again (after a `MOVED`, or a failed
    /// call) from the node that answered last, the masters the table names, then the URLs'
    /// servers: the first that answers. Each is given an equal share of what is left of
    /// `deadline` (one that never answers costs a share, not the call); if none answers, the
    /// table as last read, which `MOVED` replies correct.
    fn slot_table(&self, c: &Cluster, deadline: Instant) -> io::Result<Arc<SlotTable>> {
        let (old, mut addrs) = {
            let t = c.table.lock();
            match &t.table {
                Some(table) if !t.stale => return Ok(table.clone()),
                Some(table) => (Some(table.clone()), table.addrs()),
                None => (None, Vec::new()),
            }
        };
        // Reading it failed 3 times in a row less than a second ago: not asked again yet.
        if self.paused(SLOT_TABLE) {
            return old.ok_or_else(|| bad("no cluster node answered CLUSTER SLOTS: paused"));
        }
        addrs.extend(c.seeds.iter().map(addr_of));
        if let Some(last) = c.table.lock().last.clone() {
            addrs.insert(0, last);
        }
        let mut seen = std::collections::HashSet::new();
        addrs.retain(|a| seen.insert(a.clone()));
        let mut last = None;
        for (k, addr) in addrs.iter().enumerate() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let share = now + (deadline - now) / (addrs.len() - k) as u32;
            let asked = c.node(addr).and_then(|info| {
                let mut link = self.connect(addr, &info, share)?;
                let host = match &info.addr {
                    redis::ConnectionAddr::Tcp(h, _) => h.clone(),
                    _ => String::new(),
                };
                let t = link.cluster_slots(&host, share)?;
                self.pool(addr, link);
                Ok(t)
            });
            match asked {
                Ok(t) if !t.is_empty() => {
                    let t = Arc::new(t);
                    let keep = t.addrs();
                    *c.table.lock() = Slots {
                        table: Some(t.clone()),
                        stale: false,
                        last: Some(addr.clone()),
                    };
                    // Connections to nodes no longer named (nor seeds) go.
                    let kept =
                        |a: &String| keep.contains(a) || c.seeds.iter().any(|s| addr_of(s) == *a);
                    self.pool.lock().retain(|a, _| kept(a));
                    self.breakers
                        .lock()
                        .retain(|a, _| a == SLOT_TABLE || kept(a));
                    self.count(SLOT_TABLE, Ok(()), false);
                    return Ok(t);
                }
                Ok(_) => last = Some(bad(format!("{addr}: CLUSTER SLOTS named no slot"))),
                Err(e) => last = Some(e),
            }
        }
        let e = last.unwrap_or_else(|| bad("no cluster node to ask"));
        self.count(SLOT_TABLE, Err(&e), false);
        match old {
            Some(t) => {
                tracing::debug!(error = %e, "redis tier: slot table not read again: the old one stands");
                Ok(t)
            }
            None => Err(e),
        }
    }

    /// One pipeline through a Redis Cluster: a pipeline to each master its commands' slots
    /// live on, then the commands redirected (`MOVED`: to the slot's new master; `ASK`: once,
    /// after `ASKING`) again, at most [`MAX_REDIRECTS`] times, all by `deadline`.
    fn run_cluster(
        &self,
        c: &Cluster,
        cmds: &[Cmd<'_>],
        idx: Vec<usize>,
        deadline: Instant,
        reply: &mut OnReply<'_>,
    ) -> io::Result<()> {
        let mut todo: Vec<(usize, Option<Redirect>)> = idx.into_iter().map(|i| (i, None)).collect();
        let mut failed = None;
        // Read once: past the first round, every command goes where it was redirected.
        let table = self.slot_table(c, deadline)?;
        for _ in 0..=MAX_REDIRECTS {
            if todo.is_empty() {
                break;
            }
            // Each master's commands (and those asked after ASKING), in their order; the
            // masters in the order of their first command. A prefix's blocks are asked for
            // first to last, so a master that trickles its replies (and takes what is left
            // of the deadline) costs the blocks from its first one on, which a prefix could
            // not use anyway, and never the blocks before it.
            todo.sort_unstable_by_key(|t| t.0);
            let mut groups: Vec<((String, bool), Vec<usize>)> = Vec::new();
            let mut group_of: HashMap<(String, bool), usize> = HashMap::new();
            for (i, r) in &todo {
                let at = match r {
                    Some(Redirect::Moved(_, a)) => (a.clone(), false),
                    Some(Redirect::Ask(_, a)) => (a.clone(), true),
                    None => {
                        let s = slot(cmds[*i].name().as_bytes());
                        let Some(a) = table.addr(s) else {
                            c.table.lock().stale = true;
                            return Err(bad(format!("no master serves slot {s}")));
                        };
                        (a.to_string(), false)
                    }
                };
                match group_of.get(&at) {
                    Some(&g) => groups[g].1.push(*i),
                    None => {
                        group_of.insert(at.clone(), groups.len());
                        groups.push((at, vec![*i]));
                    }
                }
            }
            let mut next = Vec::new();
            for ((addr, asking), idx) in groups {
                let sent = c.node(&addr).and_then(|info| {
                    self.send(
                        &addr,
                        &info,
                        cmds,
                        &idx,
                        asking,
                        deadline,
                        reply,
                        &mut |i, text| match redirect(text) {
                            Some(r) => {
                                next.push((i, Some(same_host(r, &addr))));
                                true
                            }
                            None => false,
                        },
                    )
                });
                if let Err(e) = sent {
                    // The master may have failed over: read the table again next time (not
                    // for a SET cut off because its block changed: no fault of the master's).
                    // The other masters' commands still go (their hits are kept); the call
                    // fails.
                    let changed = idx
                        .iter()
                        .any(|&i| matches!(&cmds[i], Cmd::Set(_, v) if v.changed.get()));
                    if !changed {
                        tracing::debug!(error = %e, addr, "redis tier: a cluster master failed");
                        c.table.lock().stale = true;
                    }
                    failed.get_or_insert(e);
                }
            }
            let moved: Vec<(u16, String)> = next
                .iter()
                .filter_map(|(_, r)| match r {
                    Some(Redirect::Moved(s, a)) => Some((*s, a.clone())),
                    _ => None,
                })
                .collect();
            if !moved.is_empty() {
                let mut t = c.table.lock();
                if let Some(table) = &mut t.table {
                    let table = Arc::make_mut(table);
                    for (s, a) in &moved {
                        table.moved(*s, a);
                    }
                }
                // The rest of the table may be stale too: read it again at the next call.
                t.stale = true;
            }
            todo = next;
        }
        match failed {
            Some(e) => Err(e),
            None if todo.is_empty() => Ok(()),
            None => Err(bad(format!(
                "a command redirected more than {MAX_REDIRECTS} times"
            ))),
        }
    }

    /// Writes `cmd` as one command (`piece`: a SET's buffer, kept for the next).
    fn frame(&self, w: &mut dyn Write, cmd: &Cmd<'_>, piece: &mut Vec<u8>) -> io::Result<()> {
        let end = (HEADER - 1).to_string();
        match cmd {
            Cmd::Header(k) => frame(w, &[b"GETRANGE", k.as_bytes(), b"0", end.as_bytes()]),
            Cmd::Get(k, _) => frame(w, &[b"GET", k.as_bytes()]),
            Cmd::Set(k, v) => {
                let ttl = self.cfg.ttl_s.to_string();
                let n = if self.cfg.ttl_s > 0 { 5 } else { 3 };
                write!(
                    w,
                    "*{n}\r\n$3\r\nSET\r\n${}\r\n{k}\r\n${}\r\n",
                    k.len(),
                    v.len()
                )?;
                v.send(w, piece)?;
                w.write_all(b"\r\n")?;
                if self.cfg.ttl_s > 0 {
                    write!(w, "$2\r\nEX\r\n${}\r\n{ttl}\r\n", ttl.len())?;
                }
                Ok(())
            }
        }
    }

    /// A value's header (`v`, its first [`HEADER`] bytes), found under `key`'s name: its
    /// length, checksum and namespace, if it is kvtier's and `key`'s. A value that names
    /// another key is a miss; a read (`read`) counts it with the checksum failures (a
    /// lookup, which may ask for it again and again, only logs it).
    fn header(&self, key: &BlockKey, v: &[u8], read: bool) -> Option<(u32, u64, u16)> {
        if v.len() < HEADER || &v[..4] != MAGIC {
            return None;
        }
        let len = u32::from_le_bytes(v[4..8].try_into().ok()?);
        let sum = u64::from_le_bytes(v[8..16].try_into().ok()?);
        let fp = crate::wire::fingerprint(&v[16..32])?;
        let named = u128::from_le_bytes(v[32..48].try_into().ok()?);
        if named != key.0 {
            let named = BlockKey(named);
            if read {
                self.stats.checksum_failures.fetch_add(1, Relaxed);
                tracing::warn!(%key, %named, "redis tier: a value under this key's name is another key's: a miss");
            } else {
                tracing::debug!(%key, %named, "redis tier: a value under this key's name is another key's");
            }
            return None;
        }
        let ns = self.ns.id_of(&fp)?;
        Some((len, sum, ns))
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
        let mut out = vec![None; keys.len()];
        let res = self.run(&cmds, &mut |i, head, body| {
            if let Head::Bulk(_) = head {
                let mut h = Vec::with_capacity(HEADER);
                body.take(HEADER as u64).read_to_end(&mut h)?;
                out[i] = self
                    .header(&keys[i], &h, false)
                    .map(|(len, checksum, ns)| BlockInfo { len, ns, checksum });
            }
            Ok(())
        });
        if let Err(e) = res {
            // The headers read before the failure stand (each checked against its key; a
            // read checks the value again): one master down costs only its keys.
            tracing::debug!(error = %e, "redis tier: lookup failed (misses from there)");
        }
        out
    }

    fn pin(&self, _key: &BlockKey) -> bool {
        false
    }

    fn unpin(&self, _key: &BlockKey) {}

    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        self.stats.reads.fetch_add(1, Relaxed);
        let names: Vec<String> = items.iter().map(|it| self.name(&it.key)).collect();
        let cmds: Vec<Cmd<'_>> = names
            .iter()
            .zip(&items)
            .map(|(n, it)| Cmd::Get(n, it.buf.cap()))
            .collect();
        // Each value is read straight into its block's slot and checked there: verified
        // blocks stay hits if a later reply fails, the rest are misses.
        let mut out = vec![ReadOutcome::Miss; items.len()];
        let res = self.run(&cmds, &mut |i, head, body| {
            let it = &items[i];
            let Head::Bulk(n) = head else {
                return Ok(());
            };
            let mut h = [0u8; HEADER];
            if n < HEADER {
                return Ok(());
            }
            body.read_exact(&mut h)?;
            let Some((len, sum, ns)) = self.header(&it.key, &h, true) else {
                return Ok(());
            };
            if n - HEADER != len as usize || len as usize > it.buf.cap() {
                self.stats.checksum_failures.fetch_add(1, Relaxed);
                return Ok(());
            }
            // SAFETY: the buffer is the block's reserved host slot (or an owned buffer),
            // `cap` >= len bytes, ours alone until this call returns.
            let dst = unsafe { std::slice::from_raw_parts_mut(it.buf.as_ptr(), len as usize) };
            body.read_exact(dst)?;
            if kvstore::checksum(dst) != sum {
                self.stats.checksum_failures.fetch_add(1, Relaxed);
                tracing::warn!(key = %it.key, "redis tier: a block failed its checksum: a miss");
                return Ok(());
            }
            self.stats.bytes_read.fetch_add(u64::from(len), Relaxed);
            out[i] = ReadOutcome::Hit(BlockInfo {
                len,
                ns,
                checksum: sum,
            });
            Ok(())
        });
        if let Err(e) = res {
            self.stats.read_errors.fetch_add(1, Relaxed);
            tracing::debug!(error = %e, "redis tier: read failed (misses)");
        }
        out
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
            let mut head = [0u8; HEADER];
            head[..4].copy_from_slice(MAGIC);
            head[4..8].copy_from_slice(&it.len.to_le_bytes());
            head[8..16].copy_from_slice(&it.checksum.to_le_bytes());
            head[16..32].copy_from_slice(&crate::wire::fp_bytes(fp));
            head[32..].copy_from_slice(&it.key.0.to_le_bytes());
            // SAFETY: the block's slot is pinned by the caller for this call, `len` <= cap.
            let src = unsafe { std::slice::from_raw_parts(it.buf.as_ptr(), it.len as usize) };
            names.push(self.name(&it.key));
            vals.push(Value {
                head,
                src,
                sum: it.checksum,
                changed: Default::default(),
            });
            idx.push(i);
        }
        if idx.is_empty() {
            return out;
        }
        // Written once its SET answered OK; a SET with no answer (the call failed first) failed.
        for &i in &idx {
            out[i] = WriteOutcome::Failed;
        }
        // Checked against the commit checksum as it is sent: a slot an engine wrote into after
        // its commit is never stored (`Corrupt`), and the SETs that call left unanswered are
        // sent again (each round settles at least the changed one, so it ends).
        let mut todo: Vec<usize> = (0..idx.len()).collect();
        while !todo.is_empty() {
            let cmds: Vec<Cmd<'_>> = todo
                .iter()
                .map(|&j| Cmd::Set(&names[j], &vals[j]))
                .collect();
            let res = self.run(&cmds, &mut |c, head, _| match head {
                Head::Simple => {
                    let i = idx[todo[c]];
                    out[i] = WriteOutcome::Written;
                    self.stats
                        .bytes_written
                        .fetch_add(u64::from(items[i].len), Relaxed);
                    Ok(())
                }
                _ => Err(bad("SET did not answer OK")),
            });
            let Err(e) = res else { break };
            let mut changed = false;
            for &j in &todo {
                if vals[j].changed.get() {
                    out[idx[j]] = WriteOutcome::Corrupt;
                    changed = true;
                }
            }
            if !changed {
                self.stats.write_errors.fetch_add(1, Relaxed);
                tracing::debug!(error = %e, "redis tier: write failed");
                break;
            }
            tracing::warn!("redis tier: a block's slot changed after its commit: not stored");
            todo.retain(|&j| out[idx[j]] == WriteOutcome::Failed);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn head(b: &[u8]) -> io::Result<Head> {
        read_head(&mut &b[..])
    }

    #[test]
    fn reply_heads_parse_and_bad_ones_are_named() {
        assert!(matches!(head(b"+OK\r\n"), Ok(Head::Simple)));
        assert!(matches!(head(b":12\r\n"), Ok(Head::Int)));
        assert!(matches!(head(b"$-1\r\n"), Ok(Head::Nil)));
        assert!(matches!(head(b"$70032\r\nKVT2"), Ok(Head::Bulk(70_032))));
        assert!(matches!(
            head(b"-OOM command not allowed\r\n"),
            Ok(Head::Error(t)) if t == "OOM command not allowed"
        ));
        for (bad, says) in [
            (&b""[..], "closed"),
            (b"$12", "cut short"),
            (b"$-5\r\n", "length -5"),
            (b"$1x\r\n", "\"1x\""),
            (b"\r\n", "empty"),
            (b"*2\r\n", "type '*'"),
        ] {
            let e = head(bad).err().unwrap();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            assert!(e.to_string().contains(says), "{e} (wanted {says:?})");
        }
        // A line longer than the limit is refused, not buffered on.
        let mut long = vec![b'+'; 10_000];
        long.extend_from_slice(b"\r\n");
        assert!(head(&long).is_err());
    }

    #[test]
    fn a_redirect_without_a_host_is_to_the_node_that_answered() {
        let moved = |a: &str| same_host(Redirect::Moved(7, a.into()), "10.0.0.2:7000");
        assert_eq!(moved(":7001"), Redirect::Moved(7, "10.0.0.2:7001".into()));
        assert_eq!(
            moved("10.0.0.3:7001"),
            Redirect::Moved(7, "10.0.0.3:7001".into())
        );
        // An IPv6 address as Redis writes it (no brackets) is not a bare port.
        assert_eq!(moved("::1:7001"), Redirect::Moved(7, "::1:7001".into()));
        let ask = same_host(Redirect::Ask(9, ":7002".into()), "[::1]:7000");
        assert_eq!(ask, Redirect::Ask(9, "[::1]:7002".into()));
    }

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut w = Vec::new();
        frame(&mut w, &[b"SET", b"k", b"\r\n\0", b"EX", b"60"]).unwrap();
        assert_eq!(
            w,
            b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n\r\n\0\r\n$2\r\nEX\r\n$2\r\n60\r\n"
        );
    }
}

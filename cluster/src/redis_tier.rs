//! The remote tier on an existing Redis or Valkey (standalone, or Redis Cluster) for operators
//! who already run one: each block is one binary value `KVT1 | len u32 | xxh3-64 u64 |
//! namespace fingerprint 16 B | payload` under `prefix + hex(key)` with a TTL. Lookups read
//! only the 32-byte headers (GETRANGE), reads and writes are pipelined (a round trip per
//! batch, or per 32 MiB of values, 8 MiB of GET replies); a value whose header or checksum
//! does not match is a miss, counted. The same [`LowerTier`] seam as the kvtierd peers' tier,
//! so the store does not know which it has.
//!
//! A standalone server is spoken to on sockets of our own (the `redis` crate parses the URL):
//! a call's pipelines are written and their replies read within one deadline
//! (`deadline::Deadlined`), so a server that trickles a reply (or reads a request slowly)
//! costs a call its deadline, never a reader held for as long as it likes (the crate's
//! connection sets a timeout per read only). Commands are framed here (RESP2 arrays of bulk
//! strings); a GET's value is read straight into its block's slot and a SET's is sent from
//! its slot a piece at a time, where the crate's pipelines copied each value three times
//! (puts 3.3–4 × faster, gets 4.1 × at 2 MiB and 1.7 × at 16 MiB, each at a plain client's
//! rate: bench/RESULTS.md). A Redis Cluster goes through the crate's cluster
//! connection (slot routing, redirections), with its timeout per read.

use std::fmt::Display;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use kvstore::{
    BlockInfo, BlockKey, Fingerprint, LowerTier, NsUsage, ReadItem, ReadOutcome, Tier, TierStats,
    WriteItem, WriteOutcome,
};
use parking_lot::Mutex;

use crate::deadline::{connect_any, resolve_all, Deadlined};

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
}

/// How one RESP2 reply starts (the replies the tier's commands get; an error reply fails the
/// call, as the crate's pipelines do).
#[derive(Debug)]
enum Head {
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
        b'-' => Err(io::Error::other(format!("redis: {text}"))),
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

impl Link {
    /// Writes a pipeline (`write` frames its commands) and hands each of its `n` replies to
    /// `reply`, all by `deadline`.
    fn exchange(
        &mut self,
        n: usize,
        deadline: Instant,
        write: impl FnOnce(&mut dyn Write) -> io::Result<()>,
        reply: &mut OnReply<'_>,
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
    let s = connect_any(&resolve_all(&name, deadline)?, deadline)?;
    s.set_nodelay(true)?;
    crate::wire::keepalive(&s)?;
    let mut link = Link { s };
    let r = &info.redis;
    let ok = |what: &'static str| {
        move |_: usize, head: Head, _: &mut dyn Read| match head {
            Head::Simple => Ok(()),
            _ => Err(bad(format!("{what} did not answer OK"))),
        }
    };
    if let Some(pw) = &r.password {
        let mut auth: Vec<&[u8]> = vec![b"AUTH"];
        if let Some(user) = &r.username {
            auth.push(user.as_bytes());
        }
        auth.push(pw.as_bytes());
        let sent = link.exchange(1, deadline, |w| frame(w, &auth), &mut ok("AUTH"));
        match sent {
            // A server older than Redis 6 takes a password only (as the crate did, again
            // without the user).
            Err(e) if auth.len() == 3 && e.to_string().contains("wrong number of arguments") => {
                let auth: [&[u8]; 2] = [b"AUTH", pw.as_bytes()];
                link.exchange(1, deadline, |w| frame(w, &auth), &mut ok("AUTH"))?;
            }
            other => other?,
        }
    }
    if r.db != 0 {
        let db = r.db.to_string();
        let select: [&[u8]; 2] = [b"SELECT", db.as_bytes()];
        link.exchange(1, deadline, |w| frame(w, &select), &mut ok("SELECT"))?;
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

    /// The value in one buffer (for the crate's pipelines), or `None` if the slot changed.
    fn to_vec(&self) -> Option<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        v[..HEADER].copy_from_slice(&self.head);
        if kvstore::copy_hashed(&mut v[HEADER..], self.src) != self.sum {
            self.changed.set(true);
            return None;
        }
        Some(v)
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
            let info = c.get_connection_info().clone();
            if !matches!(info.addr, redis::ConnectionAddr::Tcp(..)) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{}: only redis:// URLs (plain TCP) are supported",
                        cfg.urls[0]
                    ),
                ));
            }
            (Some(info), None)
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
        {
            let b = self.breaker.lock();
            if b.open_until.is_some_and(|t| Instant::now() < t) {
                return Err(io::Error::other("redis breaker open"));
            }
        }
        let res = self.connect(deadline).and_then(|mut c| {
            let out = match &mut c {
                Conn::Single(link) => {
                    let mut piece = Vec::new();
                    link.exchange(
                        cmds.len(),
                        deadline,
                        |w| {
                            cmds.iter()
                                .try_for_each(|cmd| self.frame(w, cmd, &mut piece))
                        },
                        reply,
                    )
                }
                Conn::Cluster(con) => {
                    let mut p = redis::cluster::cluster_pipe();
                    let mut changed = false;
                    for cmd in cmds {
                        match cmd {
                            Cmd::Header(k) => p.cmd("GETRANGE").arg(*k).arg(0).arg(HEADER - 1),
                            Cmd::Get(k, _) => p.cmd("GET").arg(*k),
                            Cmd::Set(k, v) => {
                                let Some(v) = v.to_vec() else {
                                    changed = true;
                                    break;
                                };
                                let c = p.cmd("SET").arg(*k).arg(v);
                                if self.cfg.ttl_s > 0 {
                                    c.arg("EX").arg(self.cfg.ttl_s);
                                }
                                c
                            }
                        };
                    }
                    if changed {
                        Err(bad("a block's slot changed after its commit: not stored"))
                    } else {
                        p.query::<Vec<redis::Value>>(con)
                            .map_err(err)
                            .and_then(|vals| replay(cmds.len(), vals, reply))
                    }
                }
            };
            if out.is_ok() {
                let mut pool = self.pool.lock();
                if pool.len() < 4 {
                    pool.push(c);
                }
            }
            out
        });
        // A slot an engine changed after its commit is that engine's fault, not Redis's.
        let changed = cmds
            .iter()
            .any(|c| matches!(c, Cmd::Set(_, v) if v.changed.get()));
        let mut b = self.breaker.lock();
        match &res {
            Ok(_) => *b = Breaker::default(),
            Err(_) if changed => {}
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

/// Hands the crate's replies to a pipeline (a Redis Cluster's) to `reply` as a standalone
/// server's are.
fn replay(n: usize, vals: Vec<redis::Value>, reply: &mut OnReply<'_>) -> io::Result<()> {
    if vals.len() != n {
        return Err(bad(format!("{} replies to {n} commands", vals.len())));
    }
    for (i, v) in vals.into_iter().enumerate() {
        match v {
            redis::Value::BulkString(b) => reply(i, Head::Bulk(b.len()), &mut &b[..])?,
            redis::Value::Nil => reply(i, Head::Nil, &mut io::empty())?,
            redis::Value::Okay | redis::Value::SimpleString(_) => {
                reply(i, Head::Simple, &mut io::empty())?
            }
            redis::Value::Int(_) => reply(i, Head::Int, &mut io::empty())?,
            other => return Err(bad(format!("an unexpected reply {other:?}"))),
        }
    }
    Ok(())
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
                    .header(&h)
                    .map(|(len, checksum, ns)| BlockInfo { len, ns, checksum });
            }
            Ok(())
        });
        if let Err(e) = res {
            tracing::debug!(error = %e, "redis tier: lookup failed (a miss)");
            return vec![None; keys.len()];
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
            let Some((len, sum, ns)) = self.header(&h) else {
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
            head[16..].copy_from_slice(&crate::wire::fp_bytes(fp));
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
        assert!(matches!(head(b"$70032\r\nKVT1"), Ok(Head::Bulk(70_032))));
        let e = head(b"-OOM command not allowed\r\n").unwrap_err();
        assert!(e.to_string().contains("OOM command not allowed"), "{e}");
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
    fn commands_are_arrays_of_bulk_strings() {
        let mut w = Vec::new();
        frame(&mut w, &[b"SET", b"k", b"\r\n\0", b"EX", b"60"]).unwrap();
        assert_eq!(
            w,
            b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n\r\n\0\r\n$2\r\nEX\r\n$2\r\n60\r\n"
        );
    }
}

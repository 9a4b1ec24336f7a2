//! The remote tier: a [`LowerTier`] whose blocks live on the other members of the cluster.
//! Blocking sockets (the store's tiering worker and the engine threads call it from their own
//! threads), a small pool of authenticated connections per peer, one deadline
//! (`cluster.timeout_ms`) per call, and a circuit breaker per peer: three failures in a row
//! open it (0.5 s, doubling to 30 s); when the pause ends a background probe, not an engine's
//! call, finds out whether the peer answers again.
//!
//! A call asks every peer it needs at once, each on a thread of its own with its own budget
//! inside the call's deadline: a peer that stalls costs its own keys and its own breaker
//! strike, never another peer's answer. A read or lookup that a peer misses, fails or does not
//! answer within its budget (half the deadline when there is somewhere else to ask) is asked
//! once more of the key's next candidate: its other owners, its owners under the previous
//! membership while a hand-off lasts (`cluster.handoff_ms`), then the next member in
//! rendezvous order, where a push goes when no owner took it. A block read from a peer is read
//! into its reserved host slot and checked against its xxh3 checksum before the store
//! publishes it; anything short of a whole, verified block is a miss.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvstore::{
    BlockInfo, BlockKey, Fingerprint, LatencyBuckets, LowerTier, NsUsage, ReadItem, ReadOutcome,
    Tier, TierStats, WriteItem, WriteOutcome,
};
use kvtier_proto::cluster::{request::Op, Auth, AuthReply, Block, Hello, Reply, Request};
use kvtier_proto::CLUSTER_VERSION;
use parking_lot::{Mutex, RwLock};

use crate::deadline::{connect_any, remaining, resolve_all, Deadlined};
use crate::placement::{Member, Placement};
use crate::wire::{self, PutOutcome};

/// Consecutive failures that open a peer's breaker.
const BREAKER_FAILURES: u32 = 3;
/// First and longest pause of an open breaker.
const BREAKER_MIN: Duration = Duration::from_millis(500);
const BREAKER_MAX: Duration = Duration::from_secs(30);
/// Longest a late push ([`RemoteTier::write_late`]) waits for the probe of an owner whose
/// breaker's pause has ended: a connection set up and authenticated (a few round trips and
/// a hash on loopback or a LAN). A peer slower than that is left to a background probe
/// with the whole `cluster.timeout_ms`, as for reads.
const PUSH_PROBE: Duration = Duration::from_millis(500);
/// Idle connections kept per peer.
const POOL: usize = 4;
/// Bytes read (and hashed) at a time.
const PIECE: usize = 256 << 10;
/// PUT requests written ahead of their replies.
const WINDOW: usize = 32;

/// How the remote tier reaches the cluster.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// This node's data-plane address as the members list names it.
    pub me: String,
    /// The members (this node included), with weights.
    pub members: Vec<Member>,
    /// The cluster secret ("" = none).
    pub secret: String,
    /// Deadline of every call (connect, request and reply).
    pub timeout: Duration,
    /// Owners per block (the first is asked first; pushes go to all of them).
    pub replicas: usize,
    /// After a membership change, how long the previous owners are still asked.
    pub handoff: Duration,
}

/// What one member holds of a prefix (see [`RemoteTier::node_prefixes`]).
#[derive(Clone, Debug, PartialEq)]
pub struct NodePrefix {
    /// Its data-plane address.
    pub addr: String,
    /// The tier of each leading block it holds.
    pub tiers: Vec<Tier>,
    /// Why it did not answer.
    pub error: Option<String>,
    /// Its expected seconds to bring those blocks into its host memory, and whether every tier
    /// involved was measured there (see `kvstore::Store::load_seconds`).
    pub load_seconds: f64,
    /// See `load_seconds`.
    pub load_measured: bool,
}

/// A peer's state, for `kvtier cluster` and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStatus {
    /// Its data-plane address.
    pub addr: String,
    /// `self`, `up` (answered last time), `down` (breaker open) or `unknown` (not asked yet).
    pub state: &'static str,
    /// Payload bytes received from it.
    pub bytes_in: u64,
    /// Payload bytes sent to it.
    pub bytes_out: u64,
    /// Requests that failed (timeout, refused, broken connection).
    pub failures: u64,
    /// Requests that succeeded.
    pub requests: u64,
}

#[derive(Default)]
struct Breaker {
    failures: u32,
    open_until: Option<Instant>,
    pause: Duration,
    ever_ok: bool,
    /// A probe of the peer is under way, in the background or on a late push's thread
    /// (see [`RemoteTier::usable`], [`RemoteTier::usable_now`]).
    probing: bool,
}

struct Peer {
    addr: String,
    pool: Mutex<Vec<TcpStream>>,
    breaker: Mutex<Breaker>,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    failures: AtomicU64,
    requests: AtomicU64,
}

impl Peer {
    fn new(addr: String) -> Self {
        Self {
            addr,
            pool: Mutex::default(),
            breaker: Mutex::default(),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        }
    }

    fn ok(&self) {
        self.requests.fetch_add(1, Relaxed);
        let mut b = self.breaker.lock();
        if b.open_until.is_some() {
            tracing::info!(peer = %self.addr, "cluster: peer answers again");
        }
        *b = Breaker {
            ever_ok: true,
            ..Default::default()
        };
    }

    fn failed(&self, e: &io::Error) {
        self.failures.fetch_add(1, Relaxed);
        self.pool.lock().clear();
        let mut b = self.breaker.lock();
        b.failures += 1;
        if b.failures >= BREAKER_FAILURES {
            b.pause = (b.pause * 2).clamp(BREAKER_MIN, BREAKER_MAX);
            b.open_until = Some(Instant::now() + b.pause);
            tracing::warn!(peer = %self.addr, error = %e, pause_ms = b.pause.as_millis() as u64,
                "cluster: peer keeps failing: not asked until the pause ends");
        } else {
            tracing::debug!(peer = %self.addr, error = %e, "cluster: request to peer failed");
        }
    }
}

#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    checksum_failures: AtomicU64,
}

/// The members, and the previous ones while a hand-off lasts.
struct View {
    now: Arc<Placement>,
    /// The placement before the last change, asked until the instant.
    prev: Option<(Arc<Placement>, Instant)>,
}

/// A caller's buffer (a reserved or pinned host slot), shared by the per-peer threads of one
/// call.
#[derive(Clone, Copy)]
struct Buf {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: the caller of `read`/`write` owns the buffers for the whole call (`IoBuf`'s
// contract); within a call a read slot is written by one peer thread at a time (each key is in
// one group per round, and a round's threads are joined before the next), and a write slot is
// only read.
unsafe impl Send for Buf {}
// SAFETY: as above: shared access is reads only, or writes by the one thread a round gives
// the key to.
unsafe impl Sync for Buf {}

/// Keys (positions in the caller's batch) grouped by the peer asked for them.
type Groups = Vec<(Arc<Peer>, Vec<usize>)>;

/// The remote tier (see the module docs).
pub struct RemoteTier {
    cfg: RemoteConfig,
    view: RwLock<View>,
    peers: RwLock<HashMap<String, Arc<Peer>>>,
    /// Namespace fingerprints by local id, and back.
    ns: crate::nsmap::NsMap,
    stats: Counters,
    next_id: AtomicU64,
    /// Read and write call latencies, microseconds.
    lat: Mutex<(Histogram<u64>, Histogram<u64>)>,
}

impl RemoteTier {
    /// A remote tier over `cfg.members`; `cfg.me` must be one of them.
    pub fn new(cfg: RemoteConfig) -> io::Result<Self> {
        if !cfg.members.iter().any(|m| m.addr == cfg.me) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "cluster.members does not name this node's cluster.listen ({})",
                    cfg.me
                ),
            ));
        }
        let t = Self {
            view: RwLock::new(View {
                now: Arc::new(Placement::new(cfg.members.clone())),
                prev: None,
            }),
            peers: RwLock::default(),
            ns: Default::default(),
            stats: Counters::default(),
            next_id: AtomicU64::new(1),
            lat: Mutex::new((hist()?, hist()?)),
            cfg,
        };
        t.sync_peers();
        Ok(t)
    }

    /// Replaces the members (membership changed); only blocks whose owner changed move. The
    /// previous owners are still asked for `cluster.handoff_ms` (blocks are where they were
    /// saved until engines save them again or a leaving node hands them over).
    pub fn set_members(&self, members: Vec<Member>) {
        let next = Placement::new(members);
        {
            let mut v = self.view.write();
            if v.now.members() == next.members() {
                return;
            }
            let old = std::mem::replace(&mut v.now, Arc::new(next));
            v.prev =
                (!self.cfg.handoff.is_zero()).then(|| (old, Instant::now() + self.cfg.handoff));
        }
        self.sync_peers();
    }

    /// The current placement.
    pub fn placement(&self) -> Arc<Placement> {
        self.view.read().now.clone()
    }

    /// The current placement and the previous one while its hand-off lasts.
    fn view(&self) -> (Arc<Placement>, Option<Arc<Placement>>) {
        let v = self.view.read();
        let prev = v
            .prev
            .as_ref()
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(p, _)| p.clone());
        (v.now.clone(), prev)
    }

    fn sync_peers(&self) {
        let (now, prev) = self.view();
        let known = |a: &str| {
            now.members().iter().any(|m| m.addr == a)
                || prev
                    .as_ref()
                    .is_some_and(|p| p.members().iter().any(|m| m.addr == a))
        };
        let mut peers = self.peers.write();
        for m in now
            .members()
            .iter()
            .chain(prev.iter().flat_map(|p| p.members()))
        {
            if m.addr != self.cfg.me && !peers.contains_key(&m.addr) {
                peers.insert(m.addr.clone(), Arc::new(Peer::new(m.addr.clone())));
            }
        }
        peers.retain(|a, _| known(a));
    }

    /// Every member's state.
    pub fn peers(&self) -> Vec<PeerStatus> {
        let p = self.placement();
        let peers = self.peers.read();
        p.members()
            .iter()
            .map(|m| match peers.get(&m.addr) {
                None => PeerStatus {
                    addr: m.addr.clone(),
                    state: "self",
                    bytes_in: 0,
                    bytes_out: 0,
                    failures: 0,
                    requests: 0,
                },
                Some(peer) => {
                    let b = peer.breaker.lock();
                    let state = if b.open_until.is_some_and(|t| Instant::now() < t) {
                        "down"
                    } else if b.failures > 0 {
                        "failing"
                    } else if b.ever_ok {
                        "up"
                    } else {
                        "unknown"
                    };
                    PeerStatus {
                        addr: m.addr.clone(),
                        state,
                        bytes_in: peer.bytes_in.load(Relaxed),
                        bytes_out: peer.bytes_out.load(Relaxed),
                        failures: peer.failures.load(Relaxed),
                        requests: peer.requests.load(Relaxed),
                    }
                }
            })
            .collect()
    }

    /// Where to look for `key`, best first, this node and peers whose breaker is open left
    /// out: its owners, its owners under the previous membership (during a hand-off), then the
    /// next member in rendezvous order (where a push goes when no owner took it).
    fn candidates(
        &self,
        now: &Placement,
        prev: Option<&Placement>,
        key: &BlockKey,
    ) -> Vec<Arc<Peer>> {
        let r = self.cfg.replicas.max(1);
        let owners = now.owners(key, r + 1);
        let (owners, spare) = owners.split_at(owners.len().min(r));
        let mut addrs: Vec<&str> = owners
            .iter()
            .map(|&i| now.members()[i].addr.as_str())
            .collect();
        if let Some(p) = prev {
            addrs.extend(
                p.owners(key, r)
                    .iter()
                    .map(|&i| p.members()[i].addr.as_str()),
            );
        }
        addrs.extend(spare.iter().map(|&i| now.members()[i].addr.as_str()));
        let mut out: Vec<Arc<Peer>> = Vec::new();
        {
            let peers = self.peers.read();
            for a in addrs {
                if a != self.cfg.me && !out.iter().any(|p| p.addr == a) {
                    out.extend(peers.get(a).cloned());
                }
            }
        }
        // (Outside the peers' lock: an open breaker may start its probe here.)
        out.retain(|p| self.usable(p));
        out
    }

    /// Where a push of `key` goes: its owners other than this node (`None` where the breaker is
    /// open), and the member a block no owner took goes to instead (`None` when that is this
    /// node or its breaker is open).
    /// With `probe`, a peer whose breaker's pause has ended is probed on this thread
    /// ([`RemoteTier::usable_now`]).
    fn push_targets(
        &self,
        p: &Placement,
        key: &BlockKey,
        probe: bool,
    ) -> (Vec<Option<Arc<Peer>>>, Option<Arc<Peer>>) {
        let r = self.cfg.replicas.max(1);
        let all = p.owners(key, r + 1);
        // Each member other than this node, if known (under the peers' lock), and usable
        // (outside it: an open breaker may start its probe).
        let known: Vec<Option<Option<Arc<Peer>>>> = {
            let peers = self.peers.read();
            all.iter()
                .map(|&i| {
                    let a = &p.members()[i].addr;
                    (*a != self.cfg.me).then(|| peers.get(a).cloned())
                })
                .collect()
        };
        let mut picked = known.into_iter().map(|k| {
            k.map(|peer| {
                peer.filter(|q| {
                    if probe {
                        self.usable_now(q)
                    } else {
                        self.usable(q)
                    }
                })
            })
        });
        let owners = picked.by_ref().take(r).flatten().collect();
        let spare = picked.next().flatten().flatten();
        (owners, spare)
    }

    fn connect(&self, peer: &Peer, deadline: Instant) -> io::Result<TcpStream> {
        if let Some(c) = peer.pool.lock().pop() {
            return Ok(c);
        }
        connect_to(&peer.addr, &self.cfg.secret, &self.cfg.me, deadline)
    }

    /// Whether `peer` may be asked now. A peer whose breaker is open is not; once its pause
    /// ended, one probe in the background (a connection set up and authenticated) decides:
    /// answered, the breaker closes (the connection goes to the pool); not, the pause doubles.
    /// Only the strikes that opened the breaker ever cost a caller a wait (and a late push's
    /// probe, [`RemoteTier::usable_now`], its pusher).
    fn usable(&self, peer: &Arc<Peer>) -> bool {
        if let Some(usable) = Self::probe_due(peer) {
            return usable;
        }
        self.probe_in_background(peer);
        false
    }

    /// Probes `peer` (marked probing) in a thread of its own, within `cluster.timeout_ms`.
    fn probe_in_background(&self, peer: &Arc<Peer>) {
        let (p, secret, me) = (peer.clone(), self.cfg.secret.clone(), self.cfg.me.clone());
        let timeout = self.cfg.timeout;
        let spawned = std::thread::Builder::new()
            .name("kvtier-probe".into())
            .spawn(move || probe(&p, &secret, &me, Instant::now() + timeout));
        if let Err(e) = spawned {
            // Not probed: as if it failed (the pause doubles; no one pays for it again
            // before the next pause ends).
            peer.failed(&e);
            peer.breaker.lock().probing = false;
        }
    }

    /// [`RemoteTier::usable`] for a late push (the pusher's thread, which no engine waits
    /// on): a peer whose breaker's pause has ended is probed here, for at most
    /// [`PUSH_PROBE`], and asked if it answered. So a late try that finds its owner back
    /// goes through, where a probe in the background would count it failed while it runs
    /// (and the next try comes 4× later, or never). A peer that refuses counts a failure,
    /// as a background probe's would. One that does not answer in time is left to a
    /// background probe with the whole timeout, so the shorter wait here never doubles a
    /// pause that reads then live with. A peer gone silent so holds up the pusher
    /// [`PUSH_PROBE`] once per pause, and only when a late try comes due.
    fn usable_now(&self, peer: &Arc<Peer>) -> bool {
        if let Some(usable) = Self::probe_due(peer) {
            return usable;
        }
        let deadline = Instant::now() + self.cfg.timeout.min(PUSH_PROBE);
        match connect_to(&peer.addr, &self.cfg.secret, &self.cfg.me, deadline) {
            Ok(c) => {
                peer.ok();
                peer.pool.lock().push(c);
                peer.breaker.lock().probing = false;
                true
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                // Still marked probing: the background probe takes over.
                self.probe_in_background(peer);
                false
            }
            Err(e) => {
                peer.failed(&e);
                peer.breaker.lock().probing = false;
                false
            }
        }
    }

    /// Whether `peer`'s breaker lets it be asked (`Some`), or `None`: its pause has ended
    /// and the caller is to probe it (marked as probing, so no one else does).
    fn probe_due(peer: &Peer) -> Option<bool> {
        let mut b = peer.breaker.lock();
        let Some(until) = b.open_until else {
            return Some(true);
        };
        if b.probing || Instant::now() < until {
            return Some(false);
        }
        b.probing = true;
        None
    }

    /// Sends one request of `op` for `keys` (no payload) to `peer` on a fresh or pooled
    /// connection and reads its reply header.
    fn ask(
        &self,
        peer: &Peer,
        op: Op,
        keys: &[BlockKey],
        deadline: Instant,
    ) -> io::Result<(TcpStream, Reply)> {
        let id = self.id();
        let req = Request {
            id,
            op: op as i32,
            keys: wire::pack_keys(keys),
            blocks: Vec::new(),
        };
        let mut c = self.connect(peer, deadline)?;
        Deadlined::new(&c, deadline).write_all(&wire::encode_header(&req))?;
        let r = Self::reply(&mut c, id, keys.len(), deadline)?;
        Ok((c, r))
    }

    /// Runs `f` for every group, each peer on a thread of its own (the first on the caller's):
    /// one peer's stall is its own.
    fn fan_out<T: Send>(
        groups: &[(Arc<Peer>, Vec<usize>)],
        f: impl Fn(&Arc<Peer>, &[usize]) -> T + Sync,
    ) -> Vec<T> {
        let Some(((p0, i0), rest)) = groups.split_first() else {
            return Vec::new();
        };
        if rest.is_empty() {
            return vec![f(p0, i0)];
        }
        std::thread::scope(|s| {
            let f = &f;
            let spawned: Vec<_> = rest
                .iter()
                .map(|(p, i)| {
                    std::thread::Builder::new()
                        .name("kvtier-remote".into())
                        .spawn_scoped(s, move || f(p, i))
                        .map_err(|_| (p, i))
                })
                .collect();
            let mut out = vec![f(p0, i0)];
            for h in spawned {
                out.push(match h {
                    Ok(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                    // No thread to be had: asked from this one.
                    Err((p, i)) => f(p, i),
                });
            }
            out
        })
    }

    /// Reads the reply to request `id` on `c`.
    fn reply(c: &mut TcpStream, id: u64, n: usize, deadline: Instant) -> io::Result<Reply> {
        let r: Reply = wire::read_header(&mut Deadlined::new(c, deadline))?;
        if r.id != id {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply {} to request {id}", r.id),
            ));
        }
        if !r.error.is_empty() {
            return Err(io::Error::other(r.error));
        }
        if r.blocks.len() != n && r.outcomes.len() != n {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "reply does not answer every key",
            ));
        }
        Ok(r)
    }

    /// Records a request's outcome on `peer`; a connection that served it goes back to the
    /// pool.
    fn done(&self, peer: &Peer, conn: Option<TcpStream>, res: &io::Result<()>) {
        match res {
            Ok(()) => {
                peer.ok();
                if let Some(c) = conn {
                    let mut pool = peer.pool.lock();
                    if pool.len() < POOL {
                        pool.push(c);
                    }
                }
            }
            Err(e) => peer.failed(e),
        }
    }

    /// The two rounds of a read or lookup: positions `todo` grouped by their first candidate,
    /// then by their next. `ask` runs one group against its peer within a deadline and
    /// returns the positions it answered; the rest go to the next round. Round one's budget is
    /// half the deadline when any key has somewhere else to go.
    fn two_rounds(
        &self,
        keys: &[BlockKey],
        ask: impl Fn(&Arc<Peer>, &[usize], Instant) -> Vec<usize> + Sync,
    ) -> bool {
        self.rounds(keys, 2, ask)
    }

    /// [`RemoteTier::two_rounds`] with at most `rounds` rounds.
    fn rounds(
        &self,
        keys: &[BlockKey],
        rounds: usize,
        ask: impl Fn(&Arc<Peer>, &[usize], Instant) -> Vec<usize> + Sync,
    ) -> bool {
        let (now, prev) = self.view();
        let cands: Vec<Vec<Arc<Peer>>> = keys
            .iter()
            .map(|k| self.candidates(&now, prev.as_deref(), k))
            .collect();
        let started = Instant::now();
        let deadline = started + self.cfg.timeout;
        let mut todo: Vec<usize> = (0..keys.len()).filter(|&i| !cands[i].is_empty()).collect();
        let mut answered = vec![false; keys.len()];
        for round in 0..rounds {
            let groups = group_by(todo.iter().filter_map(|&i| Some((cands[i].get(round)?, i))));
            if groups.is_empty() {
                return round > 0;
            }
            let more = round + 1 < rounds && todo.iter().any(|&i| cands[i].len() > 1);
            let budget = if more {
                started + self.cfg.timeout / 2
            } else {
                deadline
            };
            for i in Self::fan_out(&groups, |p, idx| ask(p, idx, budget))
                .into_iter()
                .flatten()
            {
                answered[i] = true;
            }
            todo.retain(|&i| !answered[i]);
        }
        true
    }

    /// For routers: the longest run of leading `keys` each other member holds in its own
    /// tiers, with the tier of each block; one EXISTS to every member, each on its own thread
    /// (one round trip, bounded by the deadline). A member that fails answers with its error.
    pub fn node_prefixes(&self, keys: &[BlockKey]) -> Vec<NodePrefix> {
        let deadline = Instant::now() + self.cfg.timeout;
        let all: Vec<Arc<Peer>> = {
            let p = self.placement();
            let peers = self.peers.read();
            p.members()
                .iter()
                .filter_map(|m| peers.get(&m.addr).cloned())
                .collect()
        };
        let (asked, paused): (Vec<Arc<Peer>>, Vec<Arc<Peer>>) =
            all.into_iter().partition(|peer| self.usable(peer));
        let mut out: Vec<NodePrefix> = paused
            .iter()
            .map(|peer| NodePrefix {
                addr: peer.addr.clone(),
                tiers: Vec::new(),
                error: Some("breaker open: the peer keeps failing".into()),
                load_seconds: 0.0,
                load_measured: false,
            })
            .collect();
        let groups: Groups = asked.into_iter().map(|p| (p, Vec::new())).collect();
        out.extend(Self::fan_out(&groups, |peer, _| {
            let mut tiers = Vec::new();
            let mut cost = (0.0, false);
            let (conn, res) = match self.ask(peer, Op::Exists, keys, deadline) {
                Ok((c, r)) => {
                    cost = (r.load_seconds, r.load_measured);
                    tiers = r
                        .blocks
                        .iter()
                        .take_while(|b| b.present)
                        .map(|b| if b.tier == 1 { Tier::Host } else { Tier::Disk })
                        .collect();
                    (Some(c), Ok(()))
                }
                Err(e) => (None, Err(e)),
            };
            let error = res.as_ref().err().map(|e| e.to_string());
            self.done(peer, conn, &res);
            NodePrefix {
                addr: peer.addr.clone(),
                tiers,
                error,
                load_seconds: cost.0,
                load_measured: cost.1,
            }
        }));
        out.sort_by(|a, b| a.addr.cmp(&b.addr));
        out
    }

    /// Reads the blocks `idx` of `items` from `peer` into their buffers: the positions it
    /// served whole and verified, with their info (an error: none of them).
    fn get_from(
        &self,
        peer: &Peer,
        idx: &[usize],
        keys: &[BlockKey],
        bufs: &[Buf],
        deadline: Instant,
    ) -> io::Result<(TcpStream, Vec<(usize, BlockInfo)>)> {
        let ask: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
        let (c, r) = self.ask(peer, Op::Get, &ask, deadline)?;
        let mut hits = Vec::new();
        // Every payload by the deadline, however the peer paces them.
        let mut rd = Deadlined::new(&c, deadline);
        // Present blocks come first, their payloads in order.
        for (&i, b) in idx.iter().zip(&r.blocks) {
            if !b.present {
                break;
            }
            let len = b.len as usize;
            if wire::key16(&b.key) != Some(keys[i]) || len == 0 || len > bufs[i].cap {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a block that does not fit its slot",
                ));
            }
            // SAFETY: the buffer is the block's reserved host slot (or an owned buffer), `cap`
            // >= `len` bytes, written by this thread alone this round (`Buf`); engines map the
            // arena writable, so it is never a `&mut [u8]`.
            let dst = unsafe { kvstore::ArenaSlice::new(bufs[i].ptr, len) };
            // Each piece arrives in private memory and is hashed there (in cache), then copied
            // into the slot.
            let mut h = kvstore::Checksummer::new();
            let mut piece = vec![0u8; PIECE.min(len)];
            let mut at = 0;
            while at < len {
                let n = PIECE.min(len - at);
                rd.read_exact(&mut piece[..n])?;
                h.update(&piece[..n]);
                // SAFETY: within the slot (above).
                unsafe { dst.write(at, &piece[..n]) };
                at += n;
            }
            peer.bytes_in.fetch_add(len as u64, Relaxed);
            self.stats.bytes_read.fetch_add(len as u64, Relaxed);
            if h.finish() != b.checksum {
                self.stats.checksum_failures.fetch_add(1, Relaxed);
                tracing::warn!(peer = %peer.addr, key = %keys[i],
                    "cluster: a block from a peer failed its checksum: a miss");
                continue;
            }
            if let Some(info) = info_of(b, self.local_ns(&b.fingerprint)) {
                hits.push((i, info));
            }
        }
        Ok((c, hits))
    }

    /// Pushes blocks `idx` of `items` to `peer`, pipelined: up to WINDOW PUTs are written
    /// before their replies are read, so the peer stores block i while this thread checks and
    /// sends block i+1. The outcome of each block it settled.
    fn push_to(
        &self,
        peer: &Peer,
        idx: &[usize],
        items: &[(BlockKey, u16, Buf, u32, u64)],
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
        deadline: Instant,
    ) -> Vec<(usize, WriteOutcome)> {
        let mut out = Vec::new();
        let mut conn: Option<TcpStream> = None;
        let mut pending: std::collections::VecDeque<(usize, u64)> = Default::default();
        let settle = |c: &mut TcpStream, (i, id): (usize, u64), out: &mut Vec<_>| {
            let r = Self::reply(c, id, 1, deadline)?;
            let o = match r.outcomes.first().map(|&o| PutOutcome::from_wire(o)) {
                Some(PutOutcome::Stored) => WriteOutcome::Written,
                Some(PutOutcome::Present) => WriteOutcome::Present,
                _ => WriteOutcome::Failed,
            };
            out.push((i, o));
            io::Result::Ok(())
        };
        let res = (|| -> io::Result<()> {
            for &i in idx {
                let (key, ns, buf, len, checksum) = items[i];
                if !still_wanted(&key) {
                    continue;
                }
                let Some(fp) = self.fp_of(ns) else {
                    out.push((i, WriteOutcome::Failed));
                    continue;
                };
                // SAFETY: the block's slot is pinned by the caller for this call, `len` <= cap;
                // engines map it writable: read through copies, never referenced.
                let shared = unsafe { kvstore::ArenaSlice::new(buf.ptr, len as usize) };
                let id = self.id();
                let req = Request {
                    id,
                    op: Op::Put as i32,
                    keys: Vec::new(),
                    blocks: vec![Block {
                        key: key.0.to_be_bytes().to_vec(),
                        present: true,
                        len,
                        checksum,
                        fingerprint: wire::fp_bytes(fp),
                        tier: 0,
                    }],
                };
                let c = match conn.as_mut() {
                    Some(c) => c,
                    None => conn.insert(self.connect(peer, deadline)?),
                };
                // The header and the payload by the deadline, however slowly the peer reads.
                let mut w = Deadlined::new(c, deadline);
                w.write_all(&wire::encode_header(&req))?;
                // Hashed as it leaves (the slot read once): a slot an engine wrote into after
                // its commit does not match its commit checksum, sent with it, so the owner
                // refuses it, and here it counts as damaged.
                if wire::send_arena_hashed(&mut w, shared)? != checksum {
                    out.push((i, WriteOutcome::Corrupt));
                }
                peer.bytes_out.fetch_add(u64::from(len), Relaxed);
                self.stats.bytes_written.fetch_add(u64::from(len), Relaxed);
                pending.push_back((i, id));
                while pending.len() > WINDOW {
                    if let Some(p) = pending.pop_front() {
                        settle(c, p, &mut out)?;
                    }
                }
            }
            if let Some(c) = conn.as_mut() {
                while let Some(p) = pending.pop_front() {
                    settle(c, p, &mut out)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = &res {
            self.stats.write_errors.fetch_add(1, Relaxed);
            tracing::debug!(peer = %peer.addr, error = %e, "cluster: push failed");
        }
        if conn.is_some() || res.is_err() {
            self.done(peer, conn, &res);
        }
        out
    }

    /// What the first reachable owner of each of `keys` holds (one round: no other candidate
    /// is asked), for a node handing its blocks over.
    pub fn held_by_owners(&self, keys: &[BlockKey]) -> Vec<Option<BlockInfo>> {
        self.lookup_rounds(keys, 1)
    }

    /// What the candidates of `keys` hold, asking at most `rounds` of them per key.
    fn lookup_rounds(&self, keys: &[BlockKey], rounds: usize) -> Vec<Option<BlockInfo>> {
        let out = Mutex::new(vec![None; keys.len()]);
        let asked = self.rounds(keys, rounds, |peer, idx, deadline| {
            let ask: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
            match self.ask(peer, Op::Exists, &ask, deadline) {
                Ok((c, r)) => {
                    self.done(peer, Some(c), &Ok(()));
                    let mut o = out.lock();
                    idx.iter()
                        .zip(&r.blocks)
                        .filter(|(&i, b)| wire::key16(&b.key) == Some(keys[i]))
                        .filter_map(|(&i, b)| {
                            o[i] = Some(info_of(b, self.local_ns(&b.fingerprint))?);
                            Some(i)
                        })
                        .collect()
                }
                Err(e) => {
                    self.done(peer, None, &Err(e));
                    Vec::new()
                }
            }
        });
        if asked {
            self.stats.lookups.fetch_add(1, Relaxed);
        }
        out.into_inner()
    }

    /// This node's data-plane address.
    pub fn me(&self) -> &str {
        &self.cfg.me
    }

    fn local_ns(&self, fp: &[u8]) -> Option<u16> {
        self.ns.id_of(&wire::fingerprint(fp)?)
    }

    fn fp_of(&self, ns: u16) -> Option<Fingerprint> {
        self.ns.fp_of(ns)
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }
}

/// Probes `peer` (its breaker marked probing): a connection set up and authenticated by
/// `deadline` closes the breaker (the connection goes to the pool); else the pause doubles.
fn probe(peer: &Peer, secret: &str, me: &str, deadline: Instant) {
    match connect_to(&peer.addr, secret, me, deadline) {
        Ok(c) => {
            peer.ok();
            peer.pool.lock().push(c);
        }
        Err(e) => peer.failed(&e),
    }
    peer.breaker.lock().probing = false;
}

/// A new connection to `addr`, set up and authenticated as `me` by `deadline`.
fn connect_to(addr: &str, secret: &str, me: &str, deadline: Instant) -> io::Result<TcpStream> {
    let s = connect_any(&resolve_all(addr, deadline)?, deadline)?;
    s.set_nodelay(true)?;
    wire::keepalive(&s)?;
    // Every frame of the handshake, both ways, by the deadline.
    let mut link = Deadlined::new(&s, deadline);
    let hello: Hello = wire::read_header(&mut link)?;
    if hello.version != CLUSTER_VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer speaks cluster protocol {}", hello.version),
        ));
    }
    wire::write_header(
        &mut link,
        &Auth {
            version: CLUSTER_VERSION,
            mac: wire::mac(secret, &hello.nonce),
            node: me.to_string(),
        },
    )?;
    let r: AuthReply = wire::read_header(&mut link)?;
    if !r.error.is_empty() {
        tracing::error!(peer = %addr, error = %r.error, "cluster: the peer refused this node");
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, r.error));
    }
    Ok(s)
}

/// Positions grouped by the peer they go to (first-seen order).
fn group_by<'a>(it: impl Iterator<Item = (&'a Arc<Peer>, usize)>) -> Groups {
    let mut groups: Groups = Vec::new();
    for (peer, i) in it {
        match groups.iter_mut().find(|(q, _)| Arc::ptr_eq(q, peer)) {
            Some((_, v)) => v.push(i),
            None => groups.push((peer.clone(), vec![i])),
        }
    }
    groups
}

fn hist() -> io::Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 60_000_000, 2).map_err(|e| io::Error::other(e.to_string()))
}

/// Which of two owners' answers to a push counts (the best).
fn rank(o: WriteOutcome) -> u8 {
    match o {
        WriteOutcome::Written => 5,
        WriteOutcome::Present => 4,
        WriteOutcome::Corrupt => 3,
        WriteOutcome::Failed => 2,
        WriteOutcome::Busy => 1,
        WriteOutcome::Cancelled => 0,
    }
}

fn info_of(b: &Block, ns: Option<u16>) -> Option<BlockInfo> {
    (b.present && b.len > 0 && b.len <= wire::MAX_BLOCK).then_some(BlockInfo {
        len: b.len,
        ns: ns?,
        checksum: b.checksum,
    })
}

impl RemoteTier {
    /// [`LowerTier::write`], and with `probe` [`LowerTier::write_late`]: owners whose
    /// breaker's pause has ended are probed on this thread ([`RemoteTier::usable_now`]).
    fn write_with(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
        probe: bool,
    ) -> Vec<WriteOutcome> {
        // Blocks this node owns alone are not pushed anywhere: "cancelled" (nothing to do).
        let mut out = vec![WriteOutcome::Cancelled; items.len()];
        let shared: Vec<(BlockKey, u16, Buf, u32, u64)> = items
            .iter()
            .map(|it| {
                let buf = Buf {
                    ptr: it.buf.as_ptr(),
                    cap: it.buf.cap(),
                };
                (it.key, it.ns, buf, it.len, it.checksum)
            })
            .collect();
        let p = self.placement();
        let targets: Vec<_> = items
            .iter()
            .map(|it| self.push_targets(&p, &it.key, probe))
            .collect();
        // From here: a late push's probes above are not the pushes' time (deadline,
        // latency).
        let now = Instant::now();
        let deadline = now + self.cfg.timeout;
        // Round one: every block to every owner but this node, each peer on its own thread.
        let groups = group_by(
            targets
                .iter()
                .enumerate()
                .flat_map(|(i, (owners, _))| owners.iter().flatten().map(move |p| (p, i))),
        );
        let settle = |out: &mut [WriteOutcome], results: Vec<Vec<(usize, WriteOutcome)>>| {
            for (i, o) in results.into_iter().flatten() {
                // With replicas, the best outcome of any owner counts.
                if rank(o) > rank(out[i]) {
                    out[i] = o;
                }
            }
        };
        // Round one gets half the deadline where a block has somewhere else to go.
        let first_by = if targets.iter().any(|(_, next)| next.is_some()) {
            now + self.cfg.timeout / 2
        } else {
            deadline
        };
        let shared = &shared;
        let push = |by: Instant| {
            move |peer: &Arc<Peer>, idx: &[usize]| self.push_to(peer, idx, shared, still_wanted, by)
        };
        settle(&mut out, Self::fan_out(&groups, push(first_by)));
        // Round two: a block no owner took (owner down, timed out, full) goes to the next
        // member in rendezvous order, where reads look next; when that is this node, or it is
        // down too, the block is busy (the pusher tries the owners again later).
        let mut spare = Vec::new();
        for (i, (owners, next)) in targets.iter().enumerate() {
            let taken = matches!(
                out[i],
                WriteOutcome::Written | WriteOutcome::Present | WriteOutcome::Corrupt
            );
            if owners.is_empty() || taken || !still_wanted(&items[i].key) {
                continue;
            }
            match next {
                Some(peer) if remaining(deadline).is_ok() => spare.push((peer, i)),
                _ => out[i] = WriteOutcome::Busy,
            }
        }
        let groups = group_by(spare.into_iter());
        settle(&mut out, Self::fan_out(&groups, push(deadline)));
        for (i, (owners, _)) in targets.iter().enumerate() {
            if !owners.is_empty()
                && out[i] == WriteOutcome::Cancelled
                && still_wanted(&items[i].key)
            {
                out[i] = WriteOutcome::Failed;
            }
        }
        self.stats.writes.fetch_add(1, Relaxed);
        let _ = self
            .lat
            .lock()
            .1
            .record((now.elapsed().as_micros() as u64).max(1));
        drop(items);
        out
    }
}

impl LowerTier for RemoteTier {
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
        self.lookup_rounds(keys, 2)
    }

    fn pin(&self, _key: &BlockKey) -> bool {
        // Peers' blocks cannot be leased from here: a lease covers local tiers only.
        false
    }

    fn unpin(&self, _key: &BlockKey) {}

    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        let started = Instant::now();
        let keys: Vec<BlockKey> = items.iter().map(|it| it.key).collect();
        let bufs: Vec<Buf> = items
            .iter()
            .map(|it| Buf {
                ptr: it.buf.as_ptr(),
                cap: it.buf.cap(),
            })
            .collect();
        let out = Mutex::new(vec![ReadOutcome::Miss; items.len()]);
        self.two_rounds(&keys, |peer, idx, deadline| {
            let res = self.get_from(peer, idx, &keys, &bufs, deadline);
            match res {
                Ok((c, hits)) => {
                    self.done(peer, Some(c), &Ok(()));
                    let mut o = out.lock();
                    hits.into_iter()
                        .map(|(i, info)| {
                            o[i] = ReadOutcome::Hit(info);
                            i
                        })
                        .collect()
                }
                Err(e) => {
                    // Nothing of a broken reply is served: its keys go to the next round.
                    self.stats.read_errors.fetch_add(1, Relaxed);
                    self.done(peer, None, &Err(e));
                    Vec::new()
                }
            }
        });
        self.stats.reads.fetch_add(1, Relaxed);
        let _ = self
            .lat
            .lock()
            .0
            .record((started.elapsed().as_micros() as u64).max(1));
        drop(items);
        out.into_inner()
    }

    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        self.write_with(items, still_wanted, false)
    }

    fn write_late(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        self.write_with(items, still_wanted, true)
    }

    fn remove(&self, _key: &BlockKey) -> bool {
        // A node removes only its own copies; the owner's copy ages out by its own policy.
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
        let (r, w, rl, wl) = {
            let l = self.lat.lock();
            let pct = |h: &Histogram<u64>| (h.value_at_quantile(0.5), h.value_at_quantile(0.99));
            (
                pct(&l.0),
                pct(&l.1),
                LatencyBuckets::from_hdr(&l.0),
                LatencyBuckets::from_hdr(&l.1),
            )
        };
        TierStats {
            tier: Some(Tier::Remote),
            engine: "tcp",
            queue_depth: POOL as u32,
            reads: s.reads.load(Relaxed),
            writes: s.writes.load(Relaxed),
            bytes_read: s.bytes_read.load(Relaxed),
            bytes_written: s.bytes_written.load(Relaxed),
            read_errors: s.read_errors.load(Relaxed),
            write_errors: s.write_errors.load(Relaxed),
            checksum_failures: s.checksum_failures.load(Relaxed),
            read_us: r,
            write_us: w,
            read_latency: rl,
            write_latency: wl,
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

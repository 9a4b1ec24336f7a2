//! The engine socket: one thread per connection (engines are few: one per GPU), blocking I/O.
//! A connection's reservations and leases die with it.

use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::{BlockKey, LeaseId, Namespace, NsId, Reservation, Reserve, StoreError, Tier};
use kvtier_ipc::{send_with_fd, unpack_keys, write_frame, MAX_FRAME};
use kvtier_proto::ipc::{self as pb, request, response};
use kvtier_proto::IPC_VERSION;
use prost::Message;

use crate::Daemon;

/// Most reservations one connection may hold.
const MAX_RESERVATIONS: usize = 1 << 16;
/// Most leases one connection may hold (the store's max_leases bounds all of them together).
const MAX_CONN_LEASES: usize = 1 << 12;
/// Longest lease or pin an engine may ask for (an hour).
const MAX_PIN_TTL_MS: u64 = 3_600_000;
/// Frames up to this size are not counted against server.max_inflight_frame_bytes.
const SMALL_FRAME: usize = 64 << 10;
/// Expired reservation tokens remembered per connection, to answer a late commit with an
/// error instead of "unknown".
const EXPIRED_MEMORY: usize = 1 << 12;

/// Accepts connections until shutdown.
pub fn serve(listener: UnixListener, d: Arc<Daemon>) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "engine socket: cannot poll for shutdown");
    }
    let mut workers = Vec::new();
    let max_pending = pending_cap(&d);
    while !d.stopping() {
        match listener.accept() {
            Ok((stream, _)) => {
                // Connections that have not said Hello have their own, smaller cap (and a
                // handshake deadline), so idle sockets cannot lock engines out.
                let refuse = if d.ipc_pending.load(Relaxed) >= max_pending {
                    Some("too many connections that have not sent Hello; try again")
                } else if d.ipc_clients.load(Relaxed) + d.ipc_pending.load(Relaxed)
                    >= u64::from(d.cfg.server.max_clients)
                {
                    Some("too many clients: raise server.max_clients")
                } else {
                    None
                };
                if let Some(why) = refuse {
                    tracing::warn!("engine socket: connection refused: {why}");
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                    let _ = write_frame(&mut &stream, &error_response(0, why));
                    continue;
                }
                let d = d.clone();
                d.ipc_pending.fetch_add(1, Relaxed);
                let spawned = std::thread::Builder::new()
                    .name("kvtierd-conn".into())
                    .spawn({
                        let d = d.clone();
                        move || {
                            let mut said_hello = false;
                            match Conn::new(&d, stream) {
                                Ok(mut c) => {
                                    if let Err(e) = c.run() {
                                        tracing::debug!(error = %e, "engine connection ended");
                                    }
                                    said_hello = c.hello;
                                }
                                Err(e) => tracing::debug!(error = %e, "engine connection failed"),
                            }
                            if said_hello {
                                d.ipc_clients.fetch_sub(1, Relaxed);
                            } else {
                                d.ipc_pending.fetch_sub(1, Relaxed);
                            }
                        }
                    });
                match spawned {
                    Ok(h) => workers.push(h),
                    Err(e) => {
                        d.ipc_pending.fetch_sub(1, Relaxed);
                        tracing::warn!(error = %e, "engine socket: cannot start a connection thread");
                    }
                }
                workers.retain(|w| !w.is_finished());
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!(error = %e, "engine socket accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    // In-flight requests finish; idle connections notice the shutdown within their poll.
    for w in workers {
        let _ = w.join();
    }
}

/// Connections allowed at once before their Hello.
fn pending_cap(d: &Daemon) -> u64 {
    (u64::from(d.cfg.server.max_clients) / 4).max(4)
}

/// The peer's uid and gid (SO_PEERCRED).
fn peer_cred(s: &UnixStream) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt on a valid socket fd into a properly sized, writable ucred.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.uid, cred.gid))
}

fn error_response(id: u64, msg: &str) -> pb::Response {
    pb::Response {
        id,
        error: msg.to_string(),
        body: None,
    }
}

fn tier(t: &Tier) -> i32 {
    match t {
        Tier::Disk => pb::Tier::Disk as i32,
        Tier::Remote => pb::Tier::Remote as i32,
        _ => pb::Tier::Host as i32,
    }
}

pub(crate) struct Conn<'d> {
    d: &'d Daemon,
    /// The store this connection's tenant owns (the shared one in shared isolation), known
    /// from Hello on.
    t: usize,
    store: &'static kvstore::Store,
    stream: UnixStream,
    reader: io::BufReader<UnixStream>,
    hello: bool,
    next_token: u64,
    /// Uncommitted slots: token → (reservation, when reserved).
    reservations: HashMap<u64, (Reservation, Instant)>,
    /// Tokens that expired uncommitted (most recent last), bounded.
    expired: std::collections::VecDeque<u64>,
    /// Their bytes (bounded to half the host tier per connection).
    reserved_bytes: u64,
    /// Leases held, with the blocks each pins.
    leases: HashMap<u64, u64>,
    /// Blocks pinned by those leases.
    pinned: u64,
    /// Namespace ids this connection registered.
    namespaces: HashSet<u32>,
    connected: Instant,
    /// Scopes this connection's preload tags.
    serial: u64,
}

impl<'d> Conn<'d> {
    pub(crate) fn new(d: &'d Daemon, stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_millis(200)))?;
        // A client that stops reading its replies cannot hold a worker (or shutdown) forever.
        stream.set_write_timeout(Some(Duration::from_secs(10)))?;
        Ok(Self {
            d,
            t: 0,
            store: d.store,
            reader: io::BufReader::with_capacity(64 << 10, stream.try_clone()?),
            stream,
            hello: false,
            next_token: 1,
            serial: d.next_conn_serial(),
            reservations: HashMap::new(),
            expired: std::collections::VecDeque::new(),
            reserved_bytes: 0,
            leases: HashMap::new(),
            pinned: 0,
            namespaces: HashSet::new(),
            connected: Instant::now(),
        })
    }

    /// Reads exactly `buf.len()` bytes. Before the first byte, a read timeout is a chance to
    /// notice shutdown (`Ok(false)`); after it, the frame is read to its end.
    fn read_full(&mut self, buf: &mut [u8], idle_ok: bool) -> io::Result<bool> {
        let mut got = 0;
        let start = Instant::now();
        while got < buf.len() {
            // A frame must arrive whole within 30 s (a trickling client cannot hold a worker),
            // and shutdown does not wait for half-sent frames.
            if got > 0 && (start.elapsed() > Duration::from_secs(30) || self.d.stopping()) {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "partial frame stalled or shutdown",
                ));
            }
            match self.reader.read(&mut buf[got..]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if got == 0 && idle_ok {
                        return Ok(false);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Drops reservations older than `server.reservation_ttl_ms`: a client that reserves and
    /// never commits cannot hold host memory forever.
    fn expire_reservations(&mut self) {
        let ttl = Duration::from_millis(self.d.cfg.server.reservation_ttl_ms);
        let before = self.reservations.len();
        let mut freed = 0u64;
        let mut gone = Vec::new();
        self.reservations.retain(|t, (r, at)| {
            let keep = at.elapsed() < ttl;
            if !keep {
                freed += r.len() as u64;
                gone.push(*t);
            }
            keep
        });
        for t in gone {
            if self.expired.len() == EXPIRED_MEMORY {
                self.expired.pop_front();
            }
            self.expired.push_back(t);
        }
        if before != self.reservations.len() {
            self.reserved_bytes -= freed;
            tracing::warn!(
                dropped = before - self.reservations.len(),
                "engine connection: uncommitted reservations expired"
            );
        }
    }

    pub(crate) fn run(&mut self) -> io::Result<()> {
        let hello_timeout = Duration::from_millis(self.d.cfg.server.hello_timeout_ms);
        loop {
            if self.d.stopping() {
                return Ok(());
            }
            if !self.hello && self.connected.elapsed() > hello_timeout {
                let _ = write_frame(
                    &mut &self.stream,
                    &error_response(0, "no Hello within server.hello_timeout_ms: closing"),
                );
                return Ok(());
            }
            self.expire_reservations();
            if self.reader.buffer().is_empty() {
                let spin = Duration::from_micros(self.d.cfg.server.spin_us);
                kvtier_ipc::spin_until_readable(&self.stream, spin);
            }
            let mut len = [0u8; 4];
            match self.read_full(&mut len, true) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
            let len = u32::from_le_bytes(len) as usize;
            if len > MAX_FRAME {
                // The stream cannot be resynchronised: say why, then close.
                self.d.ipc_errors.fetch_add(1, Relaxed);
                let msg = format!("frame of {len} bytes exceeds the {MAX_FRAME}-byte limit");
                tracing::warn!("engine connection: {msg}; closing it");
                let _ = write_frame(&mut &self.stream, &error_response(0, &msg));
                return Ok(());
            }
            // Frames in flight across all connections are bounded in bytes: clients that
            // each start an 8 MiB frame and trickle it cannot pin the daemon's memory.
            // Small frames (every Hello, lookups of a few hundred keys) always get in: only
            // large ones count against the budget.
            let budget = self.d.cfg.server.max_inflight_frame_bytes.0;
            let counted = if len > SMALL_FRAME { len as u64 } else { 0 };
            if self
                .d
                .frame_bytes
                .fetch_update(Relaxed, Relaxed, |b| {
                    (b + counted <= budget).then_some(b + counted)
                })
                .is_err()
            {
                self.d.ipc_errors.fetch_add(1, Relaxed);
                let msg = "the daemon is receiving too many large frames now (server.max_inflight_frame_bytes): retry";
                let _ = write_frame(&mut &self.stream, &error_response(0, msg));
                return Ok(());
            }
            let mut body = vec![0u8; len];
            let got = self.read_full(&mut body, false);
            self.d.frame_bytes.fetch_sub(counted, Relaxed);
            got?;
            let req = match pb::Request::decode(&body[..]) {
                Ok(r) => r,
                Err(e) => {
                    self.d.ipc_errors.fetch_add(1, Relaxed);
                    write_frame(
                        &mut &self.stream,
                        &error_response(0, &format!("malformed request: {e}")),
                    )?;
                    continue;
                }
            };
            let id = req.id;
            let start = Instant::now();
            let op = op_name(&req.body);
            let resp = match self.handle(req) {
                Ok(Some(body)) => pb::Response {
                    id,
                    error: String::new(),
                    body: Some(body),
                },
                Ok(None) => continue, // hello: already answered with the fd attached
                Err(msg) => {
                    self.d.ipc_errors.fetch_add(1, Relaxed);
                    error_response(id, &msg)
                }
            };
            write_frame(&mut &self.stream, &resp)?;
            self.d.record(op, start.elapsed());
        }
    }

    fn handle(&mut self, req: pb::Request) -> Result<Option<response::Body>, String> {
        let store = self.store;
        let Some(body) = req.body else {
            return Err("request without a body".into());
        };
        if !self.hello && !matches!(body, request::Body::Hello(_)) {
            return Err("send Hello first".into());
        }
        Ok(Some(match body {
            request::Body::Hello(h) => {
                if h.version != IPC_VERSION {
                    return Err(format!(
                        "protocol version {} is not supported (kvtierd speaks {IPC_VERSION}): use a kvtier package of the daemon's version",
                        h.version
                    ));
                }
                if self.hello {
                    return Err("Hello was sent already".into());
                }
                // The tenant decides which arena this client ever sees.
                let (uid, gid) = peer_cred(&self.stream).map_err(|e| e.to_string())?;
                self.t = self.d.tenant_of(&h.tenant_secret, uid, gid)?;
                self.store = self.d.store_at(self.t);
                let store = self.store;
                let tenant = self
                    .d
                    .tenants
                    .get(self.t)
                    .map(|t| t.cfg.name.clone())
                    .unwrap_or_default();
                let reply = pb::Response {
                    id: req.id,
                    error: String::new(),
                    body: Some(response::Body::Hello(pb::HelloReply {
                        version: IPC_VERSION,
                        arena_bytes: store.arena().len() as u64,
                        max_reserve_bytes: self.reserve_quota(),
                        max_keys: self.d.cfg.server.max_keys,
                        tenant: tenant.clone(),
                        reservation_ttl_ms: self.d.cfg.server.reservation_ttl_ms,
                        events: self.d.engine_hashes.is_some(),
                    })),
                };
                let mut frame = Vec::new();
                write_frame(&mut frame, &reply).map_err(|e| e.to_string())?;
                send_with_fd(&self.stream, &frame, store.arena().fd().as_raw_fd())
                    .map_err(|e| e.to_string())?;
                self.hello = true;
                self.d.ipc_pending.fetch_sub(1, Relaxed);
                self.d.ipc_clients.fetch_add(1, Relaxed);
                tracing::info!(client = %h.client, tenant = %tenant, "engine connected");
                return Ok(None);
            }
            request::Body::RegisterNamespace(r) => {
                let ns = Namespace::decode(&r.encoded).map_err(|e| e.to_string())?;
                let group = match r.group {
                    Some(g) => {
                        kvtier_ipc::check_kv_group(&g)?;
                        Some(crate::events::KvGroup {
                            idx: g.idx,
                            spec_kind: g.spec_kind,
                            sliding_window: g.sliding_window,
                        })
                    }
                    None => None,
                };
                let max = self.d.cfg.server.max_namespaces_per_connection as usize;
                let id = self.d.register_namespace(self.t, &ns, group, |id| {
                    if self.namespaces.contains(&id.0) || self.namespaces.len() < max {
                        Ok(())
                    } else {
                        Err(format!(
                            "this connection registered {max} namespaces already (server.max_namespaces_per_connection)"
                        ))
                    }
                })?;
                if self.namespaces.insert(id.0) {
                    self.d.hold_namespace(self.t, id, true);
                }
                response::Body::Namespace(pb::NamespaceReply { id: id.0 })
            }
            request::Body::Lookup(l) => {
                let ks = self.keys(&l.keys)?;
                if l.lease {
                    self.lease_room(ks.len())?;
                    let lease = store
                        .lease(&ks, self.ttl(l.ttl_ms))
                        .map_err(|e| e.to_string())?;
                    if let Some(id) = lease.id {
                        self.hold(id.0, lease.n);
                    }
                    response::Body::Lookup(pb::LookupReply {
                        n: lease.n as u32,
                        tiers: lease.tiers.iter().map(tier).collect(),
                        lease_id: lease.id.map_or(0, |i| i.0),
                        present: lease.n as u32,
                        pending: 0,
                    })
                } else {
                    let (m, present) =
                        store.match_prefix_priced(&ks, l.tokens_per_block, l.prefill_tokens_per_s);
                    response::Body::Lookup(pb::LookupReply {
                        n: m.n as u32,
                        tiers: m.tiers.iter().map(tier).collect(),
                        lease_id: 0,
                        present: present as u32,
                        pending: m.pending as u32,
                    })
                }
            }
            request::Body::Load(l) => {
                let ks = self.keys(&l.keys)?;
                self.lease_room(ks.len())?;
                let wait = if l.wait_ms == 0 {
                    self.d.cfg.load_wait()
                } else {
                    Duration::from_millis(l.wait_ms.min(600_000))
                };
                let (lease, locs) = store
                    .load_and_lease(&ks, self.ttl(l.ttl_ms), Instant::now() + wait)
                    .map_err(|e| e.to_string())?;
                if let Some(id) = lease.id {
                    self.hold(id.0, lease.n);
                }
                response::Body::Load(pb::LoadReply {
                    n: lease.n as u32,
                    offsets: locs.iter().map(|b| b.offset).collect(),
                    lens: locs.iter().map(|b| b.len).collect(),
                    checksums: locs.iter().map(|b| b.checksum).collect(),
                    lease_id: lease.id.map_or(0, |i| i.0),
                })
            }
            request::Body::Reserve(r) => {
                let ks = self.keys(&r.keys)?;
                if ks.len() != r.lens.len() {
                    return Err(format!("{} keys but {} lengths", ks.len(), r.lens.len()));
                }
                let want: u64 = r.lens.iter().map(|&l| u64::from(l)).sum();
                let quota = self.reserve_quota();
                if self.reserved_bytes + want > quota {
                    return Err(format!(
                        "this connection has {} bytes reserved and asks for {want} more; the limit is {quota} (half the host tier): commit or abort first, or reserve in chunks",
                        self.reserved_bytes
                    ));
                }
                if self.reservations.len() + ks.len() > MAX_RESERVATIONS {
                    return Err(format!(
                        "more than {MAX_RESERVATIONS} reservations outstanding: commit or abort first"
                    ));
                }
                let mut slots = Vec::with_capacity(ks.len());
                let mut made = Vec::new();
                // One deadline for the whole request: under pressure the first keys may wait
                // for room, the rest do not wait again.
                let deadline = Instant::now() + self.d.cfg.load_wait();
                for (k, &len) in ks.iter().zip(&r.lens) {
                    use pb::reserved_slot::Status;
                    let slot =
                        match store.reserve_until(NsId(r.namespace_id), *k, len as usize, deadline)
                        {
                            Ok(Reserve::Slot(res)) => {
                                let token = self.next_token;
                                self.next_token += 1;
                                let offset = res.arena_offset();
                                self.reserved_bytes += res.len() as u64;
                                self.reservations.insert(token, (res, Instant::now()));
                                made.push(token);
                                pb::ReservedSlot {
                                    status: Status::Slot as i32,
                                    offset,
                                    token,
                                }
                            }
                            Ok(Reserve::AlreadyPresent) => pb::ReservedSlot {
                                status: Status::Present as i32,
                                ..Default::default()
                            },
                            Ok(Reserve::InFlight) => pb::ReservedSlot {
                                status: Status::InFlight as i32,
                                ..Default::default()
                            },
                            Err(StoreError::NoSpace { .. }) => pb::ReservedSlot {
                                status: Status::NoSpace as i32,
                                ..Default::default()
                            },
                            Err(e) => {
                                for t in made {
                                    self.take(t);
                                }
                                return Err(format!("key {k}: {e}"));
                            }
                        };
                    slots.push(slot);
                }
                response::Body::Reserve(pb::ReserveReply { slots })
            }
            request::Body::Commit(c) => {
                // One per token; the engine's descriptions may also be absent.
                let n = c.tokens.len();
                for (what, len, optional) in [
                    ("checksums", c.checksums.len(), false),
                    ("engine hashes", c.engine_hashes.len(), true),
                    ("parent hashes", c.parent_hashes.len(), true),
                    ("token id lists", c.token_ids.len(), true),
                ] {
                    if len != n && !(optional && len == 0) {
                        return Err(format!("{n} tokens but {len} {what}"));
                    }
                }
                // Engine hashes matter only to the KV event publisher.
                let engine = self
                    .d
                    .engine_hashes
                    .as_ref()
                    .filter(|_| !c.engine_hashes.is_empty());
                if let Some(e) = engine {
                    e.note(
                        self.t,
                        c.tokens
                            .iter()
                            .zip(&c.engine_hashes)
                            .enumerate()
                            .filter_map(|(i, (t, h))| {
                                let (r, _) = self.reservations.get(t)?;
                                Some(crate::events::Described {
                                    key: r.key().0,
                                    hash: h.as_slice(),
                                    parent: c.parent_hashes.get(i).map(Vec::as_slice),
                                    tokens: c.token_ids.get(i).map(|t| t.ids.as_slice()),
                                })
                            }),
                    );
                }
                let mut reply = pb::CommitReply::default();
                for (t, sum) in c.tokens.into_iter().zip(c.checksums) {
                    match self.take(t) {
                        Some(r) => {
                            let key = r.key().0;
                            let stored = r.commit_with_checksum(sum).map_err(|e| e.to_string());
                            if stored != Ok(true) {
                                if let Some(e) = engine {
                                    e.abandon(self.t, key);
                                }
                            }
                            if stored? {
                                reply.committed += 1;
                            } else {
                                reply.cancelled.push(t);
                            }
                        }
                        None => {
                            // Expired (its slot may hold another block by now) or never ours:
                            // never a success.
                            if !self.expired.contains(&t) {
                                tracing::debug!(token = t, "commit of an unknown token");
                            }
                            reply.expired.push(t);
                        }
                    }
                }
                response::Body::Commit(reply)
            }
            request::Body::Abort(a) => {
                for t in a.tokens {
                    self.take(t);
                }
                response::Body::Empty(pb::Empty {})
            }
            request::Body::Release(r) => {
                let Some(n) = self.leases.remove(&r.lease_id) else {
                    return Err(format!(
                        "lease {} is not held by this connection",
                        r.lease_id
                    ));
                };
                self.pinned -= n;
                self.d.leases_held.fetch_sub(1, Relaxed);
                if !store.release(LeaseId(r.lease_id)) {
                    // It lapsed while the client held it: the slots may have been reused.
                    return Err(format!(
                        "lease {} expired before release: blocks copied under it may have been overwritten, discard them",
                        r.lease_id
                    ));
                }
                response::Body::Empty(pb::Empty {})
            }
            request::Body::Prefetch(p) => {
                let ks = self.keys(&p.keys)?;
                let priority = u8::try_from(p.priority)
                    .map_err(|_| format!("priority {} is not in 0..=255", p.priority))?;
                // Each engine connection hints within its share of the preload room (at least
                // an eighth: many small engines may overcommit, the store's own bound holds),
                // so one engine cannot hold the host memory or the waiting list the others
                // need.
                let engines = self.d.ipc_clients.load(Relaxed).clamp(1, 8);
                let quota = kvstore::PrefetchQuota {
                    owner: self.serial,
                    max_bytes: store.prefetch_max_held_bytes() / engines,
                    max_waiting_keys: kvstore::PREFETCH_WAITING_KEYS_MAX / engines as usize,
                };
                let r = store.prefetch_as(
                    &ks,
                    priority,
                    self.d.preload_deadline(p.deadline_ms),
                    crate::Daemon::preload_tag(self.serial, p.tag),
                    quota,
                );
                response::Body::Prefetch(pb::PrefetchReply {
                    present: r.present as u32,
                    in_host: r.in_host as u32,
                    joined: r.joined as u32,
                    queued: r.queued as u32,
                    dropped: r.dropped as u32,
                    held: r.held as u32,
                    waiting: r.waiting as u32,
                })
            }
            request::Body::CancelPrefetch(c) => {
                let n = store.cancel_prefetch_as(
                    crate::Daemon::preload_tag(self.serial, c.tag),
                    self.serial,
                );
                response::Body::CancelPrefetch(pb::CancelPrefetchReply {
                    cancelled: n as u32,
                })
            }
            request::Body::Retain(r) => {
                let ks = self.keys(&r.keys)?;
                let priority = u8::try_from(r.priority)
                    .map_err(|_| format!("priority {} is not in 0..=255", r.priority))?;
                let out = store.retain(
                    (!r.session.is_empty()).then_some(r.session.as_str()),
                    &ks,
                    self.d.retain_ttl(r.ttl_ms),
                    priority,
                );
                response::Body::Retain(crate::retain_reply(&out))
            }
            request::Body::Demote(r) => {
                let ks = self.keys(&r.keys)?;
                let out = store.demote((!r.session.is_empty()).then_some(r.session.as_str()), &ks);
                response::Body::Demote(pb::DemoteReply {
                    released: out.released as u32,
                    freed: out.freed as u32,
                    queued: out.queued as u32,
                    busy: out.busy as u32,
                    not_in_host: out.not_in_host as u32,
                    kept: out.kept as u32,
                })
            }
            request::Body::Pin(p) => {
                let mut ks = self.keys(&p.keys)?;
                let mut reply = pb::PinReply::default();
                if p.ttl_ms > MAX_PIN_TTL_MS {
                    reply.clipped_by.push("ttl".into());
                }
                let ttl = self.ttl(p.ttl_ms);
                reply.ttl_ms = ttl.as_millis() as u64;
                // What the connection may still pin: the leading keys that fit.
                let max_pinned = self.d.cfg.server.max_pinned_per_connection;
                let room = max_pinned.saturating_sub(self.pinned) as usize;
                if ks.len() > room {
                    reply.clipped = (ks.len() - room) as u32;
                    reply
                        .clipped_by
                        .push("server.max_pinned_per_connection".into());
                    ks.truncate(room);
                }
                if ks.is_empty() {
                    reply.refused = if reply.clipped > 0 {
                        format!("this connection pins {} blocks, the most server.max_pinned_per_connection allows: release some first", self.pinned)
                    } else {
                        "no keys".into()
                    };
                    return Ok(Some(response::Body::Pin(reply)));
                }
                if let Err(why) = self.lease_room(ks.len()) {
                    reply.refused = why;
                    return Ok(Some(response::Body::Pin(reply)));
                }
                match store.lease(&ks, ttl) {
                    Ok(lease) => {
                        if let Some(id) = lease.id {
                            self.hold(id.0, lease.n);
                        }
                        reply.n = lease.n as u32;
                        reply.tiers = lease.tiers.iter().map(tier).collect();
                        reply.lease_id = lease.id.map_or(0, |i| i.0);
                    }
                    Err(e) => reply.refused = e.to_string(),
                }
                response::Body::Pin(reply)
            }
            request::Body::Stats(_) => {
                let s = store.stats();
                response::Body::Stats(pb::StatsReply {
                    capacity_bytes: s.capacity_bytes,
                    used_bytes: s.used_bytes,
                    blocks: s.blocks,
                    hits: s.hits,
                    misses: s.misses,
                    leases: s.leases,
                })
            }
        }))
    }

    /// Keys of a request, checked against the per-request bound.
    fn keys(&self, packed: &[u8]) -> Result<Vec<BlockKey>, String> {
        let ks = unpack_keys(packed)?;
        let max = self.d.cfg.server.max_keys as usize;
        if ks.len() > max {
            return Err(format!(
                "{} keys in one request; the limit is {max} (server.max_keys): split the request",
                ks.len()
            ));
        }
        Ok(ks)
    }

    /// Bytes one connection may hold reserved at once.
    fn reserve_quota(&self) -> u64 {
        self.store.capacity_bytes() / 2
    }

    /// Removes a reservation from the books (committing or dropping it is the caller's).
    fn take(&mut self, token: u64) -> Option<Reservation> {
        let (r, _) = self.reservations.remove(&token)?;
        self.reserved_bytes -= r.len() as u64;
        Some(r)
    }

    /// Whether this connection may take one more lease of up to `keys` blocks: at most its
    /// fair share of the store's leases (max_leases over the engines connected, at least 64),
    /// at most MAX_CONN_LEASES, and at most `server.max_pinned_per_connection` blocks pinned.
    fn lease_room(&self, keys: usize) -> Result<(), String> {
        let engines = self.d.ipc_clients.load(Relaxed).max(1);
        let share = (self.d.cfg.host.max_leases / engines).clamp(64, MAX_CONN_LEASES as u64);
        if self.leases.len() as u64 >= share {
            self.d.lease_refusals.fetch_add(1, Relaxed);
            return Err(format!(
                "this connection holds {} leases, its share of host.max_leases with {engines} engines connected: release some first",
                self.leases.len()
            ));
        }
        let max_pinned = self.d.cfg.server.max_pinned_per_connection;
        if self.pinned + keys as u64 > max_pinned {
            self.d.lease_refusals.fetch_add(1, Relaxed);
            return Err(format!(
                "this connection pins {} blocks and asks for up to {keys} more; the limit is {max_pinned} (server.max_pinned_per_connection): release some first",
                self.pinned
            ));
        }
        Ok(())
    }

    fn hold(&mut self, id: u64, n: usize) {
        self.leases.insert(id, n as u64);
        self.pinned += n as u64;
        self.d.leases_held.fetch_add(1, Relaxed);
    }

    fn ttl(&self, ms: u64) -> Duration {
        if ms == 0 {
            self.d.cfg.lease_ttl()
        } else {
            Duration::from_millis(ms.min(MAX_PIN_TTL_MS))
        }
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        // Client gone: uncommitted slots are freed (Reservation's drop), leases released.
        let (r, l) = (self.reservations.len(), self.leases.len());
        self.reservations.clear();
        for (id, _) in self.leases.drain() {
            self.store.release(LeaseId(id));
            self.d.leases_held.fetch_sub(1, Relaxed);
        }
        for id in self.namespaces.drain() {
            self.d.hold_namespace(self.t, kvstore::NsId(id), false);
        }
        // Its hints' queued preloads and the blocks held for its loads: nobody will load them.
        let p = self.store.cancel_prefetch_of_owner(self.serial);
        if r + l + p > 0 {
            tracing::info!(
                reservations = r,
                leases = l,
                preloads = p,
                "engine disconnected: released what it held"
            );
        }
    }
}

fn op_name(body: &Option<request::Body>) -> &'static str {
    match body {
        Some(request::Body::Hello(_)) => "hello",
        Some(request::Body::RegisterNamespace(_)) => "register_namespace",
        Some(request::Body::Lookup(_)) => "lookup",
        Some(request::Body::Load(_)) => "load",
        Some(request::Body::Reserve(_)) => "reserve",
        Some(request::Body::Commit(_)) => "commit",
        Some(request::Body::Abort(_)) => "abort",
        Some(request::Body::Release(_)) => "release",
        Some(request::Body::Stats(_)) => "stats",
        Some(request::Body::Prefetch(_)) => "prefetch",
        Some(request::Body::CancelPrefetch(_)) => "cancel_prefetch",
        Some(request::Body::Retain(_)) => "retain",
        Some(request::Body::Demote(_)) => "demote",
        Some(request::Body::Pin(_)) => "pin",
        None => "none",
    }
}

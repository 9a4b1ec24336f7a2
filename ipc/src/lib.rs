//! The local engine IPC protocol of `kvtierd` (messages in `proto/proto/ipc.proto`): framing,
//! file-descriptor passing, packed keys, and the blocking client engines use in sidecar mode.
//!
//! A frame is a little-endian `u32` length and one prost message. The daemon's `HelloReply`
//! carries the host arena's memfd as `SCM_RIGHTS`; the client maps it and reads and writes block
//! slots in place, so no block byte crosses the socket.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A KV-cache group of an engine, as registered with a namespace (published with KV events).
pub use kvtier_proto::ipc::KvGroup;
use kvtier_proto::ipc::{self as pb, request, response};
use kvtier_proto::IPC_VERSION;
use memmap2::MmapRaw;
use prost::Message;

use kvstore::{checksum, copy_hashed, ArenaSlice};
use kvstore::{BlockKey, LeaseId, Namespace, NsId, Tier};

/// Most bytes of a [`KvGroup`]'s `spec_kind`.
pub const MAX_SPEC_KIND: usize = 32;

/// Whether a [`KvGroup`] from an engine can be published: its `spec_kind` is empty or at most
/// [`MAX_SPEC_KIND`] lowercase ASCII letters, digits and '_' (vLLM's `KVCacheSpecKind`
/// values); else an error naming the problem.
pub fn check_kv_group(g: &KvGroup) -> Result<(), String> {
    let k = g.spec_kind.as_str();
    if k.len() > MAX_SPEC_KIND
        || !k
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!(
            "KV-cache group {}: spec_kind {:?} is not a vLLM KVCacheSpecKind value (lowercase letters, digits and '_', at most {MAX_SPEC_KIND})",
            g.idx,
            k.chars().take(40).collect::<String>()
        ));
    }
    Ok(())
}

/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 8 << 20;

/// Errors of the IPC protocol.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// Socket error.
    #[error("kvtierd socket: {0}")]
    Io(#[from] io::Error),
    /// A frame longer than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    /// A frame that does not decode.
    #[error("malformed message: {0}")]
    Malformed(#[from] prost::DecodeError),
    /// The daemon answered with an error.
    #[error("kvtierd refused: {0}")]
    Remote(String),
    /// The daemon answered something unexpected.
    #[error("kvtierd protocol error: {0}")]
    Protocol(String),
    /// A loaded block's bytes do not match its commit checksum (discard what was copied).
    #[error("block {0} of the load does not match its commit checksum: discard it")]
    Damaged(usize),
}

/// Keys packed for the wire: 16 big-endian bytes each, back to back.
pub fn pack_keys(keys: &[BlockKey]) -> Vec<u8> {
    let mut v = Vec::with_capacity(keys.len() * BlockKey::LEN);
    for k in keys {
        v.extend_from_slice(&k.to_bytes());
    }
    v
}

/// Keys from their packed form; an error naming the problem if the length is not a multiple of
/// 16.
pub fn unpack_keys(b: &[u8]) -> Result<Vec<BlockKey>, String> {
    if !b.len().is_multiple_of(BlockKey::LEN) {
        return Err(format!(
            "keys: {} bytes is not a whole number of 16-byte keys",
            b.len()
        ));
    }
    Ok(b.chunks_exact(BlockKey::LEN)
        .map(|c| BlockKey(u128::from_be_bytes(c.try_into().unwrap_or_default())))
        .collect())
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, msg: &impl Message) -> io::Result<()> {
    let len = msg.encoded_len();
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    msg.encode(&mut buf).map_err(io::Error::other)?;
    w.write_all(&buf)
}

/// Polls `sock` for up to `spin` until it has bytes to read (or is closed): whether it has.
/// A peer that answers within microseconds is then read without a scheduler wake-up (tens of
/// microseconds in a VM); past `spin` the caller blocks as usual.
pub fn spin_until_readable(sock: &UnixStream, spin: Duration) -> bool {
    if spin.is_zero() {
        return false;
    }
    let start = std::time::Instant::now();
    let mut b = 0u8;
    loop {
        // SAFETY: a 1-byte peek into a valid local; MSG_DONTWAIT never blocks.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                (&mut b as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n != -1 {
            return true;
        }
        if start.elapsed() >= spin {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// Reads one frame's body (after its length), refusing lengths above `max`.
pub fn read_frame_body(r: &mut impl Read, max: usize) -> Result<Vec<u8>, IpcError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(IpcError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// A control buffer with room for one fd.
fn fd_cmsg_buf() -> Vec<u8> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    vec![0u8; space]
}

/// A one-iovec message header over `iov` and the control buffer `cbuf` (both must outlive its
/// use).
fn fd_msghdr(iov: &mut libc::iovec, cbuf: &mut [u8]) -> libc::msghdr {
    // SAFETY: msghdr is plain data; all-zero is a valid starting value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = cbuf.len() as _;
    msg
}

/// Runs a syscall returning a byte count, retrying on EINTR.
fn retry_eintr(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Sends `bytes` with `fd` attached as SCM_RIGHTS.
pub fn send_with_fd(sock: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut cbuf = fd_cmsg_buf();
    let msg = fd_msghdr(&mut iov, &mut cbuf);
    // SAFETY: msg_control points to `space` bytes, enough for one cmsg holding one fd, so
    // CMSG_FIRSTHDR is non-null and CMSG_DATA has room for the fd.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
    }
    // SAFETY: msg and its buffers are valid for the call.
    let n = retry_eintr(|| unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) })?;
    // The fd went with the first chunk; the rest (if any) goes plainly.
    if n < bytes.len() {
        (&mut &*sock).write_all(&bytes[n..])?;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and, if one came with them, a file descriptor.
pub fn recv_with_fd(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cbuf = fd_cmsg_buf();
    let mut msg = fd_msghdr(&mut iov, &mut cbuf);
    // SAFETY: msg points to valid buffers for the call; MSG_CMSG_CLOEXEC marks received fds
    // close-on-exec.
    let n = retry_eintr(|| unsafe {
        libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC)
    })?;
    let mut fd = None;
    // SAFETY: the kernel filled msg_control/msg_controllen; CMSG_* walk only within it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const RawFd);
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n, fd))
}

/// Status of one reserved key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotStatus {
    /// Write the block at `offset`, then commit `token`.
    Slot {
        /// Arena offset.
        offset: u64,
        /// Commit token.
        token: u64,
    },
    /// Already stored.
    Present,
    /// Someone else is writing it.
    InFlight,
    /// No room (everything pinned).
    NoSpace,
}

/// Where a loaded block lies in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLoc {
    /// Arena offset.
    pub offset: u64,
    /// Length.
    pub len: u32,
    /// Commit checksum (xxh3-64).
    pub checksum: u64,
}

/// A loaded, pinned prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// Leading blocks now pinned in the arena.
    pub n: usize,
    /// Where each is.
    pub blocks: Vec<BlockLoc>,
    /// The lease to release once copied.
    pub lease: Option<LeaseId>,
}

/// Answer to a lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// Leading keys present.
    pub n: usize,
    /// The tier of each.
    pub tiers: Vec<Tier>,
    /// The lease pinning them, if one was asked for (and something was found).
    pub lease: Option<LeaseId>,
    /// Leading keys present before a break-even cut (`n` without one).
    pub present: usize,
    /// Keys right after the `n` present ones being saved by another engine now (see
    /// `kvstore::PrefixMatch::pending`).
    pub pending: usize,
}

/// Answer to a commit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Committed {
    /// Blocks made visible.
    pub committed: u32,
    /// Tokens whose reservation had expired: not stored.
    pub expired: Vec<u64>,
    /// Tokens whose block was removed while being written: not stored.
    pub cancelled: Vec<u64>,
}

/// A reserved slot this client may write: offset, length, and the checksum of what was written
/// (once it was).
struct Pending {
    offset: u64,
    len: u32,
    checksum: Option<u64>,
}

/// A blocking client of kvtierd's engine socket, with the arena mapped.
pub struct IpcClient {
    sock: UnixStream,
    reader: io::BufReader<UnixStream>,
    arena: MmapRaw,
    next: u64,
    /// Reserved, uncommitted slots by token.
    pending: std::collections::HashMap<u64, Pending>,
    max_reserve_bytes: u64,
    max_keys: usize,
    reservation_ttl: std::time::Duration,
    /// Set when the stream lost sync (timeout, I/O error, mismatched reply): every later call
    /// fails instead of reading someone else's reply.
    broken: Option<String>,
    tenant: String,
    /// The daemon publishes KV events (commits may describe their blocks).
    events: bool,
}

/// The tier a reply's `Tier` value names (unknown values read as host).
pub fn tier(t: i32) -> Tier {
    if t == pb::Tier::Disk as i32 {
        Tier::Disk
    } else if t == pb::Tier::Remote as i32 {
        Tier::Remote
    } else {
        Tier::Host
    }
}

impl IpcClient {
    /// Bounds every later read and write of a call on this connection (60 s by default): a
    /// call past it fails with a timeout and the connection is broken.
    pub fn set_timeout(&self, d: Duration) -> Result<(), IpcError> {
        self.sock.set_read_timeout(Some(d))?;
        self.sock.set_write_timeout(Some(d))?;
        Ok(())
    }

    /// Connects, checks the protocol version and maps the arena.
    pub fn connect(path: &Path, client: &str) -> Result<Self, IpcError> {
        Self::connect_as(path, client, "")
    }

    /// Like [`IpcClient::connect`], presenting a tenant secret (a daemon with
    /// `server.isolation = "tenant"` then hands over that tenant's arena only).
    pub fn connect_as(path: &Path, client: &str, tenant_secret: &str) -> Result<Self, IpcError> {
        let sock = UnixStream::connect(path).map_err(|e| {
            IpcError::Io(io::Error::new(
                e.kind(),
                format!(
                    "cannot connect to {}: {e} (is kvtierd running?)",
                    path.display()
                ),
            ))
        })?;
        sock.set_read_timeout(Some(Duration::from_secs(60)))?;
        sock.set_write_timeout(Some(Duration::from_secs(60)))?;
        let hello = pb::Request {
            id: 1,
            body: Some(request::Body::Hello(pb::Hello {
                version: IPC_VERSION,
                client: client.to_string(),
                tenant_secret: tenant_secret.to_string(),
            })),
        };
        write_frame(&mut &sock, &hello)?;
        // The reply comes with the arena fd attached to its first bytes.
        let mut first = vec![0u8; 4096];
        let (n, fd) = recv_with_fd(&sock, &mut first)?;
        if n < 4 {
            return Err(IpcError::Protocol("short hello reply".into()));
        }
        let len = u32::from_le_bytes([first[0], first[1], first[2], first[3]]) as usize;
        if len > MAX_FRAME {
            return Err(IpcError::TooLarge(len));
        }
        let mut body = first[4..n].to_vec();
        if body.len() < len {
            let mut rest = vec![0u8; len - body.len()];
            (&sock).read_exact(&mut rest)?;
            body.extend_from_slice(&rest);
        }
        body.truncate(len);
        let resp = pb::Response::decode(&body[..])?;
        if !resp.error.is_empty() {
            return Err(IpcError::Remote(resp.error));
        }
        let Some(response::Body::Hello(h)) = resp.body else {
            return Err(IpcError::Protocol("expected a hello reply".into()));
        };
        let fd = fd.ok_or_else(|| IpcError::Protocol("hello reply without the arena fd".into()))?;
        let file = File::from(fd);
        let arena = memmap2::MmapOptions::new()
            .len(h.arena_bytes as usize)
            .map_raw(&file)?;
        // Fill this process's page tables now, writable, so the first copy into a slot does not
        // pay a page fault per 4 KiB (MAP_POPULATE maps a shared mapping read-only, which still
        // faults on the first write). Contents are untouched. Best effort: before Linux 5.14
        // the faults just happen later.
        // SAFETY: the range is exactly our mapping; MADV_POPULATE_WRITE does not change data.
        let r = unsafe {
            libc::madvise(
                arena.as_mut_ptr() as *mut libc::c_void,
                arena.len(),
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "MADV_POPULATE_WRITE refused: the first write into each arena page will fault");
        }
        Ok(Self {
            tenant: h.tenant,
            reader: io::BufReader::with_capacity(64 << 10, sock.try_clone()?),
            sock,
            arena,
            next: 2,
            pending: Default::default(),
            max_reserve_bytes: if h.max_reserve_bytes == 0 {
                64 << 20
            } else {
                h.max_reserve_bytes
            },
            max_keys: if h.max_keys == 0 {
                usize::MAX
            } else {
                h.max_keys as usize
            },
            reservation_ttl: std::time::Duration::from_millis(if h.reservation_ttl_ms == 0 {
                60_000
            } else {
                h.reservation_ttl_ms
            }),
            broken: None,
            events: h.events,
        })
    }

    /// Most bytes this connection may hold reserved and uncommitted at once (a save larger
    /// than this goes in chunks).
    pub fn max_reserve_bytes(&self) -> u64 {
        self.max_reserve_bytes
    }

    /// Most keys one request may carry.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// How long the daemon keeps an uncommitted reservation (after that its slot may be given
    /// to another client: never write into it then).
    pub fn reservation_ttl(&self) -> std::time::Duration {
        self.reservation_ttl
    }

    /// The tenant the daemon placed this connection in ("" in shared isolation).
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Whether the daemon publishes KV events: only then do commits carry the blocks' parents
    /// and token ids ([`IpcClient::commit_described`]).
    pub fn events(&self) -> bool {
        self.events
    }

    fn call(&mut self, body: request::Body) -> Result<response::Body, IpcError> {
        if let Some(why) = &self.broken {
            return Err(IpcError::Protocol(format!(
                "connection unusable since: {why}; connect again"
            )));
        }
        let r = self.exchange(body);
        if let Err(e) = &r {
            if !matches!(e, IpcError::Remote(_) | IpcError::Damaged(_)) {
                self.broken = Some(e.to_string());
            }
        }
        r
    }

    /// Whether the connection lost sync and must be replaced.
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    fn exchange(&mut self, body: request::Body) -> Result<response::Body, IpcError> {
        let id = self.next;
        self.next += 1;
        write_frame(
            &mut &self.sock,
            &pb::Request {
                id,
                body: Some(body),
            },
        )?;
        self.spin_for_reply();
        let resp = pb::Response::decode(&read_frame_body(&mut self.reader, MAX_FRAME)?[..])?;
        if resp.id != id {
            return Err(IpcError::Protocol(format!(
                "reply {} to request {id}",
                resp.id
            )));
        }
        if !resp.error.is_empty() {
            return Err(IpcError::Remote(resp.error));
        }
        resp.body
            .ok_or_else(|| IpcError::Protocol("empty reply".into()))
    }

    /// Polls the socket for up to 50 µs before the blocking read: a reply usually arrives
    /// within tens of microseconds, and sleeping on it adds a scheduler wake-up to every call.
    fn spin_for_reply(&self) {
        if !self.reader.buffer().is_empty() {
            return;
        }
        spin_until_readable(&self.sock, Duration::from_micros(50));
    }

    /// Registers a namespace; the id is the daemon's.
    pub fn register_namespace(&mut self, ns: &Namespace) -> Result<NsId, IpcError> {
        self.register_namespace_in(ns, None)
    }

    /// Registers a namespace that keys the blocks of an engine's KV-cache group (published with
    /// its KV events); the id is the daemon's.
    pub fn register_namespace_in(
        &mut self,
        ns: &Namespace,
        group: Option<&pb::KvGroup>,
    ) -> Result<NsId, IpcError> {
        match self.call(request::Body::RegisterNamespace(pb::RegisterNamespace {
            encoded: ns.encode(),
            group: group.cloned(),
        }))? {
            response::Body::Namespace(r) => Ok(NsId(r.id)),
            _ => Err(IpcError::Protocol("expected a namespace reply".into())),
        }
    }

    /// Longest present prefix; with `lease`, also pins it for that long.
    pub fn lookup(
        &mut self,
        keys: &[BlockKey],
        lease: Option<Duration>,
    ) -> Result<Lookup, IpcError> {
        self.lookup_request(
            pb::Lookup {
                keys: pack_keys(keys),
                lease: lease.is_some(),
                ttl_ms: lease.map_or(0, |d| d.as_millis() as u64),
                ..Default::default()
            },
            keys.len(),
        )
    }

    /// Longest present prefix worth loading: break-even admission with the engine's prefill
    /// rate (the daemon prices each tier by its measured read speed; see
    /// `kvstore::Store::match_prefix_priced`). `present` in the answer is the prefix before
    /// the cut.
    pub fn lookup_priced(
        &mut self,
        keys: &[BlockKey],
        tokens_per_block: u32,
        prefill_tokens_per_s: f64,
    ) -> Result<Lookup, IpcError> {
        self.lookup_request(
            pb::Lookup {
                keys: pack_keys(keys),
                tokens_per_block,
                prefill_tokens_per_s,
                ..Default::default()
            },
            keys.len(),
        )
    }

    /// Hints that `keys` (a prefix) will be loaded soon: the daemon promotes the blocks found
    /// only below into host memory in the background (`deadline`: from now; `tag`: this
    /// connection's name for the hint, for [`IpcClient::cancel_prefetch`]).
    pub fn prefetch(
        &mut self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Duration,
        tag: u64,
    ) -> Result<pb::PrefetchReply, IpcError> {
        match self.call(request::Body::Prefetch(pb::Prefetch {
            keys: pack_keys(keys),
            priority: u32::from(priority),
            deadline_ms: (deadline.as_millis() as u64).max(1),
            tag,
        }))? {
            response::Body::Prefetch(r) => Ok(r),
            _ => Err(IpcError::Protocol("expected a prefetch reply".into())),
        }
    }

    /// Drops the queued preloads of hint `tag`; returns how many blocks they held.
    pub fn cancel_prefetch(&mut self, tag: u64) -> Result<usize, IpcError> {
        match self.call(request::Body::CancelPrefetch(pb::CancelPrefetch { tag }))? {
            response::Body::CancelPrefetch(r) => Ok(r.cancelled as usize),
            _ => Err(IpcError::Protocol("expected a cancel reply".into())),
        }
    }

    /// Retains the present prefix of `keys` for `session` (empty: anonymous) until `ttl` (zero:
    /// the daemon's longest); the reply says what was retained, clipped (by which bound) or
    /// refused.
    pub fn retain(
        &mut self,
        keys: &[BlockKey],
        session: &str,
        ttl: Duration,
        priority: u8,
    ) -> Result<pb::RetainReply, IpcError> {
        match self.call(request::Body::Retain(pb::Retain {
            keys: pack_keys(keys),
            session: session.to_string(),
            ttl_ms: ttl.as_millis() as u64,
            priority: u32::from(priority),
        }))? {
            response::Body::Retain(r) => Ok(r),
            _ => Err(IpcError::Protocol("expected a retain reply".into())),
        }
    }

    /// Ends the retention of `session` (if not empty) and of `keys`, and moves their host blocks
    /// to disk now.
    pub fn demote(
        &mut self,
        keys: &[BlockKey],
        session: &str,
    ) -> Result<pb::DemoteReply, IpcError> {
        match self.call(request::Body::Demote(pb::Demote {
            keys: pack_keys(keys),
            session: session.to_string(),
        }))? {
            response::Body::Demote(r) => Ok(r),
            _ => Err(IpcError::Protocol("expected a demote reply".into())),
        }
    }

    /// Pins the leading present keys (any tier, not loaded) for `ttl` as a lease of this
    /// connection ([`IpcClient::release`] ends it); the reply says what was pinned, clipped or
    /// refused.
    pub fn pin(&mut self, keys: &[BlockKey], ttl: Duration) -> Result<pb::PinReply, IpcError> {
        match self.call(request::Body::Pin(pb::Pin {
            keys: pack_keys(keys),
            ttl_ms: ttl.as_millis() as u64,
        }))? {
            response::Body::Pin(r) => {
                if r.n as usize > keys.len() || r.tiers.len() != r.n as usize {
                    return Err(IpcError::Protocol(format!(
                        "pin of {} keys answered {} ({} tiers)",
                        keys.len(),
                        r.n,
                        r.tiers.len()
                    )));
                }
                Ok(r)
            }
            _ => Err(IpcError::Protocol("expected a pin reply".into())),
        }
    }

    fn lookup_request(&mut self, req: pb::Lookup, asked: usize) -> Result<Lookup, IpcError> {
        match self.call(request::Body::Lookup(req))? {
            response::Body::Lookup(r) => {
                if r.n as usize > asked || r.tiers.len() != r.n as usize {
                    return Err(IpcError::Protocol(format!(
                        "lookup of {asked} keys answered {} ({} tiers)",
                        r.n,
                        r.tiers.len()
                    )));
                }
                Ok(Lookup {
                    n: r.n as usize,
                    tiers: r.tiers.into_iter().map(tier).collect(),
                    lease: (r.lease_id != 0).then_some(LeaseId(r.lease_id)),
                    present: (r.present as usize).clamp(r.n as usize, asked),
                    pending: (r.pending as usize).min(asked - r.n as usize),
                })
            }
            _ => Err(IpcError::Protocol("expected a lookup reply".into())),
        }
    }

    /// Makes the present prefix resident in host memory and pins it. `wait` bounds the wait
    /// for blocks being promoted from a lower tier (`None`: the daemon's default).
    pub fn load(
        &mut self,
        keys: &[BlockKey],
        ttl: Duration,
        wait: Option<Duration>,
    ) -> Result<Loaded, IpcError> {
        match self.call(request::Body::Load(pb::Load {
            keys: pack_keys(keys),
            ttl_ms: ttl.as_millis() as u64,
            wait_ms: wait.map_or(0, |w| (w.as_millis() as u64).max(1)),
        }))? {
            response::Body::Load(r) => {
                let n = r.n as usize;
                if n > keys.len()
                    || r.offsets.len() != n
                    || r.lens.len() != n
                    || r.checksums.len() != n
                {
                    return Err(IpcError::Protocol(format!(
                        "load of {} keys answered {n} blocks with {}/{}/{} locations",
                        keys.len(),
                        r.offsets.len(),
                        r.lens.len(),
                        r.checksums.len()
                    )));
                }
                let blocks: Vec<BlockLoc> = (0..n)
                    .map(|i| BlockLoc {
                        offset: r.offsets[i],
                        len: r.lens[i],
                        checksum: r.checksums[i],
                    })
                    .collect();
                for b in &blocks {
                    self.check(b.offset, b.len as usize)?;
                }
                Ok(Loaded {
                    n,
                    blocks,
                    lease: (r.lease_id != 0).then_some(LeaseId(r.lease_id)),
                })
            }
            _ => Err(IpcError::Protocol("expected a load reply".into())),
        }
    }

    /// Reserves slots for blocks of the given lengths.
    pub fn reserve(
        &mut self,
        ns: NsId,
        keys: &[BlockKey],
        lens: &[u32],
    ) -> Result<Vec<SlotStatus>, IpcError> {
        match self.call(request::Body::Reserve(pb::Reserve {
            namespace_id: ns.0,
            keys: pack_keys(keys),
            lens: lens.to_vec(),
        }))? {
            response::Body::Reserve(r) => {
                if r.slots.len() != keys.len() {
                    return Err(IpcError::Protocol(
                        "reserve reply of the wrong length".into(),
                    ));
                }
                let mut out = Vec::with_capacity(r.slots.len());
                for (s, &len) in r.slots.iter().zip(lens) {
                    use pb::reserved_slot::Status;
                    out.push(
                        match Status::try_from(s.status).unwrap_or(Status::Unspecified) {
                            Status::Slot => {
                                self.check(s.offset, len as usize)?;
                                self.pending.insert(
                                    s.token,
                                    Pending {
                                        offset: s.offset,
                                        len,
                                        checksum: None,
                                    },
                                );
                                SlotStatus::Slot {
                                    offset: s.offset,
                                    token: s.token,
                                }
                            }
                            Status::Present => SlotStatus::Present,
                            Status::InFlight => SlotStatus::InFlight,
                            Status::NoSpace => SlotStatus::NoSpace,
                            Status::Unspecified => {
                                return Err(IpcError::Protocol("unknown slot status".into()))
                            }
                        },
                    );
                }
                Ok(out)
            }
            _ => Err(IpcError::Protocol("expected a reserve reply".into())),
        }
    }

    /// Commits reserved slots (their bytes written). Each goes with the checksum of what was
    /// written into it (a slot committed unwritten is hashed as it is now).
    pub fn commit(&mut self, tokens: &[u64]) -> Result<Committed, IpcError> {
        self.commit_tagged(tokens, &[])
    }

    /// [`IpcClient::commit`], with the engine's own hash of each block (`engine_hashes` empty,
    /// or one per token): the daemon's KV events name the blocks by it.
    pub fn commit_tagged(
        &mut self,
        tokens: &[u64],
        engine_hashes: &[Vec<u8>],
    ) -> Result<Committed, IpcError> {
        self.commit_described(tokens, engine_hashes, &[], &[])
    }

    /// [`IpcClient::commit_tagged`], with each block's parent engine hash (empty for a first
    /// block) and token ids, which the daemon's BlockStored events carry as vLLM's do
    /// (`parent_block_hash`, `token_ids`); each list empty or one per token. Dropped here when
    /// the daemon publishes no events ([`IpcClient::events`]).
    pub fn commit_described(
        &mut self,
        tokens: &[u64],
        engine_hashes: &[Vec<u8>],
        parents: &[Vec<u8>],
        token_ids: &[Vec<u32>],
    ) -> Result<Committed, IpcError> {
        for (n, what) in [
            (engine_hashes.len(), "engine hashes"),
            (parents.len(), "parent hashes"),
            (token_ids.len(), "token id lists"),
        ] {
            if n != 0 && n != tokens.len() {
                return Err(IpcError::Protocol(format!(
                    "{} tokens but {n} {what}",
                    tokens.len()
                )));
            }
        }
        let described = self.events && !engine_hashes.is_empty();
        let mut checksums = Vec::with_capacity(tokens.len());
        for t in tokens {
            let sum = match self.pending.remove(t) {
                Some(Pending {
                    checksum: Some(c), ..
                }) => c,
                Some(p) => {
                    // SAFETY: in bounds (checked at reserve); our slot until this commit.
                    let b = unsafe { self.slot(p.offset, p.len) };
                    checksum(b)
                }
                None => 0,
            };
            checksums.push(sum);
        }
        match self.call(request::Body::Commit(pb::Commit {
            tokens: tokens.to_vec(),
            checksums,
            engine_hashes: engine_hashes.to_vec(),
            parent_hashes: if described {
                parents.to_vec()
            } else {
                Vec::new()
            },
            token_ids: if described {
                token_ids
                    .iter()
                    .map(|ids| pb::BlockTokens { ids: ids.clone() })
                    .collect()
            } else {
                Vec::new()
            },
        }))? {
            response::Body::Commit(r) => Ok(Committed {
                committed: r.committed,
                expired: r.expired,
                cancelled: r.cancelled,
            }),
            _ => Err(IpcError::Protocol("expected a commit reply".into())),
        }
    }

    /// Gives reserved slots back unwritten.
    pub fn abort(&mut self, tokens: &[u64]) -> Result<(), IpcError> {
        for t in tokens {
            self.pending.remove(t);
        }
        self.call(request::Body::Abort(pb::Abort {
            tokens: tokens.to_vec(),
        }))
        .map(|_| ())
    }

    /// Releases a lease. An error here after a [`IpcClient::load`] means the lease lapsed
    /// first: bytes copied under it may belong to another block, so discard them.
    pub fn release(&mut self, lease: LeaseId) -> Result<(), IpcError> {
        self.call(request::Body::Release(pb::Release { lease_id: lease.0 }))
            .map(|_| ())
    }

    /// The daemon's store counters.
    pub fn stats(&mut self) -> Result<pb::StatsReply, IpcError> {
        match self.call(request::Body::Stats(pb::Stats {}))? {
            response::Body::Stats(s) => Ok(s),
            _ => Err(IpcError::Protocol("expected a stats reply".into())),
        }
    }

    fn check(&self, offset: u64, len: usize) -> Result<(), IpcError> {
        match (offset as usize).checked_add(len) {
            Some(end) if end <= self.arena.len() => Ok(()),
            _ => Err(IpcError::Protocol(format!(
                "block at {offset}+{len} lies outside the {}-byte arena",
                self.arena.len()
            ))),
        }
    }

    /// The reserved slot at `offset`.
    ///
    /// # Safety
    /// `offset..offset+len` must be in the arena (checked at reserve) and reserved by this
    /// client, uncommitted.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot(&self, offset: u64, len: u32) -> &mut [u8] {
        // SAFETY: the caller's contract: in bounds, and the daemon gave this slot to this
        // client alone until it commits or aborts it.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.as_mut_ptr().add(offset as usize),
                len as usize,
            )
        }
    }

    fn pending(&self, token: u64) -> Result<&Pending, IpcError> {
        self.pending.get(&token).ok_or_else(|| {
            IpcError::Protocol(format!("token {token} is not a slot this client reserved"))
        })
    }

    /// Lends the slot reserved under `token` to `fill` (a copy engine writes the block in
    /// place: no staging buffer); its checksum is computed from the slot afterwards.
    pub fn fill_slot<R>(
        &mut self,
        token: u64,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, IpcError> {
        self.fill_slot_hashed(token, |slot| {
            let r = fill(slot);
            let sum = checksum(slot);
            (r, sum)
        })
    }

    /// Like [`IpcClient::fill_slot`], with `fill` returning the checksum of what it wrote
    /// (computed as it wrote, so the slot is not read again).
    pub fn fill_slot_hashed<R>(
        &mut self,
        token: u64,
        fill: impl FnOnce(&mut [u8]) -> (R, u64),
    ) -> Result<R, IpcError> {
        let p = self.pending(token)?;
        let (offset, len) = (p.offset, p.len);
        self.check(offset, len as usize)?;
        // SAFETY: in bounds (checked); the daemon gave this slot to this client alone until it
        // commits or aborts it; `&mut self` keeps any other borrow of it out while `fill` runs.
        let slot = unsafe { self.slot(offset, len) };
        let (r, sum) = fill(slot);
        if let Some(p) = self.pending.get_mut(&token) {
            p.checksum = Some(sum);
        }
        Ok(r)
    }

    /// Lends the slots reserved under `tokens` to `fill` all at once (so they can be filled in
    /// parallel); `fill` returns, per slot, the checksum of what it wrote (`None`: hashed at
    /// commit as it is then). Refused if a token repeats, is not this client's, or two slots
    /// overlap (a daemon that handed out one slot twice).
    pub fn fill_slots_hashed<R>(
        &mut self,
        tokens: &[u64],
        fill: impl FnOnce(&mut [&mut [u8]]) -> (R, Vec<Option<u64>>),
    ) -> Result<R, IpcError> {
        let mut spans = Vec::with_capacity(tokens.len());
        for &t in tokens {
            let p = self.pending(t)?;
            self.check(p.offset, p.len as usize)?;
            spans.push((p.offset, u64::from(p.len), t));
        }
        let mut sorted = spans.clone();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            if w[0].2 == w[1].2 || w[0].0 + w[0].1 > w[1].0 {
                return Err(IpcError::Protocol(format!(
                    "slots of tokens {} and {} overlap (or a token repeats)",
                    w[0].2, w[1].2
                )));
            }
        }
        let mut slots: Vec<&mut [u8]> = spans
            .iter()
            // SAFETY: in bounds (checked); pairwise disjoint (checked above); the daemon gave
            // each slot to this client alone until it commits or aborts it, and `&mut self`
            // keeps any other borrow of them out while `fill` runs.
            .map(|&(offset, len, _)| unsafe { self.slot(offset, len as u32) })
            .collect();
        let (r, sums) = fill(&mut slots);
        drop(slots);
        for (t, sum) in tokens.iter().zip(sums) {
            if let (Some(p), Some(sum)) = (self.pending.get_mut(t), sum) {
                p.checksum = Some(sum);
            }
        }
        Ok(r)
    }

    /// Lends every block of a load to `read` at once (e.g. to copy them out in parallel; valid
    /// while the lease holds). The blocks are shared memory that other engines map writable:
    /// they come as [`ArenaSlice`]s, copied out through raw pointers, never references.
    pub fn with_blocks<R>(
        &self,
        loaded: &Loaded,
        read: impl FnOnce(&[ArenaSlice<'_>]) -> R,
    ) -> Result<R, IpcError> {
        let mut blocks = Vec::with_capacity(loaded.blocks.len());
        for b in &loaded.blocks {
            self.check(b.offset, b.len as usize)?;
            // SAFETY: in bounds (checked) of the mapping, which lives as long as `self`; the
            // block is pinned by the load's lease. Other processes may write it: an
            // ArenaSlice only ever copies out of it.
            blocks.push(unsafe {
                ArenaSlice::new(
                    self.arena.as_ptr().add(b.offset as usize) as *mut u8,
                    b.len as usize,
                )
            });
        }
        Ok(read(&blocks))
    }

    /// Lends block `i` of a load to `read` (valid while the lease holds; see
    /// [`IpcClient::with_blocks`]).
    pub fn with_block<R>(
        &self,
        loaded: &Loaded,
        i: usize,
        read: impl FnOnce(ArenaSlice<'_>) -> R,
    ) -> Result<R, IpcError> {
        let b = loaded.blocks.get(i).ok_or_else(|| {
            IpcError::Protocol(format!(
                "block {i} is not part of this load ({} blocks)",
                loaded.n
            ))
        })?;
        self.check(b.offset, b.len as usize)?;
        // SAFETY: as in `with_blocks`.
        let block = unsafe {
            ArenaSlice::new(
                self.arena.as_ptr().add(b.offset as usize) as *mut u8,
                b.len as usize,
            )
        };
        Ok(read(block))
    }

    /// Copies a block into the slot reserved under `token` (exactly its reserved length).
    pub fn write(&mut self, token: u64, data: &[u8]) -> Result<(), IpcError> {
        let len = self.pending(token)?.len;
        if data.len() != len as usize {
            return Err(IpcError::Protocol(format!(
                "slot {token} holds {len} bytes, not {}",
                data.len()
            )));
        }
        self.fill_slot_hashed(token, |slot| ((), copy_hashed(slot, data)))
    }

    /// Copies block `i` of a load out of the arena into `dst` (exactly its length), checking
    /// its commit checksum as it copies: an error if the bytes do not match (the block was
    /// written after its commit; discard the copy). Valid while the load's lease is held; check
    /// [`IpcClient::release`] before trusting the bytes.
    pub fn read(&self, loaded: &Loaded, i: usize, dst: &mut [u8]) -> Result<(), IpcError> {
        let Some(b) = loaded.blocks.get(i) else {
            return Err(IpcError::Protocol(format!(
                "block {i} is not part of this load ({} blocks)",
                loaded.n
            )));
        };
        if b.len as usize != dst.len() {
            return Err(IpcError::Protocol(format!(
                "block {i} is {} bytes, the buffer {}",
                b.len,
                dst.len()
            )));
        }
        let want = b.checksum;
        let got = self.with_block(loaded, i, |b| b.copy_to_hashed(dst))?;
        if got != want {
            return Err(IpcError::Damaged(i));
        }
        Ok(())
    }

    /// Base address and length of the mapped arena (for GPU copy engines that register it).
    pub fn arena(&self) -> (*mut u8, usize) {
        (self.arena.as_mut_ptr(), self.arena.len())
    }
}

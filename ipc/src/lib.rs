//! The local engine IPC protocol of `kvtierd` (messages in `proto/proto/ipc.proto`): framing,
//! file-descriptor passing, and a blocking client.
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

use kvtier_proto::ipc::{self as pb, request, response};
use kvtier_proto::IPC_VERSION;
use memmap2::MmapRaw;
use prost::Message;

use kvstore::{BlockKey, LeaseId, Namespace, NsId, Tier};

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
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, msg: &impl Message) -> io::Result<()> {
    let len = msg.encoded_len();
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    msg.encode(&mut buf).map_err(io::Error::other)?;
    w.write_all(&buf)
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

/// A loaded, pinned prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// Leading blocks now pinned in the arena.
    pub n: usize,
    /// (arena offset, length) of each.
    pub blocks: Vec<(u64, u32)>,
    /// The lease to release once copied.
    pub lease: Option<LeaseId>,
}

/// A blocking client of kvtierd's engine socket, with the arena mapped.
pub struct IpcClient {
    sock: UnixStream,
    reader: io::BufReader<UnixStream>,
    arena: MmapRaw,
    next: u64,
    /// Reserved, uncommitted slots: token → (offset, length).
    pending: std::collections::HashMap<u64, (u64, u32)>,
    /// Set when the stream lost sync (timeout, I/O error, mismatched reply): every later call
    /// fails instead of reading someone else's reply.
    broken: Option<String>,
}

fn tier(t: i32) -> Tier {
    if t == pb::Tier::Disk as i32 {
        Tier::Disk
    } else {
        Tier::Host
    }
}

impl IpcClient {
    /// Connects, checks the protocol version and maps the arena.
    pub fn connect(path: &Path, client: &str) -> Result<Self, IpcError> {
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
        let hello = pb::Request {
            id: 1,
            body: Some(request::Body::Hello(pb::Hello {
                version: IPC_VERSION,
                client: client.to_string(),
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
            reader: io::BufReader::with_capacity(64 << 10, sock.try_clone()?),
            sock,
            arena,
            next: 2,
            pending: Default::default(),
            broken: None,
        })
    }

    fn call(&mut self, body: request::Body) -> Result<response::Body, IpcError> {
        if let Some(why) = &self.broken {
            return Err(IpcError::Protocol(format!(
                "connection unusable since: {why}; connect again"
            )));
        }
        let r = self.exchange(body);
        if let Err(e) = &r {
            if !matches!(e, IpcError::Remote(_)) {
                self.broken = Some(e.to_string());
            }
        }
        r
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
        let start = std::time::Instant::now();
        let mut b = 0u8;
        while start.elapsed() < Duration::from_micros(50) {
            // SAFETY: a 1-byte peek into a valid local; MSG_DONTWAIT never blocks.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    (&mut b as *mut u8).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n != -1 {
                return;
            }
            std::hint::spin_loop();
        }
    }

    /// Registers a namespace; the id is the daemon's.
    pub fn register_namespace(&mut self, ns: &Namespace) -> Result<NsId, IpcError> {
        match self.call(request::Body::RegisterNamespace(pb::RegisterNamespace {
            encoded: ns.encode(),
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
    ) -> Result<(usize, Vec<Tier>, Option<LeaseId>), IpcError> {
        match self.call(request::Body::Lookup(pb::Lookup {
            keys: keys.iter().map(|k| k.to_bytes().to_vec()).collect(),
            lease: lease.is_some(),
            ttl_ms: lease.map_or(0, |d| d.as_millis() as u64),
        }))? {
            response::Body::Lookup(r) => Ok((
                r.n as usize,
                r.tiers.into_iter().map(tier).collect(),
                (r.lease_id != 0).then_some(LeaseId(r.lease_id)),
            )),
            _ => Err(IpcError::Protocol("expected a lookup reply".into())),
        }
    }

    /// Makes the present prefix resident in host memory and pins it.
    pub fn load(&mut self, keys: &[BlockKey], ttl: Duration) -> Result<Loaded, IpcError> {
        match self.call(request::Body::Load(pb::Load {
            keys: keys.iter().map(|k| k.to_bytes().to_vec()).collect(),
            ttl_ms: ttl.as_millis() as u64,
        }))? {
            response::Body::Load(r) => {
                let blocks: Vec<(u64, u32)> = r.blocks.iter().map(|b| (b.offset, b.len)).collect();
                for &(o, l) in &blocks {
                    self.check(o, l as usize)?;
                }
                Ok(Loaded {
                    n: r.n as usize,
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
            keys: keys.iter().map(|k| k.to_bytes().to_vec()).collect(),
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
                                self.pending.insert(s.token, (s.offset, len));
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

    /// Commits reserved slots (their bytes written); returns how many were committed.
    pub fn commit(&mut self, tokens: &[u64]) -> Result<u32, IpcError> {
        for t in tokens {
            self.pending.remove(t);
        }
        match self.call(request::Body::Commit(pb::Commit {
            tokens: tokens.to_vec(),
        }))? {
            response::Body::Commit(r) => Ok(r.committed),
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

    /// Lends the slot reserved under `token` to `fill` (a copy engine writes the block in
    /// place: no staging buffer).
    pub fn fill_slot<R>(
        &self,
        token: u64,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, IpcError> {
        let &(offset, len) = self.pending.get(&token).ok_or_else(|| {
            IpcError::Protocol(format!("token {token} is not a slot this client reserved"))
        })?;
        self.check(offset, len as usize)?;
        // SAFETY: in bounds (checked); the daemon gave this slot to this client alone until it
        // commits or aborts it, and the borrow ends before this call returns.
        let slot = unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.as_mut_ptr().add(offset as usize),
                len as usize,
            )
        };
        Ok(fill(slot))
    }

    /// Lends block `i` of a load to `read` (copied out in place; valid while the lease holds).
    pub fn with_block<R>(
        &self,
        loaded: &Loaded,
        i: usize,
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, IpcError> {
        let &(offset, len) = loaded.blocks.get(i).ok_or_else(|| {
            IpcError::Protocol(format!(
                "block {i} is not part of this load ({} blocks)",
                loaded.n
            ))
        })?;
        self.check(offset, len as usize)?;
        // SAFETY: in bounds (checked); the block is committed and pinned by the load's lease,
        // so the daemon neither reuses nor writes the slot during the borrow.
        let block = unsafe {
            std::slice::from_raw_parts(self.arena.as_ptr().add(offset as usize), len as usize)
        };
        Ok(read(block))
    }

    /// Copies a block into the slot reserved under `token` (exactly its reserved length).
    pub fn write(&self, token: u64, data: &[u8]) -> Result<(), IpcError> {
        let &(offset, len) = self.pending.get(&token).ok_or_else(|| {
            IpcError::Protocol(format!("token {token} is not a slot this client reserved"))
        })?;
        if data.len() != len as usize {
            return Err(IpcError::Protocol(format!(
                "slot {token} holds {len} bytes, not {}",
                data.len()
            )));
        }
        self.check(offset, data.len())?;
        // SAFETY: in bounds (checked); the daemon gave this slot to this client alone until it
        // commits or aborts it, so no one else reads or writes these bytes meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.arena.as_mut_ptr().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Copies block `i` of a load out of the arena into `dst` (exactly its length). Valid
    /// while the load's lease is held; check [`IpcClient::release`] before trusting the bytes.
    pub fn read(&self, loaded: &Loaded, i: usize, dst: &mut [u8]) -> Result<(), IpcError> {
        let &(offset, len) = loaded.blocks.get(i).ok_or_else(|| {
            IpcError::Protocol(format!(
                "block {i} is not part of this load ({} blocks)",
                loaded.n
            ))
        })?;
        if dst.len() != len as usize {
            return Err(IpcError::Protocol(format!(
                "block {i} is {len} bytes, the buffer {}",
                dst.len()
            )));
        }
        self.check(offset, dst.len())?;
        // SAFETY: in bounds (checked); the block is committed and pinned by the load's lease,
        // so the daemon does not reuse or write the slot meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.arena.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Base address and length of the mapped arena (for GPU copy engines that register it).
    pub fn arena(&self) -> (*mut u8, usize) {
        (self.arena.as_mut_ptr(), self.arena.len())
    }
}

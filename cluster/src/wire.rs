//! Framing of the data plane (`proto/proto/cluster.proto`): a u32 little-endian length, a
//! prost header, then raw payloads. Blocking helpers for the client (the store's tiering
//! worker calls it from its own threads), async ones for the server.

use std::io::{self, Read, Write};

use hmac::{Hmac, Mac};
use kvstore::{BlockKey, Fingerprint};
use prost::Message;
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest header accepted (a GET of 2^16 keys is ~6 MiB of header).
pub const MAX_HEADER: usize = 16 << 20;
/// Largest header accepted before a peer authenticated (an `Auth` is ~100 bytes).
pub const MAX_AUTH_HEADER: usize = 4 << 10;
/// Largest block accepted over the wire.
pub const MAX_BLOCK: u32 = 1 << 30;
/// Most keys in one request.
pub const MAX_KEYS: usize = 1 << 16;

/// What happened to one block of a PUT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum PutOutcome {
    /// Stored.
    Stored = 0,
    /// Already there (or being written by someone else).
    Present = 1,
    /// Not stored (no room, unknown size, busy).
    Failed = 2,
    /// Its bytes did not match its checksum: not stored.
    Corrupt = 3,
}

impl PutOutcome {
    /// From the wire; unknown values are failures.
    pub fn from_wire(v: u32) -> Self {
        match v {
            0 => Self::Stored,
            1 => Self::Present,
            3 => Self::Corrupt,
            _ => Self::Failed,
        }
    }
}

fn too_big(n: usize, max: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("header of {n} bytes (most {max})"),
    )
}

/// TCP keepalive on `sock`: a peer that vanished without a reset (power loss, partition) is
/// noticed within ~25 s even on an idle pooled connection.
pub fn keepalive<S: std::os::fd::AsFd>(sock: &S) -> io::Result<()> {
    let ka = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(10))
        .with_interval(std::time::Duration::from_secs(5))
        .with_retries(3);
    socket2::SockRef::from(sock).set_tcp_keepalive(&ka)
}

/// Writes one header frame.
pub fn write_header(w: &mut impl Write, m: &impl Message) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 + m.encoded_len());
    buf.extend_from_slice(&(m.encoded_len() as u32).to_le_bytes());
    m.encode(&mut buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    w.write_all(&buf)
}

/// Reads one header frame.
pub fn read_header<M: Message + Default>(r: &mut impl Read) -> io::Result<M> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_HEADER {
        return Err(too_big(n, MAX_HEADER));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf)?;
    M::decode(&buf[..]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Encodes one header frame (for the async writer).
pub fn encode_header(m: &impl Message) -> Vec<u8> {
    let mut buf = Vec::with_capacity(4 + m.encoded_len());
    buf.extend_from_slice(&(m.encoded_len() as u32).to_le_bytes());
    // Encoding into a Vec cannot run out of room.
    let _ = m.encode(&mut buf);
    buf
}

/// Reads one header frame of at most `max` bytes (async).
pub async fn read_header_async<M: Message + Default>(
    r: &mut (impl AsyncReadExt + Unpin),
    max: usize,
) -> io::Result<M> {
    let n = r.read_u32_le().await? as usize;
    if n > max {
        return Err(too_big(n, max));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await?;
    M::decode(&buf[..]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Writes one header frame (async).
pub async fn write_header_async(
    w: &mut (impl AsyncWriteExt + Unpin),
    m: &impl Message,
) -> io::Result<()> {
    w.write_all(&encode_header(m)).await
}

/// Keys packed 16 bytes each, big-endian (their canonical form).
pub fn pack_keys(keys: &[BlockKey]) -> Vec<u8> {
    let mut v = Vec::with_capacity(keys.len() * 16);
    for k in keys {
        v.extend_from_slice(&k.0.to_be_bytes());
    }
    v
}

/// Unpacks keys; `None` unless a whole number of 16-byte keys, at most [`MAX_KEYS`].
pub fn unpack_keys(b: &[u8]) -> Option<Vec<BlockKey>> {
    if !b.len().is_multiple_of(16) || b.len() / 16 > MAX_KEYS {
        return None;
    }
    Some(
        b.chunks_exact(16)
            .map(|c| {
                let mut a = [0u8; 16];
                a.copy_from_slice(c);
                BlockKey(u128::from_be_bytes(a))
            })
            .collect(),
    )
}

/// One 16-byte key or fingerprint from the wire.
pub fn key16(b: &[u8]) -> Option<BlockKey> {
    let a: [u8; 16] = b.try_into().ok()?;
    Some(BlockKey(u128::from_be_bytes(a)))
}

/// A fingerprint from the wire.
pub fn fingerprint(b: &[u8]) -> Option<Fingerprint> {
    key16(b).map(Fingerprint)
}

/// A fingerprint for the wire.
pub fn fp_bytes(f: Fingerprint) -> Vec<u8> {
    f.0 .0.to_be_bytes().to_vec()
}

const AUTH_CONTEXT: &[u8] = b"kvtier-cluster-v1";

/// The MAC a client answers a nonce with: HMAC-SHA256(secret, context || nonce); empty without
/// a secret.
pub fn mac(secret: &str, nonce: &[u8]) -> Vec<u8> {
    if secret.is_empty() {
        return Vec::new();
    }
    // HMAC takes keys of any length.
    let Ok(mut m) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        return Vec::new();
    };
    m.update(AUTH_CONTEXT);
    m.update(nonce);
    m.finalize().into_bytes().to_vec()
}

/// Whether `got` is the right MAC for `nonce` (constant time); without a secret only an empty
/// MAC is.
pub fn mac_ok(secret: &str, nonce: &[u8], got: &[u8]) -> bool {
    if secret.is_empty() {
        return got.is_empty();
    }
    let Ok(mut m) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        return false;
    };
    m.update(AUTH_CONTEXT);
    m.update(nonce);
    m.verify_slice(got).is_ok()
}

/// One `send(2)` of bytes `at..` of `b` (shared arena memory: the kernel reads them out of
/// the slot itself, so the block is neither copied nor borrowed as a `&[u8]`); the bytes sent.
pub fn send_arena_once(
    fd: std::os::fd::RawFd,
    b: kvstore::ArenaSlice<'_>,
    at: usize,
) -> io::Result<usize> {
    assert!(at < b.len(), "send_arena_once: {at} of {}", b.len());
    // SAFETY: `at < b.len()` (checked): the range lies in the slot `b` names, mapped and
    // pinned while its owner holds it; the kernel only reads it.
    let n = unsafe {
        libc::send(
            fd,
            b.as_ptr().add(at).cast(),
            b.len() - at,
            libc::MSG_NOSIGNAL,
        )
    };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        0 => Err(io::ErrorKind::WriteZero.into()),
        n => Ok(n as usize),
    }
}

/// Sends `b` on a blocking socket through 1 MiB private pieces (half the L2 here; with 128 KiB
/// pieces 16 MiB pushes reached 0.71–0.80 of iperf3, with 1 MiB 0.83–0.91): each is copied
/// out of the slot
/// once, hashed while in cache, then sent from there, so the slot is read once and what is
/// hashed is exactly what is sent (the socket's write timeout applies: past it, `TimedOut`;
/// the remote tier passes a writer that holds the whole send to its deadline). Returns the
/// checksum of the bytes sent.
pub fn send_arena_hashed(sock: &mut impl Write, b: kvstore::ArenaSlice<'_>) -> io::Result<u64> {
    const PIECE: usize = 1 << 20;
    let mut piece = vec![0u8; PIECE.min(b.len())];
    let mut h = kvstore::Checksummer::new();
    let mut at = 0;
    while at < b.len() {
        let n = PIECE.min(b.len() - at);
        b.copy_to(at, &mut piece[..n]);
        h.update(&piece[..n]);
        sock.write_all(&piece[..n]).map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                io::ErrorKind::TimedOut.into()
            } else {
                e
            }
        })?;
        at += n;
    }
    Ok(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_bad_lengths_are_refused() {
        let k = vec![BlockKey(1), BlockKey(u128::MAX), BlockKey(7 << 100)];
        assert_eq!(unpack_keys(&pack_keys(&k)), Some(k));
        assert_eq!(unpack_keys(&[0u8; 17]), None);
        assert_eq!(unpack_keys(&vec![0u8; 16 * (MAX_KEYS + 1)]), None);
    }

    #[test]
    fn macs_check_the_secret_and_the_nonce() {
        let m = mac("s3cret", b"nonce-1");
        assert_eq!(m.len(), 32);
        assert!(mac_ok("s3cret", b"nonce-1", &m));
        assert!(!mac_ok("s3cret", b"nonce-2", &m));
        assert!(!mac_ok("other", b"nonce-1", &m));
        assert!(!mac_ok("s3cret", b"nonce-1", &[]));
        assert!(mac_ok("", b"x", &[]));
        assert!(!mac_ok("", b"x", &m));
    }

    #[test]
    fn oversized_headers_are_refused_before_allocating() {
        let mut b: &[u8] = &(u32::MAX).to_le_bytes();
        let e = read_header::<kvtier_proto::cluster::Reply>(&mut b).unwrap_err();
        assert!(e.to_string().contains("header of"), "{e}");
    }
}

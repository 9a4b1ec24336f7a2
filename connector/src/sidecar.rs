//! A `kvtierd` connection that rides out daemon restarts. While the daemon is unreachable every
//! call is a miss (nothing loaded, nothing stored, nothing found), logged once per outage and
//! counted; the connection is re-made with backoff (100 ms, doubling, at most 2 s) on the next
//! calls, the namespaces are registered again, and hits resume. A rolling upgrade of the daemon
//! is routine: an engine must not need a restart for it.
//!
//! Namespace ids handed out here are local (the order of registration through this handle) and
//! mapped to the daemon's ids per connection, so a restarted daemon that numbers them otherwise
//! changes nothing for the caller.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvstore::{Namespace, NsId};
use kvtier_ipc::{IpcClient, IpcError, KvGroup};

use crate::transfer::TransferError;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Counters of a sidecar connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SidecarStats {
    /// Times the daemon became unreachable.
    pub outages: u64,
    /// Calls answered as misses while it was.
    pub missed_calls: u64,
    /// Times the connection was made again.
    pub reconnects: u64,
}

struct State {
    conn: Option<IpcClient>,
    /// Which connection `conn` is (counted from 1; 0: none made yet): reservations belong to
    /// one connection and die with it.
    conn_id: u64,
    /// Registered through this handle, each with the engine's KV-cache group it keys (if
    /// said); the local id is the index.
    namespaces: Vec<(Namespace, Option<KvGroup>)>,
    /// The daemon's id of each on the current connection.
    remote: Vec<Option<NsId>>,
    retry_at: Instant,
    backoff: Duration,
    down_since: Option<Instant>,
    stats: SidecarStats,
    /// The GPU copier whose DMA uses each connection's arena, and that arena's registration.
    #[cfg(feature = "cuda")]
    pinned: Option<Pinned>,
}

impl Drop for State {
    fn drop(&mut self) {
        // The arena's registration goes before the arena.
        self.drop_conn();
    }
}

#[cfg(feature = "cuda")]
struct Pinned {
    copier: std::sync::Arc<crate::cuda::CudaCopier>,
    reg: Option<crate::cuda::Registered>,
}

impl State {
    /// Drops the connection (and unmaps its arena), after the GPU copies that may still use
    /// the arena finished and its registration was dropped.
    fn drop_conn(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(p) = &mut self.pinned {
            if p.reg.is_some() && p.copier.synchronize().is_err() {
                // Copies may still be using the arena: leak its registration and its mapping
                // rather than let DMA reach memory handed to someone else.
                tracing::error!(
                    "kvtier: GPU copies could not be waited for: kvtierd's arena mapping is \
                     leaked"
                );
                std::mem::forget(p.reg.take());
                std::mem::forget(self.conn.take());
            }
            p.reg = None;
        }
        self.conn = None;
    }

    /// Forgets the pinned copier (its registration dropped after its copies finished).
    #[cfg(feature = "cuda")]
    fn drop_pin(&mut self) {
        if let Some(mut p) = self.pinned.take() {
            if p.reg.is_some() && p.copier.synchronize().is_err() {
                // As in drop_conn: never unregister under running copies.
                std::mem::forget(p.reg.take());
            }
        }
    }

    /// Registers the live connection's arena with the pinned copier, if any and not yet;
    /// false if that failed (copies then go through the driver's own staging: slower).
    #[cfg(feature = "cuda")]
    fn pin_arena(&mut self) -> bool {
        let (Some(p), Some(c)) = (&mut self.pinned, &self.conn) else {
            return true;
        };
        if p.reg.is_some() {
            return true;
        }
        let (ptr, len) = c.arena();
        // SAFETY: the arena stays mapped while `conn` lives; `drop_conn` drops the
        // registration (after the copier's queued copies finished) before the connection.
        match unsafe { p.copier.register(ptr, len) } {
            Ok(r) => {
                p.reg = Some(r);
                true
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    bytes = len,
                    "kvtier: cannot register kvtierd's shared arena with the CUDA driver: GPU \
                     copies go through the driver's staging buffers (slower)"
                );
                false
            }
        }
    }
}

/// A kvtierd connection that reconnects.
pub struct Sidecar {
    socket: PathBuf,
    client: String,
    secret: String,
    st: Mutex<State>,
}

/// The daemon's ids of this handle's namespaces on the live connection (registered lazily).
pub struct NsMap<'a> {
    namespaces: &'a [(Namespace, Option<KvGroup>)],
    remote: &'a mut Vec<Option<NsId>>,
    conn_id: u64,
}

impl NsMap<'_> {
    /// Which connection this is (for [`Sidecar::call_on`]).
    pub fn connection(&self) -> u64 {
        self.conn_id
    }

    /// The daemon's id of local namespace `local`, registering it on this connection first.
    pub fn get(&mut self, c: &mut IpcClient, local: NsId) -> Result<NsId, IpcError> {
        let i = local.0 as usize;
        let (ns, group) = self.namespaces.get(i).ok_or_else(|| {
            IpcError::Remote(format!("namespace id {} was never registered", local.0))
        })?;
        if let Some(id) = self.remote[i] {
            return Ok(id);
        }
        let id = c.register_namespace_in(ns, group.as_ref())?;
        self.remote[i] = Some(id);
        Ok(id)
    }
}

/// Whether an error means the connection is gone (as opposed to a request the daemon refused).
fn lost(e: &IpcError) -> bool {
    !matches!(e, IpcError::Remote(_) | IpcError::Damaged(_))
}

impl Sidecar {
    /// A handle to the daemon at `socket`; the first connection is made now if the daemon is
    /// there (if not, calls are misses until it is).
    pub fn new(socket: &std::path::Path, client: &str, tenant_secret: &str) -> Self {
        let s = Self::new_unconnected(socket, client, tenant_secret);
        if let Ok(mut st) = s.st.lock() {
            s.connect(&mut st);
        }
        s
    }

    /// Connects now, or fails with the daemon's error (for callers that want to know at once).
    pub fn connect_now(
        socket: &std::path::Path,
        client: &str,
        tenant_secret: &str,
    ) -> Result<Self, TransferError> {
        let c = IpcClient::connect_as(socket, client, tenant_secret)?;
        let s = Self::new_unconnected(socket, client, tenant_secret);
        {
            let mut st = s.st.lock().map_err(|_| TransferError::Poisoned)?;
            st.conn = Some(c);
            st.conn_id = 1;
        }
        Ok(s)
    }

    fn new_unconnected(socket: &std::path::Path, client: &str, tenant_secret: &str) -> Self {
        Self {
            socket: socket.to_path_buf(),
            client: client.to_string(),
            secret: tenant_secret.to_string(),
            st: Mutex::new(State {
                conn: None,
                conn_id: 0,
                namespaces: Vec::new(),
                remote: Vec::new(),
                retry_at: Instant::now(),
                backoff: BACKOFF_MIN,
                down_since: None,
                stats: SidecarStats::default(),
                #[cfg(feature = "cuda")]
                pinned: None,
            }),
        }
    }

    fn connect(&self, st: &mut State) {
        match IpcClient::connect_as(&self.socket, &self.client, &self.secret) {
            Ok(c) => {
                if let Some(since) = st.down_since.take() {
                    st.stats.reconnects += 1;
                    tracing::warn!(
                        socket = %self.socket.display(),
                        down_secs = format!("{:.1}", since.elapsed().as_secs_f64()),
                        missed_calls = st.stats.missed_calls,
                        "kvtier: kvtierd reachable again; namespaces registered again"
                    );
                }
                st.drop_conn();
                st.conn = Some(c);
                st.conn_id += 1;
                st.remote = vec![None; st.namespaces.len()];
                st.backoff = BACKOFF_MIN;
                #[cfg(feature = "cuda")]
                st.pin_arena();
            }
            Err(e) => self.went_down(st, &e),
        }
    }

    fn went_down(&self, st: &mut State, e: &IpcError) {
        st.drop_conn();
        if st.down_since.is_none() {
            st.down_since = Some(Instant::now());
            st.stats.outages += 1;
            tracing::warn!(
                socket = %self.socket.display(),
                error = %e,
                "kvtier: kvtierd unreachable: every call is a miss until it is back (reconnecting with backoff)"
            );
        }
        st.retry_at = Instant::now() + st.backoff;
        st.backoff = (st.backoff * 2).min(BACKOFF_MAX);
    }

    /// Registers a namespace; returns its local id (valid across reconnections).
    pub fn register_namespace(&self, ns: &Namespace) -> Result<NsId, TransferError> {
        self.register_namespace_in(ns, None)
    }

    /// Registers a namespace that keys the blocks of the engine's KV-cache group `group`
    /// (sent with every registration, on every connection, for the daemon's KV events);
    /// returns its local id (valid across reconnections).
    pub fn register_namespace_in(
        &self,
        ns: &Namespace,
        group: Option<KvGroup>,
    ) -> Result<NsId, TransferError> {
        ns.validate()?;
        let mut st = self.st.lock().map_err(|_| TransferError::Poisoned)?;
        let fp = ns.fingerprint();
        let i = match st
            .namespaces
            .iter()
            .position(|(n, _)| n.fingerprint() == fp)
        {
            Some(i) => {
                if group.is_some() && st.namespaces[i].1 != group {
                    // Said now: registered again, so the daemon hears it.
                    st.namespaces[i].1 = group;
                    st.remote[i] = None;
                }
                i
            }
            None => {
                st.namespaces.push((ns.clone(), group));
                st.remote.push(None);
                st.namespaces.len() - 1
            }
        };
        let local = NsId(i as u32);
        // Registered on the daemon now if it is there (a refusal, e.g. a full table or a bad
        // namespace, is the caller's error); otherwise at the next connection.
        drop(st);
        match self.call(|c, map| map.get(c, local))? {
            Some(_) | None => Ok(local),
        }
    }

    /// Runs `f` on a live connection (made again if it was lost and the backoff allows);
    /// `Ok(None)`: the daemon is unreachable now, the call is a miss.
    pub fn call<R>(
        &self,
        f: impl FnOnce(&mut IpcClient, &mut NsMap<'_>) -> Result<R, IpcError>,
    ) -> Result<Option<R>, TransferError> {
        self.call_inner(None, f)
    }

    /// [`Sidecar::call`] on connection `conn` only (see [`NsMap::connection`]), for what
    /// continues work begun on it (reservations): `Ok(None)` if that connection is gone, even
    /// when another one is up (its reservations went with it).
    pub fn call_on<R>(
        &self,
        conn: u64,
        f: impl FnOnce(&mut IpcClient, &mut NsMap<'_>) -> Result<R, IpcError>,
    ) -> Result<Option<R>, TransferError> {
        self.call_inner(Some(conn), f)
    }

    fn call_inner<R>(
        &self,
        only: Option<u64>,
        f: impl FnOnce(&mut IpcClient, &mut NsMap<'_>) -> Result<R, IpcError>,
    ) -> Result<Option<R>, TransferError> {
        let mut st = self.st.lock().map_err(|_| TransferError::Poisoned)?;
        let st = &mut *st;
        if only.is_some_and(|id| id != st.conn_id) {
            st.stats.missed_calls += 1;
            return Ok(None);
        }
        if st.conn.is_none() && only.is_none() && Instant::now() >= st.retry_at {
            self.connect(st);
        }
        let Some(c) = st.conn.as_mut() else {
            st.stats.missed_calls += 1;
            return Ok(None);
        };
        let mut map = NsMap {
            namespaces: &st.namespaces,
            remote: &mut st.remote,
            conn_id: st.conn_id,
        };
        match f(c, &mut map) {
            Ok(r) => Ok(Some(r)),
            Err(e) if lost(&e) || c.is_broken() => {
                self.went_down(st, &e);
                st.stats.missed_calls += 1;
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Registers the arena of the live connection, and of every later one, with `copier`'s
    /// driver (page-locked: its GPU copies are DMA straight to and from the arena). False if
    /// the registration failed (logged; the copies still work, through the driver's staging).
    #[cfg(feature = "cuda")]
    pub fn pin_for_cuda(
        &self,
        copier: std::sync::Arc<crate::cuda::CudaCopier>,
    ) -> Result<bool, TransferError> {
        let mut st = self.st.lock().map_err(|_| TransferError::Poisoned)?;
        st.drop_pin();
        st.pinned = Some(Pinned { copier, reg: None });
        Ok(st.pin_arena())
    }

    /// Counters.
    pub fn stats(&self) -> SidecarStats {
        self.st.lock().map(|s| s.stats).unwrap_or_default()
    }
}

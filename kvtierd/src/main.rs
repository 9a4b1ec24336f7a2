//! `kvtierd`: kvtier's per-node sidecar. It owns the host arena and the disk tier, so the cache
//! outlives engine processes; engines talk to it over a Unix socket (the arena is shared by fd
//! passing), operators over gRPC, Prometheus over `/metrics`.

mod admin;
mod config;
mod conns;
mod events;
#[cfg(test)]
mod fuzz_tests;
mod ipc_server;
mod logging;
mod metrics;
mod zmtp;

use std::collections::HashMap;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use hdrhistogram::Histogram;
use kvstore::Store;
use kvtier_proto::admin::admin_server::AdminServer;
use parking_lot::Mutex;

/// kvtierd: the kvtier node daemon. With no arguments it runs on embedded defaults (data in
/// ./kvtier-data, everything on loopback) and prints where it listens.
#[derive(Parser, Debug)]
#[command(name = "kvtierd", version)]
struct Args {
    /// TOML configuration file.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Data directory (disk tier, engine socket).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Host memory for blocks, e.g. 4G.
    #[arg(long)]
    host_capacity: Option<String>,
    /// Disk space for blocks, e.g. 64G.
    #[arg(long)]
    disk_capacity: Option<String>,
    /// Run without a disk tier.
    #[arg(long)]
    no_disk: bool,
    /// Engine socket path.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Admin gRPC address (port 0: any free port).
    #[arg(long)]
    grpc: Option<String>,
    /// Prometheus /metrics address.
    #[arg(long)]
    metrics: Option<String>,
    /// Any setting as section.key=value (repeatable), e.g. --set disk.queue_depth=64.
    #[arg(long = "set")]
    sets: Vec<String>,
}

/// How long announcing a namespace's disk blocks waits for each events subscriber to make
/// room (the publisher's thread drains its channel continuously; a stalled subscriber loses
/// the rest, counted as dropped events).
const ANNOUNCE_PATIENCE: Duration = Duration::from_secs(30);

/// A tenant (`server.isolation = "tenant"`).
pub struct Tenant {
    /// Its configuration.
    pub cfg: config::TenantSection,
    /// Its store.
    pub store: &'static Store,
}

/// State shared by the servers.
pub struct Daemon {
    /// The store (lives as long as the process): the only one in shared isolation, the first
    /// tenant's in tenant isolation (what an admin request naming no tenant addresses).
    pub store: &'static Store,
    /// Tenant isolation: each tenant's own store (arena, disk subdirectory, quotas).
    pub tenants: Vec<Tenant>,
    /// The configuration in force.
    pub cfg: config::Config,
    /// Start time.
    pub started: Instant,
    stop: AtomicBool,
    /// Engine connections now (after their Hello).
    pub ipc_clients: AtomicU64,
    /// Connections that have not sent Hello yet.
    pub ipc_pending: AtomicU64,
    /// Bytes of engine frames being received now, over every connection.
    pub frame_bytes: AtomicU64,
    /// Engine leases held now.
    pub leases_held: AtomicU64,
    /// Leases refused for a connection's fair share or pinned-block bound.
    pub lease_refusals: AtomicU64,
    /// Namespace ids registered by live connections, per store (kept when the table is
    /// reclaimed).
    ns_held: Mutex<HashMap<(usize, u32), usize>>,
    /// Leases made through the admin API (id → store, blocks pinned).
    pub admin_leases: Mutex<HashMap<u64, (usize, u64)>>,
    /// Engine requests answered with an error.
    pub ipc_errors: AtomicU64,
    /// Admin Watch streams open now (bounded by server.max_watchers).
    pub watchers: AtomicU64,
    /// Log lines dropped (stderr gone or stalled).
    pub log: Arc<logging::LogStats>,
    latency: Mutex<HashMap<&'static str, Histogram<u64>>>,
    /// Serial numbers of engine connections (preload tags are scoped by them).
    conn_serial: AtomicU64,
    /// Tokens per block and KV-cache group of each registered namespace, per store (for KV
    /// events).
    pub ns_info: events::NsInfos,
    /// KV event publisher counters.
    pub events: Arc<events::EventStats>,
    /// Connections to the admin gRPC listener refused or closed silent.
    pub admin_conns: Arc<conns::ConnStats>,
    /// Connections to the metrics listener refused or closed silent.
    pub metrics_conns: Arc<conns::ConnStats>,
    /// Engine hashes of stored blocks, for KV events (only while `[events]` is on).
    pub engine_hashes: Option<Arc<events::EngineHashes>>,
    /// The remote tier, when `[cluster]` is on.
    pub cluster: Option<Cluster>,
}

/// Connections to the admin gRPC listener at once: in all, and from one address (a router,
/// the CLI and a few operators need a handful; each Watch is a stream on one of them).
const ADMIN_CONNS: conns::Limits = conns::Limits {
    total: 1024,
    per_address: 256,
    // HTTP/2's connection preface.
    preface: 24,
};

/// This node's remote tier and data-plane server.
pub struct Cluster {
    /// The tier in the store's chain (placement, peers' state).
    pub remote: Arc<kvtier_cluster::RemoteTier>,
    /// The data-plane server's counters.
    pub server: Arc<kvtier_cluster::ServerStats>,
    /// etcd membership (None: static members).
    pub etcd: Option<(
        kvtier_cluster::EtcdConfig,
        Arc<kvtier_cluster::MembershipState>,
    )>,
}

impl Cluster {
    /// "ok", or "degraded" while etcd is unreachable.
    pub fn state(&self) -> &'static str {
        match &self.etcd {
            Some((_, m)) if m.degraded.load(Relaxed) => "degraded",
            _ => "ok",
        }
    }
}

impl Daemon {
    /// A fresh serial number for an engine connection.
    pub fn next_conn_serial(&self) -> u64 {
        self.conn_serial.fetch_add(1, Relaxed) + 1
    }

    /// The store-wide tag of preload hint `tag` from client scope `scope` (an engine
    /// connection's serial, or 0 for the admin API): one client cannot cancel another's.
    /// Tag 0 stays 0: an untagged hint (SGLang's, whose engine never ends its hints) stays
    /// untagged in the store, so it does not wait for blocks not stored yet (it would hold its
    /// own request's saves until its deadline); a client's cancel of tag 0 ends only its own
    /// untagged hints (the store matches the owner too).
    pub fn preload_tag(scope: u64, tag: u64) -> u64 {
        if tag == 0 {
            return 0;
        }
        let mut x = scope
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(tag)
            .wrapping_add(0x632B_E59B_D9B4_E019);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }

    /// The TTL a Retain asks for (0: `preload.max_retain_ms`; the store clips it to that).
    pub fn retain_ttl(&self, ms: u64) -> Duration {
        Duration::from_millis(if ms == 0 {
            self.cfg.preload.max_retain_ms
        } else {
            ms
        })
    }

    /// The deadline of a hint that asks for `ms` (0: `preload.deadline_ms`).
    pub fn preload_deadline(&self, ms: u64) -> Instant {
        let ms = if ms == 0 {
            self.cfg.preload.deadline_ms
        } else {
            ms
        };
        Instant::now() + Duration::from_millis(ms.min(3_600_000))
    }
    /// The daemon's shared state around its stores.
    pub fn new(
        store: &'static Store,
        tenants: Vec<Tenant>,
        cfg: config::Config,
        log: Arc<logging::LogStats>,
    ) -> Self {
        let engine_hashes = (!cfg.events.endpoint.is_empty()).then(Arc::default);
        let d = Self {
            engine_hashes,
            store,
            tenants,
            cfg,
            started: Instant::now(),
            stop: AtomicBool::new(false),
            ipc_clients: AtomicU64::new(0),
            ipc_pending: AtomicU64::new(0),
            frame_bytes: AtomicU64::new(0),
            leases_held: AtomicU64::new(0),
            lease_refusals: AtomicU64::new(0),
            ns_held: Mutex::new(HashMap::new()),
            admin_leases: Mutex::new(HashMap::new()),
            ipc_errors: AtomicU64::new(0),
            watchers: AtomicU64::new(0),
            log,
            latency: Mutex::new(HashMap::new()),
            conn_serial: AtomicU64::new(0),
            ns_info: Arc::default(),
            events: Arc::default(),
            admin_conns: Arc::default(),
            metrics_conns: Arc::default(),
            cluster: None,
        };
        d.keep_engine_tags();
        d
    }

    /// With KV events on: the engine hashes the disk tiers' journals kept are published again
    /// (held as on disk), and each disk tier journals the hashes of the blocks it writes from
    /// the engine-hash map. Off: the journals keep what they hold, and new blocks go untagged.
    fn keep_engine_tags(&self) {
        let Some(eh) = &self.engine_hashes else {
            return;
        };
        for (t, store) in self.stores().into_iter().enumerate() {
            let tags = store.recovered_engine_tags();
            if !tags.is_empty() {
                tracing::info!(
                    store = t,
                    blocks = tags.len(),
                    "disk tier: engine hashes recovered"
                );
            }
            eh.seed(t, tags);
            let eh = eh.clone();
            store.set_engine_tagger(Arc::new(move |keys: &[kvstore::BlockKey]| {
                eh.tags_of(t, keys)
            }));
        }
    }

    /// Registers a namespace for a connection (`check` may refuse a new one), with the
    /// engine's KV-cache group it keys if the engine said (the last registration's word
    /// stands); when the table is full, ids of namespaces with no blocks that no live
    /// connection holds are reclaimed first.
    pub fn register_namespace(
        &self,
        t: usize,
        ns: &kvstore::Namespace,
        group: Option<events::KvGroup>,
        check: impl Fn(kvstore::NsId) -> Result<(), String>,
    ) -> Result<kvstore::NsId, String> {
        let store = self.store_at(t);
        let fp = ns.fingerprint();
        let info = events::NsInfo {
            block_tokens: ns.block_tokens,
            group,
        };
        if let Some(i) = store.namespaces().iter().position(|f| *f == fp) {
            let id = kvstore::NsId(i as u32);
            check(id)?;
            // Known already (registered before, or recovered from the disk tier after a
            // restart): its tokens per block and group still have to reach the KV events.
            let first = self.ns_info.lock().insert((t, id.0 as u16), info).is_none();
            if first && self.engine_hashes.is_some() {
                // The first engine of this namespace since the daemon started: announce the
                // blocks the disk tier kept (subscribers were told to forget this node), now
                // that their tokens per block and group are known. Off the engine's path.
                let eh = self.engine_hashes.clone().unwrap_or_default();
                let spawned = std::thread::Builder::new()
                    .name("kvtierd-announce".into())
                    .spawn(move || {
                        let order = |keys: &mut Vec<kvstore::BlockKey>| eh.chain_order(t, keys);
                        let n = store.announce_disk(id, order, ANNOUNCE_PATIENCE);
                        if n > 0 {
                            tracing::info!(
                                store = t,
                                ns = id.0,
                                blocks = n,
                                "KV events: disk blocks announced after the restart"
                            );
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "KV events: disk blocks not announced");
                }
            }
            return Ok(id);
        }
        check(kvstore::NsId(u32::MAX))?;
        let id = match store.register_namespace(ns) {
            Err(kvstore::KeyError::TableFull(_)) => {
                let held = self.ns_held.lock().clone();
                store.reclaim_namespaces(&|id| held.contains_key(&(t, id.0)));
                store.register_namespace(ns).map_err(|e| e.to_string())
            }
            r => r.map_err(|e| e.to_string()),
        }?;
        self.ns_info.lock().insert((t, id.0 as u16), info);
        Ok(id)
    }

    /// Counts a live connection's hold on a namespace id of store `t` (`hold`), or drops it.
    pub fn hold_namespace(&self, t: usize, id: kvstore::NsId, hold: bool) {
        let mut m = self.ns_held.lock();
        let n = m.entry((t, id.0)).or_default();
        if hold {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&(t, id.0));
            }
        }
    }

    /// Store `t`: the shared store (t = 0 in shared isolation) or tenant t's.
    pub fn store_at(&self, t: usize) -> &'static Store {
        self.tenants.get(t).map_or(self.store, |x| x.store)
    }

    /// The store an admin request names by tenant ("" = the default store).
    pub fn store_named(&self, tenant: &str) -> Option<(usize, &'static Store)> {
        if tenant.is_empty() {
            return Some((0, self.store));
        }
        self.tenants
            .iter()
            .position(|t| t.cfg.name == tenant)
            .map(|i| (i, self.tenants[i].store))
    }

    /// Every store (one in shared isolation).
    pub fn stores(&self) -> Vec<&'static Store> {
        if self.tenants.is_empty() {
            vec![self.store]
        } else {
            self.tenants.iter().map(|t| t.store).collect()
        }
    }

    /// The tenant a new connection belongs to: the one whose secret it presented, else the
    /// one its peer uid or gid maps to. Shared isolation: always store 0.
    pub fn tenant_of(&self, secret: &str, uid: u32, gid: u32) -> Result<usize, String> {
        if self.tenants.is_empty() {
            return Ok(0);
        }
        if !secret.is_empty() {
            return self
                .tenants
                .iter()
                .position(|t| {
                    !t.cfg.secret.is_empty()
                        && admin::same(t.cfg.secret.as_bytes(), secret.as_bytes())
                })
                .ok_or_else(|| "no tenant has this secret".to_string());
        }
        self.tenants
            .iter()
            .position(|t| t.cfg.uids.contains(&uid) || t.cfg.gids.contains(&gid))
            .ok_or_else(|| {
                format!("uid {uid} / gid {gid} belongs to no tenant: present a tenant secret in Hello, or map it in [[tenants]]")
            })
    }

    /// Whether shutdown began.
    pub fn stopping(&self) -> bool {
        self.stop.load(Relaxed)
    }

    /// Records one engine request's service time.
    pub fn record(&self, op: &'static str, d: Duration) {
        let mut m = self.latency.lock();
        let h = match m.entry(op) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                match Histogram::new_with_bounds(1, 60_000_000, 2) {
                    Ok(h) => v.insert(h),
                    Err(_) => return,
                }
            }
        };
        let _ = h.record((d.as_micros() as u64).max(1));
    }

    /// Service-time distribution per engine request kind, sorted by kind.
    pub fn latency_buckets(&self) -> Vec<(&'static str, kvstore::LatencyBuckets)> {
        let m = self.latency.lock();
        let mut v: Vec<_> = m
            .iter()
            .map(|(op, h)| (*op, kvstore::LatencyBuckets::from_hdr(h)))
            .collect();
        v.sort_by_key(|(op, _)| *op);
        v
    }
}

/// The remote tier `[cluster]` asks for, and its etcd membership, if any.
type ClusterTier = (
    Arc<kvtier_cluster::RemoteTier>,
    Option<kvtier_cluster::EtcdConfig>,
);

/// The remote tier `[cluster]` asks for (static or etcd membership), if any.
/// A retain's answer, as the engine protocol says it.
pub(crate) fn retain_reply(out: &kvstore::Retained) -> kvtier_proto::ipc::RetainReply {
    kvtier_proto::ipc::RetainReply {
        present: out.present as u32,
        retained: out.retained as u32,
        clipped: out.clipped as u32,
        clipped_by: out.clipped_by.iter().map(|b| b.key().to_string()).collect(),
        refused: out.refused.clone(),
        ttl_ms: out.ttl.as_millis() as u64,
        retained_bytes: out.bytes,
        displaced: out.displaced as u32,
    }
}

fn cluster_tier(cfg: &config::Config) -> Result<Option<ClusterTier>> {
    let c = &cfg.cluster;
    if c.listen.is_empty() {
        return Ok(None);
    }
    let etcd = if c.etcd.is_empty() {
        None
    } else {
        let s = cfg.store()?;
        Some(kvtier_cluster::EtcdConfig {
            endpoints: c.etcd.clone(),
            prefix: c.etcd_prefix.clone(),
            ttl: Duration::from_millis(c.lease_ttl_ms),
            timeout: Duration::from_millis(c.timeout_ms),
            me: c.listen.clone(),
            capacity: s.capacity_bytes + s.disk.as_ref().map_or(0, |d| d.capacity_bytes),
            version: env!("CARGO_PKG_VERSION").to_string(),
        })
    };
    // Static members weigh the same; with etcd each member's advertised capacity is its weight
    // (until etcd answers, this node alone).
    let members = match &etcd {
        Some(e) => vec![kvtier_cluster::Member::new(
            c.listen.clone(),
            e.capacity as f64,
        )],
        None => c
            .members
            .iter()
            .map(|m| kvtier_cluster::Member::new(m.clone(), 1.0))
            .collect(),
    };
    let t = kvtier_cluster::RemoteTier::new(kvtier_cluster::RemoteConfig {
        me: c.listen.clone(),
        members,
        secret: c.secret.clone(),
        timeout: Duration::from_millis(c.timeout_ms),
        replicas: c.replicas as usize,
        handoff: Duration::from_millis(c.handoff_ms),
    })
    .context("cluster")?;
    Ok(Some((Arc::new(t), etcd)))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            logging::say(std::io::stderr(), &format!("kvtierd: {e:#}"));
            ExitCode::from(2)
        }
    }
}

/// Raises the soft limit on open files to the hard one (systemd's default soft limit is
/// 1,024): engine connections, admin and metrics connections, peers and the disk tier's files
/// all take descriptors, and running out stops every listener from accepting.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit it is given, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 || r.rlim_cur >= r.rlim_max {
        return;
    }
    let from = r.rlim_cur;
    r.rlim_cur = r.rlim_max;
    // SAFETY: setrlimit reads the rlimit it is given, which lives for the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) } == 0 {
        tracing::info!(
            from,
            to = r.rlim_cur,
            "open files limit raised to the hard limit"
        );
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    let mut sets = Vec::new();
    let mut flag = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            sets.push(format!("{k}={v}"));
        }
    };
    flag("data_dir", args.data_dir.map(|p| p.display().to_string()));
    flag("host.capacity", args.host_capacity);
    flag("disk.capacity", args.disk_capacity);
    flag(
        "server.socket",
        args.socket.map(|p| p.display().to_string()),
    );
    flag("server.grpc", args.grpc);
    flag("server.metrics", args.metrics);
    if args.no_disk {
        sets.push("disk.enabled=false".into());
    }
    sets.extend(args.sets);
    let cfg = config::load(config::Sources {
        file: args.config.as_deref(),
        env: std::env::vars().collect(),
        sets,
    })?;
    // Logging never panics and never blocks a request: a writer thread, a bounded queue, lines
    // dropped (and counted) when stderr is gone or stalled.
    let (log_writer, log_stats) = logging::non_blocking(std::io::stderr())?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cfg.log)
                .with_context(|| format!("log = {:?} is not a tracing filter", cfg.log))?,
        )
        .with_writer(log_writer)
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    raise_fd_limit();

    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("creating the data directory {}", cfg.data_dir.display()))?;
    // One daemon per data directory: an exclusive lock held for the process's life.
    let lock_path = cfg.data_dir.join("kvtierd.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    // SAFETY: flock on a valid open fd.
    if unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&lock),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    } != 0
    {
        bail!(
            "another kvtierd is using {} (it holds {})",
            cfg.data_dir.display(),
            lock_path.display()
        );
    }
    let socket = cfg.socket();
    if let Ok(meta) = std::fs::symlink_metadata(&socket) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            bail!(
                "{} exists and is not a socket: refusing to replace it (check server.socket)",
                socket.display()
            );
        }
        if UnixStream::connect(&socket).is_ok() {
            bail!("another kvtierd is serving {}", socket.display());
        }
        std::fs::remove_file(&socket)
            .with_context(|| format!("removing the stale socket {}", socket.display()))?;
    }
    let opened = Instant::now();
    let remote = cluster_tier(&cfg)?;
    let mut tenants = Vec::new();
    let store: &'static Store = if cfg.server.isolation == "tenant" {
        for (t, scfg) in cfg.tenant_stores()? {
            tracing::info!(
                tenant = %t.name,
                host_bytes = scfg.capacity_bytes,
                disk_bytes = scfg.disk.as_ref().map_or(0, |d| d.capacity_bytes),
                "kvtierd starting: opening a tenant's store (its own arena)"
            );
            let s: &'static Store = Box::leak(Box::new(
                scfg.build()
                    .with_context(|| format!("opening tenant {}'s store", t.name))?,
            ));
            tenants.push(Tenant { cfg: t, store: s });
        }
        tenants[0].store
    } else {
        let mut scfg = cfg.store()?;
        if let Some((r, _)) = &remote {
            scfg.remote = Some(kvstore::SharedTier(r.clone()));
            scfg.push_queue_bytes = cfg.cluster.push_queue_bytes.0;
        } else if !cfg.cluster.redis.is_empty() {
            let c = &cfg.cluster;
            let t = kvtier_cluster::RedisTier::new(kvtier_cluster::RedisConfig {
                urls: c.redis.split(',').map(|u| u.trim().to_string()).collect(),
                cluster: c.redis_cluster,
                prefix: c.redis_prefix.clone(),
                ttl_s: c.redis_ttl_s,
                timeout: Duration::from_millis(c.timeout_ms),
            })
            .context("cluster.redis")?;
            tracing::info!(redis = %c.redis, cluster = c.redis_cluster, "remote tier: Redis");
            scfg.remote = Some(kvstore::SharedTier(std::sync::Arc::new(t)));
            scfg.push_queue_bytes = c.push_queue_bytes.0;
        }
        tracing::info!(
            host_bytes = scfg.capacity_bytes,
            disk_bytes = scfg.disk.as_ref().map_or(0, |d| d.capacity_bytes),
            disk_dir = ?scfg.disk.as_ref().map(|d| d.dir.display().to_string()),
            host_policy = scfg.policy.name(),
            disk_policy = scfg.disk.as_ref().map_or("", |d| d.policy.name()),
            "kvtierd starting: opening the store (the host arena is faulted in in the background)"
        );
        let mut s = scfg.build().context("opening the store")?;
        if cfg.disk.fault_delay_ms > 0 {
            tracing::warn!(
                ms = cfg.disk.fault_delay_ms,
                "disk.fault_delay_ms is set: every disk I/O completion is delayed (for tests only)"
            );
            let delay = Duration::from_millis(cfg.disk.fault_delay_ms);
            s.wrap_disk_engine(|inner| {
                let f = kvstore::io::fault::FaultEngine::new(inner);
                f.set_plan(kvstore::io::fault::FaultPlan {
                    delay,
                    ..Default::default()
                });
                std::sync::Arc::new(f)
            });
        }
        Box::leak(Box::new(s))
    };
    tracing::info!(
        secs = format!("{:.2}", opened.elapsed().as_secs_f64()),
        "store open"
    );
    let ipc = UnixListener::bind(&socket)
        .with_context(|| format!("binding the engine socket {}", socket.display()))?;
    // Whoever connects gets the whole arena: owner and group only.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660))
            .with_context(|| format!("restricting {}", socket.display()))?;
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut daemon = Daemon::new(store, tenants, cfg.clone(), log_stats);
    daemon.cluster = remote.map(|(remote, etcd)| Cluster {
        remote,
        server: Arc::default(),
        etcd: etcd.map(|e| (e, Arc::default())),
    });
    let d = Arc::new(daemon);
    rt.block_on(async {
        let mut cluster_at = String::new();
        let mut cluster_task = None;
        let mut membership_task = None;
        if let Some(c) = &d.cluster {
            let l = tokio::net::TcpListener::bind(&cfg.cluster.listen)
                .await
                .with_context(|| format!("binding cluster.listen = {}", cfg.cluster.listen))?;
            cluster_at = format!(" cluster={}", l.local_addr()?);
            let st = store.stats();
            let capacity = st.capacity_bytes + st.disk().map_or(0, |k| k.capacity_bytes);
            cluster_task = Some(tokio::spawn(kvtier_cluster::serve(
                l,
                store,
                kvtier_cluster::ServerConfig {
                    node: cfg.cluster.listen.clone(),
                    secret: cfg.cluster.secret.clone(),
                    capacity,
                    timeout: Duration::from_millis(cfg.cluster.timeout_ms),
                },
                c.server.clone(),
            )));
            tracing::info!(listen = %cfg.cluster.listen, members = cfg.cluster.members.len(),
                etcd = ?cfg.cluster.etcd, replicas = cfg.cluster.replicas, "remote tier: serving peers");
            if let Some((e, m)) = &c.etcd {
                membership_task = Some(tokio::spawn(kvtier_cluster::run_etcd(
                    e.clone(),
                    c.remote.clone(),
                    m.clone(),
                )));
            }
        }
        let grpc = tokio::net::TcpListener::bind(&cfg.server.grpc)
            .await
            .with_context(|| format!("binding server.grpc = {}", cfg.server.grpc))?;
        let metrics_l = tokio::net::TcpListener::bind(&cfg.server.metrics)
            .await
            .with_context(|| format!("binding server.metrics = {}", cfg.server.metrics))?;
        let (grpc_addr, metrics_addr) = (grpc.local_addr()?, metrics_l.local_addr()?);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut events_at = String::new();
        if !cfg.events.endpoint.is_empty() {
            let stores = d.stores().into_iter().enumerate().collect();
            let p = events::start(
                &cfg.events,
                stores,
                d.ns_info.clone(),
                d.engine_hashes.clone().unwrap_or_default(),
                d.events.clone(),
                stop_rx.clone(),
            )
            .await?;
            events_at = format!(" events={}", p.endpoint);
            if let Some(r) = p.replay_endpoint {
                events_at.push_str(&format!(" events_replay={r}"));
            }
        }
        // SIGTERM is handled from before the ready line: a supervisor that stops the daemon
        // right after it reported ready still gets a clean shutdown.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        let st = store.stats();
        logging::say(
            std::io::stdout(),
            &format!(
                "kvtierd ready: socket={} grpc={grpc_addr} metrics={metrics_addr} data_dir={} host_bytes={} disk_bytes={} io_engine={}{events_at}{cluster_at}",
                socket.display(),
                cfg.data_dir.display(),
                st.capacity_bytes,
                st.disk().map_or(0, |k| k.capacity_bytes),
                st.disk().map_or("none", |k| k.engine),
            ),
        );

        let ipc_thread = {
            let d = d.clone();
            std::thread::Builder::new()
                .name("kvtierd-ipc".into())
                .spawn(move || ipc_server::serve(ipc, d))?
        };
        let metrics_task = tokio::spawn(metrics::serve(metrics_l, d.clone(), stop_rx.clone()));
        let svc = AdminServer::new(admin::AdminService { d: d.clone() })
            .max_decoding_message_size(cfg.server.max_message_bytes.0 as usize)
            .max_encoding_message_size(cfg.server.max_message_bytes.0 as usize);
        let svc = tonic::service::interceptor::InterceptedService::new(
            svc,
            admin::check_token(cfg.server.token.clone()),
        );
        let mut grpc_stop = stop_rx.clone();
        let gate = conns::Gate::new("admin gRPC", ADMIN_CONNS, d.admin_conns.clone());
        let grpc_task = tokio::spawn(
            tonic::transport::Server::builder()
                // A peer that answers no ping for 20 s is dropped (a Watch's client that
                // hung, a cut network): its connection, its streams' threads and slots go.
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(20)))
                // A peer that answers pings and opens no stream holds its slot 30 min at
                // most: then GOAWAY, and the connection ends once its streams have (a
                // Watch's goes on; a gRPC client opens a new connection for its next call).
                .max_connection_age(Duration::from_secs(30 * 60))
                .add_service(svc)
                .serve_with_incoming_shutdown(conns::incoming(grpc, gate), async move {
                    let _ = grpc_stop.changed().await;
                }),
        );

        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        // Stop accepting; let in-flight requests finish.
        d.stop.store(true, Relaxed);
        let _ = stop_tx.send(true);
        // In-flight requests finish; a stuck client is not waited for past the grace period.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ipc_thread.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !ipc_thread.is_finished() {
            tracing::warn!("engine connections still busy after 30 s: flushing anyway");
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), grpc_task).await;
        metrics_task.abort();
        if let Some(t) = membership_task {
            t.abort();
        }
        if let Some((e, m)) = d.cluster.as_ref().and_then(|c| c.etcd.as_ref()) {
            // A clean stop leaves the placement at once (peers stop asking this node).
            kvtier_cluster::leave(e, m).await;
        }
        if let Some(c) = d.cluster.as_ref().filter(|_| cfg.cluster.handoff_stop_ms > 0) {
            // Then hands its host blocks to their next owners (still serving peers meanwhile).
            let remote = c.remote.clone();
            let (rate, by) = (
                cfg.cluster.handoff_bytes_per_s.0,
                Instant::now() + Duration::from_millis(cfg.cluster.handoff_stop_ms),
            );
            let r = tokio::task::spawn_blocking(move || {
                kvtier_cluster::hand_over(store, &remote, rate, by)
            })
            .await;
            if let Err(e) = r {
                tracing::warn!(error = %e, "cluster: the hand-over failed");
            }
        }
        if let Some(t) = cluster_task {
            t.abort();
        }
        anyhow::Ok(())
    })?;
    // Make the disk tier durable and its journal compact.
    let written: usize = d.stores().iter().map(|s| s.flush()).sum();
    tracing::info!(written, "flushed dirty blocks to disk; bye");
    let _ = std::fs::remove_file(&socket);
    drop(lock);
    Ok(())
}

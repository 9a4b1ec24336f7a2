//! `kvtierd`: kvtier's per-node sidecar. It owns the host arena and the disk tier, so the cache
//! outlives engine processes; engines talk to it over a Unix socket (the arena is shared by fd
//! passing), operators over gRPC, Prometheus over `/metrics`.

mod admin;
mod config;
mod ipc_server;
mod logging;
mod metrics;

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

/// State shared by the servers.
pub struct Daemon {
    /// The store (lives as long as the process).
    pub store: &'static Store,
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
    /// Namespace ids registered by live connections (kept when the table is reclaimed).
    ns_held: Mutex<HashMap<u32, usize>>,
    /// Leases made through the admin API (id → blocks pinned).
    pub admin_leases: Mutex<HashMap<u64, u64>>,
    /// Engine requests answered with an error.
    pub ipc_errors: AtomicU64,
    /// Admin Watch streams open now (bounded by server.max_watchers).
    pub watchers: AtomicU64,
    /// Log lines dropped (stderr gone or stalled).
    pub log: Arc<logging::LogStats>,
    latency: Mutex<HashMap<&'static str, Histogram<u64>>>,
}

impl Daemon {
    /// Registers a namespace for a connection (`check` may refuse a new one); when the table
    /// is full, ids of namespaces with no blocks that no live connection holds are reclaimed
    /// first.
    pub fn register_namespace(
        &self,
        ns: &kvstore::Namespace,
        check: impl Fn(kvstore::NsId) -> Result<(), String>,
    ) -> Result<kvstore::NsId, String> {
        let fp = ns.fingerprint();
        if let Some(i) = self.store.namespaces().iter().position(|f| *f == fp) {
            let id = kvstore::NsId(i as u32);
            check(id)?;
            return Ok(id);
        }
        check(kvstore::NsId(u32::MAX))?;
        match self.store.register_namespace(ns) {
            Err(kvstore::KeyError::TableFull(_)) => {
                let held = self.ns_held.lock().clone();
                self.store
                    .reclaim_namespaces(&|id| held.contains_key(&id.0));
                self.store.register_namespace(ns).map_err(|e| e.to_string())
            }
            r => r.map_err(|e| e.to_string()),
        }
    }

    /// Counts a live connection's hold on a namespace id (`hold`), or drops it.
    pub fn hold_namespace(&self, id: kvstore::NsId, hold: bool) {
        let mut m = self.ns_held.lock();
        let n = m.entry(id.0).or_default();
        if hold {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&id.0);
            }
        }
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

    /// (op, count, p50 µs, p99 µs) per engine request kind.
    pub fn latency_quantiles(&self) -> Vec<(&'static str, u64, u64, u64)> {
        let m = self.latency.lock();
        let mut v: Vec<_> = m
            .iter()
            .map(|(op, h)| {
                (
                    *op,
                    h.len(),
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.99),
                )
            })
            .collect();
        v.sort();
        v
    }
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
    let scfg = cfg.store()?;
    tracing::info!(
        host_bytes = scfg.capacity_bytes,
        disk_bytes = scfg.disk.as_ref().map_or(0, |d| d.capacity_bytes),
        disk_dir = ?scfg.disk.as_ref().map(|d| d.dir.display().to_string()),
        "kvtierd starting: opening the store (the host arena is faulted in in the background)"
    );
    let opened = Instant::now();
    let store: &'static Store = Box::leak(Box::new(scfg.build().context("opening the store")?));
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
    let d = Arc::new(Daemon {
        store,
        cfg: cfg.clone(),
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
        log: log_stats,
        latency: Mutex::new(HashMap::new()),
    });
    rt.block_on(async {
        let grpc = tokio::net::TcpListener::bind(&cfg.server.grpc)
            .await
            .with_context(|| format!("binding server.grpc = {}", cfg.server.grpc))?;
        let metrics_l = tokio::net::TcpListener::bind(&cfg.server.metrics)
            .await
            .with_context(|| format!("binding server.metrics = {}", cfg.server.metrics))?;
        let (grpc_addr, metrics_addr) = (grpc.local_addr()?, metrics_l.local_addr()?);
        let st = store.stats();
        logging::say(
            std::io::stdout(),
            &format!(
                "kvtierd ready: socket={} grpc={grpc_addr} metrics={metrics_addr} data_dir={} host_bytes={} disk_bytes={} io_engine={}",
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
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let metrics_task = tokio::spawn(metrics::serve(metrics_l, d.clone(), stop_rx.clone()));
        let svc = AdminServer::new(admin::AdminService { d: d.clone() })
            .max_decoding_message_size(cfg.server.max_message_bytes.0 as usize)
            .max_encoding_message_size(cfg.server.max_message_bytes.0 as usize);
        let svc = tonic::service::interceptor::InterceptedService::new(
            svc,
            admin::check_token(cfg.server.token.clone()),
        );
        let mut grpc_stop = stop_rx.clone();
        let grpc_task = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(grpc),
                    async move {
                        let _ = grpc_stop.changed().await;
                    },
                ),
        );

        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
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
        anyhow::Ok(())
    })?;
    // Make the disk tier durable and its journal compact.
    let written = store.flush();
    tracing::info!(written, "flushed dirty blocks to disk; bye");
    let _ = std::fs::remove_file(&socket);
    drop(lock);
    Ok(())
}

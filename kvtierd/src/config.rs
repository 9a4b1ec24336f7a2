//! kvtierd's configuration: embedded defaults, then a TOML file, then `KVTIERD_*` environment
//! variables, then command-line flags. An unknown or invalid key anywhere is a startup error that
//! names it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use kvstore::io::{IoConfig, IoEngineKind};
use kvstore::{Admission, DiskConfig, PolicyKind, Populate, StoreConfig};
use serde::{Deserialize, Serialize};

/// A byte size: an integer or a string like "4G".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            N(u64),
            S(String),
        }
        let r = Repr::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a size: a non-negative integer or a string like \"4G\"",
            )
        })?;
        match r {
            Repr::N(n) => Ok(Size(n)),
            Repr::S(s) => parse_size(&s).map(Size).map_err(serde::de::Error::custom),
        }
    }
}

/// Parses `123`, `64K`, `4M`, `2G`, `1T` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .with_context(|| format!("{s:?} is not a size (use a number with K, M, G or T)"))?;
    n.checked_mul(mult)
        .with_context(|| format!("{s:?} does not fit in 64 bits"))
}

/// The whole configuration.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where the disk tier and the engine socket live.
    pub data_dir: PathBuf,
    /// tracing filter, e.g. "info" or "kvstore=debug".
    pub log: String,
    /// Host memory tier.
    pub host: HostSection,
    /// Disk tier.
    pub disk: DiskSection,
    /// Listeners.
    pub server: ServerSection,
    /// Preloading from engines' hints.
    pub preload: PreloadSection,
    /// KV events for cache-aware routers (vLLM's ZMQ publisher format).
    pub events: EventsSection,
    /// Tenants (`server.isolation = "tenant"`): each gets its own arena and quota.
    pub tenants: Vec<TenantSection>,
    /// The remote tier: nodes pooling their blocks.
    pub cluster: ClusterSection,
}

/// `[cluster]`: this node's place in a cluster of kvtierd nodes that pool their blocks (the
/// remote tier). Each block is owned by the member with the highest rendezvous score for its
/// key; a node pushes what engines save to the owners in the background and asks the owners
/// for what its own tiers miss.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSection {
    /// This node's data-plane address, `host:port`, as the members list names it; empty: no
    /// remote tier (the default).
    pub listen: String,
    /// Static membership: every member's data-plane address, this node's included.
    pub members: Vec<String>,
    /// etcd endpoints (`http://host:port`) for membership under a lease, instead of
    /// `members`: each node registers itself (address, capacity, version), keeps its lease
    /// alive and watches the others.
    pub etcd: Vec<String>,
    /// Key prefix of the members in etcd (one cluster per prefix).
    pub etcd_prefix: String,
    /// Lease TTL in etcd, milliseconds (whole seconds, at least 1 s): a member that stops
    /// renewing leaves the placement after it.
    pub lease_ttl_ms: u64,
    /// Shared secret every member presents at connection set-up (HMAC-SHA256 over a nonce);
    /// required when `listen` is not a loopback address.
    pub secret: String,
    /// Deadline of every request to a peer (connect, ask, transfer), milliseconds: a dead or
    /// slow peer costs a miss within it.
    pub timeout_ms: u64,
    /// Owners per block (pushes go to all; loads ask the first reachable, then the next).
    pub replicas: u32,
    /// After a membership change (a join, a leave), how long lookups and loads also ask the
    /// owners under the previous membership, milliseconds (0: not at all).
    pub handoff_ms: u64,
    /// On a clean stop (SIGTERM), how long this node hands its host blocks over to their next
    /// owners before it exits, milliseconds (0: it does not); fits the manifests' grace period.
    pub handoff_stop_ms: u64,
    /// Bandwidth of that hand-over, bytes per second (0: unbounded).
    pub handoff_bytes_per_s: Size,
    /// Most bytes of saved blocks queued for pushing to their owners; past it a block is not
    /// pushed (counted), so a slow network never holds up an engine.
    pub push_queue_bytes: Size,
    /// An existing Redis or Valkey as the remote tier instead of kvtierd peers:
    /// `redis://host:port[/db]` (comma-separated seeds with `redis_cluster`); empty: none.
    pub redis: String,
    /// `redis` names a Redis Cluster.
    pub redis_cluster: bool,
    /// Key prefix of the blocks in Redis.
    pub redis_prefix: String,
    /// Time to live of each block in Redis, seconds (0: none).
    pub redis_ttl_s: u64,
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            listen: String::new(),
            members: Vec::new(),
            etcd: Vec::new(),
            etcd_prefix: "/kvtier/members/".into(),
            lease_ttl_ms: 10_000,
            secret: String::new(),
            timeout_ms: 2_000,
            replicas: 1,
            handoff_ms: 600_000,
            handoff_stop_ms: 60_000,
            handoff_bytes_per_s: Size(512 << 20),
            push_queue_bytes: Size(256 << 20),
            redis: String::new(),
            redis_cluster: false,
            redis_prefix: "kvtier:".into(),
            redis_ttl_s: 86_400,
        }
    }
}

/// `[events]`: block stored/removed events published as vLLM's `ZmqEventPublisher` does (PUB
/// socket, frames topic / 8-byte big-endian sequence / msgpack `KVEventBatch`; a ROUTER socket
/// replays buffered batches), so routers that read vLLM's KV events read kvtierd's.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsSection {
    /// PUB endpoint, `tcp://HOST:PORT` (`*` binds every address; port 0 picks one, printed in
    /// the ready line); empty: no events (the default).
    pub endpoint: String,
    /// ROUTER endpoint for replay requests (empty: none).
    pub replay_endpoint: String,
    /// The first frame of every message.
    pub topic: String,
    /// "map" (current vLLM: events as tagged maps) or "array" (older consumers: tagged arrays).
    pub encoding: String,
    /// Block hashes as the low 64 bits of the key, an integer, instead of its 16 bytes.
    pub int_hashes: bool,
    /// A copy pushed to another node announced with `medium` "REMOTE" (kvtier before vLLM 0.32
    /// gave events a `locality`) instead of `medium` "CPU" and `locality` "REMOTE".
    pub remote_medium: bool,
    /// Batches kept for replay (at most 64 MiB of them).
    pub buffer_steps: usize,
    /// Batches queued for publishing (at most 64 MiB); past it new batches are dropped
    /// (counted), and subscribers' view is reset.
    pub hwm: usize,
    /// Block events a store may run ahead of its publisher thread; past it events are lost
    /// (counted), and subscribers' view is reset: an `AllBlocksCleared`, then every block
    /// held.
    pub backlog: usize,
}

impl Default for EventsSection {
    fn default() -> Self {
        Self {
            endpoint: String::new(),
            replay_endpoint: String::new(),
            topic: String::new(),
            encoding: "map".into(),
            int_hashes: false,
            remote_medium: false,
            buffer_steps: 10_000,
            hwm: 100_000,
            backlog: 65_536,
        }
    }
}

/// `[preload]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PreloadSection {
    /// Most bytes of hinted blocks being promoted at once, queued or being read (per store;
    /// 0: an eighth of the host tier). A hint past it is cut short (counted).
    pub max_inflight_bytes: Size,
    /// Most bytes of preloaded blocks held in host memory until the request that hinted them
    /// loads them (or the hint's deadline passes), those in flight included (0: an eighth
    /// of the host tier). A hint past it is cut short (counted).
    pub max_held_bytes: Size,
    /// Deadline of a hint that names none: a preload not started by then is dropped.
    pub deadline_ms: u64,
    /// Most bytes (host and disk together) retained for sessions by Retain hints, per tenant
    /// (0: a quarter of the host tier). A retain past it ends lower-priority retentions first,
    /// then keeps what fits and says so.
    pub max_retained_bytes: Size,
    /// Longest TTL a Retain is granted (longer ones are shortened, and the reply says so); 0:
    /// retention off (every Retain refused with the reason).
    pub max_retain_ms: u64,
}

impl Default for PreloadSection {
    fn default() -> Self {
        Self {
            max_inflight_bytes: Size(0),
            max_held_bytes: Size(0),
            deadline_ms: 10_000,
            max_retained_bytes: Size(0),
            max_retain_ms: 3_600_000,
        }
    }
}

/// `[[tenants]]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantSection {
    /// The tenant's name (labels its stats and its disk subdirectory).
    pub name: String,
    /// Peer uids (SO_PEERCRED) that belong to this tenant.
    pub uids: Vec<u32>,
    /// Peer primary gids that belong to this tenant.
    pub gids: Vec<u32>,
    /// A secret a client presents in Hello instead (empty: none).
    pub secret: String,
    /// The tenant's host arena (its own memfd): its host quota.
    pub host_capacity: Size,
    /// Its disk quota (0: no disk tier for it).
    pub disk_capacity: Size,
}

impl Default for TenantSection {
    fn default() -> Self {
        Self {
            name: String::new(),
            uids: Vec::new(),
            gids: Vec::new(),
            secret: String::new(),
            host_capacity: Size(1 << 30),
            disk_capacity: Size(0),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("kvtier-data"),
            log: "info".into(),
            host: HostSection::default(),
            disk: DiskSection::default(),
            server: ServerSection::default(),
            preload: PreloadSection::default(),
            events: EventsSection::default(),
            tenants: Vec::new(),
            cluster: ClusterSection::default(),
        }
    }
}

/// `[host]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostSection {
    /// Bytes of shared host memory for blocks; default min(25% of RAM, 8 GiB).
    pub capacity: Option<Size>,
    /// Segment size (each serves one size class at a time).
    pub segment: Size,
    /// Slot sizes; empty: 4 per power of two from 64 KiB to the segment size.
    pub size_classes: Vec<Size>,
    /// Eviction policy: auto (default: lru in front of a disk tier, duel without one), duel
    /// (S3-FIFO and LRU in a duel), duel-clock (CLOCK in LRU's place: 8 bytes a block less),
    /// s3fifo, s3fifo-adaptive, lru, clock, sieve, wtinylfu or arc.
    pub policy: String,
    /// Explicit huge pages (needs vm.nr_hugepages).
    pub huge_pages: bool,
    /// Fault the arena in (in the background, segment by segment, while serving).
    pub populate: bool,
    /// Most leases outstanding.
    pub max_leases: u64,
    /// Check a host block's commit checksum every time it is loaded.
    pub verify_reads: bool,
}

impl Default for HostSection {
    fn default() -> Self {
        Self {
            capacity: None,
            segment: Size(64 << 20),
            size_classes: Vec::new(),
            policy: "auto".into(),
            huge_pages: false,
            populate: true,
            max_leases: 1 << 16,
            verify_reads: false,
        }
    }
}

/// `[disk]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiskSection {
    /// Whether the disk tier is on.
    pub enabled: bool,
    /// Its directory; default `<data_dir>/disk`.
    pub dir: Option<PathBuf>,
    /// Bytes of block space; default min(25% of the free space there, 32 GiB).
    pub capacity: Option<Size>,
    /// Data files.
    pub files: u32,
    /// auto, io_uring or psync.
    pub engine: String,
    /// I/O queue depth.
    pub queue_depth: u32,
    /// io_uring submission-queue polling thread.
    pub sqpoll: bool,
    /// Eviction policy of the disk tier.
    pub policy: String,
    /// seen-twice or always.
    pub admission: String,
    /// seen-twice admits every block while the disk is less full than this fraction of its
    /// capacity (writing into free room displaces nothing); 0: seen-twice from the first block.
    pub admit_all_below: f64,
    /// Write at commit instead of at host eviction.
    pub write_through: bool,
    /// Bytes per write-back batch.
    pub max_batch: Size,
    /// For tests only: delay every disk I/O completion by this long (a slow device).
    pub fault_delay_ms: u64,
}

impl Default for DiskSection {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: None,
            capacity: None,
            files: 1,
            engine: "auto".into(),
            queue_depth: 32,
            sqpoll: false,
            policy: "duel".into(),
            admission: "seen-twice".into(),
            admit_all_below: kvstore::DEFAULT_ADMIT_ALL_BELOW,
            write_through: false,
            max_batch: Size(256 << 20),
            fault_delay_ms: 0,
        }
    }
}

/// `[server]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    /// Engine socket; default `<data_dir>/kvtierd.sock`.
    pub socket: Option<PathBuf>,
    /// Admin gRPC address.
    pub grpc: String,
    /// Prometheus `/metrics` address.
    pub metrics: String,
    /// Bearer token for gRPC and /metrics; required to bind anything but loopback.
    pub token: String,
    /// Largest gRPC message accepted.
    pub max_message_bytes: Size,
    /// Default lease TTL, milliseconds.
    pub lease_ttl_ms: u64,
    /// Uncommitted reservations are dropped after this long, milliseconds.
    pub reservation_ttl_ms: u64,
    /// Most engine connections at once.
    pub max_clients: u32,
    /// Most keys in one engine request.
    pub max_keys: u32,
    /// Most admin Watch streams open at once.
    pub max_watchers: u32,
    /// A Watch stream whose client takes no message for this long (it stopped reading, or
    /// vanished without closing its connection) is ended, its thread and slot freed;
    /// milliseconds.
    pub watch_send_timeout_ms: u64,
    /// A connection must send Hello within this long, milliseconds.
    pub hello_timeout_ms: u64,
    /// Bytes of engine frames being received at once, over every connection.
    pub max_inflight_frame_bytes: Size,
    /// Most blocks one engine connection may hold pinned by its leases.
    pub max_pinned_per_connection: u64,
    /// Most namespaces one engine connection may register.
    pub max_namespaces_per_connection: u32,
    /// Admin writes (pin, unpin, clear) without a token: only when set explicitly.
    pub allow_unauthenticated_admin: bool,
    /// Most blocks pinned through the admin API at once.
    pub max_admin_pinned: u64,
    /// "shared": one arena every engine maps (engines on the node trust each other); "tenant":
    /// each `[[tenants]]` entry gets its own arena, and a client only ever receives its own.
    pub isolation: String,
    /// Longest an engine's Load waits for blocks being promoted from a lower tier (and a
    /// save for room being written back), milliseconds.
    pub load_wait_ms: u64,
    /// After answering, a connection's thread polls for the engine's next request this many
    /// microseconds before it sleeps (0: sleep at once): a request that follows within it is
    /// read without a scheduler wake-up. Costs up to that much CPU per request.
    pub spin_us: u64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            socket: None,
            grpc: "127.0.0.1:50551".into(),
            metrics: "127.0.0.1:9464".into(),
            token: String::new(),
            max_message_bytes: Size(4 << 20),
            lease_ttl_ms: 30_000,
            reservation_ttl_ms: 60_000,
            max_clients: 256,
            max_keys: 65_536,
            max_watchers: 16,
            watch_send_timeout_ms: 30_000,
            hello_timeout_ms: 5_000,
            max_inflight_frame_bytes: Size(64 << 20),
            max_pinned_per_connection: 1 << 20,
            max_namespaces_per_connection: 64,
            allow_unauthenticated_admin: false,
            max_admin_pinned: 1 << 16,
            isolation: "shared".into(),
            load_wait_ms: 5_000,
            spin_us: 50,
        }
    }
}

/// Sets `path = raw` in a TOML table, typed as the key is: a key whose default is a string
/// (an address, a token, a name) takes `raw` verbatim, so `[::1]:7070` or a numeric token stay
/// strings; any other key takes `raw` as a TOML value (`8`, `true`, `[64K, 2M]`, `"4G"`), and a
/// bare word where TOML sees none (`4G`) as a string.
fn set_path(
    table: &mut toml::Table,
    defaults: &toml::Table,
    path: &[&str],
    raw: &str,
    origin: &str,
) -> Result<()> {
    let mut d: Option<&toml::Value> = None;
    let mut t = Some(defaults);
    for p in path {
        d = t.and_then(|t| t.get(*p));
        t = d.and_then(|v| v.as_table());
    }
    let value = match d {
        Some(toml::Value::String(_)) => toml::Value::String(raw.to_string()),
        _ => match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
            Ok(t) => t["v"].clone(),
            Err(_) if raw.starts_with('[') || raw.starts_with('{') => {
                bail!("{origin}: {raw:?} is not a TOML value")
            }
            Err(_) => toml::Value::String(raw.to_string()),
        },
    };
    let (last, parents) = path.split_last().context("empty key")?;
    let mut t = table;
    for p in parents {
        let entry = t
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .with_context(|| format!("{origin}: {p} is not a section"))?;
    }
    t.insert(last.to_string(), value);
    Ok(())
}

/// Fails, naming `origin`, when the layers merged so far (ending with the one from `origin`)
/// do not make a configuration: an unknown key or a mistyped value is blamed on the file,
/// variable or flag that brought it (the layers before it were fine).
fn check_layer(table: &toml::Table, origin: &str) -> Result<()> {
    match Config::deserialize(toml::Value::Table(table.clone())) {
        Ok(_) => Ok(()),
        Err(e) => bail!("invalid configuration from {origin}: {e}"),
    }
}

/// Where the configuration comes from.
pub struct Sources<'a> {
    /// A TOML file.
    pub file: Option<&'a Path>,
    /// Environment variables (all of them; `KVTIERD_*` are used).
    pub env: Vec<(String, String)>,
    /// `section.key=value` settings from flags, in order.
    pub sets: Vec<String>,
}

/// Loads and validates the configuration.
pub fn load(src: Sources<'_>) -> Result<Config> {
    let mut table = match src.file {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading the config file {}", p.display()))?;
            let t = toml::from_str::<toml::Table>(&text)
                .with_context(|| format!("config file {}", p.display()))?;
            check_layer(&t, &format!("config file {}", p.display()))?;
            t
        }
        None => toml::Table::new(),
    };
    let defaults = toml::Table::try_from(Config::default())
        .context("serializing the default configuration")?;
    for (k, v) in &src.env {
        let Some(name) = k.strip_prefix("KVTIERD_") else {
            continue;
        };
        let name = name.to_ascii_lowercase();
        // The sections are those of the defaults (every one: `KVTIERD_EVENTS_ENDPOINT` and
        // `KVTIERD_PRELOAD_*` were refused when a hand-kept list left them out).
        let path: Vec<&str> = match name.split_once('_') {
            Some((sec, rest)) if defaults.get(sec).is_some_and(|v| v.is_table()) => {
                vec![sec, rest]
            }
            _ => vec![name.as_str()],
        };
        set_path(
            &mut table,
            &defaults,
            &path,
            v,
            &format!("environment variable {k}"),
        )?;
        check_layer(&table, &format!("environment variable {k}"))?;
    }
    for s in &src.sets {
        let (k, v) = s
            .split_once('=')
            .with_context(|| format!("--set {s:?}: expected section.key=value"))?;
        let path: Vec<&str> = k.trim().split('.').collect();
        set_path(
            &mut table,
            &defaults,
            &path,
            v.trim(),
            &format!("--set {k}"),
        )?;
        check_layer(&table, &format!("--set {k}"))?;
    }
    let cfg = Config::deserialize(toml::Value::Table(table))
        .map_err(|e| anyhow::anyhow!("invalid configuration: {e}"))?;
    cfg.validate()?;
    Ok(cfg)
}

fn loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

impl Config {
    fn validate(&self) -> Result<()> {
        self.validate_cluster()?;
        ensure!(
            matches!(self.events.encoding.as_str(), "map" | "array"),
            "events.encoding = {:?}: use \"map\" or \"array\"",
            self.events.encoding
        );
        for (k, v) in [
            ("events.endpoint", &self.events.endpoint),
            ("events.replay_endpoint", &self.events.replay_endpoint),
        ] {
            ensure!(
                v.is_empty() || v.starts_with("tcp://"),
                "{k} = {v:?}: use tcp://HOST:PORT (or empty for none)"
            );
        }
        ensure!(
            self.events.replay_endpoint.is_empty() || !self.events.endpoint.is_empty(),
            "events.replay_endpoint is set but events.endpoint is empty: set both"
        );
        ensure!(
            self.events.buffer_steps > 0 && self.events.hwm > 0 && self.events.backlog > 0,
            "events.buffer_steps, events.hwm and events.backlog must be positive"
        );
        ensure!(
            self.server.spin_us <= 10_000,
            "server.spin_us = {}: at most 10000 (a connection's thread would burn a core)",
            self.server.spin_us
        );
        let grpc: SocketAddr =
            self.server.grpc.parse().with_context(|| {
                format!("server.grpc = {:?} is not an ip:port", self.server.grpc)
            })?;
        let metrics: SocketAddr = self.server.metrics.parse().with_context(|| {
            format!(
                "server.metrics = {:?} is not an ip:port",
                self.server.metrics
            )
        })?;
        for (name, a) in [("server.grpc", grpc), ("server.metrics", metrics)] {
            if !loopback(&a) && self.server.token.is_empty() {
                bail!("{name} = {a} is not loopback: set server.token (clients send it as a bearer token) or bind 127.0.0.1");
            }
        }
        ensure!(
            self.host.policy.eq_ignore_ascii_case("auto")
                || PolicyKind::parse(&self.host.policy).is_some(),
            "host.policy = {:?}: use auto, duel, duel-clock, s3fifo, s3fifo-adaptive, lru, clock, sieve, wtinylfu or arc",
            self.host.policy
        );
        ensure!(
            PolicyKind::parse(&self.disk.policy).is_some(),
            "disk.policy = {:?}: use duel, duel-clock, s3fifo, s3fifo-adaptive, lru, clock, sieve, wtinylfu or arc",
            self.disk.policy
        );
        ensure!(
            IoEngineKind::parse(&self.disk.engine).is_some(),
            "disk.engine = {:?}: use auto, io_uring or psync",
            self.disk.engine
        );
        ensure!(
            Admission::parse(&self.disk.admission).is_some(),
            "disk.admission = {:?}: use seen-twice or always",
            self.disk.admission
        );
        ensure!(
            (0.0..=1.0).contains(&self.disk.admit_all_below),
            "disk.admit_all_below = {}: a fraction of the disk's capacity, 0 to 1",
            self.disk.admit_all_below
        );
        ensure!(
            self.server.lease_ttl_ms > 0,
            "server.lease_ttl_ms must be positive"
        );
        ensure!(
            self.server.reservation_ttl_ms > 0,
            "server.reservation_ttl_ms must be positive"
        );
        ensure!(
            self.server.max_clients > 0,
            "server.max_clients must be positive"
        );
        ensure!(self.server.max_keys > 0, "server.max_keys must be positive");
        match self.server.isolation.as_str() {
            "shared" => ensure!(
                self.tenants.is_empty(),
                "[[tenants]] are configured but server.isolation = \"shared\": set it to \"tenant\""
            ),
            "tenant" => {
                ensure!(
                    !self.tenants.is_empty(),
                    "server.isolation = \"tenant\" needs at least one [[tenants]] entry"
                );
                let mut names = std::collections::HashSet::new();
                for t in &self.tenants {
                    ensure!(
                        !t.name.is_empty()
                            && t.name
                                .chars()
                                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                        "tenant name {:?}: use letters, digits, - and _",
                        t.name
                    );
                    ensure!(
                        names.insert(&t.name),
                        "tenant {:?} is configured twice",
                        t.name
                    );
                    ensure!(
                        !t.uids.is_empty() || !t.gids.is_empty() || !t.secret.is_empty(),
                        "tenant {:?} has no uids, gids or secret: no client could reach it",
                        t.name
                    );
                }
            }
            other => bail!("server.isolation = {other:?}: use \"shared\" or \"tenant\""),
        }
        ensure!(
            self.server.hello_timeout_ms > 0,
            "server.hello_timeout_ms must be positive"
        );
        ensure!(
            self.server.watch_send_timeout_ms > 0,
            "server.watch_send_timeout_ms must be positive"
        );
        ensure!(
            self.server.max_inflight_frame_bytes.0 >= kvtier_ipc::MAX_FRAME as u64,
            "server.max_inflight_frame_bytes must hold at least one whole frame ({} bytes)",
            kvtier_ipc::MAX_FRAME
        );
        Ok(())
    }

    fn validate_cluster(&self) -> Result<()> {
        let c = &self.cluster;
        if !c.redis.is_empty() {
            ensure!(
                c.listen.is_empty() && c.members.is_empty() && c.etcd.is_empty(),
                "cluster.redis and cluster.listen/members/etcd are both set: the remote tier is either kvtierd peers or Redis"
            );
            for u in c.redis.split(',') {
                ensure!(
                    u.trim().starts_with("redis://") || u.trim().starts_with("rediss://"),
                    "cluster.redis: {u:?} is not a redis:// URL"
                );
            }
            ensure!(c.timeout_ms > 0, "cluster.timeout_ms must be positive");
            ensure!(
                self.server.isolation != "tenant",
                "cluster.redis with server.isolation = \"tenant\": tenants' stores stay local"
            );
            return Ok(());
        }
        if c.listen.is_empty() {
            ensure!(
                c.members.is_empty() && c.etcd.is_empty(),
                "cluster.members / cluster.etcd are set but cluster.listen is empty: set this node's data-plane address"
            );
            return Ok(());
        }
        ensure!(
            c.listen.parse::<SocketAddr>().is_ok(),
            "cluster.listen = {:?}: use IP:PORT (the address the other members name)",
            c.listen
        );
        if c.etcd.is_empty() {
            ensure!(
                c.members.contains(&c.listen),
                "cluster.members must name this node's cluster.listen ({})",
                c.listen
            );
        } else {
            ensure!(
                c.members.is_empty(),
                "cluster.members and cluster.etcd are both set: use one (etcd: membership under a lease)"
            );
            for e in &c.etcd {
                ensure!(
                    e.starts_with("http://"),
                    "cluster.etcd: {e:?} is not an http:// URL"
                );
            }
            ensure!(
                c.lease_ttl_ms >= 1000,
                "cluster.lease_ttl_ms = {}: at least 1000",
                c.lease_ttl_ms
            );
        }
        for m in &c.members {
            ensure!(
                m.parse::<SocketAddr>().is_ok(),
                "cluster.members: {m:?} is not IP:PORT"
            );
        }
        ensure!(
            !c.secret.is_empty() || kvtier_cluster::is_loopback(&c.listen),
            "cluster.listen = {} is not a loopback address: set cluster.secret (every member presents it)",
            c.listen
        );
        ensure!(c.timeout_ms > 0, "cluster.timeout_ms must be positive");
        ensure!(
            (1..=8).contains(&c.replicas),
            "cluster.replicas = {}: use 1 to 8",
            c.replicas
        );
        ensure!(
            self.server.isolation != "tenant",
            "cluster.listen with server.isolation = \"tenant\": the remote tier pools one store per node; tenants' stores stay local"
        );
        Ok(())
    }

    /// The engine socket path.
    pub fn socket(&self) -> PathBuf {
        self.server
            .socket
            .clone()
            .unwrap_or_else(|| self.data_dir.join("kvtierd.sock"))
    }

    /// Default lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.server.lease_ttl_ms)
    }

    /// Default wait of a Load for promotions.
    pub fn load_wait(&self) -> Duration {
        Duration::from_millis(self.server.load_wait_ms)
    }

    /// The store configuration of each tenant (`server.isolation = "tenant"`): the shared
    /// configuration with the tenant's own host and disk quotas and disk subdirectory.
    pub fn tenant_stores(&self) -> Result<Vec<(TenantSection, StoreConfig)>> {
        let base = self.store()?;
        let seg = base.segment_bytes;
        self.tenants
            .iter()
            .map(|t| {
                let host = t.host_capacity.0 / seg * seg;
                ensure!(
                    host >= seg,
                    "tenant {:?}: host_capacity {} is smaller than one segment ({seg})",
                    t.name,
                    t.host_capacity.0
                );
                let mut c = base.clone();
                c.capacity_bytes = host;
                c.disk = match (&base.disk, t.disk_capacity.0) {
                    (Some(d), cap) if cap > 0 => {
                        let mut d = d.clone();
                        d.dir = d.dir.join(format!("tenant-{}", t.name));
                        d.capacity_bytes = cap;
                        Some(d)
                    }
                    _ => None,
                };
                c.policy = self.host_policy(c.disk.is_some());
                Ok((t.clone(), c))
            })
            .collect()
    }

    /// The host tier's policy: `host.policy`, or for `auto` LRU in front of a disk tier and the
    /// duel without one (`PolicyKind::for_host`).
    fn host_policy(&self, disk: bool) -> PolicyKind {
        PolicyKind::parse(&self.host.policy).unwrap_or_else(|| PolicyKind::for_host(disk))
    }

    /// The store configuration, with defaults sized to this machine.
    pub fn store(&self) -> Result<StoreConfig> {
        let seg = self.host.segment.0;
        ensure!(
            seg >= 4096 && seg.is_multiple_of(4096),
            "host.segment = {seg}: use a multiple of 4096 (default 64M)"
        );
        let host = match self.host.capacity {
            Some(c) => c.0,
            None => (mem_total()? / 4).min(8 << 30),
        };
        ensure!(
            host >= seg,
            "host.capacity = {host} bytes is smaller than one segment ({seg}): raise it or lower host.segment"
        );
        let disk = if self.disk.enabled {
            let dir = self
                .disk
                .dir
                .clone()
                .unwrap_or_else(|| self.data_dir.join("disk"));
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating the disk tier directory {}", dir.display()))?;
            let capacity = match self.disk.capacity {
                Some(c) => c.0,
                None => (free_space(&dir)? / 4).min(32 << 30),
            };
            Some(DiskConfig {
                dir,
                capacity_bytes: capacity,
                files: self.disk.files,
                io: IoConfig {
                    kind: IoEngineKind::parse(&self.disk.engine).unwrap_or_default(),
                    queue_depth: self.disk.queue_depth,
                    sqpoll: self.disk.sqpoll,
                    ..Default::default()
                },
                policy: PolicyKind::parse(&self.disk.policy).unwrap_or_default(),
                admission: Admission::parse(&self.disk.admission).unwrap_or_default(),
                admit_all_below: self.disk.admit_all_below,
                write_through: self.disk.write_through,
                max_batch_bytes: self.disk.max_batch.0,
                // The store sets it when the arena is in 4 KiB pages.
                bounce_bytes: 0,
            })
        } else {
            None
        };
        Ok(StoreConfig {
            capacity_bytes: host / seg * seg,
            segment_bytes: seg,
            size_classes: self
                .host
                .size_classes
                .iter()
                .map(|s| s.0 as usize)
                .collect(),
            policy: self.host_policy(disk.is_some()),
            huge_pages: self.host.huge_pages,
            // The daemon serves at once and faults the arena in behind (logged, and shown in
            // `kvtier status`).
            populate: if self.host.populate {
                Populate::Background
            } else {
                Populate::Lazy
            },
            max_leases: self.host.max_leases as usize,
            verify_reads: self.host.verify_reads,
            prefetch_max_inflight_bytes: self.preload.max_inflight_bytes.0,
            prefetch_max_held_bytes: self.preload.max_held_bytes.0,
            retain_max_bytes: match (
                self.preload.max_retain_ms,
                self.preload.max_retained_bytes.0,
            ) {
                (0, _) => Some(0),
                (_, 0) => None,
                (_, b) => Some(b),
            },
            retain_max_ttl: Duration::from_millis(self.preload.max_retain_ms),
            wait: self.load_wait(),
            disk,
            ..Default::default()
        })
    }
}

fn mem_total() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no MemTotal in /proc/meminfo: set host.capacity")?;
    Ok(kb * 1024)
}

fn free_space(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: statvfs on a valid NUL-terminated path into a zeroed out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    ensure!(
        r == 0,
        "statvfs {}: {} (set disk.capacity)",
        dir.display(),
        std::io::Error::last_os_error()
    );
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_with(toml: &str, env: &[(&str, &str)], sets: &[&str]) -> Result<Config> {
        let dir = std::env::temp_dir().join(format!("kvtierd-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let f = dir.join(format!("c{n}.toml"));
        std::fs::write(&f, toml)?;
        load(Sources {
            file: Some(&f),
            env: env
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            sets: sets.iter().map(|s| s.to_string()).collect(),
        })
    }

    #[test]
    fn layers_and_errors() {
        let c = load_with(
            "data_dir = \"/x\"\n[host]\ncapacity = \"2G\"\n",
            &[("KVTIERD_DISK_QUEUE_DEPTH", "8"), ("PATH", "/bin")],
            &["server.grpc=127.0.0.1:0", "host.capacity=1G"],
        )
        .unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/x"));
        assert_eq!(c.host.capacity, Some(Size(1 << 30)));
        assert_eq!(c.disk.queue_depth, 8);
        assert_eq!(c.server.grpc, "127.0.0.1:0");
        let e = format!(
            "{:#}",
            load_with("[host]\ncapcity = 1\n", &[], &[]).unwrap_err()
        );
        assert!(e.contains("capcity"), "{e}");
        let e = format!(
            "{:#}",
            load_with("", &[("KVTIERD_HOST_NOPE", "1")], &[]).unwrap_err()
        );
        assert!(e.contains("NOPE") || e.contains("nope"), "{e}");
        let e = format!(
            "{:#}",
            load_with("", &[], &["server.grpc=0.0.0.0:1"]).unwrap_err()
        );
        assert!(e.contains("token"), "{e}");
        load_with("", &[], &["server.grpc=0.0.0.0:1", "server.token=s3cret"]).unwrap();
        let e = format!(
            "{:#}",
            load_with("[host]\ncapacity = \"lots\"\n", &[], &[]).unwrap_err()
        );
        assert!(e.contains("lots"), "{e}");
        let e = format!(
            "{:#}",
            load_with("", &[], &["disk.engine=spdk"]).unwrap_err()
        );
        assert!(e.contains("disk.engine"), "{e}");
        let e = format!(
            "{:#}",
            load_with("[host]\nsegment = -1\n", &[], &[]).unwrap_err()
        );
        assert!(e.contains("expected a size"), "{e}");
        let c = load_with("", &[], &["host.segment=0", "host.capacity=1G"]).unwrap();
        let e = format!("{:#}", c.store().unwrap_err());
        assert!(e.contains("host.segment"), "{e}");
    }

    #[test]
    fn host_policy_auto_is_lru_in_front_of_a_disk_tier() {
        let tmp = std::env::temp_dir().join(format!("kvtierd-policy-{}", std::process::id()));
        let dir = format!("disk.dir={:?}", tmp.display().to_string());
        let small = ["host.capacity=64M", "disk.capacity=64M"];
        let policy = |sets: &[&str]| {
            let mut all = vec![dir.as_str()];
            all.extend(small);
            all.extend(sets);
            let c = load_with("", &[], &all).unwrap();
            assert_eq!(
                c.host.policy,
                sets.iter()
                    .find_map(|s| s.strip_prefix("host.policy="))
                    .unwrap_or("auto")
            );
            c.store().unwrap().policy
        };
        assert_eq!(policy(&[]), PolicyKind::Lru);
        assert_eq!(policy(&["disk.enabled=false"]), PolicyKind::Duel);
        assert_eq!(policy(&["host.policy=duel"]), PolicyKind::Duel);
        assert_eq!(
            policy(&["host.policy=s3fifo", "disk.enabled=false"]),
            PolicyKind::S3Fifo
        );
        // Per tenant: a tenant without a disk quota has no disk tier, so the duel.
        let toml = "[server]\nisolation = \"tenant\"\n\
            [[tenants]]\nname = \"a\"\nsecret = \"x\"\nhost_capacity = \"64M\"\ndisk_capacity = \"16M\"\n\
            [[tenants]]\nname = \"b\"\nsecret = \"y\"\nhost_capacity = \"64M\"\n";
        let sets: Vec<&str> = [dir.as_str()].into_iter().chain(small).collect();
        let tenants = load_with(toml, &[], &sets)
            .unwrap()
            .tenant_stores()
            .unwrap();
        let got: Vec<_> = tenants
            .iter()
            .map(|(t, c)| (t.name.as_str(), c.policy))
            .collect();
        assert_eq!(got, [("a", PolicyKind::Lru), ("b", PolicyKind::Duel)]);
        let e = format!(
            "{:#}",
            load_with("", &[], &["host.policy=autox"]).unwrap_err()
        );
        assert!(e.contains("host.policy") && e.contains("auto"), "{e}");
        let _ = std::fs::remove_dir_all(&tmp);
    }

    #[test]
    fn env_and_flags_type_values_as_the_toml_file_does() {
        // Values a TOML file takes must be taken from --set and the environment too.
        let c = load_with(
            "",
            &[("KVTIERD_SERVER_TOKEN", "12345")],
            &[
                "server.grpc=[::1]:0",
                "server.metrics=127.0.0.1:0",
                "host.size_classes=[65536, \"2M\"]",
                "disk.queue_depth=64",
                "disk.write_through=true",
                "host.capacity=4G",
            ],
        )
        .unwrap();
        assert_eq!(c.server.token, "12345");
        assert_eq!(c.server.grpc, "[::1]:0");
        assert_eq!(c.host.size_classes, vec![Size(65536), Size(2 << 20)]);
        assert_eq!(c.disk.queue_depth, 64);
        assert!(c.disk.write_through);
        assert_eq!(c.host.capacity, Some(Size(4 << 30)));
        // A wrong type still names the key and where it came from.
        let e = format!(
            "{:#}",
            load_with("", &[], &["disk.queue_depth=lots"]).unwrap_err()
        );
        assert!(e.contains("queue_depth"), "{e}");
        let e = format!(
            "{:#}",
            load_with("", &[], &["host.size_classes=[1,"]).unwrap_err()
        );
        assert!(e.contains("size_classes") && e.contains("--set"), "{e}");
        // Unknown and mistyped keys name the layer that brought them, not just the key.
        let e = format!(
            "{:#}",
            load_with(
                "[disk]\nqueue_depth = 8\n",
                &[("KVTIERD_HOST_CAPACTY", "1G")],
                &["disk.queue_depth=16"]
            )
            .unwrap_err()
        );
        assert!(
            e.contains("capacty") && e.contains("environment variable KVTIERD_HOST_CAPACTY"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            load_with(
                "",
                &[("KVTIERD_DISK_QUEUE_DEPTH", "8")],
                &["disk.queue_depth=lots"]
            )
            .unwrap_err()
        );
        assert!(
            e.contains("queue_depth") && e.contains("--set disk.queue_depth"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            load_with("[host]\nnope = 1\n", &[], &[]).unwrap_err()
        );
        assert!(e.contains("nope") && e.contains("config file"), "{e}");
    }

    #[test]
    fn tenant_isolation_is_checked() {
        let ok = "[server]\nisolation = \"tenant\"\n[[tenants]]\nname = \"a\"\nsecret = \"x\"\nhost_capacity = \"128M\"\n";
        let c = load_with(ok, &[], &[]).unwrap();
        assert_eq!(c.tenants[0].name, "a");
        for (bad, why) in [
            ("[server]\nisolation = \"tenant\"\n", "at least one"),
            ("[[tenants]]\nname = \"a\"\nsecret = \"x\"\n", "shared"),
            (
                "[server]\nisolation = \"tenant\"\n[[tenants]]\nname = \"a\"\n",
                "no uids",
            ),
            ("[server]\nisolation = \"both\"\n", "isolation"),
        ] {
            let e = format!("{:#}", load_with(bad, &[], &[]).unwrap_err());
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    /// Every key of every section of the example, as (section, key, value) (top-level keys
    /// with section "").
    fn example_keys() -> Vec<(String, String, toml::Value)> {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kvtierd.toml");
        let t: toml::Table = toml::from_str(&std::fs::read_to_string(example).unwrap()).unwrap();
        let mut out = Vec::new();
        for (k, v) in t {
            match v {
                toml::Value::Table(sec) => {
                    for (kk, vv) in sec {
                        out.push((k.clone(), kk, vv));
                    }
                }
                // [[tenants]]: a list of tables, set in a file only.
                toml::Value::Array(a) if a.iter().all(|x| x.is_table()) && !a.is_empty() => {}
                v => out.push((String::new(), k, v)),
            }
        }
        out
    }

    /// What a value looks like on a command line or in a variable: strings bare, the rest as
    /// TOML.
    fn raw(v: &toml::Value) -> String {
        match v {
            toml::Value::String(s) => s.clone(),
            v => v.to_string(),
        }
    }

    #[test]
    fn every_key_of_the_example_can_be_set_by_env_and_by_flag() {
        let keys = example_keys();
        assert!(keys.len() > 60, "{} keys", keys.len());
        let dir = std::env::temp_dir().join(format!("kvtierd-every-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let as_table = |c: &Config| toml::Table::try_from(c).unwrap();
        let at = |t: &toml::Table, sec: &str, key: &str| -> toml::Value {
            let t = if sec.is_empty() {
                t
            } else {
                t[sec].as_table().unwrap()
            };
            t[key].clone()
        };
        for (sec, key, v) in keys {
            // The value as a file sets it: what the other two layers must give.
            let file = dir.join("one.toml");
            let text = if sec.is_empty() {
                format!("{key} = {v}\n")
            } else {
                format!("[{sec}]\n{key} = {v}\n")
            };
            std::fs::write(&file, text).unwrap();
            let want = match load(Sources {
                file: Some(&file),
                env: Vec::new(),
                sets: Vec::new(),
            }) {
                Ok(c) => at(&as_table(&c), &sec, &key),
                // A value that is only valid beside others (e.g. a non-loopback address needs
                // a token): the other layers must refuse it too, naming the key.
                Err(e) => {
                    let e = format!("{e:#}");
                    eprintln!("{sec}.{key}: {e}");
                    continue;
                }
            };
            let var = if sec.is_empty() {
                format!("KVTIERD_{}", key.to_uppercase())
            } else {
                format!("KVTIERD_{}_{}", sec.to_uppercase(), key.to_uppercase())
            };
            let by_env = load(Sources {
                file: None,
                env: vec![(var.clone(), raw(&v))],
                sets: Vec::new(),
            })
            .unwrap_or_else(|e| panic!("{var}={}: {e:#}", raw(&v)));
            assert_eq!(at(&as_table(&by_env), &sec, &key), want, "{var}");
            let path = if sec.is_empty() {
                key.clone()
            } else {
                format!("{sec}.{key}")
            };
            let by_flag = load(Sources {
                file: None,
                env: Vec::new(),
                sets: vec![format!("{path}={}", raw(&v))],
            })
            .unwrap_or_else(|e| panic!("--set {path}={}: {e:#}", raw(&v)));
            assert_eq!(at(&as_table(&by_flag), &sec, &key), want, "--set {path}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_example_config_is_valid_and_complete() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kvtierd.toml");
        let c = load(Sources {
            file: Some(Path::new(example)),
            env: Vec::new(),
            sets: Vec::new(),
        })
        .unwrap();
        assert_eq!(c.disk.queue_depth, 32);
        // Every key of every section appears in the example (so it documents them all).
        let text = std::fs::read_to_string(example).unwrap();
        for key in [
            "capacity",
            "segment",
            "size_classes",
            "policy",
            "huge_pages",
            "populate",
            "max_leases",
            "enabled",
            "files",
            "engine",
            "queue_depth",
            "sqpoll",
            "admission",
            "admit_all_below",
            "write_through",
            "max_batch",
            "grpc",
            "metrics",
            "token",
            "max_message_bytes",
            "lease_ttl_ms",
            "max_clients",
            "reservation_ttl_ms",
            "max_keys",
            "max_watchers",
            "watch_send_timeout_ms",
            "hello_timeout_ms",
            "max_inflight_frame_bytes",
            "max_pinned_per_connection",
            "max_namespaces_per_connection",
            "allow_unauthenticated_admin",
            "max_admin_pinned",
            "isolation",
            "load_wait_ms",
            "spin_us",
            "verify_reads",
            "max_inflight_bytes",
            "max_held_bytes",
            "endpoint",
            "replay_endpoint",
            "topic",
            "encoding",
            "int_hashes",
            "remote_medium",
            "buffer_steps",
            "hwm",
            "backlog",
            "deadline_ms",
            "max_retained_bytes",
            "max_retain_ms",
            "fault_delay_ms",
            "data_dir",
            "log",
            "listen",
            "members",
            "etcd",
            "secret",
            "timeout_ms",
            "replicas",
            "handoff_ms",
            "handoff_stop_ms",
            "handoff_bytes_per_s",
            "push_queue_bytes",
            "etcd_prefix",
            "lease_ttl_ms",
            "redis",
            "redis_cluster",
            "redis_prefix",
            "redis_ttl_s",
        ] {
            assert!(
                text.contains(&format!("{key} =")),
                "deploy/kvtierd.toml lacks {key}"
            );
        }
    }
}

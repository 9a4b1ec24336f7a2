//! `kvtier-bench soak`: several engine processes against one kvtierd for `--minutes`, with the
//! daemon killed (SIGKILL) or stopped (SIGTERM) and restarted at random times.
//!
//! Each engine (this binary, `soak-engine`, a process of its own) loops over random operations on
//! two namespaces, its own and one every engine shares (so several processes race to store the
//! same keys): saves of 1–8 blocks of mixed sizes (16 KiB to 1 MiB; a key's size and bytes are a
//! function of the key), loads whose every byte is compared with what the key must hold, lookups,
//! reservations given back unwritten (aborts), and now and then a clear of its own namespace
//! through the admin API (the engine protocol has no per-key removal: aborts and clears are the
//! removals). While the daemon is away an engine reconnects every 50 ms.
//!
//! Engines log every acknowledged commit, every clear (before it is sent) and every lost
//! connection to a file. A block is *durable* once its commit was acknowledged before a clean
//! shutdown (SIGTERM flushes every dirty block to disk; `disk.admission = always`, and the disk
//! tier is sized to hold every key, so nothing is evicted from it): from then on, until its
//! namespace is cleared, every restart must find it. After each restart the controller checks
//! the durable set (presence of all, bytes of a sample; all bytes at the end).
//!
//! Reported (goals as baselines, ratio 1 = met): wrong bytes served (0), lost acknowledged
//! durable blocks (0), the daemon's RSS drift after warm-up (within ±5%, over lifetimes of at
//! least 90 s); and the counts of everything done.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use kvstore::{fill_pattern, BlockKey, Namespace, NsId, TpShard};
use kvtier_ipc::{IpcClient, IpcError, SlotStatus};
use serde::{Deserialize, Serialize};

use crate::report::{Report, Row};
use crate::rng::Rng;

/// Block sizes the engines mix.
const SIZES: [usize; 4] = [16 << 10, 64 << 10, 256 << 10, 1 << 20];
/// The admin token of the soak's daemon.
const TOKEN: &str = "soak-token";
/// Warm-up of each daemon lifetime, excluded from the RSS drift.
const WARMUP: Duration = Duration::from_secs(30);
/// Shortest lifetime whose RSS drift is reported.
const MIN_LIFETIME: Duration = Duration::from_secs(90);

/// Options of `kvtier-bench soak`.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// How long to run.
    #[arg(long, default_value_t = 2.0)]
    pub minutes: f64,
    /// Engine processes.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Mean seconds between daemon restarts (each uniformly 0.5–1.5× this; half of them kill -9).
    #[arg(long, default_value_t = 30.0)]
    pub restart_every: f64,
    /// Keys per namespace (each engine's own, and the shared one).
    #[arg(long, default_value_t = 256)]
    pub keys: u64,
    /// The daemon's host tier (small, so blocks move to disk and back).
    #[arg(long, default_value = "96M", value_parser = crate::parse_size)]
    pub host_capacity: u64,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The kvtierd binary (default: next to this one).
    #[arg(long)]
    pub kvtierd: Option<PathBuf>,
    /// Where the daemon keeps its data (default: a fresh directory under the temp dir, removed
    /// afterwards). Not /dev/shm: the disk tier uses O_DIRECT.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

/// Options of one soak engine process (started by `soak`).
#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Engine number.
    #[arg(long)]
    pub id: u64,
    /// The daemon's engine socket.
    #[arg(long)]
    pub socket: PathBuf,
    /// File holding the daemon's current admin address (it changes at every restart).
    #[arg(long)]
    pub grpc_file: PathBuf,
    /// The engine's log of acknowledged commits, clears and lost connections.
    #[arg(long)]
    pub log: PathBuf,
    /// Run for this long.
    #[arg(long)]
    pub seconds: f64,
    /// Keys per namespace.
    #[arg(long)]
    pub keys: u64,
    /// Seed.
    #[arg(long)]
    pub seed: u64,
}

/// A namespace of the soak: `0` is the shared one, `1 + id` engine `id`'s own.
fn namespace(tag: u64) -> Namespace {
    Namespace {
        model: format!("soak/ns-{tag}"),
        dtype: "bytes".into(),
        layout: "soak".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

/// The key of block `idx` of namespace `tag` (keys are per namespace: the same on every
/// engine for the shared one).
fn key(tag: u64, idx: u64) -> BlockKey {
    let mut x = Rng((tag << 32) ^ idx ^ 0x0050_414B);
    BlockKey((u128::from(x.next()) << 64) | u128::from(x.next()))
}

fn seed_of(tag: u64, idx: u64) -> u64 {
    (tag << 40) ^ idx.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Size of block `idx` of namespace `tag`.
fn size_of(tag: u64, idx: u64) -> usize {
    SIZES[((idx * 7 + tag) % SIZES.len() as u64) as usize]
}

/// The bytes block `idx` of namespace `tag` must hold.
fn expected(tag: u64, idx: u64) -> Vec<u8> {
    let mut v = vec![0u8; size_of(tag, idx)];
    fill_pattern(&mut v, seed_of(tag, idx));
    v
}

/// What one engine did.
#[derive(Serialize, Deserialize, Default, Debug, Clone)]
pub struct EngineStats {
    ops: u64,
    saves: u64,
    blocks_acked: u64,
    blocks_present: u64,
    no_space: u64,
    expired: u64,
    loads: u64,
    blocks_verified: u64,
    bytes_verified: u64,
    wrong_bytes: u64,
    damaged_detected: u64,
    lookups: u64,
    aborts: u64,
    clears: u64,
    reconnects: u64,
    refused: u64,
}

fn lost_connection(e: &IpcError) -> bool {
    !matches!(e, IpcError::Remote(_) | IpcError::Damaged(_))
}

struct Engine {
    a: EngineArgs,
    log: std::fs::File,
    rng: Rng,
    st: EngineStats,
    rt: tokio::runtime::Runtime,
}

impl Engine {
    fn note(&mut self, line: &str) -> Result<()> {
        self.log
            .write_all(format!("{line}\n").as_bytes())
            .context("writing the engine log")
    }

    /// Connects (retrying every 50 ms until `until`) and registers both namespaces.
    fn connect(&mut self, until: Instant) -> Option<(IpcClient, [NsId; 2])> {
        loop {
            if Instant::now() >= until {
                return None;
            }
            if let Ok(mut c) = IpcClient::connect(&self.a.socket, &format!("soak-{}", self.a.id)) {
                let shared = c.register_namespace(&namespace(0));
                let own = c.register_namespace(&namespace(1 + self.a.id));
                if let (Ok(s), Ok(o)) = (shared, own) {
                    return Some((c, [s, o]));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn run(mut self) -> Result<EngineStats> {
        let until = Instant::now() + Duration::from_secs_f64(self.a.seconds);
        let mut conn = None;
        while Instant::now() < until {
            let (c, ns) = match conn.as_mut() {
                Some(x) => x,
                None => match self.connect(until) {
                    Some(x) => {
                        self.st.reconnects += 1;
                        conn.insert(x)
                    }
                    None => break,
                },
            };
            let ns = *ns;
            self.st.ops += 1;
            let r = match self.rng.below(100) {
                0..=39 => self.save(c, ns),
                40..=79 => self.load(c, ns),
                80..=89 => self.lookup(c, ns),
                90..=98 => self.abort(c, ns),
                _ => self.maybe_clear(c, ns),
            };
            match r {
                Ok(()) => {}
                Err(e) => match e.downcast_ref::<IpcError>() {
                    Some(ie) if lost_connection(ie) => {
                        self.note("D")?;
                        conn = None;
                    }
                    Some(_) => self.st.refused += 1,
                    None => return Err(e),
                },
            }
        }
        self.st.reconnects = self.st.reconnects.saturating_sub(1);
        Ok(self.st)
    }

    /// Namespace tag and id for this operation: the shared one or the engine's own.
    fn pick_ns(&mut self, ns: [NsId; 2]) -> (u64, NsId) {
        if self.rng.below(2) == 0 {
            (0, ns[0])
        } else {
            (1 + self.a.id, ns[1])
        }
    }

    fn pick_idxs(&mut self, n: u64) -> Vec<u64> {
        let mut seen = HashSet::new();
        let mut v = Vec::new();
        while (v.len() as u64) < n.min(self.a.keys) {
            let i = self.rng.below(self.a.keys);
            if seen.insert(i) {
                v.push(i);
            }
        }
        v
    }

    fn save(&mut self, c: &mut IpcClient, ns: [NsId; 2]) -> Result<()> {
        let (tag, id) = self.pick_ns(ns);
        let n = 1 + self.rng.below(8);
        let idxs = self.pick_idxs(n);
        let keys: Vec<BlockKey> = idxs.iter().map(|&i| key(tag, i)).collect();
        let lens: Vec<u32> = idxs.iter().map(|&i| size_of(tag, i) as u32).collect();
        self.st.saves += 1;
        let slots = c.reserve(id, &keys, &lens)?;
        let mut tokens = Vec::new();
        for (j, s) in slots.iter().enumerate() {
            match *s {
                SlotStatus::Slot { token, .. } => {
                    c.write(token, &expected(tag, idxs[j]))?;
                    tokens.push((idxs[j], token));
                }
                SlotStatus::Present | SlotStatus::InFlight => self.st.blocks_present += 1,
                SlotStatus::NoSpace => self.st.no_space += 1,
            }
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let toks: Vec<u64> = tokens.iter().map(|t| t.1).collect();
        let r = c.commit(&toks)?;
        for (idx, t) in tokens {
            if r.expired.contains(&t) || r.cancelled.contains(&t) {
                self.st.expired += 1;
            } else {
                self.st.blocks_acked += 1;
                self.note(&format!("A {tag} {idx}"))?;
            }
        }
        Ok(())
    }

    fn load(&mut self, c: &mut IpcClient, ns: [NsId; 2]) -> Result<()> {
        let (tag, _) = self.pick_ns(ns);
        let n = 1 + self.rng.below(8);
        let idxs = self.pick_idxs(n);
        let keys: Vec<BlockKey> = idxs.iter().map(|&i| key(tag, i)).collect();
        self.st.loads += 1;
        let l = c.load(&keys, Duration::from_secs(10), None)?;
        for (i, &idx) in idxs.iter().enumerate().take(l.n.min(l.blocks.len())) {
            let mut got = vec![0u8; l.blocks[i].len as usize];
            match c.read(&l, i, &mut got) {
                Ok(()) => {
                    if got == expected(tag, idx) {
                        self.st.blocks_verified += 1;
                        self.st.bytes_verified += got.len() as u64;
                    } else {
                        self.st.wrong_bytes += 1;
                        eprintln!(
                            "soak engine {}: WRONG BYTES served for namespace {tag} block {idx} \
                             ({} bytes)",
                            self.a.id,
                            got.len()
                        );
                    }
                }
                Err(IpcError::Damaged(_)) => self.st.damaged_detected += 1,
                Err(e) => return Err(e.into()),
            }
        }
        if let Some(lease) = l.lease {
            c.release(lease)?;
        }
        Ok(())
    }

    fn lookup(&mut self, c: &mut IpcClient, ns: [NsId; 2]) -> Result<()> {
        let (tag, _) = self.pick_ns(ns);
        let n = 1 + self.rng.below(16);
        let idxs = self.pick_idxs(n);
        let keys: Vec<BlockKey> = idxs.iter().map(|&i| key(tag, i)).collect();
        self.st.lookups += 1;
        c.lookup(&keys, None)?;
        Ok(())
    }

    fn abort(&mut self, c: &mut IpcClient, ns: [NsId; 2]) -> Result<()> {
        let (tag, id) = self.pick_ns(ns);
        let n = 1 + self.rng.below(4);
        let idxs = self.pick_idxs(n);
        let keys: Vec<BlockKey> = idxs.iter().map(|&i| key(tag, i)).collect();
        let lens: Vec<u32> = idxs.iter().map(|&i| size_of(tag, i) as u32).collect();
        let slots = c.reserve(id, &keys, &lens)?;
        let toks: Vec<u64> = slots
            .iter()
            .filter_map(|s| match s {
                SlotStatus::Slot { token, .. } => Some(*token),
                _ => None,
            })
            .collect();
        // Half-written, then given back: nothing of it may ever be served.
        for &t in &toks {
            c.fill_slot(t, |s| {
                let half = s.len() / 2;
                s[..half].fill(0xAB)
            })?;
        }
        c.abort(&toks)?;
        self.st.aborts += 1;
        Ok(())
    }

    /// One in fifty of these clears the engine's own namespace through the admin API.
    fn maybe_clear(&mut self, _c: &mut IpcClient, ns: [NsId; 2]) -> Result<()> {
        if self.rng.below(50) != 0 {
            return Ok(());
        }
        // Logged before it is sent: every acknowledgement before it no longer counts.
        self.note("C")?;
        let addr = std::fs::read_to_string(&self.a.grpc_file).unwrap_or_default();
        let id = ns[1];
        let done = self.rt.block_on(async {
            let mut a = kvtier_client::connect(addr.trim(), Some(TOKEN)).await?;
            a.clear_namespace(kvtier_client::pb::ClearRequest {
                namespace_id: id.0,
                tenant: String::new(),
            })
            .await
            .map_err(kvtier_client::explain)?;
            anyhow::Ok(())
        });
        if done.is_ok() {
            self.st.clears += 1;
        }
        Ok(())
    }
}

/// Runs one soak engine (a process of its own) and prints its counts as JSON.
pub fn run_engine(a: EngineArgs) -> Result<()> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&a.log)
        .with_context(|| format!("opening {}", a.log.display()))?;
    let rng = Rng(a.seed ^ a.id.wrapping_mul(0xA076_1D64_78BD_642F));
    // One worker thread: the admin connection is driven (and closed once dropped) in the
    // background, so it never holds the daemon's graceful shutdown open.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let st = Engine {
        a,
        log,
        rng,
        st: EngineStats::default(),
        rt,
    }
    .run()?;
    println!("{}", serde_json::to_string(&st)?);
    Ok(())
}

/// The daemon under test.
struct Daemon {
    bin: PathBuf,
    dir: PathBuf,
    host_capacity: u64,
    disk_capacity: u64,
    child: Option<Child>,
    socket: PathBuf,
    started: Instant,
    /// (seconds since start, RSS bytes) of this lifetime.
    rss: Vec<(f64, u64)>,
}

impl Daemon {
    fn start(&mut self) -> Result<()> {
        // The daemon's log, one file for every lifetime (kept with --dir).
        std::fs::create_dir_all(&self.dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.with_file_name("kvtierd.log"))?;
        let mut child = Command::new(&self.bin)
            .arg("--data-dir")
            .arg(&self.dir)
            .args(["--host-capacity", &self.host_capacity.to_string()])
            .args(["--disk-capacity", &self.disk_capacity.to_string()])
            .args(["--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
            .args([
                "--set",
                "host.segment=4M",
                "--set",
                &format!(
                    "log={}",
                    std::env::var("KVTIER_SOAK_LOG").unwrap_or_else(|_| "info".into())
                ),
            ])
            .args(["--set", "disk.admission=always"])
            .args(["--set", &format!("server.token={TOKEN}")])
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let out = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let Ok(line) = rx.recv_timeout(Duration::from_secs(120)) else {
            let _ = child.kill();
            bail!("kvtierd printed no ready line within 120 s");
        };
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .map(str::to_string)
                .with_context(|| format!("kvtierd did not start: {line:?}"))
        };
        self.socket = PathBuf::from(field("socket=")?);
        let grpc = field("grpc=")?;
        // Atomically, for the engines' clears.
        let tmp = self.dir.join("soak-grpc.tmp");
        std::fs::write(&tmp, &grpc)?;
        std::fs::rename(&tmp, self.dir.join("soak-grpc"))?;
        self.child = Some(child);
        self.started = Instant::now();
        self.rss.clear();
        Ok(())
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn sample_rss(&mut self) {
        let Some(pid) = self.pid() else { return };
        let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return;
        };
        if let Some(kb) = s
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            self.rss
                .push((self.started.elapsed().as_secs_f64(), kb * 1024));
        }
    }

    /// Stops the daemon (SIGKILL or SIGTERM); returns whether a SIGTERM exit was clean, and
    /// the RSS drift of the lifetime (percent), if long enough.
    fn stop(&mut self, kill: bool) -> Result<(bool, Option<f64>)> {
        let drift = self.drift();
        let Some(mut child) = self.child.take() else {
            return Ok((true, drift));
        };
        let sig = if kill { libc::SIGKILL } else { libc::SIGTERM };
        // SAFETY: kill(2) on our own child's pid, which has not been waited for yet (so it
        // cannot have been reused).
        unsafe { libc::kill(child.id() as i32, sig) };
        let st = child.wait()?;
        Ok((kill || st.success(), drift))
    }

    /// (end − start) / start over the lifetime after warm-up, in percent: the mean RSS of the
    /// first and of the last 10% of the samples after warm-up.
    fn drift(&self) -> Option<f64> {
        if self.started.elapsed() < MIN_LIFETIME {
            return None;
        }
        let after: Vec<u64> = self
            .rss
            .iter()
            .filter(|(t, _)| *t >= WARMUP.as_secs_f64())
            .map(|(_, r)| *r)
            .collect();
        if after.len() < 20 {
            return None;
        }
        let k = (after.len() / 10).max(1);
        let mean = |s: &[u64]| s.iter().sum::<u64>() as f64 / s.len() as f64;
        let first = mean(&after[..k]);
        let last = mean(&after[after.len() - k..]);
        Some((last - first) / first * 100.0)
    }
}

/// One engine's log, parsed: acknowledgements with their position, clears, lost connections.
#[derive(Default)]
struct Log {
    /// (position, tag, idx) of each acknowledged commit.
    acks: Vec<(usize, u64, u64)>,
    /// Positions of clears of the engine's own namespace.
    clears: Vec<usize>,
    /// Positions of lost connections.
    lost: Vec<usize>,
}

fn read_log(path: &Path) -> Result<Log> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut log = Log::default();
    // Only whole lines: the engine may be writing the last one.
    let whole = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    for (pos, line) in whole.lines().enumerate() {
        let mut w = line.split_whitespace();
        match w.next() {
            Some("A") => {
                let tag = w.next().and_then(|s| s.parse().ok());
                let idx = w.next().and_then(|s| s.parse().ok());
                if let (Some(t), Some(i)) = (tag, idx) {
                    log.acks.push((pos, t, i));
                }
            }
            Some("C") => log.clears.push(pos),
            Some("D") => log.lost.push(pos),
            _ => {}
        }
    }
    Ok(log)
}

/// A block of the soak: (namespace tag, index).
type Block = (u64, u64);

/// How one daemon lifetime ended: killed or stopped cleanly, and where in each engine's log
/// (the line of its first lost connection after it).
struct Stop {
    kill: bool,
    at: Vec<usize>,
}

/// The blocks every restart must find: acknowledged in a daemon lifetime that ended with a
/// clean shutdown (SIGTERM flushes them to disk; a block acknowledged in a lifetime that was
/// killed may be gone), and not in an own namespace cleared since (as far as the logs say
/// now).
fn durable(
    logs: &[PathBuf],
    stops: &[Stop],
    own_tag: impl Fn(usize) -> u64,
) -> Result<HashSet<(u64, u64)>> {
    let mut set = HashSet::new();
    for (e, path) in logs.iter().enumerate() {
        let log = read_log(path)?;
        for &(pos, tag, idx) in &log.acks {
            // The lifetime it was acknowledged in ended at the first stop after it.
            match stops.iter().find(|s| pos < s.at[e]) {
                Some(s) if !s.kill => {}
                _ => continue,
            }
            let cleared = tag == own_tag(e) && log.clears.iter().any(|&c| c > pos);
            if !cleared {
                set.insert((tag, idx));
            }
        }
    }
    Ok(set)
}

/// Checks the durable blocks against the running daemon: every one present, and the bytes of
/// `verify` of them (all if `None`). Returns (checked, lost, wrong).
fn check_durable(
    d: &Daemon,
    blocks: &HashSet<(u64, u64)>,
    engines: usize,
    verify: Option<usize>,
) -> Result<(u64, Vec<Block>, u64)> {
    let mut c = None;
    for _ in 0..200 {
        if let Ok(x) = IpcClient::connect(&d.socket, "soak-check") {
            c = Some(x);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut c = c.context("the soak's checker cannot connect to kvtierd")?;
    // Registered so that the daemon knows them after a restart (ids are not needed here).
    for tag in 0..=engines as u64 {
        c.register_namespace(&namespace(tag))?;
    }
    let mut sorted: Vec<(u64, u64)> = blocks.iter().copied().collect();
    sorted.sort_unstable();
    let mut lost = Vec::new();
    let mut wrong = 0;
    let mut unverified = 0u64;
    let stride = verify.map_or(1, |v| (sorted.len() / v.max(1)).max(1));
    for (j, &(tag, idx)) in sorted.iter().enumerate() {
        let k = key(tag, idx);
        if c.lookup(&[k], None)?.n == 0 {
            lost.push((tag, idx));
            continue;
        }
        if j % stride == 0 {
            // Present (above); its bytes, if host memory has room to promote it now (a load
            // that finds none is a miss, not a loss: tried again a few times, then counted
            // as unverified).
            for attempt in 0..5 {
                let l = c.load(&[k], Duration::from_secs(10), Some(Duration::from_secs(10)))?;
                let mut done = true;
                if l.n == 1 {
                    let mut got = vec![0u8; l.blocks[0].len as usize];
                    match c.read(&l, 0, &mut got) {
                        Ok(()) if got == expected(tag, idx) => {}
                        Ok(()) => wrong += 1,
                        Err(IpcError::Damaged(_)) => lost.push((tag, idx)),
                        Err(e) => return Err(e.into()),
                    }
                } else if attempt < 4 {
                    done = false;
                } else {
                    unverified += 1;
                }
                if let Some(lease) = l.lease {
                    let _ = c.release(lease);
                }
                if done {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    if unverified > 0 {
        eprintln!(
            "soak: {unverified} durable blocks present but not loadable now (no room): unverified"
        );
    }
    Ok((sorted.len() as u64, lost, wrong))
}

/// Where the engines' logs acknowledged a block (for a loss report).
fn history(logs: &[PathBuf], b: (u64, u64)) -> String {
    let mut out = Vec::new();
    for (e, path) in logs.iter().enumerate() {
        if let Ok(log) = read_log(path) {
            for &(pos, t, i) in &log.acks {
                if (t, i) == b {
                    let downs = log.lost.iter().filter(|&&l| l < pos).count();
                    out.push(format!(
                        "engine {e} acked at line {pos}, after {downs} outages"
                    ));
                }
            }
        }
    }
    out.join("; ")
}

/// The disk tier's counters, from the admin API.
fn disk_stats(d: &Daemon) -> Result<kvtier_client::pb::TierStats> {
    let addr = std::fs::read_to_string(d.dir.join("soak-grpc"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut a = kvtier_client::connect(addr.trim(), Some(TOKEN)).await?;
        let s = a
            .stats(kvtier_client::pb::StatsRequest::default())
            .await
            .map_err(kvtier_client::explain)?
            .into_inner();
        s.tiers
            .into_iter()
            .find(|t| t.tier == kvtier_client::pb::Tier::Disk as i32)
            .context("kvtierd reports no disk tier")
    })
}

/// Runs the soak.
pub fn run(args: SoakArgs) -> Result<()> {
    ensure!(
        args.minutes > 0.0 && args.engines > 0 && args.keys > 0 && args.restart_every > 0.0,
        "--minutes, --engines, --keys and --restart-every must be positive"
    );
    let bin = crate::sidecar::binary(args.kvtierd.as_deref())?;
    let (dir, remove_dir) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("kvtier-soak-{}", std::process::id())),
            true,
        ),
    };
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // Room on disk for every key of every namespace (nothing durable is ever evicted).
    let per_ns: u64 = (0..args.keys)
        .map(|i| size_of(0, i) as u64 + 4096)
        .sum::<u64>()
        + SIZES.iter().sum::<usize>() as u64;
    let disk_capacity = (per_ns * (args.engines as u64 + 1) * 3).max(256 << 20);
    let mut d = Daemon {
        bin,
        dir: dir.join("data"),
        host_capacity: args.host_capacity,
        disk_capacity,
        child: None,
        socket: PathBuf::new(),
        started: Instant::now(),
        rss: Vec::new(),
    };
    d.start()?;
    let total = Duration::from_secs_f64(args.minutes * 60.0);
    let t0 = Instant::now();
    eprintln!(
        "soak: {} engines, {:.1} min, restarts every ~{:.0} s, host {} MiB, disk {} MiB",
        args.engines,
        args.minutes,
        args.restart_every,
        args.host_capacity >> 20,
        disk_capacity >> 20
    );
    let me = std::env::current_exe()?;
    let logs: Vec<PathBuf> = (0..args.engines)
        .map(|e| dir.join(format!("engine-{e}.log")))
        .collect();
    let mut engines = Vec::new();
    for (e, log) in logs.iter().enumerate() {
        engines.push(
            Command::new(&me)
                .arg("soak-engine")
                .args(["--id", &e.to_string()])
                .arg("--socket")
                .arg(&d.socket)
                .arg("--grpc-file")
                .arg(d.dir.join("soak-grpc"))
                .arg("--log")
                .arg(log)
                .args(["--seconds", &total.as_secs_f64().to_string()])
                .args(["--keys", &args.keys.to_string()])
                .args(["--seed", &args.seed.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .context("starting a soak engine")?,
        );
    }
    let own_tag = |e: usize| 1 + e as u64;
    let mut rng = Rng(args.seed);
    let mut stops: Vec<Stop> = Vec::new();
    let (mut kills, mut terms, mut unclean) = (0u64, 0u64, 0u64);
    let mut drifts = Vec::new();
    let (mut checked, mut lost, mut wrong_durable) = (0u64, 0u64, 0u64);
    // Leave the last 15 s (at least) for the final clean restart and check.
    let end_faults = total.saturating_sub(Duration::from_secs(15));
    loop {
        let wait =
            Duration::from_secs_f64(args.restart_every * (0.5 + rng.below(1000) as f64 / 1000.0));
        let next = Instant::now() + wait;
        while Instant::now() < next && t0.elapsed() < end_faults {
            d.sample_rss();
            std::thread::sleep(Duration::from_millis(500));
        }
        if t0.elapsed() >= end_faults {
            break;
        }
        let kill = rng.below(2) == 0;
        let before: Vec<usize> = logs
            .iter()
            .map(|l| read_log(l).map_or(0, |g| g.lost.len()))
            .collect();
        let (clean, drift) = d.stop(kill)?;
        drifts.extend(drift);
        if kill {
            kills += 1;
        } else {
            terms += 1;
            if !clean {
                unclean += 1;
            }
        }
        // Every engine notices the stop (its next call fails) before the restart: what it
        // logged as acknowledged before that belongs to the lifetime that just ended.
        let until = Instant::now() + Duration::from_secs(30);
        let mut at = Vec::with_capacity(logs.len());
        for (e, l) in logs.iter().enumerate() {
            loop {
                let g = read_log(l)?;
                if g.lost.len() > before[e] {
                    at.push(g.lost[before[e]]);
                    break;
                }
                if Instant::now() > until {
                    // Never noticed (stuck?): everything it logged so far is before the stop.
                    at.push(g.acks.len() + g.clears.len() + g.lost.len());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        stops.push(Stop { kill, at });
        eprintln!(
            "soak: {:>6.1} s: {} and restart",
            t0.elapsed().as_secs_f64(),
            if kill { "kill -9" } else { "SIGTERM" }
        );
        d.start()?;
        let set = durable(&logs, &stops, own_tag)?;
        let (n, missing, w) = check_durable(&d, &set, args.engines, Some(64))?;
        // A clear sent while the check ran is not a loss: ask the logs again.
        let now = durable(&logs, &stops, own_tag)?;
        let really: Vec<_> = missing.into_iter().filter(|b| now.contains(b)).collect();
        for b in &really {
            eprintln!(
                "soak: LOST durable block: namespace {} block {} key {} ({})",
                b.0,
                b.1,
                key(b.0, b.1),
                history(&logs, *b)
            );
        }
        checked += n;
        lost += really.len() as u64;
        wrong_durable += w;
    }
    // Engines end by themselves at the deadline.
    let mut stats = Vec::new();
    for mut e in engines {
        let mut out = String::new();
        if let Some(mut o) = e.stdout.take() {
            std::io::Read::read_to_string(&mut o, &mut out)?;
        }
        let st = e.wait()?;
        ensure!(st.success(), "a soak engine failed ({st})");
        let last = out.lines().last().unwrap_or_default();
        stats.push(serde_json::from_str::<EngineStats>(last).context("an engine's counts")?);
    }
    // Final: a clean shutdown and restart, then every durable block checked byte for byte.
    let (clean, drift) = d.stop(false)?;
    drifts.extend(drift);
    terms += 1;
    if !clean {
        unclean += 1;
    }
    // The engines are gone: everything they logged was acknowledged before this shutdown.
    stops.push(Stop {
        kill: false,
        at: vec![usize::MAX; args.engines],
    });
    d.start()?;
    let set = durable(&logs, &stops, own_tag)?;
    let (n, missing, w) = check_durable(&d, &set, args.engines, None)?;
    for b in &missing {
        eprintln!(
            "soak: LOST durable block: namespace {} block {} key {} ({})",
            b.0,
            b.1,
            key(b.0, b.1),
            history(&logs, *b)
        );
    }
    checked += n;
    lost += missing.len() as u64;
    wrong_durable += w;
    let disk = disk_stats(&d)?;
    eprintln!(
        "soak: disk tier at the end: {} blocks, {} MiB used of {} MiB, {} evictions, {} write errors, {} checksum failures",
        disk.blocks,
        disk.used_bytes >> 20,
        disk.capacity_bytes >> 20,
        disk.evictions,
        disk.write_errors,
        disk.checksum_failures
    );
    d.stop(false)?;
    if remove_dir {
        let _ = std::fs::remove_dir_all(&dir);
    }

    let mut sum = EngineStats::default();
    for s in &stats {
        sum.ops += s.ops;
        sum.saves += s.saves;
        sum.blocks_acked += s.blocks_acked;
        sum.blocks_present += s.blocks_present;
        sum.no_space += s.no_space;
        sum.expired += s.expired;
        sum.loads += s.loads;
        sum.blocks_verified += s.blocks_verified;
        sum.bytes_verified += s.bytes_verified;
        sum.wrong_bytes += s.wrong_bytes;
        sum.damaged_detected += s.damaged_detected;
        sum.lookups += s.lookups;
        sum.aborts += s.aborts;
        sum.clears += s.clears;
        sum.reconnects += s.reconnects;
        sum.refused += s.refused;
    }
    let secs = t0.elapsed().as_secs_f64();
    let wrong = sum.wrong_bytes + wrong_durable;
    let met = |ok: bool| if ok { 1.0 } else { 0.0 };
    let goal_row = |case: &str, unit: &'static str, value: f64, goal: f64, ok: bool| Row {
        case: case.into(),
        unit,
        value,
        baseline: goal,
        ratio: met(ok),
        ratio_spread: None,
        sweep: None,
        baseline_is: "goal (ratio 1 = met)",
    };
    let mut rows = vec![
        goal_row(
            "wrong bytes served",
            "blocks",
            wrong as f64,
            0.0,
            wrong == 0,
        ),
        goal_row(
            "lost acknowledged durable blocks",
            "blocks",
            lost as f64,
            0.0,
            lost == 0,
        ),
        goal_row(
            "unclean SIGTERM exits",
            "exits",
            unclean as f64,
            0.0,
            unclean == 0,
        ),
    ];
    if let Some(worst) = drifts
        .iter()
        .copied()
        .max_by(|a, b| a.abs().total_cmp(&b.abs()))
    {
        rows.push(goal_row(
            "daemon RSS drift after warm-up (worst lifetime)",
            "%",
            worst,
            5.0,
            worst.abs() <= 5.0,
        ));
    }
    let counts: BTreeMap<String, f64> = [
        ("seconds", secs),
        ("engines", args.engines as f64),
        ("operations", sum.ops as f64),
        ("operations_per_s", sum.ops as f64 / secs),
        ("saves", sum.saves as f64),
        ("blocks_acked", sum.blocks_acked as f64),
        ("blocks_already_present", sum.blocks_present as f64),
        ("no_space", sum.no_space as f64),
        ("commits_expired_or_cancelled", sum.expired as f64),
        ("loads", sum.loads as f64),
        ("blocks_verified", sum.blocks_verified as f64),
        (
            "gib_verified",
            sum.bytes_verified as f64 / (1u64 << 30) as f64,
        ),
        ("damaged_detected", sum.damaged_detected as f64),
        ("lookups", sum.lookups as f64),
        ("aborts", sum.aborts as f64),
        ("clears", sum.clears as f64),
        ("engine_reconnects", sum.reconnects as f64),
        ("refused", sum.refused as f64),
        ("restarts_kill9", kills as f64),
        ("restarts_sigterm", terms as f64),
        ("durable_checks", checked as f64),
        ("rss_lifetimes_measured", drifts.len() as f64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in &counts {
        eprintln!("soak: {k} = {v:.2}");
    }
    Report {
        bench: "soak",
        results: std::mem::take(&mut rows),
    }
    .print_with(args.json, Some(&counts))
}

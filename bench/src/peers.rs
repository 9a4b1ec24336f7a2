//! `kvtier-bench peers`: the same put/get workload against kvtier (embedded store), Redis and
//! Mooncake Store (CPU build, TCP), on this machine in the same run. Each peer is installed if
//! missing, started on loopback, and stopped by pid afterwards; a peer that cannot be had is
//! skipped with a message. Rows are kvtier's figure against the peer's (ratio > 1: kvtier is
//! faster).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use kvstore::{AlignedBuf, BlockKey, Namespace, StoreConfig, TpShard};

use crate::report::{row, Report, Row};

/// Options of `kvtier-bench peers`.
#[derive(Args, Debug)]
pub struct PeersArgs {
    /// Value sizes.
    #[arg(long, value_delimiter = ',', default_value = "2M,16M", value_parser = crate::parse_size)]
    pub sizes: Vec<u64>,
    /// Bytes put and got per round.
    #[arg(long, default_value = "512M", value_parser = crate::parse_size)]
    pub bytes: u64,
    /// Rounds (after one warm-up round).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Peers to run: redis, mooncake (local mode: the client owns its segment, as kvtier
    /// embedded does).
    #[arg(long, value_delimiter = ',', default_value = "redis,mooncake")]
    pub peers: Vec<String>,
    /// Python with (or to receive) the mooncake package.
    #[arg(long, default_value = ".venv/bin/python")]
    pub python: PathBuf,
    /// Write a Markdown summary into this directory.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

/// A child process killed (by pid) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_port(port: u16, what: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{what} did not listen on 127.0.0.1:{port} within 20 s")
}

/// kvtier: (put, get) GB/s per round.
fn kvtier(
    size: u64,
    count: u64,
    rounds: usize,
    src: &AlignedBuf,
    dst: &mut AlignedBuf,
) -> Result<Vec<(f64, f64)>> {
    let seg = (64u64 << 20).max(size);
    let store = StoreConfig {
        capacity_bytes: (count * size * 5 / 4).div_ceil(seg) * seg + seg,
        segment_bytes: seg,
        size_classes: vec![size as usize],
        ..Default::default()
    }
    .build()?;
    let ns = store.register_namespace(&Namespace {
        model: "peers".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    })?;
    let total = (count * size) as f64;
    let mut out = Vec::new();
    for r in 0..=rounds {
        let key = |i: u64| BlockKey(u128::from(i + 1) * 0x9E37_79B9_7F4A_7C15_F39C_C060);
        for i in 0..count {
            store.remove(&key(i));
        }
        let t = Instant::now();
        for i in 0..count {
            let s = (i * size) as usize;
            store.put(ns, key(i), &src[s..s + size as usize])?;
        }
        let put = total / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        for i in 0..count {
            let s = (i * size) as usize;
            ensure!(
                store.get_into(&key(i), &mut dst[s..s + size as usize])? == Some(size as usize),
                "kvtier lost block {i}"
            );
        }
        let get = total / t.elapsed().as_secs_f64() / 1e9;
        ensure!(src[..] == dst[..], "kvtier returned wrong bytes");
        if r > 0 {
            out.push((put, get));
        }
    }
    Ok(out)
}

fn ensure_redis() -> Result<()> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok()
    {
        return Ok(());
    }
    eprintln!("redis-server not found: installing it with apt-get");
    let ok = Command::new("apt-get")
        .args(["install", "-y", "-q", "redis-server"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ensure!(
        ok,
        "could not install redis-server (apt-get install redis-server)"
    );
    Ok(())
}

fn resp_cmd(w: &mut impl Write, parts: &[&[u8]]) -> std::io::Result<()> {
    write!(w, "*{}\r\n", parts.len())?;
    for p in parts {
        write!(w, "${}\r\n", p.len())?;
        w.write_all(p)?;
        w.write_all(b"\r\n")?;
    }
    Ok(())
}

fn resp_line(r: &mut impl BufRead) -> Result<String> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    ensure!(line.ends_with("\r\n"), "redis closed the connection");
    Ok(line.trim_end().to_string())
}

/// Redis: (put, get) GB/s per round, over one loopback TCP connection.
pub(crate) fn redis(
    size: u64,
    count: u64,
    rounds: usize,
    src: &AlignedBuf,
    dst: &mut AlignedBuf,
) -> Result<Vec<(f64, f64)>> {
    ensure_redis()?;
    let port = free_port()?;
    let _server = Proc(
        Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                "8gb",
                "--maxmemory-policy",
                "noeviction",
                "--proto-max-bulk-len",
                "1gb",
            ])
            .stdout(Stdio::null())
            .spawn()
            .context("starting redis-server")?,
    );
    wait_port(port, "redis-server")?;
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_nodelay(true)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, stream.try_clone()?);
    let mut r = BufReader::with_capacity(1 << 20, stream);
    let total = (count * size) as f64;
    let mut out = Vec::new();
    for round in 0..=rounds {
        resp_cmd(&mut w, &[b"FLUSHALL"])?;
        w.flush()?;
        ensure!(resp_line(&mut r)? == "+OK", "FLUSHALL failed");
        let t = Instant::now();
        for i in 0..count {
            let s = (i * size) as usize;
            let k = format!("k{i}");
            resp_cmd(&mut w, &[b"SET", k.as_bytes(), &src[s..s + size as usize]])?;
            w.flush()?;
            let reply = resp_line(&mut r)?;
            ensure!(reply == "+OK", "SET failed: {reply}");
        }
        let put = total / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        for i in 0..count {
            let s = (i * size) as usize;
            let k = format!("k{i}");
            resp_cmd(&mut w, &[b"GET", k.as_bytes()])?;
            w.flush()?;
            let head = resp_line(&mut r)?;
            ensure!(
                head == format!("${size}"),
                "GET {k}: unexpected reply {head}"
            );
            r.read_exact(&mut dst[s..s + size as usize])?;
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf)?;
        }
        let get = total / t.elapsed().as_secs_f64() / 1e9;
        ensure!(src[..] == dst[..], "redis returned wrong bytes");
        if round > 0 {
            out.push((put, get));
        }
    }
    Ok(out)
}

/// Mooncake Store, local mode, through its Python API.
fn mooncake(size: u64, count: u64, rounds: usize, python: &PathBuf) -> Result<Vec<(f64, f64)>> {
    let has = |py: &PathBuf| {
        Command::new(py)
            .args([
                "-c",
                "import mooncake.store, mooncake, os; print(os.path.dirname(mooncake.__file__))",
            ])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let dir = match has(python) {
        Some(d) => d,
        None => {
            eprintln!("mooncake not importable: installing mooncake-transfer-engine-non-cuda==0.3.13.post1");
            let ok = Command::new(python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "mooncake-transfer-engine-non-cuda==0.3.13.post1",
                ])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            ensure!(ok, "could not install mooncake with {}", python.display());
            has(python).context("mooncake still not importable after install")?
        }
    };
    let port = free_port()?;
    let metrics = free_port()?;
    let _master = Proc(
        Command::new(PathBuf::from(&dir).join("mooncake_master"))
            .args([
                "--rpc_address=127.0.0.1".to_string(),
                format!("--rpc_port={port}"),
                "--metrics_host=127.0.0.1".to_string(),
                format!("--metrics_port={metrics}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting mooncake_master")?,
    );
    wait_port(port, "mooncake_master")?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("peers/mooncake_peer.py");
    let out = Command::new(python)
        .arg(&script)
        .args([
            format!("--master=127.0.0.1:{port}"),
            format!("--size={size}"),
            format!("--count={count}"),
            format!("--rounds={rounds}"),
        ])
        .stderr(Stdio::null())
        .output()
        .context("running the mooncake workload")?;
    ensure!(
        out.status.success(),
        "the mooncake workload failed (exit {:?})",
        out.status.code()
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text
        .lines()
        .last()
        .context("no output from the mooncake workload")?;
    let v: serde_json::Value = serde_json::from_str(last)?;
    let arr = |k: &str| -> Vec<f64> {
        v[k].as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default()
    };
    let (p, g) = (arr("put"), arr("get"));
    ensure!(
        p.len() == rounds && g.len() == rounds,
        "mooncake reported {} rounds",
        p.len()
    );
    Ok(p.into_iter().zip(g).collect())
}

/// Runs the peers benchmark.
pub fn run(args: PeersArgs) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let mut rows: Vec<Row> = Vec::new();
    let pb = crate::replay::bar((args.sizes.len() * (1 + args.peers.len())) as u64, "peers");
    for &size in &args.sizes {
        let count = (args.bytes / size).max(1);
        let mut src = AlignedBuf::new((count * size) as usize)?;
        src.fill_pattern(size);
        let mut dst = AlignedBuf::new((count * size) as usize)?;
        let ours = kvtier(size, count, args.rounds, &src, &mut dst)?;
        pb.inc(1);
        let sz = crate::host::human(size);
        for peer in &args.peers {
            dst.fill(0);
            let theirs = match peer.as_str() {
                "redis" => redis(size, count, args.rounds, &src, &mut dst),
                "mooncake" => mooncake(size, count, args.rounds, &args.python),
                other => bail!("unknown peer {other:?}: use redis or mooncake"),
            };
            pb.inc(1);
            let theirs = match theirs {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("peer {peer} skipped: {e:#}");
                    continue;
                }
            };
            let put: Vec<(f64, f64)> = ours.iter().zip(&theirs).map(|(o, t)| (o.0, t.0)).collect();
            let get: Vec<(f64, f64)> = ours.iter().zip(&theirs).map(|(o, t)| (o.1, t.1)).collect();
            let label: &'static str = if peer == "redis" {
                "redis (loopback TCP)"
            } else {
                "mooncake store (local mode)"
            };
            rows.push(row(format!("put {sz} vs {peer}"), "GB/s", label, &put));
            rows.push(row(format!("get {sz} vs {peer}"), "GB/s", label, &get));
        }
    }
    pb.finish_and_clear();
    let report = Report {
        bench: "peers",
        results: rows,
    };
    if let Some(dir) = &args.report {
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("peers.md"),
            format!(
                "# kvtier vs peers (same machine, same run)\n\n{}",
                crate::plot::table(&report)
            ),
        )?;
    }
    report.print(args.json)
}

//! `kvtier-bench remote`: the remote tier's data plane between two kvtier nodes on loopback
//! (node B's store behind its data-plane server, node A's remote tier asking it), against the
//! loopback's limit (iperf3, one stream) and Redis 7 on the same loopback, rounds interleaved.
//! Also the latency of a 64-key lookup against the owner, next to the loopback round trip.

use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;
use kvstore::io::IoBuf;
use kvstore::{AlignedBuf, BlockKey, LowerTier, ReadItem, ReadOutcome, StoreConfig, WriteItem};
use kvtier_cluster::{Member, RemoteConfig, RemoteTier, ServerConfig, ServerStats};

use crate::report::{row, Report, Row};

/// Options of `kvtier-bench remote`.
#[derive(Args, Debug)]
pub struct RemoteArgs {
    /// Block sizes.
    #[arg(long, value_delimiter = ',', default_value = "2M,16M", value_parser = crate::parse_size)]
    pub sizes: Vec<u64>,
    /// Bytes put and got per round.
    #[arg(long, default_value = "256M", value_parser = crate::parse_size)]
    pub bytes: u64,
    /// Rounds (after one warm-up round).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Peers besides iperf3: redis (empty: none).
    #[arg(long, value_delimiter = ',', default_value = "redis")]
    pub peers: Vec<String>,
    /// Lookups timed for the latency rows.
    #[arg(long, default_value_t = 2000)]
    pub lookups: usize,
    /// Skip the cluster replay.
    #[arg(long)]
    pub no_replay: bool,
    /// Trace for the cluster replay (Mooncake JSONL, or `gen:chat|agent|docqa`).
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_synthetic_trace.jsonl"
    )]
    pub trace: std::path::PathBuf,
    /// Requests of a generated trace.
    #[arg(long, default_value_t = 4000)]
    pub trace_requests: usize,
    /// Nodes of the cluster replay (requests assigned round-robin).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Host capacity of each node in the replay, percent of the trace's distinct blocks.
    #[arg(long, default_value_t = 10.0)]
    pub node_pct: f64,
    /// Block bytes in the replay.
    #[arg(long, default_value = "64K", value_parser = crate::parse_size)]
    pub block_bytes: u64,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

/// Node B (owner of every block) serving on loopback, and node A's remote tier.
struct Pair {
    _rt: tokio::runtime::Runtime,
    remote: RemoteTier,
}

/// The bench's runtime for data-plane servers.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// A store (populated up front) behind its data-plane server on a loopback port of `rt`: an
/// owner of blocks. Its address.
fn owner(
    rt: &tokio::runtime::Runtime,
    capacity: u64,
    segment: u64,
    timeout: Duration,
) -> Result<String> {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?.to_string();
    let store = Arc::new(
        StoreConfig {
            capacity_bytes: capacity,
            segment_bytes: segment,
            populate: kvstore::Populate::Now,
            ..Default::default()
        }
        .build()?,
    );
    rt.spawn(kvtier_cluster::serve(
        listener,
        store,
        ServerConfig {
            node: addr.clone(),
            secret: "bench".into(),
            capacity,
            timeout,
        },
        Arc::new(ServerStats::default()),
    ));
    Ok(addr)
}

fn pair(capacity: u64, segment: u64) -> Result<Pair> {
    let rt = runtime()?;
    let b = owner(&rt, capacity, segment, Duration::from_secs(30))?;
    let a = "127.0.0.1:1".to_string();
    // B owns every block: A's weight is negligible.
    let remote = RemoteTier::new(RemoteConfig {
        me: a.clone(),
        members: vec![Member::new(a, 1e-12), Member::new(b, 1e12)],
        secret: "bench".into(),
        timeout: Duration::from_secs(30),
        replicas: 1,
        handoff: Duration::from_secs(600),
    })?;
    remote.note_namespace(0, fingerprint())?;
    Ok(Pair { _rt: rt, remote })
}

fn fingerprint() -> kvstore::Fingerprint {
    kvstore::Namespace {
        model: "bench/remote".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 256,
        tp: kvstore::TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
    .fingerprint()
}

fn keys(round: usize, count: u64) -> Vec<BlockKey> {
    (0..count)
        .map(|i| {
            BlockKey(
                (((round as u128) << 64) | (u128::from(i) + 1))
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
            )
        })
        .collect()
}

/// One round: put `count` blocks of `size` to B, then get them back; (put, get) GB/s.
fn kvtier_round(
    tier: &dyn LowerTier,
    round: usize,
    size: u64,
    src: &AlignedBuf,
    sums: &[u64],
    dst: &mut AlignedBuf,
) -> Result<(f64, f64)> {
    // Batches as the store's pusher sends them (max_batch_bytes, 256 MiB).
    batched_round(tier, round, size, 256 << 20, src, sums, dst)
}

/// [`kvtier_round`] in calls of `batch` bytes.
fn batched_round(
    tier: &dyn LowerTier,
    round: usize,
    size: u64,
    batch: u64,
    src: &AlignedBuf,
    sums: &[u64],
    dst: &mut AlignedBuf,
) -> Result<(f64, f64)> {
    let count = sums.len() as u64;
    let ks = keys(round, count);
    let per = (batch / size).max(1) as usize;
    let t = Instant::now();
    for chunk in (0..count as usize).collect::<Vec<_>>().chunks(per) {
        let items = chunk
            .iter()
            .map(|&i| WriteItem {
                key: ks[i],
                ns: 0,
                // SAFETY: `src` outlives the call and nobody writes it meanwhile; the range
                // lies inside it.
                buf: unsafe {
                    IoBuf::from_raw(
                        src.as_ptr().add(i * size as usize) as *mut u8,
                        size as usize,
                    )
                },
                len: size as u32,
                checksum: sums[i],
            })
            .collect();
        let out = tier.write(items, &|_| true);
        ensure!(
            out.iter().all(|o| *o == kvstore::WriteOutcome::Written),
            "put failed: {out:?}"
        );
    }
    let put = (count * size) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for chunk in (0..count as usize).collect::<Vec<_>>().chunks(per) {
        let items = chunk
            .iter()
            .map(|&i| ReadItem {
                key: ks[i],
                // SAFETY: `dst` outlives the call; each item's range is its own.
                buf: unsafe {
                    IoBuf::from_raw(dst.as_mut_ptr().add(i * size as usize), size as usize)
                },
            })
            .collect();
        let out = tier.read(items);
        ensure!(
            out.iter().all(|o| matches!(o, ReadOutcome::Hit(_))),
            "get missed: {} of {} hits; {:?}",
            out.iter()
                .filter(|o| matches!(o, ReadOutcome::Hit(_)))
                .count(),
            out.len(),
            tier.stats()
        );
    }
    let get = (count * size) as f64 / t.elapsed().as_secs_f64() / 1e9;
    ensure!(src[..] == dst[..], "remote get returned wrong bytes");
    Ok((put, get))
}

/// iperf3, one stream over loopback for 2 s: GB/s.
fn iperf3() -> Result<f64> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut server = Command::new("iperf3")
        .args(["-s", "-B", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 (apt-get install iperf3)")?;
    // The client is retried until the server listens (a probe connection would upset it).
    let until = Instant::now() + Duration::from_secs(10);
    let out = loop {
        let out = Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-p", &port.to_string(), "-t", "2", "-J"])
            .output()
            .context("running iperf3 -c")?;
        // iperf3 -J exits 0 on errors too: the JSON says.
        let failed = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .map_or(true, |v| v.get("error").is_some());
        if !failed || Instant::now() > until {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = server.kill();
    let _ = server.wait();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 reported no throughput")?;
    Ok(bps / 8.0 / 1e9)
}

/// Loopback round trip of one byte (p50, p99 µs), same-size samples as the lookups.
fn rtt(n: usize) -> Result<(f64, f64)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).is_ok() {
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut v = Vec::with_capacity(n);
    let mut b = [7u8; 1];
    for _ in 0..n {
        let t = Instant::now();
        c.write_all(&b)?;
        c.read_exact(&mut b)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(c);
    let _ = echo.join();
    Ok(pcts(v))
}

fn pcts(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
    (at(0.5), at(0.99))
}

/// Lookup of a 64-key prefix held by B (p50, p99 µs).
fn lookups(p: &Pair, n: usize) -> Result<(f64, f64)> {
    let ks = keys(1 << 20, 64);
    let data = vec![3u8; 4096];
    let sum = kvstore::checksum(&data);
    let items = ks
        .iter()
        .map(|k| WriteItem {
            key: *k,
            ns: 0,
            // SAFETY: `data` outlives the call; nobody writes it.
            buf: unsafe { IoBuf::from_raw(data.as_ptr() as *mut u8, 4096) },
            len: 4096,
            checksum: sum,
        })
        .collect();
    p.remote.write(items, &|_| true);
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = p.remote.lookup_batch(&ks);
        v.push(t.elapsed().as_secs_f64() * 1e6);
        ensure!(r.iter().all(Option::is_some), "lookup missed");
    }
    Ok(pcts(v))
}

/// Runs the benchmark.
pub fn run(args: RemoteArgs) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let mut rows: Vec<Row> = Vec::new();
    let mut last = None;
    for &size in &args.sizes {
        // A fresh owner per block size (one size class fills its arena).
        let seg = (64u64 << 20).max(size);
        // Room for every round's blocks (new blocks are what an S3-FIFO arena evicts first).
        let capacity = (args.bytes * (args.rounds as u64 + 2) + 2 * seg).div_ceil(seg) * seg;
        drop(last.take());
        let p = pair(capacity, seg)?;
        let count = (args.bytes / size).max(1);
        let mut src = AlignedBuf::new((count * size) as usize)?;
        src.fill_pattern(size);
        let sums: Vec<u64> = src.chunks(size as usize).map(kvstore::checksum).collect();
        let mut dst = AlignedBuf::new((count * size) as usize)?;
        dst.fill(1);
        let sz = crate::host::human(size);
        let (mut put, mut get) = (Vec::new(), Vec::new());
        let mut redis_rounds: Vec<(f64, f64)> = Vec::new();
        let mut backend_rounds = Vec::new();
        // kvtier's own Redis backend (the remote tier on a Redis), against the same server.
        let backend_server = if args.peers.iter().any(|x| x == "redis") {
            match start_redis() {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("kvtier redis backend skipped: {e:#}");
                    None
                }
            }
        } else {
            None
        };
        let backend = match &backend_server {
            Some((_, port)) => {
                let t = kvtier_cluster::RedisTier::new(kvtier_cluster::RedisConfig {
                    urls: vec![format!("redis://127.0.0.1:{port}/")],
                    cluster: false,
                    prefix: "kvtier:".into(),
                    ttl_s: 0,
                    timeout: Duration::from_secs(30),
                })?;
                t.note_namespace(0, fingerprint())?;
                Some(t)
            }
            None => None,
        };
        let redis = if args.peers.iter().any(|x| x == "redis") {
            let mut rd = AlignedBuf::new((count * size) as usize)?;
            match crate::peers::redis(size, count, args.rounds, &src, &mut rd) {
                Ok(r) => Some(r),
                Err(e) => {
                    eprintln!("peer redis skipped: {e:#}");
                    None
                }
            }
        } else {
            None
        };
        for round in 0..=args.rounds {
            let limit = iperf3()?;
            let (pu, ge) = kvtier_round(
                &p.remote,
                round + size as usize,
                size,
                &src,
                &sums,
                &mut dst,
            )?;
            if let (Some(t), Some((_, port))) = (&backend, &backend_server) {
                // Emptied before each round, as the plain client's server is: kept, its
                // rounds' blocks pile up, and Redis takes new values more slowly (0.3–0.4
                // GB/s after six rounds of 256 MiB, against 2 from empty).
                flushall(*port)?;
                let (bp, bg) = kvtier_round(t, round + size as usize, size, &src, &sums, &mut dst)?;
                if round > 0 {
                    backend_rounds.push(((pu, bp), (ge, bg)));
                }
            }
            if round > 0 {
                put.push((pu, limit));
                get.push((ge, limit));
                if let Some(r) = &redis {
                    redis_rounds.push((pu, r[round - 1].0));
                    redis_rounds.push((ge, r[round - 1].1));
                }
            }
        }
        rows.push(row(
            format!("put {sz} vs iperf3"),
            "GB/s",
            "iperf3, one loopback stream",
            &put,
        ));
        rows.push(row(
            format!("get {sz} vs iperf3"),
            "GB/s",
            "iperf3, one loopback stream",
            &get,
        ));
        if !redis_rounds.is_empty() {
            let pu: Vec<_> = redis_rounds.iter().step_by(2).copied().collect();
            let ge: Vec<_> = redis_rounds.iter().skip(1).step_by(2).copied().collect();
            rows.push(row(
                format!("put {sz} vs redis"),
                "GB/s",
                "redis 7 (loopback TCP)",
                &pu,
            ));
            rows.push(row(
                format!("get {sz} vs redis"),
                "GB/s",
                "redis 7 (loopback TCP)",
                &ge,
            ));
        }
        if !backend_rounds.is_empty() {
            let pu: Vec<_> = backend_rounds.iter().map(|r| r.0).collect();
            let ge: Vec<_> = backend_rounds.iter().map(|r| r.1).collect();
            let is = "kvtier's Redis backend (remote tier on redis 7)";
            rows.push(row(format!("put {sz} vs kvtier-redis"), "GB/s", is, &pu));
            rows.push(row(format!("get {sz} vs kvtier-redis"), "GB/s", is, &ge));
        }
        last = Some(p);
    }
    let p = match last {
        Some(p) => p,
        None => pair(256 << 20, 64 << 20)?,
    };
    let (l50, l99) = lookups(&p, args.lookups)?;
    let (r50, r99) = rtt(args.lookups)?;
    // The goal is lookup <= 2 x RTT + 30 us: the baseline is that bound.
    rows.push(row(
        "lookup 64 keys p50 vs 2xRTT+30us".into(),
        "us",
        "2 x loopback RTT p50 + 30 us",
        &[(l50, 2.0 * r50 + 30.0)],
    ));
    rows.push(row(
        "lookup 64 keys p99 vs 2xRTT+30us".into(),
        "us",
        "2 x loopback RTT p99 + 30 us",
        &[(l99, 2.0 * r99 + 30.0)],
    ));
    rows.extend(stalled_peer(&args)?);
    if !args.no_replay {
        rows.extend(replay(&args)?);
    }
    let report = Report {
        bench: "remote",
        results: rows,
    };
    report.print(args.json)
}

/// Node A's remote tier over three owners on loopback (A owns nothing); with `stalled`, the
/// third is a black hole: a listener that never accepts (connections complete in its backlog,
/// nothing is ever answered).
struct Owners {
    _rt: tokio::runtime::Runtime,
    _hole: Option<TcpListener>,
    remote: RemoteTier,
}

fn owners(stalled: bool, capacity: u64, seg: u64, timeout: Duration) -> Result<Owners> {
    let rt = runtime()?;
    let a = "127.0.0.1:1".to_string();
    let mut members = vec![Member::new(a.clone(), 1e-12)];
    let mut hole = None;
    for i in 0..3 {
        if stalled && i == 2 {
            let l = TcpListener::bind("127.0.0.1:0")?;
            members.push(Member::new(l.local_addr()?.to_string(), 1.0));
            hole = Some(l);
        } else {
            members.push(Member::new(owner(&rt, capacity, seg, timeout)?, 1.0));
        }
    }
    let remote = RemoteTier::new(RemoteConfig {
        me: a,
        members,
        secret: "bench".into(),
        timeout,
        replicas: 1,
        handoff: Duration::from_secs(600),
    })?;
    remote.note_namespace(0, fingerprint())?;
    Ok(Owners {
        _rt: rt,
        _hole: hole,
        remote,
    })
}

/// `get 2MiB with a stalled peer`: 2 MiB blocks put and got through A's remote tier, eight
/// blocks a call (a request's prefix), with one of the three owners black-holed, against the
/// same with all three healthy, rounds interleaved; `cluster.timeout_ms`' default (2 s). A
/// warm-up round lets the black hole's breaker open (the calls that strike it wait their
/// budget: that is the price of finding out); after it, its blocks go to the next member.
fn stalled_peer(args: &RemoteArgs) -> Result<Vec<Row>> {
    let size = 2u64 << 20;
    let seg = 64u64 << 20;
    let bytes = args.bytes.min(64 << 20);
    let count = (bytes / size).max(8);
    // Each owner may hold half of every round's blocks (the black hole's go to the others).
    let capacity = (count * size * (args.rounds as u64 + 1)).div_ceil(2 * seg) * seg + 2 * seg;
    let timeout = Duration::from_secs(2);
    let healthy = owners(false, capacity, seg, timeout)?;
    let stalled = owners(true, capacity, seg, timeout)?;
    let mut src = AlignedBuf::new((count * size) as usize)?;
    src.fill_pattern(size);
    let sums: Vec<u64> = src.chunks(size as usize).map(kvstore::checksum).collect();
    let mut dst = AlignedBuf::new((count * size) as usize)?;
    dst.fill(1);
    let (mut put, mut get) = (Vec::new(), Vec::new());
    for round in 0..=args.rounds {
        let per = 8 * size;
        let (hp, hg) = batched_round(
            &healthy.remote,
            1000 + round,
            size,
            per,
            &src,
            &sums,
            &mut dst,
        )?;
        let (sp, sg) = batched_round(
            &stalled.remote,
            1000 + round,
            size,
            per,
            &src,
            &sums,
            &mut dst,
        )?;
        if round > 0 {
            put.push((sp, hp));
            get.push((sg, hg));
        }
    }
    let is = "the same cluster with all owners healthy";
    Ok(vec![
        row("put 2MiB with a stalled peer".into(), "GB/s", is, &put),
        row("get 2MiB with a stalled peer".into(), "GB/s", is, &get),
    ])
}

/// `n` stores on loopback (then `standby` more, to join later); with `pooled`, each has the
/// remote tier over the first `n` (a standby node's over all of them).
struct Nodes {
    rt: tokio::runtime::Runtime,
    stores: Vec<Arc<kvstore::Store>>,
    remotes: Vec<Arc<RemoteTier>>,
    all: Vec<Member>,
}

fn nodes(n: usize, standby: usize, capacity: u64, seg: u64, pooled: bool) -> Result<Nodes> {
    let rt = runtime()?;
    let mut ls = Vec::new();
    for _ in 0..n + standby {
        ls.push(rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?);
    }
    let addrs: Vec<String> = ls
        .iter()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .collect::<std::io::Result<_>>()?;
    let all: Vec<Member> = addrs.iter().map(|a| Member::new(a.clone(), 1.0)).collect();
    let mut stores = Vec::new();
    let mut remotes = Vec::new();
    for (i, (l, a)) in ls.into_iter().zip(&addrs).enumerate() {
        let remote = if pooled {
            let r = Arc::new(RemoteTier::new(RemoteConfig {
                me: a.clone(),
                members: if i < n {
                    all[..n].to_vec()
                } else {
                    all.clone()
                },
                secret: "bench".into(),
                timeout: Duration::from_secs(5),
                replicas: 1,
                handoff: Duration::from_secs(600),
            })?);
            remotes.push(r.clone());
            Some(kvstore::SharedTier(r))
        } else {
            None
        };
        let store = Arc::new(
            StoreConfig {
                capacity_bytes: capacity,
                segment_bytes: seg,
                remote,
                ..Default::default()
            }
            .build()?,
        );
        rt.spawn(kvtier_cluster::serve(
            l,
            store.clone(),
            ServerConfig {
                node: a.clone(),
                secret: "bench".into(),
                capacity,
                timeout: Duration::from_secs(5),
            },
            Arc::new(ServerStats::default()),
        ));
        stores.push(store);
    }
    Ok(Nodes {
        rt,
        stores,
        remotes,
        all,
    })
}

/// The trace's requests round-robin over `--nodes` nodes: block hits per tier, pooled (remote
/// tier) against the same nodes on their own.
fn replay(args: &RemoteArgs) -> Result<Vec<Row>> {
    let reqs = crate::replay::load_trace(&args.trace, 1, args.trace_requests)
        .with_context(|| format!("reading the trace {}", args.trace.display()))?;
    let distinct = crate::replay::distinct_blocks(&reqs);
    let bb = args.block_bytes;
    let seg = 16u64 << 20;
    let want = (distinct as f64 * args.node_pct / 100.0) as u64 * bb.max(64 << 10);
    let capacity = want.div_ceil(seg).max(2) * seg;
    let ns = kvstore::Namespace {
        model: "bench/remote-replay".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: kvstore::TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    };
    let data = vec![5u8; bb as usize];
    // (hits, remote hits, blocks; the same over the second half of the trace). With `join`,
    // one more node joins halfway and takes its turn at the requests from then on.
    let run = |pooled: bool, join: bool| -> Result<[u64; 5]> {
        let c = nodes(args.nodes, usize::from(join), capacity, seg, pooled)?;
        let stores = &c.stores;
        let ids: Vec<kvstore::NsId> = stores
            .iter()
            .map(|s| s.register_namespace(&ns))
            .collect::<Result<_, _>>()?;
        let [mut hits, mut remote, mut blocks, mut late_hits, mut late_blocks] = [0u64; 5];
        let mut serving = args.nodes;
        let half = reqs.len() / 2;
        for (i, r) in reqs.iter().enumerate() {
            if join && i == half {
                for t in &c.remotes[..args.nodes] {
                    t.set_members(c.all.clone());
                }
                serving += 1;
            }
            let at = i % serving;
            let s = &stores[at];
            let keys: Vec<BlockKey> = r
                .hash_ids
                .iter()
                .map(|&h| {
                    BlockKey(
                        u128::from(h).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) | 1,
                    )
                })
                .collect();
            blocks += keys.len() as u64;
            let m = s.match_prefix(&keys);
            let l = s.load(&keys[..m.n])?;
            hits += l.len() as u64;
            if i >= half {
                late_hits += l.len() as u64;
                late_blocks += keys.len() as u64;
            }
            remote += m.tiers[..l.len()]
                .iter()
                .filter(|t| **t == kvstore::Tier::Remote)
                .count() as u64;
            let n = l.len();
            drop(l);
            for k in &keys[n..] {
                s.put(ids[at], *k, &data)?;
            }
            // Pushes go in the background: let them reach their owners before the next
            // request, so that the pooled figure does not hang on how fast this machine is.
            let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while pooled && s.stats().push_queue_bytes > 0 && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        // The servers (and their store handles) go with the runtime, then the stores.
        let Nodes { rt, stores, .. } = c;
        drop(rt);
        drop(stores);
        Ok([hits, remote, blocks, late_hits, late_blocks])
    };
    let [alone_hits, _, blocks, _, _] = run(false, false)?;
    let [hits, remote, _, late, late_blocks] = run(true, false)?;
    let [_, _, _, joined, joined_blocks] = run(true, true)?;
    let name = crate::replay::trace_name(&args.trace);
    let n = args.nodes;
    let ratio = |x: u64| x as f64 / blocks.max(1) as f64;
    Ok(vec![
        row(
            format!("replay {name} {n} nodes hit ratio pooled vs alone"),
            "hit ratio",
            "the same nodes without the remote tier",
            &[(ratio(hits), ratio(alone_hits))],
        ),
        row(
            "hits after a join".into(),
            "hit ratio",
            "the same replay with no join (second half of the trace)",
            &[(
                joined as f64 / joined_blocks.max(1) as f64,
                late as f64 / late_blocks.max(1) as f64,
            )],
        ),
        row(
            format!("replay {name} {n} nodes remote share of hits"),
            "fraction",
            "all block hits",
            &[(remote as f64 / hits.max(1) as f64, 1.0)],
        ),
    ])
}

/// `FLUSHALL` on the Redis at `port`.
fn flushall(port: u16) -> Result<()> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(b"*1\r\n$8\r\nFLUSHALL\r\n")?;
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line)?;
    ensure!(line.trim_end() == "+OK", "FLUSHALL answered {line:?}");
    Ok(())
}

/// A redis-server on a free loopback port, killed when dropped.
fn start_redis() -> Result<(RedisProc, u16)> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new("redis-server")
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
            "--proto-max-bulk-len",
            "1gb",
        ])
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    let p = RedisProc(child);
    let until = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        ensure!(Instant::now() < until, "redis-server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((p, port))
}

/// A child process killed when dropped.
struct RedisProc(std::process::Child);

impl Drop for RedisProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

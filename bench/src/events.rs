//! `kvtier-bench events`: kvtierd's KV event publisher ([events]) under a stream of saves.
//!
//! Two daemons, one publishing events to a subscriber in this process and one without events,
//! take the same puts over the engine socket (batches of `--batch` blocks), rounds interleaved.
//! Cases: `put blocks/s with events` against the daemon without (ratio: the publishing cost on
//! saves; goal ≥ 0.95) and `events/s at N blocks`: the N events the subscriber received over
//! the time from the first put to the last event, against the put rate without events (ratio ≥
//! 1: the publisher keeps up with the fastest saves). Then both daemons clear everything they
//! hold through the admin API: `removal events/s at N blocks` is the `BlockRemoved` events the
//! subscriber received over the time from the clear request to the last of them, against the
//! blocks/s the daemon without events clears (the publisher's own speed, with a source faster
//! than any engine's saves).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use kvstore::{AlignedBuf, BlockKey, Namespace, TpShard};
use kvtier_ipc::{IpcClient, SlotStatus};
use zeromq::{Socket, SocketRecv};

use crate::report::{row, Report};
use crate::sidecar::{self, Sidecar};

/// Options of `kvtier-bench events`.
#[derive(Args, Debug)]
pub struct EventsArgs {
    /// Blocks stored per round.
    #[arg(long, default_value_t = 1_000_000)]
    pub blocks: u64,
    /// Bytes per block.
    #[arg(long, default_value = "4K", value_parser = crate::parse_size)]
    pub block: u64,
    /// Blocks per reserve/commit request.
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Rounds.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// The kvtierd binary (default: next to this one).
    #[arg(long)]
    pub kvtierd: Option<PathBuf>,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

fn ns() -> Namespace {
    named("bench-events")
}

fn named(model: &str) -> Namespace {
    Namespace {
        model: model.into(),
        dtype: "bf16".into(),
        layout: "bench".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    }
}

/// Puts `n` fresh blocks (keys from `base`) in namespace `ns`; returns the seconds it took.
fn put_all(
    c: &mut IpcClient,
    ns: &Namespace,
    n: u64,
    base: u64,
    block: usize,
    batch: usize,
    src: &[u8],
) -> Result<f64> {
    let sid = c.register_namespace(ns)?;
    let t = Instant::now();
    let mut i = 0;
    while i < n {
        let m = (n - i).min(batch as u64);
        let keys: Vec<BlockKey> = (i..i + m)
            .map(|j| BlockKey(u128::from(base + j) << 1 | 1))
            .collect();
        let slots = c.reserve(sid, &keys, &vec![block as u32; m as usize])?;
        let mut tokens = Vec::with_capacity(slots.len());
        for s in &slots {
            let SlotStatus::Slot { token, .. } = *s else {
                bail!(
                    "kvtierd gave no slot: {s:?} (is --blocks × --block beyond its host memory?)"
                );
            };
            c.write(token, &src[..block])?;
            tokens.push(token);
        }
        c.commit(&tokens)?;
        i += m;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Block hashes of BlockStored and of BlockRemoved events in one msgpack KVEventBatch payload
/// (map encoding: the key string precedes each value).
fn hashes_in(payload: &[u8]) -> Result<(u64, u64)> {
    let mut rd = payload;
    ensure!(
        rmp::decode::read_array_len(&mut rd)? == 3,
        "not a KVEventBatch"
    );
    let _ts = rmp::decode::read_f64(&mut rd)?;
    let events = rmp::decode::read_array_len(&mut rd)?;
    let (mut n, mut removed) = (0, 0);
    for _ in 0..events {
        let fields = rmp::decode::read_map_len(&mut rd)?;
        let mut stored = false;
        for _ in 0..fields {
            let mut name = [0u8; 32];
            let k = rmp::decode::read_str(&mut rd, &mut name)
                .map_err(|e| anyhow::anyhow!("{e:?}"))?
                .to_string();
            match k.as_str() {
                "type" => {
                    let mut v = [0u8; 32];
                    stored = rmp::decode::read_str(&mut rd, &mut v)
                        .map_err(|e| anyhow::anyhow!("{e:?}"))?
                        == "BlockStored";
                }
                "block_hashes" => {
                    let len = rmp::decode::read_array_len(&mut rd)?;
                    for _ in 0..len {
                        let l = rmp::decode::read_bin_len(&mut rd)? as usize;
                        rd = &rd[l..];
                    }
                    if stored {
                        n += u64::from(len);
                    } else {
                        removed += u64::from(len);
                    }
                }
                "parent_block_hash" | "lora_id" | "lora_name" => {
                    rmp::decode::read_nil(&mut rd)?;
                }
                "token_ids" => {
                    rmp::decode::read_array_len(&mut rd)?;
                }
                "block_size" => {
                    let _: u64 = rmp::decode::read_int(&mut rd)?;
                }
                "medium" | "locality" | "ownership" | "kv_cache_spec_kind" => {
                    let mut v = [0u8; 32];
                    rmp::decode::read_str(&mut rd, &mut v).map_err(|e| anyhow::anyhow!("{e:?}"))?;
                }
                "group_idx" | "kv_cache_spec_sliding_window" => {
                    let _: u64 = rmp::decode::read_int(&mut rd)?;
                }
                other => bail!("unexpected field {other:?}"),
            }
        }
    }
    Ok((n, removed))
}

/// Clears namespace `id` of the daemon at `grpc`; returns the blocks removed.
fn clear(rt: &tokio::runtime::Runtime, grpc: &str, id: u32) -> Result<u64> {
    rt.block_on(async {
        let mut a = kvtier_client::connect(grpc, None).await?;
        let r = a
            .clear_namespace(kvtier_client::pb::ClearRequest {
                namespace_id: id,
                tenant: String::new(),
            })
            .await
            .map_err(kvtier_client::explain)?;
        anyhow::Ok(r.into_inner().removed)
    })
}

/// Runs the events benchmark.
pub fn run(args: EventsArgs) -> Result<()> {
    ensure!(
        args.blocks > 0 && args.batch > 0 && args.rounds > 0,
        "counts must be positive"
    );
    let bin = sidecar::binary(args.kvtierd.as_deref())?;
    let block = args.block as usize;
    let seg = 64u64 << 20;
    // Every round's blocks stay (fresh keys each round), with a little room to spare: no
    // eviction while measuring.
    let capacity = ((args.blocks * args.block.max(4096) * args.rounds as u64) / seg + 2) * seg;
    let common = |events: bool| {
        let mut a: Vec<String> = vec![
            "--no-disk".into(),
            "--host-capacity".into(),
            capacity.to_string(),
            "--set".into(),
            format!("host.segment={seg}"),
            // Slots of exactly the block size (the default classes start at 64 KiB).
            "--set".into(),
            format!("host.size_classes=[{}]", args.block.max(4096)),
            // The clear at the end is an admin write (loopback only, no token here).
            "--set".into(),
            "server.allow_unauthenticated_admin=true".into(),
        ];
        if events {
            a.extend(["--set".into(), "events.endpoint=tcp://127.0.0.1:0".into()]);
        }
        a
    };
    let pid = std::process::id();
    let with = Sidecar::start(
        &bin,
        std::env::temp_dir().join(format!("kvtier-bench-ev-{pid}")),
        &common(true),
    )?;
    let without = Sidecar::start(
        &bin,
        std::env::temp_dir().join(format!("kvtier-bench-noev-{pid}")),
        &common(false),
    )?;
    for d in [&with, &without] {
        d.wait_populated(Duration::from_secs(600))?;
    }
    let endpoint = with
        .ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("events="))
        .context("kvtierd printed no events= endpoint")?
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The subscriber: counts stored blocks as they arrive, on its own thread.
    let (count_tx, count_rx) = std::sync::mpsc::channel::<(u64, u64, Instant)>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done_sub = done.clone();
    let sub_thread = std::thread::spawn(move || -> Result<()> {
        rt.block_on(async move {
            let mut sub = zeromq::SubSocket::new();
            sub.connect(&endpoint).await?;
            sub.subscribe("").await?;
            let _ = ready_tx.send(());
            loop {
                let m = match tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
                    Ok(m) => m?,
                    Err(_) if done_sub.load(std::sync::atomic::Ordering::Relaxed) => return Ok(()),
                    Err(_) => continue,
                };
                let Some(p) = m.get(2) else { continue };
                let (n, removed) = hashes_in(p)?;
                if count_tx.send((n, removed, Instant::now())).is_err() {
                    return Ok(());
                }
            }
        })
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .context("the subscriber did not connect")?;
    let mut src = AlignedBuf::new(block)?;
    src.fill_pattern(5);
    let mut cw = IpcClient::connect(&with.socket, "kvtier-bench-events")?;
    let mut co = IpcClient::connect(&without.socket, "kvtier-bench-events")?;
    // ZMQ's slow joiner: a PUB socket drops what it sends before the subscription reached it.
    // Probe blocks (a namespace of their own, which the clear below leaves alone) until one's
    // event arrives, then let the rest drain.
    let probe = named("bench-events-probe");
    let probes = Instant::now();
    for i in 0u64.. {
        ensure!(
            probes.elapsed() < Duration::from_secs(60),
            "the subscription never reached kvtierd's publisher"
        );
        put_all(&mut cw, &probe, 1, (1 << 60) + i, block, 1, &src)?;
        if count_rx.recv_timeout(Duration::from_millis(200)).is_ok() {
            while count_rx.recv_timeout(Duration::from_millis(300)).is_ok() {}
            break;
        }
    }
    let (mut puts, mut rates) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let base = (round as u64 + 1) << 40;
        // Alternate which daemon goes first, so that drift on this shared box (page cache,
        // neighbours) weighs on both sides alike.
        let without_first = round % 2 == 0;
        let mut t_without = 0.0;
        if without_first {
            t_without = put_all(&mut co, &ns(), args.blocks, base, block, args.batch, &src)?;
        }
        let start = Instant::now();
        let t_with = put_all(&mut cw, &ns(), args.blocks, base, block, args.batch, &src)?;
        let mut got = 0u64;
        let mut last = start;
        while got < args.blocks {
            let Ok((n, _, at)) = count_rx.recv_timeout(Duration::from_secs(60)) else {
                done.store(true, std::sync::atomic::Ordering::Relaxed);
                match sub_thread.join() {
                    Ok(Err(e)) => bail!("the subscriber failed: {e:#}"),
                    _ => bail!("events stopped at {got} of {} blocks", args.blocks),
                }
            };
            got += n;
            last = at;
        }
        if !without_first {
            t_without = put_all(&mut co, &ns(), args.blocks, base, block, args.batch, &src)?;
        }
        let put_without = args.blocks as f64 / t_without;
        puts.push((args.blocks as f64 / t_with, put_without));
        rates.push((
            args.blocks as f64 / (last - start).as_secs_f64(),
            put_without,
        ));
        eprintln!(
            "round {}: puts {:.0}/s with events, {:.0}/s without; {} events in {:.3} s",
            round + 1,
            args.blocks as f64 / t_with,
            put_without,
            got,
            (last - start).as_secs_f64()
        );
    }
    // Everything cleared at once: the removal events come as fast as the store walks its
    // blocks. The daemon without events clears first (its time is the baseline).
    let admin = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let id_without = co.register_namespace(&ns())?.0;
    let id_with = cw.register_namespace(&ns())?.0;
    let t = Instant::now();
    let cleared_without = clear(&admin, &without.grpc, id_without)?;
    let clear_rate = cleared_without as f64 / t.elapsed().as_secs_f64();
    let start = Instant::now();
    let cleared = clear(&admin, &with.grpc, id_with)?;
    let (mut removed, mut last) = (0u64, start);
    // Until all arrived, or nothing came for 5 s. Events the store dropped (it ran more than
    // events.backlog events ahead of the publisher) are counted by kvtierd in
    // kvtier_events_lost_total and show here as missing; the reset that follows a loss sends
    // BlockStored batches (every block held), which are not removals: they do not move `last`.
    while removed < cleared {
        let Ok((_, r, at)) = count_rx.recv_timeout(Duration::from_secs(5)) else {
            break;
        };
        if r > 0 {
            removed += r;
            last = at;
        }
    }
    ensure!(
        removed > 0,
        "no removal event arrived for a clear of {cleared} blocks"
    );
    let removal_rate = removed as f64 / (last - start).as_secs_f64().max(1e-9);
    eprintln!(
        "clear: {removed} of {cleared} removal events in {:.3} s ({removal_rate:.0}/s); without events {cleared_without} blocks cleared at {clear_rate:.0}/s",
        (last - start).as_secs_f64()
    );
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(count_rx);
    if let Ok(Err(e)) = sub_thread.join() {
        bail!("the subscriber failed: {e:#}");
    }
    let report = Report {
        bench: "events",
        results: vec![
            row(
                format!(
                    "put blocks/s with events ({} B blocks, batch {})",
                    args.block, args.batch
                ),
                "blocks/s",
                "the same puts to a kvtierd without events",
                &puts,
            ),
            row(
                format!("events/s at {} blocks", args.blocks),
                "events/s",
                "put rate without events",
                &rates,
            ),
            row(
                format!("removal events/s at {} blocks", cleared),
                "events/s",
                "blocks/s the daemon without events clears",
                &[(removal_rate, clear_rate)],
            ),
        ],
    };
    report.print(args.json)
}

//! `kvtier-bench connector`: saving and loading a long prompt prefix between an engine's paged
//! KV tensors and kvtier through the connector's CPU path (gather into a reserved slot, scatter
//! out of a pinned block), embedded and through `kvtierd`, against a plain memcpy of the same
//! bytes in the same run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::{Args, ValueEnum};
use kvstore::{AlignedBuf, BlockKey, Namespace, NsId, StoreConfig, TpShard};
use kvtier_connector::{Backend, Dim, LayerView, PagedKv};

use crate::report::{row, Report, Row};
use crate::sidecar::{self, Sidecar};

/// The engine's per-layer KV tensor layout.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum Layout {
    /// FlashAttention: `(2, num_blocks, block_tokens, kv_heads, head_dim)`, K and V planes first.
    KvFirst,
    /// FlashInfer / Triton: `(num_blocks, 2, block_tokens, kv_heads, head_dim)`.
    BlocksFirst,
}

/// Options of `kvtier-bench connector`.
#[derive(Args, Debug)]
pub struct ConnectorArgs {
    /// Prefix length in tokens.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Tokens per engine block (one kvtier block per engine block, as the vLLM connector).
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Attention layers (Llama-3-8B: 32).
    #[arg(long, default_value_t = 32)]
    pub layers: usize,
    /// KV heads per layer (Llama-3-8B: 8).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Bytes per element (2: bf16).
    #[arg(long, default_value_t = 2)]
    pub elem: usize,
    /// KV tensor layout.
    #[arg(long, value_enum, default_value = "kv-first")]
    pub layout: Layout,
    /// Rounds (after a warm-up).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// The kvtierd binary (default: next to this one).
    #[arg(long)]
    pub kvtierd: Option<PathBuf>,
    /// Only the embedded mode (no kvtierd).
    #[arg(long)]
    pub embedded_only: bool,
    /// Copy-thread counts to measure (comma-separated); `N` > 1 adds cases `… xNt` against a
    /// memcpy of the same bytes on N threads.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub threads: Vec<usize>,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

fn ns(a: &ConnectorArgs) -> Namespace {
    Namespace {
        model: "bench/connector".into(),
        dtype: format!("{}-byte", a.elem),
        layout: format!("{:?}", a.layout),
        block_tokens: a.block_tokens as u32,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

fn key(round: usize, i: usize) -> BlockKey {
    let x = ((round as u128) << 64) | (i as u128 + 1);
    BlockKey(x.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) | 1)
}

/// The engine's KV tensors (one aligned buffer per layer) and their description.
struct Engine {
    layers: Vec<AlignedBuf>,
    paged: PagedKv,
}

impl Engine {
    fn new(a: &ConnectorArgs, blocks: usize, seed: u64) -> Result<Self> {
        let (bt, h, d) = (a.block_tokens, a.kv_heads, a.head_dim);
        let elems = 2 * blocks * bt * h * d;
        let mut layers = Vec::with_capacity(a.layers);
        let mut views = Vec::with_capacity(a.layers);
        for l in 0..a.layers {
            let mut buf = AlignedBuf::new(elems * a.elem)?;
            buf.fill_pattern(seed + l as u64);
            let (shape, dims) = match a.layout {
                Layout::KvFirst => (
                    vec![2, blocks, bt, h, d],
                    vec![Dim::Kv, Dim::Blocks, Dim::Tokens, Dim::Inner, Dim::Inner],
                ),
                Layout::BlocksFirst => (
                    vec![blocks, 2, bt, h, d],
                    vec![Dim::Blocks, Dim::Kv, Dim::Tokens, Dim::Inner, Dim::Inner],
                ),
            };
            let mut strides = vec![1isize; 5];
            for j in (0..4).rev() {
                strides[j] = strides[j + 1] * shape[j + 1] as isize;
            }
            views.push(LayerView {
                ptr: buf.as_ptr() as usize,
                shape,
                strides,
                dims,
                elem: a.elem,
            });
            layers.push(buf);
        }
        // SAFETY: each view describes exactly its own live buffer (shape and contiguous strides
        // built from the same sizes), the buffers are kept in `layers` for as long as `paged`
        // lives, and this benchmark only copies while it holds `&mut self` or `&self` without
        // touching the buffers otherwise.
        let paged = unsafe { PagedKv::new(views)? };
        Ok(Self { layers, paged })
    }
}

/// Runs the connector benchmark.
pub fn run(args: ConnectorArgs) -> Result<()> {
    ensure!(
        args.rounds > 0 && args.tokens >= args.block_tokens && args.block_tokens > 0,
        "--rounds must be positive and --tokens at least one block"
    );
    let blocks = args.tokens / args.block_tokens;
    let src = Engine::new(&args, blocks, 1)?;
    let mut dst = Engine::new(&args, blocks, 99)?;
    let bb = src.paged.block_bytes();
    let total = blocks * bb;
    let ids: Vec<Vec<usize>> = (0..blocks).map(|b| vec![b]).collect();
    eprintln!(
        "connector: {} tokens = {blocks} blocks of {} = {} MiB ({:?}, {} layers)",
        args.tokens,
        crate::host::human(bb as u64),
        total >> 20,
        args.layout,
        args.layers
    );

    // Baseline: memcpy of the same bytes, block by block, between two aligned buffers.
    let mut from = AlignedBuf::new(total)?;
    from.fill_pattern(7);
    let mut to = AlignedBuf::new(total)?;
    ensure!(
        !args.threads.is_empty() && args.threads.iter().all(|&t| t > 0),
        "--threads: thread counts must be positive"
    );
    // On `threads` threads: contiguous shares of the blocks, one per thread.
    let memcpy = |to: &mut AlignedBuf, threads: usize| {
        let share = blocks.div_ceil(threads) * bb;
        let t = Instant::now();
        std::thread::scope(|sc| {
            for (d, s) in to.chunks_mut(share).zip(from.chunks(share)) {
                sc.spawn(move || {
                    for (d, s) in d.chunks_mut(bb).zip(s.chunks(bb)) {
                        d.copy_from_slice(s);
                    }
                });
            }
        });
        total as f64 / t.elapsed().as_secs_f64() / 1e9
    };

    let seg = (64u64 << 20).max(bb.next_power_of_two() as u64);
    let mut modes: Vec<(&'static str, Backend)> = Vec::new();
    let embedded = StoreConfig {
        capacity_bytes: (total as u64 * 5 / 4).div_ceil(seg) * seg + seg,
        segment_bytes: seg,
        size_classes: vec![bb],
        populate: kvstore::Populate::Now,
        ..Default::default()
    }
    .build()?;
    modes.push(("embedded", Backend::embedded(embedded)));
    let mut _daemon = None;
    if !args.embedded_only {
        let bin = sidecar::binary(args.kvtierd.as_deref())?;
        // Fresh keys every round, twice (whole and layer-by-layer saves; no remove over the
        // engine socket): room for all of them.
        let cap = (total as u64 * 2 * (args.rounds as u64 + 2)).div_ceil(seg) * seg + seg;
        let d = Sidecar::start(
            &bin,
            std::env::temp_dir().join(format!("kvtier-bench-conn-{}", std::process::id())),
            &[
                "--no-disk".into(),
                "--host-capacity".into(),
                cap.to_string(),
                "--set".into(),
                format!("host.segment={seg}"),
            ],
        )?;
        // The embedded store is populated up front; the daemon faults its arena in behind
        // (7.5 GB here), which competed with the measured saves for this machine's two cores
        // and swung `save 4096 tokens, kvtierd` between 0.42 and 1.0 × memcpy.
        d.wait_populated(Duration::from_secs(600))?;
        modes.push(("kvtierd", Backend::sidecar(&d.socket, "kvtier-bench")?));
        _daemon = Some(d);
    }

    let mut rows: Vec<Row> = Vec::new();
    let ttl = Duration::from_secs(30);
    let mut generation = 0;
    for &threads in &args.threads {
        for (mode, backend) in &mut modes {
            backend.set_copy_threads(threads);
            let nsid: NsId = backend.register_namespace(&ns(&args))?;
            let mut save = Vec::new();
            let mut load = Vec::new();
            let mut layered = Vec::new();
            for round in 0..=args.rounds {
                generation += 1;
                let keys: Vec<BlockKey> = (0..blocks).map(|i| key(generation, i)).collect();
                let base = memcpy(&mut to, threads);
                let t = Instant::now();
                let n = backend.save(nsid, &src.paged, &keys, &ids)?;
                let s_bw = total as f64 / t.elapsed().as_secs_f64() / 1e9;
                ensure!(n == blocks, "{mode}: saved {n} of {blocks} blocks");
                let t = Instant::now();
                let n = backend.load(&dst.paged, &keys, &ids, ttl)?;
                let l_bw = total as f64 / t.elapsed().as_secs_f64() / 1e9;
                ensure!(n == blocks, "{mode}: loaded {n} of {blocks} blocks");
                // The same blocks saved layer by layer (as vLLM's `layerwise` does: slots
                // reserved, a layer at a time, then the checksums and the commit).
                generation += 1;
                let lkeys: Vec<BlockKey> = (0..blocks).map(|i| key(generation, i)).collect();
                let t = Instant::now();
                let mut ls = backend.begin_layer_save(nsid, &src.paged, &lkeys, &ids, &[])?;
                for layer in 0..src.paged.layers() {
                    backend.save_layer(&mut ls, &src.paged, layer)?;
                }
                let n = backend.finish_layer_save(ls, &src.paged)?;
                let lw_bw = total as f64 / t.elapsed().as_secs_f64() / 1e9;
                ensure!(
                    n == blocks,
                    "{mode}: saved {n} of {blocks} blocks layer by layer"
                );
                if round == 0 {
                    // Byte-exact: the engine tensors round-tripped through the store (whole
                    // saves, and layer-by-layer ones).
                    for (l, (a, b)) in src.layers.iter().zip(&dst.layers).enumerate() {
                        ensure!(a[..] == b[..], "{mode}: layer {l} differs after save+load");
                    }
                    for (l, buf) in dst.layers.iter_mut().enumerate() {
                        buf.fill_pattern(1000 + l as u64);
                    }
                    let n = backend.load(&dst.paged, &lkeys, &ids, ttl)?;
                    ensure!(n == blocks, "{mode}: loaded {n} of {blocks} blocks");
                    for (l, (a, b)) in src.layers.iter().zip(&dst.layers).enumerate() {
                        ensure!(
                            a[..] == b[..],
                            "{mode}: layer {l} differs after a layer-by-layer save"
                        );
                    }
                    for (l, buf) in dst.layers.iter_mut().enumerate() {
                        buf.fill_pattern(2000 + l as u64);
                    }
                } else {
                    save.push((s_bw, base));
                    load.push((l_bw, base));
                    layered.push((lw_bw, base));
                }
                // The next round's keys are fresh: room for them (the embedded store can remove).
                if let Some(s) = backend.store() {
                    for k in keys.iter().chain(&lkeys) {
                        s.remove(k);
                    }
                }
            }
            let t = args.tokens;
            let (suffix, baseline) = if threads == 1 {
                (String::new(), "memcpy")
            } else {
                (format!(" x{threads}t"), "memcpy on as many threads")
            };
            rows.push(row(
                format!("save {t} tokens, {mode}{suffix}"),
                "GB/s",
                baseline,
                &save,
            ));
            rows.push(row(
                format!("load {t} tokens, {mode}{suffix}"),
                "GB/s",
                baseline,
                &load,
            ));
            rows.push(row(
                format!("save {t} tokens layer by layer, {mode}{suffix}"),
                "GB/s",
                baseline,
                &layered,
            ));
        }
    }
    drop(modes);
    Report {
        bench: "connector",
        results: rows,
    }
    .print(args.json)
}

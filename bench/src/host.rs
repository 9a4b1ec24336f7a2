//! `kvtier-bench host`: put/get through the host tier against memcpy, `match_prefix` against a
//! plain hash-set probe, and metadata bytes per block.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;
use kvstore::{
    AlignedBuf, BlockKey, Namespace, NsId, PolicyKind, Reserve, Store, StoreConfig, TpShard,
};

use crate::alloc_count;
use crate::report::{row, Report, Row};

/// Options of `kvtier-bench host`.
#[derive(Args, Debug)]
pub struct HostArgs {
    /// Block sizes in bytes (suffixes K, M, G allowed).
    #[arg(long, value_delimiter = ',', default_value = "256K,2M,16M", value_parser = crate::parse_size)]
    pub sizes: Vec<u64>,
    /// Thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub threads: Vec<usize>,
    /// Bytes of blocks per round (spread over many slots so copies leave the CPU caches).
    #[arg(long, default_value = "1G", value_parser = crate::parse_size)]
    pub working_set: u64,
    /// Rounds per case; value, baseline and ratio are medians.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Key chain length for match_prefix.
    #[arg(long, default_value_t = 1000)]
    pub chain: usize,
    /// Check each block's commit checksum when it is pinned for a get (the daemon's
    /// host.verify_reads), besides the check fused with the copy that every get does.
    #[arg(long, default_value_t = false)]
    pub verify_reads: bool,
    /// Back the host arena with hugetlbfs pages (the daemon's `host.huge_pages`; needs
    /// `vm.nr_hugepages` reserved: a bit over 1.25 × `--working-set` per size).
    #[arg(long, default_value_t = false)]
    pub huge_pages: bool,
    /// Block counts at which to measure metadata bytes per block (0 skips).
    #[arg(long, value_delimiter = ',', default_value = "1000000,10000000")]
    pub metadata_blocks: Vec<u64>,
    /// Other host policies whose metadata to measure at the same counts (cases `metadata N
    /// blocks, POLICY`; the unnamed cases use the default, the duel). `lru` is what a host
    /// tier in front of a disk tier runs by default; "none" for none.
    #[arg(long, value_delimiter = ',', default_value = "duel-clock,lru")]
    pub metadata_policies: Vec<String>,
    /// Write a Markdown summary and a bandwidth plot into this directory.
    #[arg(long)]
    pub report: Option<std::path::PathBuf>,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

fn namespace() -> Namespace {
    Namespace {
        model: "bench/llama-3.1-8b".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ 0x5555)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Runs `f(thread)` on `threads` threads started together; returns the wall time, from the
/// first thread's start to the last one's end. Each thread reads the clock itself: a
/// coordinating thread that read it could be descheduled (2 cores, 2 workers) until the
/// work was done, and time almost nothing (it did: 3,146 GB/s "gets" at `--threads 2`).
fn timed_threads<F: Fn(usize) + Sync>(threads: usize, f: F) -> Duration {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    f(t);
                    (start, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let first = spans.iter().map(|s| s.0).min();
    let last = spans.iter().map(|s| s.1).max();
    match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a),
        _ => Duration::ZERO,
    }
}

/// Disjoint `block`-sized pieces of one aligned buffer, as raw addresses (shared across threads).
struct Ring {
    buf: RingBuf,
    block: usize,
}

/// The baseline's memory: 4 KiB pages, or (with `--huge-pages`, so that both sides of the
/// ratio have the same TLB reach) anonymous memory advised to transparent huge pages before
/// its first touch.
enum RingBuf {
    Small(AlignedBuf),
    Huge { ptr: *mut u8, len: usize },
}

// SAFETY: the mapping is owned by the ring and only read or written through its addresses by
// the benchmark's threads, each on its own pieces.
unsafe impl Sync for RingBuf {}

impl Drop for RingBuf {
    fn drop(&mut self) {
        if let RingBuf::Huge { ptr, len } = *self {
            // SAFETY: `ptr`/`len` are the mapping made in `Ring::new`, unmapped once here.
            unsafe { libc::munmap(ptr.cast(), len) };
        }
    }
}

impl Ring {
    fn new(bytes: u64, block: usize, huge: bool) -> Result<Self> {
        let len = bytes as usize;
        let buf = if huge {
            // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            ensure!(ptr != libc::MAP_FAILED, "mmap of {len} bytes failed");
            // SAFETY: `ptr`/`len` is the mapping just made; the advice only changes page size.
            unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
            // SAFETY: the mapping is `len` writable bytes, owned here.
            let s = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) };
            kvstore::fill_pattern(s, 7);
            RingBuf::Huge {
                ptr: ptr.cast(),
                len,
            }
        } else {
            let mut b = AlignedBuf::new(len)?;
            b.fill_pattern(7);
            RingBuf::Small(b)
        };
        Ok(Self { buf, block })
    }
    /// Writes the ring's lines back to memory and drops them from every cache level, so the
    /// baseline's gets read DRAM as the store's do: the store's puts write blocks with
    /// non-temporal stores, past the caches, while the baseline's memcpy leaves what it wrote
    /// in the last-level cache. On a CPU whose L3 holds the working set (260 MiB on this
    /// VM's Xeon some days), the baseline read L3 and the store DRAM: `get 256KiB x1t` at
    /// 64 MiB measured 0.40–0.70 against a baseline that swung 12–24 GB/s.
    fn evict(&self) {
        let (base, len) = match &self.buf {
            RingBuf::Small(b) => (b.as_ptr(), b.len()),
            RingBuf::Huge { ptr, len } => (*ptr as *const u8, *len),
        };
        // SAFETY: the ring's own live buffer.
        unsafe { flush(base as usize, len) };
    }

    fn addr(&self, i: usize) -> usize {
        let base = match &self.buf {
            RingBuf::Small(b) => b.as_ptr() as usize,
            RingBuf::Huge { ptr, .. } => *ptr as usize,
        };
        base + i * self.block
    }
}

/// Writes the `len` bytes at `base` back to memory and drops them from every cache level
/// (see [`Ring::evict`]).
///
/// # Safety
/// `base..base + len` lies in live, mapped memory (a flush of an unmapped address faults).
unsafe fn flush(base: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let base = base as *const u8;
        // CLFLUSHOPT (CPUID leaf 7, EBX bit 23) where the CPU has it: unordered among
        // itself, ~4 × faster here than CLFLUSH, which waits for each line. Asked once (in
        // a VM, CPUID is an exit to the hypervisor).
        static OPT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let opt = *OPT.get_or_init(|| std::arch::x86_64::__cpuid_count(7, 0).ebx & (1 << 23) != 0);
        for off in (0..len).step_by(64) {
            // SAFETY: `base + off` lies inside the caller's live memory; a cache-line flush
            // changes no contents (CLFLUSH is SSE2, on every x86-64 CPU; CLFLUSHOPT only
            // where CPUID said so).
            unsafe {
                let p = base.add(off);
                if opt {
                    std::arch::asm!("clflushopt [{0}]", in(reg) p, options(nostack, preserves_flags));
                } else {
                    std::arch::x86_64::_mm_clflush(p);
                }
            }
        }
        // SAFETY: SSE2; orders the flushes before the timed reads.
        unsafe { std::arch::x86_64::_mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (base, len);
}

fn copy_raw(dst: usize, src: usize, len: usize) {
    // SAFETY: callers pass addresses of disjoint, live, `len`-byte pieces of aligned buffers
    // that outlive the copy; each destination piece is written by one thread only.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) }
}

fn bandwidth_cases(args: &HostArgs, rows: &mut Vec<Row>) -> Result<()> {
    let max_threads = args.threads.iter().copied().max().unwrap_or(1);
    for &size in &args.sizes {
        let block = size as usize;
        let n = (args.working_set / size).max(max_threads as u64 * 2) as usize;
        let seg: u64 = (64 << 20).max(size.next_power_of_two());
        let store = StoreConfig {
            capacity_bytes: (n as u64 * size * 5 / 4).div_ceil(seg) * seg + seg,
            segment_bytes: seg,
            size_classes: vec![block],
            populate: kvstore::Populate::Now,
            verify_reads: args.verify_reads,
            huge_pages: args.huge_pages,
            ..Default::default()
        }
        .build()
        .context("building the store (lower --working-set, or reserve huge pages?)")?;
        let ns = store.register_namespace(&namespace())?;
        // Baseline destinations: as many pieces as the store gets blocks.
        let ring = Ring::new(n as u64 * size, block, args.huge_pages)?;
        let mut srcs = Vec::new();
        let mut dsts = Vec::new();
        for t in 0..max_threads {
            let mut s = AlignedBuf::new(block)?;
            s.fill_pattern(t as u64);
            srcs.push(s);
            dsts.push(AlignedBuf::new(block)?);
        }
        let dst_addrs: Vec<usize> = dsts.iter_mut().map(|d| d.as_mut_ptr() as usize).collect();
        for &threads in &args.threads {
            let per = n / threads;
            let total = (per * threads) as u64 * size;
            let mut put_rounds = Vec::new();
            let mut get_rounds = Vec::new();
            let mut slot_rounds = Vec::new();
            // Round 0 warms caches, TLBs and page tables and is not reported.
            for round in 0..=args.rounds {
                for i in 0..n as u64 {
                    store.remove(&key(i));
                }
                let base_put = timed_threads(threads, |t| {
                    let src = srcs[t].as_ptr() as usize;
                    for i in t * per..(t + 1) * per {
                        copy_raw(ring.addr(i), src, block);
                    }
                });
                let put = timed_threads(threads, |t| {
                    for i in t * per..(t + 1) * per {
                        put_one(&store, ns, key(i as u64), &srcs[t]);
                    }
                });
                ring.evict();
                let base_get = timed_threads(threads, |t| {
                    for i in t * per..(t + 1) * per {
                        copy_raw(dst_addrs[t], ring.addr(i), block);
                    }
                });
                // A second baseline: memcpy of the very slots the gets read, in the same order
                // (the ring is one contiguous buffer read in order; the store's slots come off
                // free lists in whatever order earlier removals left them). It runs before the
                // gets in odd rounds and after them in even ones, each flushed from the caches
                // first, so neither side always finds the pages' translations warm.
                let slots = (0..per * threads)
                    .map(|i| slot_addr(&store, key(i as u64)))
                    .collect::<Result<Vec<usize>>>()?;
                let flush_slots = || {
                    for &a in &slots {
                        // SAFETY: the store's slots, mapped while `store` lives.
                        unsafe { flush(a, block) };
                    }
                };
                let copy_slots = || {
                    timed_threads(threads, |t| {
                        for &a in &slots[t * per..(t + 1) * per] {
                            copy_raw(dst_addrs[t], a, block);
                        }
                    })
                };
                let gets = || {
                    timed_threads(threads, |t| {
                        // SAFETY: thread t is the only user of dsts[t] during this call.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(dst_addrs[t] as *mut u8, block)
                        };
                        for i in t * per..(t + 1) * per {
                            let got = store.get_into(&key(i as u64), dst);
                            assert!(matches!(got, Ok(Some(_))), "block {i} missing");
                        }
                    })
                };
                flush_slots();
                let (base_slots, get) = if round % 2 == 1 {
                    let b = copy_slots();
                    flush_slots();
                    (b, gets())
                } else {
                    let g = gets();
                    flush_slots();
                    (copy_slots(), g)
                };
                if round > 0 {
                    put_rounds.push((gbps(total, put), gbps(total, base_put)));
                    get_rounds.push((gbps(total, get), gbps(total, base_get)));
                    slot_rounds.push((gbps(total, get), gbps(total, base_slots)));
                }
            }
            ensure!(
                store.stats().evictions == 0,
                "the bench store evicted: it must hold the working set"
            );
            let sz = human(size);
            rows.push(row(
                format!("put {sz} x{threads}t"),
                "GB/s",
                "memcpy",
                &put_rounds,
            ));
            rows.push(row(
                format!("get {sz} x{threads}t"),
                "GB/s",
                "memcpy",
                &get_rounds,
            ));
            rows.push(row(
                format!("get {sz} x{threads}t vs memcpy of its slots"),
                "GB/s",
                "memcpy of the same slots, in the same order",
                &slot_rounds,
            ));
        }
        // Check the bytes once: the last put round stored srcs[0] under thread 0's keys.
        let b = store.get(&key(0)).context("block 0 missing")?;
        ensure!(*b == srcs[0][..], "block 0 holds wrong bytes");
    }
    Ok(())
}

/// Where in the arena the store holds `k`'s block.
fn slot_addr(store: &Store, k: BlockKey) -> Result<usize> {
    let l = store.load(&[k])?;
    ensure!(l.len() == 1, "block {k} missing");
    Ok(l.arena_block(0).as_ptr() as usize)
}

fn put_one(store: &Store, ns: NsId, k: BlockKey, src: &[u8]) {
    match store.reserve(ns, k, src.len()) {
        Ok(Reserve::Slot(mut r)) => {
            // As an engine does: the checksum computed while copying, carried by the commit.
            let sum = kvstore::copy_hashed(r.as_mut_slice(), src);
            if let Err(e) = r.commit_with_checksum(sum) {
                panic!("commit: {e}");
            }
        }
        Ok(_) => panic!("block {k} already present"),
        Err(e) => panic!("reserve: {e}"),
    }
}

#[derive(Default)]
struct Fold(u64);
impl Hasher for Fold {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, b: &[u8]) {
        for x in b {
            self.0 = self.0.rotate_left(8) ^ u64::from(*x);
        }
    }
    fn write_u128(&mut self, x: u128) {
        self.0 = (x as u64) ^ ((x >> 64) as u64);
    }
}

fn match_prefix_case(args: &HostArgs, rows: &mut Vec<Row>) -> Result<()> {
    let store = StoreConfig {
        capacity_bytes: (args.chain as u64 * 4096).div_ceil(4 << 20) * (4 << 20),
        segment_bytes: 4 << 20,
        size_classes: vec![4096],
        ..Default::default()
    }
    .build()?;
    let ns = store.register_namespace(&namespace())?;
    let chain: Vec<BlockKey> = (0..args.chain as u64).map(|i| key((i + 1) << 32)).collect();
    for k in &chain {
        store.put(ns, *k, &[1u8; 4096])?;
    }
    let set: HashSet<u128, BuildHasherDefault<Fold>> = chain.iter().map(|k| k.0).collect();
    // Calls per thread per round: what one thread of the store does in about 300 ms.
    let (mut per_thread, start) = (0u64, Instant::now());
    while start.elapsed() < Duration::from_millis(300) {
        assert_eq!(store.match_prefix(&chain).n, chain.len());
        per_thread += 1;
    }
    for &threads in &args.threads {
        let mut rounds = Vec::new();
        let keys = (threads as u64 * per_thread * chain.len() as u64) as f64;
        for _ in 0..args.rounds {
            // The baseline probes four times as often (it is that much faster).
            let base = timed_threads(threads, |_| {
                for _ in 0..4 * per_thread {
                    let n = chain.iter().take_while(|k| set.contains(&k.0)).count();
                    assert_eq!(n, chain.len());
                }
            });
            let v = timed_threads(threads, |_| {
                for _ in 0..per_thread {
                    assert_eq!(store.match_prefix(&chain).n, chain.len());
                }
            });
            rounds.push((
                keys / v.as_secs_f64() / 1e6,
                4.0 * keys / base.as_secs_f64() / 1e6,
            ));
        }
        rows.push(row(
            format!("match_prefix chain {} x{threads}t", args.chain),
            "Mkeys/s",
            "unlocked hash-set probe",
            &rounds,
        ));
    }
    Ok(())
}

/// A store with room for `blocks` 4 KiB blocks whose arena is never touched: reserved slots
/// are committed without writing, so the memfd stays sparse and only metadata costs memory.
fn sparse_store(blocks: u64, policy: PolicyKind) -> Result<kvstore::Store> {
    let seg: u64 = 64 << 20;
    Ok(StoreConfig {
        capacity_bytes: (blocks * 4096).div_ceil(seg) * seg,
        segment_bytes: seg,
        size_classes: vec![4096],
        populate: kvstore::Populate::Lazy,
        policy,
        ..Default::default()
    }
    .build()?)
}

/// Heap bytes per block of a store holding `blocks` blocks under `policy`, and the store.
fn filled_store(blocks: u64, policy: PolicyKind) -> Result<(kvstore::Store, NsId, f64)> {
    let before = alloc_count::live_bytes();
    let store = sparse_store(blocks, policy)?;
    let ns = store.register_namespace(&namespace())?;
    for i in 0..blocks {
        match store.reserve(ns, key(i), 4096)? {
            Reserve::Slot(r) => {
                // A checksum the writer computed: the store reads nothing.
                r.commit_with_checksum(0)?;
            }
            _ => anyhow::bail!("duplicate key {i}"),
        }
    }
    ensure!(store.stats().blocks == blocks, "not every block was stored");
    let per = (alloc_count::live_bytes() - before) as f64 / blocks as f64;
    Ok((store, ns, per))
}

/// A row of heap bytes per block, against the 128-byte target.
fn metadata_row(case: String, per: f64) -> Row {
    Row {
        case,
        unit: "bytes/block",
        value: per,
        baseline: 128.0,
        ratio: per / 128.0,
        ratio_spread: None,
        sweep: None,
        baseline_is: "target 128 B/block",
    }
}

fn metadata_case(blocks: u64, policies: &[PolicyKind], rows: &mut Vec<Row>) -> Result<()> {
    let before = alloc_count::live_bytes();
    let (store, ns, per) = filled_store(blocks, PolicyKind::default())?;
    rows.push(metadata_row(
        format!("metadata {} blocks", human_count(blocks)),
        per,
    ));
    let at_scale = lookup_latency(&store, blocks);
    // As many again: each evicts one, so the policy's ghost history (the keys it evicted,
    // up to the blocks it holds) fills as it does on a node in steady state.
    for i in blocks..2 * blocks {
        if let Reserve::Slot(r) = store.reserve(ns, key(i), 4096)? {
            r.commit_with_checksum(0)?;
        }
    }
    let held = store.stats().blocks;
    ensure!(
        held >= blocks && store.stats().evictions > 0,
        "the store is not full and evicting"
    );
    let per = (alloc_count::live_bytes() - before) as f64 / held as f64;
    rows.push(metadata_row(
        format!("metadata {} blocks evicting", human_count(blocks)),
        per,
    ));
    drop(store);
    // The same lookups against a store of 65,536 blocks, same run: what scale costs.
    let small = sparse_store(65_536, PolicyKind::default())?;
    let sns = small.register_namespace(&namespace())?;
    for i in 0..65_536 {
        if let Reserve::Slot(r) = small.reserve(sns, key(i), 4096)? {
            r.commit_with_checksum(0)?;
        }
    }
    let base = lookup_latency(&small, 65_536);
    drop(small);
    for (q, v, b) in [("p50", at_scale.0, base.0), ("p99", at_scale.1, base.1)] {
        rows.push(Row {
            case: format!("lookup 64 keys {q} at {} blocks", human_count(blocks)),
            unit: "us",
            value: v,
            baseline: b,
            ratio: v / b,
            ratio_spread: None,
            sweep: None,
            baseline_is: "the same lookup at 65,536 blocks",
        });
    }
    for &p in policies {
        let (store, _, per) = filled_store(blocks, p)?;
        drop(store);
        rows.push(metadata_row(
            format!("metadata {} blocks, {}", human_count(blocks), p.name()),
            per,
        ));
    }
    Ok(())
}

/// p50 and p99 (µs) of longest-prefix lookups of 64 present keys at random places among
/// `blocks` stored ones (2,000 lookups).
fn lookup_latency(store: &kvstore::Store, blocks: u64) -> (f64, f64) {
    let mut rng = crate::rng::Rng(blocks);
    let mut v = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let start = rng.below(blocks.saturating_sub(64).max(1));
        let keys: Vec<_> = (start..start + 64).map(key).collect();
        let t = Instant::now();
        let m = store.match_prefix(&keys);
        v.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(m.n, keys.len().min((blocks - start) as usize));
    }
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

pub(crate) fn human(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}KiB", b >> 10)
    } else {
        format!("{b}B")
    }
}

fn human_count(n: u64) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else {
        n.to_string()
    }
}

/// Runs the host benchmark.
pub fn run(args: HostArgs) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(
        args.threads.iter().all(|&t| t > 0),
        "--threads must be positive"
    );
    let mut rows = Vec::new();
    bandwidth_cases(&args, &mut rows)?;
    if args.chain > 0 {
        match_prefix_case(&args, &mut rows)?;
    }
    let policies = args
        .metadata_policies
        .iter()
        .filter(|p| p.as_str() != "none")
        .map(|p| {
            PolicyKind::parse(p).with_context(|| format!("--metadata-policies: no policy {p:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    for &n in &args.metadata_blocks {
        if n > 0 {
            metadata_case(n, &policies, &mut rows)?;
        }
    }
    let report = Report {
        bench: "host",
        results: rows,
    };
    if let Some(dir) = &args.report {
        crate::plot::bandwidth_report(dir, &report, "Host tier: put/get vs memcpy")?;
    }
    report.print(args.json)
}

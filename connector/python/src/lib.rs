//! `kvtier._native`: Python bindings of the connector's one transfer API (`Backend`: the store
//! embedded in this process, or `kvtierd` through its socket and shared arena), the key scheme
//! and the paged-KV gather/scatter. Blocks move between an engine's memory and kvtier with one
//! copy: saves gather straight into a reserved slot, loads scatter straight out of a pinned
//! block. `Store` and `Sidecar` are the two ways to build a `Backend`.

use std::time::Duration;

use kvstore::io::IoConfig;
use kvstore::{Admission, BlockKey, DiskConfig, Namespace, NsId, StoreConfig};
use kvtier_connector::{Dim, LayerView};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

fn key(b: &[u8]) -> PyResult<BlockKey> {
    BlockKey::from_bytes(b).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A save's tags for the KV events (see `kvtier_connector::Tags`).
fn tags(
    engine_hashes: Option<Vec<Vec<u8>>>,
    parent_hashes: Option<Vec<Vec<u8>>>,
    token_ids: Option<Vec<Vec<u32>>>,
) -> kvtier_connector::Tags {
    kvtier_connector::Tags {
        engine_hashes: engine_hashes.unwrap_or_default(),
        parents: parent_hashes.unwrap_or_default(),
        token_ids: token_ids.unwrap_or_default(),
    }
}

fn tier_name(t: kvstore::Tier) -> &'static str {
    match t {
        kvstore::Tier::Host => "host",
        kvstore::Tier::Disk => "disk",
        _ => "remote",
    }
}

fn keys(v: &[Vec<u8>]) -> PyResult<Vec<BlockKey>> {
    v.iter().map(|k| key(k)).collect()
}

/// Keys for a save or load, checked against their engine block id lists.
fn paired_keys(keys: &[Vec<u8>], block_ids: &[Vec<usize>]) -> PyResult<Vec<BlockKey>> {
    if keys.len() != block_ids.len() {
        return Err(PyValueError::new_err("keys and block_ids differ in length"));
    }
    self::keys(keys)
}

/// Input errors are ValueError, everything else RuntimeError.
fn transfer_err(e: kvtier_connector::TransferError) -> PyErr {
    use kvtier_connector::TransferError as E;
    match e {
        E::Layout(_) | E::Input(_) => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Memory the caller declared as the only memory kvtier may touch for a batch of pages (e.g.
/// SGLang's host KV pool: its buffers' `(address, length)`), checked before any copy.
fn check_regions(regions: &[(usize, usize)]) -> PyResult<()> {
    for &(ptr, len) in regions {
        if ptr == 0 || len == 0 || ptr.checked_add(len).is_none() {
            return Err(PyValueError::new_err(format!(
                "bad memory region: address {ptr:#x}, {len} bytes"
            )));
        }
    }
    Ok(())
}

/// One block's bytes as the caller's memory segments `(address, length)`, in order: a
/// contiguous tensor, or a host-pool page spread over several buffers (SGLang's
/// `get_page_buffer_meta`). Refuses null, empty, oversized and overlapping segments, and, when
/// `regions` is given, any segment not wholly inside one of them (an out-of-range page index
/// becomes an error here, before any byte is copied).
///
/// # Safety
/// Every segment must be live memory that nobody else touches during the call (the Python
/// adapters pass tensors' `data_ptr()`s and byte sizes and keep the tensors alive).
unsafe fn raw_segments<'a>(
    segs: &[(usize, usize)],
    regions: Option<&[(usize, usize)]>,
) -> PyResult<Vec<&'a mut [u8]>> {
    let bad = |why: &str| PyValueError::new_err(format!("bad buffer segments: {why}"));
    if segs.is_empty() {
        return Err(bad("none given"));
    }
    let mut sorted = segs.to_vec();
    sorted.sort_unstable();
    let mut end = 0usize;
    for &(ptr, len) in &sorted {
        if ptr == 0 || len == 0 || len > isize::MAX as usize {
            return Err(bad(&format!("address {ptr:#x}, {len} bytes")));
        }
        if ptr < end {
            return Err(bad(&format!("{ptr:#x} overlaps the previous segment")));
        }
        end = ptr
            .checked_add(len)
            .ok_or_else(|| bad(&format!("{ptr:#x} + {len} wraps")))?;
        if let Some(regions) = regions {
            if !regions
                .iter()
                .any(|&(r, rl)| ptr >= r && end <= r.saturating_add(rl))
            {
                return Err(bad(&format!(
                    "{ptr:#x}+{len} lies outside the registered host pool (an index out of range?)"
                )));
            }
        }
    }
    Ok(segs
        .iter()
        // SAFETY: the caller's contract above; the segments are disjoint (checked).
        .map(|&(ptr, len)| unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) })
        .collect())
}

/// Each page's memory, as a list of segments.
type Pages<'a> = Vec<Vec<&'a mut [u8]>>;

/// Every page's segments, checked (see `raw_segments`), before anything is copied; pages may
/// not overlap each other either (they are copied from several threads at once, and are
/// lent as `&mut`).
///
/// # Safety
/// As for `raw_segments`, for every page.
unsafe fn raw_pages<'a>(
    keys: &[Vec<u8>],
    pages: &[Vec<(usize, usize)>],
    regions: Option<&[(usize, usize)]>,
) -> PyResult<(Vec<BlockKey>, Pages<'a>)> {
    if keys.len() != pages.len() {
        return Err(PyValueError::new_err(format!(
            "{} keys but {} pages",
            keys.len(),
            pages.len()
        )));
    }
    if let Some(r) = regions {
        check_regions(r)?;
    }
    let ks = self::keys(keys)?;
    let mut all: Vec<(usize, usize)> = pages.iter().flatten().copied().collect();
    all.sort_unstable();
    for w in all.windows(2) {
        if w[0].0.saturating_add(w[0].1) > w[1].0 {
            return Err(PyValueError::new_err(format!(
                "bad buffer segments: {:#x} overlaps another segment (every page must be \
                 distinct memory)",
                w[1].0
            )));
        }
    }
    let segs = pages
        .iter()
        // SAFETY: the caller's contract, page by page.
        .map(|p| unsafe { raw_segments(p, regions) })
        .collect::<PyResult<Vec<_>>>()?;
    Ok((ks, segs))
}

/// An engine's paged KV cache, described layer by layer: `(data_ptr, shape, strides, dims,
/// element_size)` with dims among "blocks", "kv", "tokens", "inner". The tensors must stay
/// allocated, and not be resized, for the life of this object. `device="cuda"`: the tensors
/// are in GPU memory (only the `*_cuda` transfers take them; the CPU ones refuse them).
#[pyclass(module = "kvtier._native", frozen)]
struct PagedKv {
    inner: kvtier_connector::PagedKv,
    on_gpu: bool,
}

impl PagedKv {
    /// The layout, for a CPU copy (refused for GPU memory: the CPU would read device
    /// addresses).
    fn host(&self) -> PyResult<&kvtier_connector::PagedKv> {
        if self.on_gpu {
            return Err(PyValueError::new_err(
                "this PagedKv describes GPU memory: use the *_cuda transfers",
            ));
        }
        Ok(&self.inner)
    }

    /// The layout, for a GPU copy.
    fn device(&self) -> PyResult<&kvtier_connector::PagedKv> {
        if !self.on_gpu {
            return Err(PyValueError::new_err(
                "this PagedKv describes host memory (device=\"cpu\"): the *_cuda transfers \
                 take GPU tensors",
            ));
        }
        Ok(&self.inner)
    }
}

type LayerSpec = (usize, Vec<usize>, Vec<isize>, Vec<String>, usize);

#[pymethods]
impl PagedKv {
    #[new]
    #[pyo3(signature = (layers, device="cpu"))]
    fn new(layers: Vec<LayerSpec>, device: &str) -> PyResult<Self> {
        let on_gpu = match device {
            "cpu" => false,
            "cuda" => true,
            other => {
                return Err(PyValueError::new_err(format!(
                    "device must be \"cpu\" or \"cuda\", not {other:?}"
                )))
            }
        };
        let mut views = Vec::with_capacity(layers.len());
        for (i, (ptr, shape, strides, dims, elem)) in layers.into_iter().enumerate() {
            let dims = dims
                .iter()
                .map(|d| match d.as_str() {
                    "blocks" => Ok(Dim::Blocks),
                    "kv" => Ok(Dim::Kv),
                    "tokens" => Ok(Dim::Tokens),
                    "inner" => Ok(Dim::Inner),
                    other => Err(PyValueError::new_err(format!(
                        "layer {i}: dim {other:?} is not blocks, kv, tokens or inner"
                    ))),
                })
                .collect::<PyResult<Vec<Dim>>>()?;
            if ptr == 0 {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: null data pointer"
                )));
            }
            views.push(LayerView {
                ptr,
                shape,
                strides,
                dims,
                elem,
            });
        }
        // SAFETY: the caller hands over live tensors' data pointers, shapes and strides and
        // keeps the tensors alive and unresized while this object exists (documented in the
        // class docstring, as for any API taking `tensor.data_ptr()`).
        let inner = unsafe { kvtier_connector::PagedKv::new(views) }
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self { inner, on_gpu })
    }

    /// Canonical bytes of one engine block (all layers, K and V).
    #[getter]
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }

    /// Engine blocks.
    #[getter]
    fn blocks(&self) -> usize {
        self.inner.blocks()
    }

    /// Copies engine blocks out (canonical form), e.g. for tests.
    fn gather<'py>(&self, py: Python<'py>, ids: Vec<usize>) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = vec![0u8; ids.len() * self.inner.block_bytes()];
        self.host()?
            .gather(&ids, &mut out)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Copies canonical bytes into engine blocks.
    fn scatter(&self, ids: Vec<usize>, data: &[u8]) -> PyResult<()> {
        self.host()?
            .scatter(&ids, data)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// A layer-by-layer save in progress (`Backend.begin_layer_save`); over once finished or
/// aborted.
#[pyclass(module = "kvtier._native", frozen)]
struct LayerSave {
    s: std::sync::Mutex<Option<kvtier_connector::LayerSave>>,
}

impl LayerSave {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Option<kvtier_connector::LayerSave>>> {
        self.s
            .lock()
            .map_err(|_| PyRuntimeError::new_err("a layer-by-layer save was poisoned by a panic"))
    }

    /// Runs `f` on the save while it is open.
    fn with_open<R>(
        &self,
        f: impl FnOnce(&mut kvtier_connector::LayerSave) -> PyResult<R>,
    ) -> PyResult<R> {
        let mut g = self.lock()?;
        f(g.as_mut().ok_or_else(over)?)
    }

    /// Ends the save: it is the caller's to finish or abort.
    fn take(&self) -> PyResult<kvtier_connector::LayerSave> {
        self.lock()?.take().ok_or_else(over)
    }
}

fn over() -> PyErr {
    PyValueError::new_err("this layer-by-layer save is over")
}

#[pymethods]
impl LayerSave {
    /// Blocks whose slots are held (0 once the save is over).
    #[getter]
    fn held(&self) -> PyResult<usize> {
        Ok(self.lock()?.as_ref().map_or(0, |s| s.held()))
    }

    /// Layers gathered so far.
    #[getter]
    fn layers_done(&self) -> PyResult<usize> {
        Ok(self.lock()?.as_ref().map_or(0, |s| s.layers_done()))
    }
}

/// kvtier's GPU copier on device `device`: its own CUDA stream in the device's primary context
/// (the one torch uses). Raises if there is no CUDA driver or device.
#[pyclass(module = "kvtier._native", frozen)]
struct Cuda {
    c: std::sync::Arc<kvtier_connector::cuda::CudaCopier>,
}

#[pymethods]
impl Cuda {
    #[new]
    fn new(device: usize) -> PyResult<Self> {
        let c = kvtier_connector::cuda::CudaCopier::new(device)
            .map_err(|e| PyRuntimeError::new_err(format!("kvtier: GPU {device}: {e}")))?;
        Ok(Self {
            c: std::sync::Arc::new(c),
        })
    }

    /// Whether the CUDA driver library can be loaded here.
    #[staticmethod]
    fn driver_present() -> bool {
        kvtier_connector::cuda::driver_present()
    }

    /// An event that fires once the work queued so far on `stream` (a raw `CUstream`, e.g.
    /// `torch.cuda.current_stream().cuda_stream`; 0: the legacy default stream) is done.
    fn record_on(&self, stream: usize) -> PyResult<CudaEvent> {
        // SAFETY: the caller hands over a live stream of this device (torch's current one).
        let ev = unsafe { self.c.record_on(stream) }
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(CudaEvent {
            ev,
            c: self.c.clone(),
        })
    }

    /// Makes loads (or, with `saves=True`, saves) queued on kvtier's streams from now on wait
    /// for `event` (e.g. one recorded on the engine's stream: what it queued before still
    /// uses the blocks a load overwrites, or writes the KV a save reads).
    #[pyo3(signature = (event, saves=false))]
    fn wait_for(&self, event: &CudaEvent, saves: bool) -> PyResult<()> {
        self.c
            .wait_for(&event.ev, saves)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Waits for every copy queued on kvtier's streams.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.c.synchronize())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

/// A CUDA event (a point in a stream's work).
#[pyclass(module = "kvtier._native", frozen)]
struct CudaEvent {
    ev: kvtier_connector::cuda::CudaEvent,
    c: std::sync::Arc<kvtier_connector::cuda::CudaCopier>,
}

#[pymethods]
impl CudaEvent {
    /// Makes work queued on `stream` from now on wait for this event, without blocking the
    /// host (e.g. a layer's attention after its load).
    fn wait_on(&self, stream: usize) -> PyResult<()> {
        // SAFETY: the caller hands over a live stream of this device (torch's current one).
        unsafe { self.c.make_wait(&self.ev, stream) }
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

/// Copies of a namespace's encoding into a `Namespace`.
fn namespace(encoded: &[u8]) -> PyResult<Namespace> {
    Namespace::decode(encoded).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// What every kvtier handle can do, embedded or through kvtierd: the connector's `Backend`.
#[pyclass(module = "kvtier._native", subclass, frozen)]
struct Backend {
    b: kvtier_connector::Backend,
}

#[pymethods]
impl Backend {
    /// How many threads large copies are split across (0 at construction: the cores available
    /// to this process less one in 8, at most 16).
    #[getter]
    fn copy_threads(&self) -> usize {
        self.b.copy_threads()
    }

    /// Registers a namespace from its canonical encoding; returns its id. With `group_idx`:
    /// the namespace keys the blocks of the engine's KV-cache group of that index (its spec's
    /// kind, e.g. "sliding_window", and window in tokens), which kvtierd publishes with the
    /// namespace's KV events as vLLM does (`group_idx`, `kv_cache_spec_kind`,
    /// `kv_cache_spec_sliding_window`).
    #[pyo3(signature = (encoded, group_idx=None, spec_kind=None, sliding_window=None))]
    fn register_namespace(
        &self,
        py: Python<'_>,
        encoded: &[u8],
        group_idx: Option<u32>,
        spec_kind: Option<String>,
        sliding_window: Option<u32>,
    ) -> PyResult<u32> {
        let ns = namespace(encoded)?;
        let group = match group_idx {
            Some(idx) => {
                let g = kvtier_ipc::KvGroup {
                    idx,
                    spec_kind: spec_kind.unwrap_or_default(),
                    sliding_window: sliding_window.unwrap_or(0),
                };
                kvtier_ipc::check_kv_group(&g).map_err(PyValueError::new_err)?;
                Some(g)
            }
            None if spec_kind.is_some() || sliding_window.is_some() => {
                return Err(PyValueError::new_err(
                    "spec_kind and sliding_window describe a KV-cache group: give its group_idx",
                ))
            }
            None => None,
        };
        py.allow_threads(|| self.b.register_namespace_in(&ns, group))
            .map(|i| i.0)
            .map_err(transfer_err)
    }

    /// How many leading keys are present in any tier (no side effects).
    fn match_prefix(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<usize> {
        let ks = self::keys(&keys)?;
        py.allow_threads(|| self.b.match_prefix(&ks))
            .map_err(transfer_err)
    }

    /// The leading keys present, and the tier of each ("host", "disk", "remote"); with
    /// `tokens_per_block` and `prefill_tokens_per_s`, break-even admission cuts the answer
    /// where loading stops paying off. Returns `(n, present, tiers)`: `present` is the prefix
    /// before that cut (= n without it); `tiers` goes on past the `n` with one "pending" per
    /// key another engine is saving right after them now (a load that asks for those waits
    /// for their commit: read-your-writes).
    #[pyo3(signature = (keys, tokens_per_block=0, prefill_tokens_per_s=0.0))]
    fn lookup(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        tokens_per_block: u32,
        prefill_tokens_per_s: f64,
    ) -> PyResult<(usize, usize, Vec<&'static str>)> {
        let ks = self::keys(&keys)?;
        let (m, present) = py
            .allow_threads(|| {
                self.b
                    .lookup_priced(&ks, tokens_per_block, prefill_tokens_per_s)
            })
            .map_err(transfer_err)?;
        let mut tiers: Vec<&str> = m.tiers.iter().map(|t| tier_name(*t)).collect();
        tiers.extend(std::iter::repeat_n("pending", m.pending));
        Ok((m.n, present, tiers))
    }

    /// Hints that `keys` (a prefix, in order) will be loaded soon: blocks found only on disk
    /// are promoted into host memory in the background, `priority` (0..255) first, unless
    /// `deadline_ms` passes before the worker gets to them. `tag` names the hint for
    /// `cancel_prefetch`. Returns what the hint found and did: present, in_host, joined (being
    /// promoted already), queued, held (in host memory, held for the load), waiting (keys
    /// waiting for preload room, preloaded in order as it comes back), dropped (given up).
    #[pyo3(signature = (keys, priority=0, deadline_ms=10000, tag=0))]
    fn prefetch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        priority: u8,
        deadline_ms: u64,
        tag: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ks = self::keys(&keys)?;
        let p = py
            .allow_threads(|| {
                self.b.prefetch(
                    &ks,
                    priority,
                    Duration::from_millis(deadline_ms.max(1)),
                    tag,
                )
            })
            .map_err(transfer_err)?;
        let d = PyDict::new(py);
        d.set_item("present", p.present)?;
        d.set_item("in_host", p.in_host)?;
        d.set_item("joined", p.joined)?;
        d.set_item("queued", p.queued)?;
        d.set_item("dropped", p.dropped)?;
        d.set_item("held", p.held)?;
        d.set_item("waiting", p.waiting)?;
        Ok(d)
    }

    /// Retain hint: keeps the present prefix of `keys` out of eviction's reach until `ttl_ms`
    /// (0: the daemon's longest, preload.max_retain_ms), under `session` (a later retain of the
    /// same session adds to it; None: anonymous). Returns a dict: present, retained, clipped,
    /// clipped_by (the bounds' configuration keys), refused (non-empty: nothing retained, and
    /// why), ttl_ms, retained_bytes, displaced (blocks of lower-priority retentions ended).
    #[pyo3(signature = (keys, session=None, ttl_ms=0, priority=0))]
    fn retain<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        session: Option<String>,
        ttl_ms: u64,
        priority: u8,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ks = self::keys(&keys)?;
        let r = py
            .allow_threads(|| {
                self.b.retain(
                    &ks,
                    session.as_deref(),
                    Duration::from_millis(ttl_ms),
                    priority,
                )
            })
            .map_err(transfer_err)?;
        let d = PyDict::new(py);
        d.set_item("present", r.present)?;
        d.set_item("retained", r.retained)?;
        d.set_item("clipped", r.clipped)?;
        d.set_item(
            "clipped_by",
            r.clipped_by.iter().map(|b| b.key()).collect::<Vec<_>>(),
        )?;
        d.set_item("refused", r.refused)?;
        d.set_item("ttl_ms", r.ttl.as_millis() as u64)?;
        d.set_item("retained_bytes", r.bytes)?;
        d.set_item("displaced", r.displaced)?;
        Ok(d)
    }

    /// Demote hint: the session (and/or keys) is done for now: ends its retention and moves
    /// its host blocks to disk at once. Returns a dict: released, freed (dropped from host
    /// memory now), queued (written first), busy (in use: left), not_in_host, kept (nowhere to
    /// go).
    #[pyo3(signature = (keys=Vec::new(), session=None))]
    fn demote<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        session: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        if keys.is_empty() && session.is_none() {
            return Err(PyValueError::new_err("demote: name a session or keys"));
        }
        let ks = self::keys(&keys)?;
        let r = py
            .allow_threads(|| self.b.demote(&ks, session.as_deref()))
            .map_err(transfer_err)?;
        let d = PyDict::new(py);
        d.set_item("released", r.released)?;
        d.set_item("freed", r.freed)?;
        d.set_item("queued", r.queued)?;
        d.set_item("busy", r.busy)?;
        d.set_item("not_in_host", r.not_in_host)?;
        d.set_item("kept", r.kept)?;
        Ok(d)
    }

    /// Pin hint: pins the leading present keys (any tier, not loaded) for `ttl_ms` (at most an
    /// hour), bounded per connection through kvtierd. Returns a dict: n, tiers, lease (pass it
    /// to `unpin`; None: nothing pinned), clipped, clipped_by, refused, ttl_ms.
    #[pyo3(signature = (keys, ttl_ms=30_000))]
    fn pin<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        ttl_ms: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ks = self::keys(&keys)?;
        let p = py
            .allow_threads(|| self.b.pin(&ks, Duration::from_millis(ttl_ms)))
            .map_err(transfer_err)?;
        let d = PyDict::new(py);
        d.set_item("n", p.n)?;
        d.set_item(
            "tiers",
            p.tiers.iter().map(|t| tier_name(*t)).collect::<Vec<_>>(),
        )?;
        d.set_item("lease", p.lease.map(|h| (h.conn, h.id.0)))?;
        d.set_item("clipped", p.clipped)?;
        d.set_item("clipped_by", p.clipped_by)?;
        d.set_item("refused", p.refused)?;
        d.set_item("ttl_ms", p.ttl.as_millis() as u64)?;
        Ok(d)
    }

    /// Ends a pin (`pin(...)["lease"]`); False if it had ended already.
    fn unpin(&self, py: Python<'_>, lease: (u64, u64)) -> PyResult<bool> {
        let h = kvtier_connector::PinHandle {
            conn: lease.0,
            id: kvstore::LeaseId(lease.1),
        };
        py.allow_threads(|| self.b.unpin(h)).map_err(transfer_err)
    }

    /// Drops the queued preloads of hint `tag`; returns how many blocks they held.
    fn cancel_prefetch(&self, py: Python<'_>, tag: u64) -> PyResult<usize> {
        py.allow_threads(|| self.b.cancel_prefetch(tag))
            .map_err(transfer_err)
    }

    /// Saves engine blocks: `keys[i]` gets the canonical bytes of engine blocks `block_ids[i]`,
    /// gathered straight into a reserved slot. Returns how many were stored now.
    /// `engine_hashes`, if given, is the engine's own hash of each block (vLLM's block hash, at
    /// most 32 bytes): kvtierd's KV events name the blocks by it; with them, `parent_hashes`
    /// (the hash of the block before each; b"" for a sequence's first) and `token_ids` (each
    /// block's) go into its BlockStored events as vLLM's `parent_block_hash` and `token_ids`
    /// (sent only to a kvtierd that publishes events).
    #[pyo3(signature = (ns, paged, keys, block_ids, engine_hashes=None, parent_hashes=None,
                        token_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        ns: u32,
        paged: &PagedKv,
        keys: Vec<Vec<u8>>,
        block_ids: Vec<Vec<usize>>,
        engine_hashes: Option<Vec<Vec<u8>>>,
        parent_hashes: Option<Vec<Vec<u8>>>,
        token_ids: Option<Vec<Vec<u32>>>,
    ) -> PyResult<usize> {
        let ks = paired_keys(&keys, &block_ids)?;
        let tags = tags(engine_hashes, parent_hashes, token_ids);
        let paged = paged.host()?;
        py.allow_threads(|| {
            self.b
                .save_described(NsId(ns), paged, &ks, &block_ids, &tags)
        })
        .map_err(transfer_err)
    }

    /// Loads the longest present prefix of `keys` into engine blocks `block_ids[i]` (scattered
    /// straight out of the pinned block). Returns how many leading keys were loaded; a block of
    /// the wrong size ends the prefix. Through kvtierd, blocks copied under a lease that lapsed
    /// before release are not counted (the engine recomputes them).
    #[pyo3(signature = (paged, keys, block_ids, ttl_ms=30_000))]
    fn load(
        &self,
        py: Python<'_>,
        paged: &PagedKv,
        keys: Vec<Vec<u8>>,
        block_ids: Vec<Vec<usize>>,
        ttl_ms: u64,
    ) -> PyResult<usize> {
        let ks = paired_keys(&keys, &block_ids)?;
        let ttl = Duration::from_millis(ttl_ms);
        let paged = paged.host()?;
        py.allow_threads(|| self.b.load(paged, &ks, &block_ids, ttl))
            .map_err(transfer_err)
    }

    /// Loads like `load`, layer by layer: every block is pinned and its size checked first,
    /// then each layer of every block is copied and `on_layer(layer, loaded)` called (with the
    /// GIL) as soon as it is in, so the engine can run that layer; once all are in, each
    /// block's copy is verified against its commit checksum. Returns how many leading keys
    /// were loaded and verified (fewer if a block changed after its commit, 0 if a lease
    /// lapsed: treat the rest as failed, whatever `on_layer` said).
    #[pyo3(signature = (paged, keys, block_ids, on_layer, ttl_ms=30_000))]
    fn load_layerwise(
        &self,
        py: Python<'_>,
        paged: &PagedKv,
        keys: Vec<Vec<u8>>,
        block_ids: Vec<Vec<usize>>,
        on_layer: PyObject,
        ttl_ms: u64,
    ) -> PyResult<usize> {
        let ks = paired_keys(&keys, &block_ids)?;
        let ttl = Duration::from_millis(ttl_ms);
        let paged = paged.host()?;
        // A callback that raised may not have let the engine know about a layer: nothing of
        // the load counts (the engine recomputes it).
        let mut raised = false;
        let n = py
            .allow_threads(|| {
                self.b
                    .load_layerwise(paged, &ks, &block_ids, ttl, &mut |layer, n| {
                        Python::with_gil(|py| {
                            if let Err(e) = on_layer.call1(py, (layer, n)) {
                                e.print(py);
                                raised = true;
                            }
                        })
                    })
            })
            .map_err(transfer_err)?;
        Ok(if raised { 0 } else { n })
    }

    /// Begins a layer-by-layer save (what `save` does, in three calls): reserves a slot for
    /// every key not present yet; `save_layer` then gathers one layer of every block into its
    /// slot, and `finish_layer_save` gathers any layer left, commits the whole blocks (never
    /// one with a layer missing) and returns how many were stored now.
    #[pyo3(signature = (ns, paged, keys, block_ids, engine_hashes=None, parent_hashes=None,
                        token_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn begin_layer_save(
        &self,
        py: Python<'_>,
        ns: u32,
        paged: &PagedKv,
        keys: Vec<Vec<u8>>,
        block_ids: Vec<Vec<usize>>,
        engine_hashes: Option<Vec<Vec<u8>>>,
        parent_hashes: Option<Vec<Vec<u8>>>,
        token_ids: Option<Vec<Vec<u32>>>,
    ) -> PyResult<LayerSave> {
        let ks = paired_keys(&keys, &block_ids)?;
        let tags = tags(engine_hashes, parent_hashes, token_ids);
        let s = py
            .allow_threads(|| {
                self.b
                    .begin_layer_save_described(NsId(ns), &paged.inner, &ks, &block_ids, tags)
            })
            .map_err(transfer_err)?;
        Ok(LayerSave {
            s: std::sync::Mutex::new(Some(s)),
        })
    }

    /// Gathers layer `layer` (its index in `paged`) of every block of a layer-by-layer save
    /// into its slot.
    fn save_layer(
        &self,
        py: Python<'_>,
        save: &LayerSave,
        paged: &PagedKv,
        layer: usize,
    ) -> PyResult<()> {
        let paged = paged.host()?;
        py.allow_threads(|| {
            save.with_open(|s| self.b.save_layer(s, paged, layer).map_err(transfer_err))
        })
    }

    /// Gathers the layers left, commits the blocks of a layer-by-layer save (and saves whole
    /// those the begin could not reserve); returns how many were stored now.
    fn finish_layer_save(
        &self,
        py: Python<'_>,
        save: &LayerSave,
        paged: &PagedKv,
    ) -> PyResult<usize> {
        let paged = paged.host()?;
        py.allow_threads(|| {
            self.b
                .finish_layer_save(save.take()?, paged)
                .map_err(transfer_err)
        })
    }

    /// Gives a layer-by-layer save up: nothing is committed, its slots are freed (after a GPU
    /// save, call `Cuda.synchronize()` first: queued copies must land before the slots go).
    fn abort_layer_save(&self, py: Python<'_>, save: &LayerSave) -> PyResult<()> {
        py.allow_threads(|| match save.lock()?.take() {
            Some(s) => self.b.abort_layer_save(s).map_err(transfer_err),
            None => Ok(()),
        })
    }

    /// Registers the host memory GPU copies use with the CUDA driver (page-locked: DMA with no
    /// staging copy): the embedded store's arena, or kvtierd's shared arena (now and after
    /// every reconnection). False if registration failed (logged; copies still work, slower).
    fn pin_for_cuda(&self, py: Python<'_>, cuda: &Cuda) -> PyResult<bool> {
        py.allow_threads(|| self.b.pin_for_cuda(&cuda.c))
            .map_err(transfer_err)
    }

    /// `save_layer` from GPU tensors (`paged` built with device="cuda"): queues the copies of
    /// layer `layer` into the save's slots on kvtier's stream, after `after` (an event recorded
    /// on the engine's stream once the layer's attention was queued: `Cuda.record_on`).
    #[pyo3(signature = (save, cuda, paged, layer, after=None))]
    fn save_layer_cuda(
        &self,
        py: Python<'_>,
        save: &LayerSave,
        cuda: &Cuda,
        paged: &PagedKv,
        layer: usize,
        after: Option<&CudaEvent>,
    ) -> PyResult<()> {
        let paged = paged.device()?;
        py.allow_threads(|| {
            save.with_open(|s| {
                // SAFETY: PagedKv's contract (live GPU tensors of this device for its life);
                // vLLM keeps a request's blocks allocated until its save reported done
                // (delay_free).
                unsafe {
                    self.b
                        .save_layer_cuda(s, &cuda.c, paged, layer, after.map(|e| &e.ev))
                }
                .map_err(transfer_err)
            })
        })
    }

    /// `finish_layer_save` from GPU tensors: queues the layers left, waits for every copy,
    /// commits; returns how many blocks were stored now.
    fn finish_layer_save_cuda(
        &self,
        py: Python<'_>,
        save: &LayerSave,
        cuda: &Cuda,
        paged: &PagedKv,
    ) -> PyResult<usize> {
        let paged = paged.device()?;
        py.allow_threads(|| {
            let s = save.take()?;
            // SAFETY: as in save_layer_cuda.
            unsafe { self.b.finish_layer_save_cuda(s, &cuda.c, paged) }.map_err(transfer_err)
        })
    }

    /// `load_layerwise` into GPU tensors: blocks pinned, each layer's copies queued on
    /// kvtier's stream, `on_layer(layer, queued, event)` called (with the GIL) once they are
    /// queued — `event.wait_on(stream)` makes the engine's stream wait for them — and each
    /// block's checksum verified on the host: `verify="beside"` while every layer's copies
    /// run, `"first"` before any is queued (slower: the copies wait for the hashing; for
    /// measuring). Returns after every copy completed: how many leading keys were loaded and
    /// verified (0 if a lease lapsed): treat the rest as failed.
    #[pyo3(signature = (cuda, paged, keys, block_ids, on_layer, ttl_ms=30_000, verify="beside"))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn load_layerwise_cuda(
        &self,
        py: Python<'_>,
        cuda: &Cuda,
        paged: &PagedKv,
        keys: Vec<Vec<u8>>,
        block_ids: Vec<Vec<usize>>,
        on_layer: PyObject,
        ttl_ms: u64,
        verify: &str,
    ) -> PyResult<usize> {
        let ks = paired_keys(&keys, &block_ids)?;
        let check = match verify {
            "beside" => kvtier_connector::SlotCheck::Beside,
            "first" => kvtier_connector::SlotCheck::First,
            other => {
                return Err(PyValueError::new_err(format!(
                    "verify={other:?}: expected \"beside\" or \"first\""
                )))
            }
        };
        let ttl = Duration::from_millis(ttl_ms);
        let paged = paged.device()?;
        let c = cuda.c.clone();
        // A callback that raised may have lost a layer's event (the engine would not wait for
        // it): nothing of the load counts (the engine recomputes it).
        let mut raised = false;
        let n = py
            .allow_threads(|| {
                // SAFETY: as in save_layer_cuda; the engine runs nothing on the target blocks
                // until their layer's event fired (it waits on it) or the load returned.
                unsafe {
                    self.b.load_layerwise_cuda(
                        &c,
                        paged,
                        &ks,
                        &block_ids,
                        ttl,
                        check,
                        &mut |layer, n, ev| {
                            Python::with_gil(|py| {
                                let event = CudaEvent { ev, c: c.clone() };
                                if let Err(e) = on_layer.call1(py, (layer, n, event)) {
                                    e.print(py);
                                    raised = true;
                                }
                            })
                        },
                    )
                }
            })
            .map_err(transfer_err)?;
        Ok(if raised { 0 } else { n })
    }

    /// Copies the longest present prefix of `keys` into the caller's pages (each a list of
    /// memory segments, in order: one tensor, or a host-pool page's pieces). `regions`, when
    /// given, is the only memory the pages may lie in. One bool per key: True only when a block
    /// of exactly the page's total size was there (promoted from disk if needed); nothing is
    /// copied into a page otherwise.
    #[pyo3(signature = (keys, pages, regions=None))]
    fn read_pages(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        pages: Vec<Vec<(usize, usize)>>,
        regions: Option<Vec<(usize, usize)>>,
    ) -> PyResult<Vec<bool>> {
        // SAFETY: the Python adapters pass live tensors' memory they keep alive, and no other
        // thread touches it during this call.
        let (ks, mut dst) = unsafe { raw_pages(&keys, &pages, regions.as_deref())? };
        py.allow_threads(|| self.b.read_segments(&ks, &mut dst, Duration::from_secs(30)))
            .map_err(transfer_err)
    }

    /// Stores each page's segments (in order) under its key, gathered straight into a reserved
    /// slot; `regions` as in `read_pages`. One bool per key: True if stored now, already
    /// present or being written by another writer (the same key is the same bytes), False if
    /// there was no room.
    #[pyo3(signature = (ns, keys, pages, regions=None))]
    fn write_pages(
        &self,
        py: Python<'_>,
        ns: u32,
        keys: Vec<Vec<u8>>,
        pages: Vec<Vec<(usize, usize)>>,
        regions: Option<Vec<(usize, usize)>>,
    ) -> PyResult<Vec<bool>> {
        // SAFETY: as in read_pages; the memory is only read.
        let (ks, src) = unsafe { raw_pages(&keys, &pages, regions.as_deref())? };
        let src: Vec<Vec<&[u8]>> = src
            .into_iter()
            .map(|p| p.into_iter().map(|s| &*s).collect())
            .collect();
        py.allow_threads(|| self.b.write_segments(NsId(ns), &ks, &src))
            .map_err(transfer_err)
    }

    /// Stores one block's bytes under `key` (copied into a reserved slot). False when the key
    /// is already present or being written, or there is no room.
    fn put(&self, py: Python<'_>, ns: u32, key: &[u8], data: &[u8]) -> PyResult<bool> {
        let k = self::key(key)?;
        if data.is_empty() {
            return Err(PyValueError::new_err("a block must not be empty"));
        }
        py.allow_threads(|| self.b.store_segments(NsId(ns), &[k], &[vec![data]]))
            .map(|s| s[0] == kvtier_connector::Stored::Now)
            .map_err(transfer_err)
    }

    /// A copy of the block stored under `key`, or None (copied straight out of the pinned
    /// block into the new bytes object).
    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let k = self::key(key)?;
        // The GIL stays held: the bytes object is built from the pinned block in one copy.
        let mut out = None;
        let got = self
            .b
            .read_with(&[k], Duration::from_secs(10), &mut |_, b, sum| {
                // Copied out of the shared block, and the copy hashed (never the shared bytes
                // a second time).
                let mut got = 0;
                let copy = PyBytes::new_with(py, b.len(), |buf| {
                    got = b.copy_to_hashed(buf);
                    Ok(())
                })
                .map_err(|e| kvtier_connector::TransferError::Input(e.to_string()))?;
                if got != sum {
                    return Ok(false);
                }
                out = Some(copy);
                Ok(true)
            })
            .map_err(transfer_err)?;
        Ok(if got == 1 { out } else { None })
    }
}

/// The store, embedded in this process (optionally with a disk tier).
#[pyclass(module = "kvtier._native", extends = Backend, frozen)]
struct Store {}

impl Store {
    fn store<'a>(slf: &'a PyRef<'_, Self>) -> PyResult<&'a kvstore::Store> {
        slf.as_super()
            .b
            .store()
            .ok_or_else(|| PyRuntimeError::new_err("not an embedded store"))
    }
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (capacity_bytes, segment_bytes=64 << 20, disk_dir=None, disk_bytes=0, admission="always", write_through=false, populate=true, copy_threads=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        capacity_bytes: u64,
        segment_bytes: u64,
        disk_dir: Option<std::path::PathBuf>,
        disk_bytes: u64,
        admission: &str,
        write_through: bool,
        populate: bool,
        copy_threads: usize,
    ) -> PyResult<(Self, Backend)> {
        let admission = Admission::parse(admission)
            .ok_or_else(|| PyValueError::new_err("admission must be always or seen-twice"))?;
        let disk = disk_dir.map(|dir| DiskConfig {
            dir,
            capacity_bytes: disk_bytes,
            io: IoConfig::default(),
            admission,
            write_through,
            ..Default::default()
        });
        let inner = StoreConfig {
            capacity_bytes,
            segment_bytes,
            populate: if populate {
                kvstore::Populate::Now
            } else {
                kvstore::Populate::Lazy
            },
            disk,
            ..Default::default()
        }
        .build()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let mut b = kvtier_connector::Backend::embedded(inner);
        b.set_copy_threads(copy_threads);
        Ok((Self {}, Backend { b }))
    }

    /// Removes every block of a namespace; returns how many.
    fn clear_namespace(slf: PyRef<'_, Self>, ns: u32) -> PyResult<usize> {
        Ok(Self::store(&slf)?.clear_namespace(NsId(ns)))
    }

    /// Writes dirty admitted blocks to disk (and waits for them); returns how many.
    fn flush(slf: PyRef<'_, Self>, py: Python<'_>) -> PyResult<usize> {
        let s = Self::store(&slf)?;
        Ok(py.allow_threads(|| s.flush()))
    }

    /// Counters.
    fn stats<'py>(slf: PyRef<'_, Self>, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = Self::store(&slf)?.stats();
        let d = PyDict::new(py);
        d.set_item("capacity_bytes", s.capacity_bytes)?;
        d.set_item("used_bytes", s.used_bytes)?;
        d.set_item("blocks", s.blocks)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("promotions", s.promotions)?;
        d.set_item("demotions", s.demotions)?;
        d.set_item("checksum_failures", s.checksum_failures)?;
        d.set_item("disk_blocks", s.disk().map_or(0, |k| k.blocks))?;
        d.set_item(
            "disk_read_bandwidth",
            s.disk().map_or(0, |k| k.read_bandwidth),
        )?;
        d.set_item("prefetch_hinted", s.prefetch.hinted)?;
        d.set_item("prefetch_in_time", s.prefetch.in_time)?;
        d.set_item("prefetch_late", s.prefetch.late)?;
        d.set_item("prefetch_cancelled", s.prefetch.cancelled)?;
        d.set_item("prefetch_expired", s.prefetch.expired)?;
        d.set_item("prefetch_dropped", s.prefetch.dropped)?;
        d.set_item("prefetch_held_bytes", s.prefetch.held_bytes)?;
        d.set_item("prefetch_waiting_keys", s.prefetch.waiting_keys)?;
        d.set_item("break_even_cuts", s.break_even_cuts)?;
        d.set_item(
            "break_even_prefill_tokens_per_s",
            s.break_even_prefill_tokens_per_s,
        )?;
        Ok(d)
    }
}

/// A connection to a node's `kvtierd` (sidecar mode): blocks move between engine memory and the
/// daemon's shared arena with one copy, as in the embedded `Store`.
#[pyclass(module = "kvtier._native", extends = Backend, frozen)]
struct Sidecar {}

#[pymethods]
impl Sidecar {
    #[new]
    #[pyo3(signature = (socket, client="kvtier-python", tenant_secret="", copy_threads=0))]
    fn new(
        py: Python<'_>,
        socket: std::path::PathBuf,
        client: &str,
        tenant_secret: &str,
        copy_threads: usize,
    ) -> PyResult<(Self, Backend)> {
        // Rides out a daemon that is not up yet or restarts later: calls are misses meanwhile.
        let mut b = py.allow_threads(|| {
            kvtier_connector::Backend::sidecar_as(&socket, client, tenant_secret)
        });
        b.set_copy_threads(copy_threads);
        Ok((Self {}, Backend { b }))
    }

    /// Connection counters: outages, calls answered as misses while the daemon was away,
    /// reconnections.
    fn connection_stats<'py>(
        slf: PyRef<'_, Self>,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, PyDict>> {
        // Without the GIL: a layer-by-layer load holds the connection while it calls back into
        // Python for each layer.
        let b = &slf.as_super().b;
        let s = py.allow_threads(|| b.sidecar_stats().unwrap_or_default());
        let d = PyDict::new(py);
        d.set_item("outages", s.outages)?;
        d.set_item("missed_calls", s.missed_calls)?;
        d.set_item("reconnects", s.reconnects)?;
        Ok(d)
    }
}

/// `(encoding, fingerprint)` of a namespace (tp_size 0: KV shared by all ranks, as MLA).
#[pyfunction]
#[pyo3(signature = (model, dtype, layout, block_tokens, tp_size=1, tp_rank=0, tenant="", lora=""))]
#[allow(clippy::too_many_arguments)]
fn namespace_fingerprint<'py>(
    py: Python<'py>,
    model: &str,
    dtype: &str,
    layout: &str,
    block_tokens: u32,
    tp_size: u32,
    tp_rank: u32,
    tenant: &str,
    lora: &str,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let ns = Namespace {
        model: model.into(),
        dtype: dtype.into(),
        layout: layout.into(),
        block_tokens,
        tp: if tp_size == 0 {
            kvstore::TpShard::Shared
        } else {
            kvstore::TpShard::Rank {
                size: tp_size,
                rank: tp_rank,
            }
        },
        tenant: tenant.into(),
        lora: lora.into(),
    };
    ns.validate()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((
        PyBytes::new(py, &ns.encode()),
        PyBytes::new(py, &ns.fingerprint().0.to_bytes()),
    ))
}

/// The kvtier key of a block named by an engine's own block hash.
#[pyfunction]
fn engine_key<'py>(
    py: Python<'py>,
    fingerprint: &[u8],
    engine_hash: &[u8],
) -> PyResult<Bound<'py, PyBytes>> {
    let fp = kvstore::Fingerprint(key(fingerprint)?);
    let k = BlockKey::from_engine_hash(&fp, engine_hash)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, &k.to_bytes()))
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Backend>()?;
    m.add_class::<Store>()?;
    m.add_class::<PagedKv>()?;
    m.add_class::<LayerSave>()?;
    m.add_class::<Cuda>()?;
    m.add_class::<CudaEvent>()?;
    m.add_class::<Sidecar>()?;
    m.add_function(wrap_pyfunction!(namespace_fingerprint, m)?)?;
    m.add_function(wrap_pyfunction!(engine_key, m)?)?;
    Ok(())
}

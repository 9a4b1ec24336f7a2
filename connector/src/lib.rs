//! What an engine links to use kvtier: the KV layout description, the CPU gather/scatter
//! between an engine's paged KV tensors and kvtier's contiguous blocks, and the transfers of
//! those blocks to and from the store, embedded or through `kvtierd` (one API, two modes).

mod copies;
#[cfg(feature = "cuda")]
pub mod cuda;
mod layout;
mod sidecar;
mod transfer;

pub use copies::Copies;
pub use layout::{Copy2D, Dim, LayerView, LayoutError, PagedKv, Piece, PieceParts};
pub use sidecar::{Sidecar, SidecarStats};
pub use transfer::{
    checksum, Backend, LayerSave, PinHandle, Pinned, SlotCheck, Stored, Tags, TransferError,
};

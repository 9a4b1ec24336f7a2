//! What an engine links to use kvtier. So far: the KV layout description and the CPU
//! gather/scatter between an engine's paged KV tensors and kvtier's contiguous blocks.

mod layout;

pub use layout::{Dim, LayerView, LayoutError, PagedKv};

//! The disk tier's in-memory index: key → extent, checksum and state; the free extents of every
//! file; the disk eviction policy; Remove records not yet journaled.
//!
//! ```text
//!  write_batch ──► Writing ──data + journal durable──► Ready ──remove / evict──► gone
//!                    │ remove                            │ pins > 0 at removal
//!                    ▼                                   ▼
//!                Cancelled ──batch ends──► gone        Doomed ──last unpin──► gone
//! ```

use crate::key::BlockKey;
use crate::policy::EvictionPolicy;
use crate::types::{FoldMap, MapKey};

use super::extent::Extents;
use super::journal::{Kind, Record};
use super::PAGE;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum DState {
    Writing,
    /// Removed while being written: the write batch frees it instead of publishing it.
    Cancelled,
    Ready,
    /// Removed while pinned: invisible, extent freed at the last unpin.
    Doomed,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct DEntry {
    /// First page in its file (a file holds at most `u32::MAX` pages: checked at open).
    pub page: u32,
    pub checksum: u64,
    pub len: u32,
    pub id: u32,
    pub pins: u32,
    pub file: u16,
    pub ns: u16,
    pub state: DState,
}

// 32 bytes, so an index bucket with its key is 48.
const _: () = assert!(std::mem::size_of::<DEntry>() == 32);

impl DEntry {
    /// First page in its file.
    pub(crate) fn first_page(&self) -> u64 {
        u64::from(self.page)
    }

    pub(crate) fn pages(&self) -> u64 {
        u64::from(self.len).div_ceil(PAGE)
    }
}

pub(crate) struct State {
    pub index: FoldMap<MapKey, DEntry>,
    pub extents: Vec<Extents>,
    pub policy: Box<dyn EvictionPolicy>,
    /// Dense policy id → key.
    pub ids: Vec<BlockKey>,
    pub free_ids: Vec<u32>,
    pub next_file: usize,
    /// Remove records not yet in the journal.
    pub removes: Vec<Record>,
    pub seq: u64,
    pub used_bytes: u64,
    pub blocks: u64,
}

impl State {
    pub(crate) fn new(files: u32, pages_per_file: u64, policy: Box<dyn EvictionPolicy>) -> Self {
        Self {
            index: FoldMap::default(),
            extents: (0..files)
                .map(|_| Extents::new(1, pages_per_file + 1))
                .collect(),
            policy,
            ids: Vec::new(),
            free_ids: Vec::new(),
            next_file: 0,
            removes: Vec::new(),
            seq: 0,
            used_bytes: 0,
            blocks: 0,
        }
    }

    pub(crate) fn new_id(&mut self, key: BlockKey) -> u32 {
        match self.free_ids.pop() {
            Some(id) => {
                self.ids[id as usize] = key;
                id
            }
            None => {
                self.ids.push(key);
                (self.ids.len() - 1) as u32
            }
        }
    }

    /// A Ready entry becomes visible and counted.
    pub(crate) fn insert_ready(&mut self, key: BlockKey, e: DEntry) {
        self.index.insert(MapKey::from(key), e);
        self.policy.insert(e.id, key.0 as u64);
        self.used_bytes += u64::from(e.len);
        self.blocks += 1;
    }

    /// Drops an entry from the index (its extent is freed now unless pinned); with `journal`,
    /// queues its Remove record.
    pub(crate) fn drop_entry(&mut self, key: BlockKey, journal: bool) {
        let mk = MapKey::from(key);
        let Some(e) = self.index.get(&mk).copied() else {
            return;
        };
        if e.state == DState::Doomed {
            return;
        }
        if e.state == DState::Ready {
            self.used_bytes -= u64::from(e.len);
            self.blocks -= 1;
            self.policy.remove(e.id);
        }
        if journal {
            self.seq += 1;
            self.removes.push(Record {
                kind: Kind::Remove,
                ns: e.ns,
                key,
                page: e.first_page(),
                len: e.len,
                file: u32::from(e.file),
                checksum: e.checksum,
                seq: self.seq,
                label: None,
            });
        }
        if e.pins > 0 {
            if let Some(x) = self.index.get_mut(&mk) {
                x.state = DState::Doomed;
            }
        } else {
            self.forget(mk, e);
        }
    }

    /// Frees an entry's extent and id and drops it from the index.
    pub(crate) fn forget(&mut self, mk: MapKey, e: DEntry) {
        self.index.remove(&mk);
        self.extents[e.file as usize].free(e.first_page(), e.pages());
        self.free_ids.push(e.id);
    }

    pub(crate) fn unpin(&mut self, key: BlockKey) {
        let mk = MapKey::from(key);
        let Some(e) = self.index.get_mut(&mk) else {
            return;
        };
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 && e.state == DState::Doomed {
            let e = *e;
            self.forget(mk, e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;

    fn entry(id: u32, page: u32, pins: u32) -> DEntry {
        DEntry {
            page,
            checksum: 1,
            len: 5000,
            id,
            pins,
            file: 0,
            ns: 0,
            state: DState::Ready,
        }
    }

    #[test]
    fn removal_of_a_pinned_block_frees_its_extent_at_the_last_unpin() {
        let mut st = State::new(1, 100, PolicyKind::Lru.build());
        assert!(st.extents[0].reserve(1, 2));
        let k = BlockKey(5);
        let id = st.new_id(k);
        st.insert_ready(k, entry(id, 1, 1));
        assert_eq!((st.blocks, st.used_bytes), (1, 5000));
        st.drop_entry(k, true);
        assert_eq!(st.removes.len(), 1);
        assert_eq!(st.index[&MapKey::from(k)].state, DState::Doomed);
        assert_eq!((st.blocks, st.used_bytes), (0, 0));
        assert!(!st.extents[0].reserve(1, 2), "still held by the pin");
        st.unpin(k);
        assert!(st.index.is_empty());
        assert!(st.extents[0].reserve(1, 2), "freed at the last unpin");
    }
}

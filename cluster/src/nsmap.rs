//! Namespace ids are local to each store; blocks travel between nodes with their namespace
//! fingerprint. Both remote tiers keep this map between the two, filled by the store's
//! `note_namespace` calls.

use std::collections::HashMap;

use kvstore::Fingerprint;
use parking_lot::RwLock;

/// Local namespace id ↔ fingerprint.
#[derive(Default)]
pub(crate) struct NsMap(RwLock<Table>);

/// Fingerprints by id, ids by fingerprint.
#[derive(Default)]
struct Table(Vec<Option<Fingerprint>>, HashMap<Fingerprint, u16>);

impl NsMap {
    /// Records that local id `id` is namespace `fp` (an id reused for another namespace
    /// forgets the old one).
    pub(crate) fn note(&self, id: u16, fp: Fingerprint) {
        let mut ns = self.0.write();
        let i = usize::from(id);
        if ns.0.len() <= i {
            ns.0.resize(i + 1, None);
        }
        if let Some(old) = ns.0[i].replace(fp) {
            ns.1.remove(&old);
        }
        ns.1.insert(fp, id);
    }

    /// The local id of namespace `fp`.
    pub(crate) fn id_of(&self, fp: &Fingerprint) -> Option<u16> {
        self.0.read().1.get(fp).copied()
    }

    /// The fingerprint of local id `id`.
    pub(crate) fn fp_of(&self, id: u16) -> Option<Fingerprint> {
        self.0.read().0.get(usize::from(id)).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstore::BlockKey;

    #[test]
    fn a_reused_id_forgets_its_old_namespace() {
        let m = NsMap::default();
        let (a, b) = (Fingerprint(BlockKey(1)), Fingerprint(BlockKey(2)));
        m.note(3, a);
        assert_eq!(
            (m.id_of(&a), m.fp_of(3), m.fp_of(0)),
            (Some(3), Some(a), None)
        );
        m.note(3, b);
        assert_eq!(
            (m.id_of(&a), m.id_of(&b), m.fp_of(3)),
            (None, Some(3), Some(b))
        );
    }
}

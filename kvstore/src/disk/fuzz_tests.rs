//! Fuzz targets of the disk tier's on-disk parsing (see `kvtier-fuzz`): a journal file of any
//! bytes opens or is refused with an error, never a panic, and what recovery builds from it is
//! consistent: no two live blocks overlap, every live block lies in its file, and the free
//! extents and the live blocks add up to each file's space.

use std::collections::BTreeMap;

use crate::key::BlockKey;
use crate::policy::PolicyKind;

use super::journal::{Journal, Record, REC};
use super::recovery::replay;
use super::state::{DState, State};
use super::PAGE;

const FILES: u32 = 2;
const PAGES: u64 = 512;

fn check_state(st: &State) {
    let mut placed: BTreeMap<(u16, u64), u64> = BTreeMap::new();
    let mut used = vec![0u64; FILES as usize];
    let mut blocks = 0;
    for e in st.index.values() {
        assert_eq!(e.state, DState::Ready);
        assert!(u32::from(e.file) < FILES);
        assert!(
            e.page >= 1 && e.first_page() + e.pages() <= PAGES + 1,
            "block out of its file"
        );
        placed.insert((e.file, e.first_page()), e.pages());
        used[e.file as usize] += e.pages();
        blocks += 1;
    }
    assert_eq!(st.blocks, blocks);
    let mut last: Option<(u16, u64)> = None;
    for (&(f, p), &n) in &placed {
        if let Some((lf, end)) = last {
            assert!(lf != f || p >= end, "live blocks overlap");
        }
        last = Some((f, p + n));
    }
    for (f, x) in st.extents.iter().enumerate() {
        assert_eq!(
            x.free_pages() + used[f],
            PAGES,
            "file {f}: free + live != its pages"
        );
    }
}

#[test]
fn fuzz_journal_files() {
    let dir = std::env::temp_dir().join(format!("kvtier-fuzz-journal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("journal.kvj");
    kvtier_fuzz::run("journal", |bytes| {
        std::fs::write(&path, bytes).unwrap();
        if let Ok((_, _, recs, _)) = Journal::open(&path) {
            let mut st = State::new(FILES, PAGES, PolicyKind::Lru.build());
            replay(&mut st, &recs, FILES, PAGES);
            check_state(&st);
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fuzz_journal_records() {
    kvtier_fuzz::run("journal-records", |bytes| {
        let recs: Vec<Record> = bytes.chunks(REC).filter_map(Record::decode).collect();
        for r in &recs {
            // A record that decodes re-encodes to the same bytes.
            assert_eq!(Record::decode(&r.encode()), Some(*r));
        }
        let mut st = State::new(FILES, PAGES, PolicyKind::S3Fifo.build());
        replay(&mut st, &recs, FILES, PAGES);
        check_state(&st);
        let _ = BlockKey::default();
        let _ = PAGE;
    });
}

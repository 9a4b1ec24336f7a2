//! Opening the disk tier: creating its files, or recovering its index from the journal.
//!
//! Creation order: data files (preallocated, superblock, fsync), then the journal, written
//! under a temporary name and renamed into place. The journal is never removed otherwise, so
//! data files without a journal are the remains of a creation that did not finish (a crash, a
//! failed preallocation): they are re-initialised, with a log line.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use crate::arena::AlignedBuf;
use crate::io::ALIGN;
use crate::key::{BlockKey, Fingerprint};
use crate::policy::EvictionPolicy;
use crate::tags::EngineTag;
use crate::types::{FoldMap, MapKey};

use super::config::{DiskConfig, DiskError};
use super::journal::{self, Journal, Kind, Record};
use super::state::{DEntry, DState, State};
use super::PAGE;

const DATA_MAGIC: &[u8; 8] = b"KVTDATA\0";

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> DiskError + '_ {
    move |error| DiskError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// The data files' format version (the journal's has its own: version 3 added records, the
/// data files did not change).
const DATA_VERSION: u32 = 2;

fn superblock(index: u32, pages: u64, instance: u64) -> io::Result<AlignedBuf> {
    let mut b = AlignedBuf::new(ALIGN)?;
    b[0..8].copy_from_slice(DATA_MAGIC);
    b[8..12].copy_from_slice(&DATA_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&index.to_le_bytes());
    b[16..24].copy_from_slice(&pages.to_le_bytes());
    b[24..32].copy_from_slice(&instance.to_le_bytes());
    let c = xxh3_64(&b[..56]);
    b[56..64].copy_from_slice(&c.to_le_bytes());
    Ok(b)
}

fn open_direct(path: &Path, create: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// What opening found.
pub(crate) struct Opened {
    pub journal: Journal,
    pub instance: u64,
    pub files: Vec<File>,
    pub state: State,
    pub namespaces: Vec<Fingerprint>,
    pub recovered: u64,
    pub skipped_records: u64,
    /// The engine tags the journal kept for live blocks.
    pub tags: FoldMap<MapKey, EngineTag>,
}

pub(crate) fn paths(cfg: &DiskConfig) -> (PathBuf, Vec<PathBuf>) {
    let jpath = cfg.dir.join("journal.kvj");
    let dpaths = (0..cfg.files)
        .map(|i| cfg.dir.join(format!("data-{i}.kvd")))
        .collect();
    (jpath, dpaths)
}

/// Creates or recovers the tier's files and index.
pub(crate) fn open(
    cfg: &DiskConfig,
    pages_per_file: u64,
    policy: Box<dyn EvictionPolicy>,
) -> Result<Opened, DiskError> {
    let (jpath, dpaths) = paths(cfg);
    if let Some(v) = journal::version_of(&jpath).filter(|&v| v < journal::READABLE_FROM) {
        // An older format (its block checksums are computed otherwise): a cache, so it starts
        // empty rather than failing every block's check one by one.
        tracing::warn!(
            dir = %cfg.dir.display(),
            found = v,
            now = journal::VERSION,
            "disk tier written by an older kvtier (another block checksum): starting it empty"
        );
        for p in dpaths.iter().filter(|p| p.exists()) {
            std::fs::remove_file(p).map_err(io_err(p))?;
        }
        std::fs::remove_file(&jpath).map_err(io_err(&jpath))?;
    }
    if !jpath.exists() {
        let leftovers: Vec<&PathBuf> = dpaths.iter().filter(|p| p.exists()).collect();
        if !leftovers.is_empty() {
            tracing::warn!(
                dir = %cfg.dir.display(),
                files = leftovers.len(),
                "disk tier: data files without a journal (a creation that did not finish): re-initialising the tier"
            );
            for p in leftovers {
                std::fs::remove_file(p).map_err(io_err(p))?;
            }
        }
        return create(cfg, pages_per_file, policy, &jpath, &dpaths);
    }
    let (journal, instance, records, skipped) =
        Journal::open(&jpath).map_err(|e| DiskError::Mismatch(e.to_string()))?;
    let mut files = Vec::new();
    for (i, p) in dpaths.iter().enumerate() {
        if !p.exists() {
            return Err(DiskError::Mismatch(format!(
                "{} is missing but {} names it: restore it, or remove the journal to start empty",
                p.display(),
                jpath.display()
            )));
        }
        let f = open_direct(p, false).map_err(io_err(p))?;
        let mut sb = AlignedBuf::new(ALIGN).map_err(io_err(p))?;
        f.read_exact_at(&mut sb, 0).map_err(io_err(p))?;
        let want = superblock(i as u32, pages_per_file, instance).map_err(io_err(p))?;
        if sb[..64] != want[..64] {
            let got_pages = u64::from_le_bytes(sb[16..24].try_into().unwrap_or_default());
            let why = if &sb[0..8] != DATA_MAGIC {
                "not a kvtier data file".to_string()
            } else if u64::from_le_bytes(sb[24..32].try_into().unwrap_or_default()) != instance {
                "belongs to another journal".to_string()
            } else if got_pages != pages_per_file {
                format!(
                    "holds {got_pages} pages but the configuration asks for {pages_per_file}: keep capacity_bytes and files as they were, or use an empty directory"
                )
            } else {
                "superblock does not match".to_string()
            };
            return Err(DiskError::Mismatch(format!("{}: {why}", p.display())));
        }
        files.push(f);
    }
    let mut state = State::new(cfg.files, pages_per_file, policy);
    let (namespaces, tags) = replay(&mut state, &records, cfg.files, pages_per_file);
    Ok(Opened {
        tags,
        journal,
        instance,
        files,
        recovered: state.blocks,
        state,
        namespaces,
        skipped_records: skipped,
    })
}

fn create(
    cfg: &DiskConfig,
    pages_per_file: u64,
    policy: Box<dyn EvictionPolicy>,
    jpath: &Path,
    dpaths: &[PathBuf],
) -> Result<Opened, DiskError> {
    let instance = xxh3_64(
        format!(
            "{:?}{}{:?}",
            std::time::SystemTime::now(),
            std::process::id(),
            cfg.dir
        )
        .as_bytes(),
    );
    let mut files = Vec::new();
    let made = |files: &mut Vec<File>| -> Result<(), DiskError> {
        for (i, p) in dpaths.iter().enumerate() {
            let f = open_direct(p, true).map_err(io_err(p))?;
            files.push(f);
            let f = &files[i];
            let bytes = (pages_per_file + 1) * PAGE;
            // SAFETY: fallocate on a valid fd with a valid range; mode 0 allocates blocks.
            let r =
                unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(f), 0, 0, bytes as i64) };
            if r != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    return Err(DiskError::Io {
                        path: p.clone(),
                        error: io::Error::new(
                            e.kind(),
                            format!(
                                "cannot preallocate {bytes} bytes: {e}; lower the disk capacity"
                            ),
                        ),
                    });
                }
                f.set_len(bytes).map_err(io_err(p))?;
            }
            let sb = superblock(i as u32, pages_per_file, instance).map_err(io_err(p))?;
            f.write_all_at(&sb, 0).map_err(io_err(p))?;
            f.sync_all().map_err(io_err(p))?;
        }
        Ok(())
    };
    if let Err(e) = made(&mut files) {
        // Nothing half-made stays behind to block the next start.
        drop(files);
        for p in dpaths {
            let _ = std::fs::remove_file(p);
        }
        return Err(e);
    }
    let journal = match Journal::create(jpath, instance) {
        Ok(j) => j,
        Err(e) => {
            drop(files);
            for p in dpaths {
                let _ = std::fs::remove_file(p);
            }
            return Err(DiskError::Mismatch(e.to_string()));
        }
    };
    Ok(Opened {
        journal,
        instance,
        files,
        state: State::new(cfg.files, pages_per_file, policy),
        namespaces: Vec::new(),
        recovered: 0,
        skipped_records: 0,
        tags: FoldMap::default(),
    })
}

/// Rebuilds the index from journal records: later records win, a Remove drops its block, a
/// Put whose extent overlaps a live block drops that block (its data was overwritten),
/// out-of-range records are skipped; a Hash (Parent) record labels the block placed by the Put
/// right before it (its Hash), and is ignored anywhere else. Returns the namespace table and
/// the live blocks' engine tags.
pub(crate) fn replay(
    st: &mut State,
    records: &[Record],
    files: u32,
    pages_per_file: u64,
) -> (Vec<Fingerprint>, FoldMap<MapKey, EngineTag>) {
    let mut namespaces: Vec<Fingerprint> = Vec::new();
    let mut tags: FoldMap<MapKey, EngineTag> = FoldMap::default();
    // Live extents by (file, page) → key, to resolve overlaps (the later record wins).
    let mut placed: BTreeMap<(u16, u64), BlockKey> = BTreeMap::new();
    // The block the previous record placed (a Put) or labelled (its Hash): what a tag record
    // may label.
    let mut labelable: Option<(BlockKey, Kind)> = None;
    for r in records {
        st.seq = st.seq.max(r.seq);
        let last = labelable.take();
        match r.kind {
            Kind::Hash | Kind::Parent => {
                let Some(label) = r.label else { continue };
                match (last, r.kind) {
                    (Some((k, Kind::Put)), Kind::Hash) if k == r.key => {
                        tags.insert(
                            MapKey::from(k),
                            EngineTag {
                                hash: label,
                                parent: None,
                            },
                        );
                        labelable = Some((k, Kind::Hash));
                    }
                    (Some((k, Kind::Hash)), Kind::Parent) if k == r.key => {
                        if let Some(t) = tags.get_mut(&MapKey::from(k)) {
                            t.parent = Some(label);
                        }
                    }
                    _ => {}
                }
            }
            Kind::Namespace => {
                let id = r.page as usize;
                if id > usize::from(u16::MAX) {
                    continue;
                }
                if namespaces.len() <= id {
                    namespaces.resize(id + 1, Fingerprint(BlockKey(0)));
                }
                namespaces[id] = Fingerprint(r.key);
            }
            Kind::Remove => {
                if let Some(e) = st.index.get(&MapKey::from(r.key)).copied() {
                    placed.remove(&(e.file, e.first_page()));
                    st.drop_entry(r.key, false);
                }
                tags.remove(&MapKey::from(r.key));
            }
            Kind::Put => {
                let file = r.file as u16;
                let pages = u64::from(r.len).div_ceil(PAGE);
                // Checked: a crafted record (its checksum valid) may name any page.
                let end = r.page.checked_add(pages);
                if r.file >= files
                    || r.page == 0
                    || end.is_none_or(|e| e > pages_per_file + 1)
                    || r.len == 0
                {
                    tracing::warn!(key = %r.key, "journal: record out of bounds, skipped");
                    continue;
                }
                if let Some(e) = st.index.get(&MapKey::from(r.key)).copied() {
                    placed.remove(&(e.file, e.first_page()));
                    st.drop_entry(r.key, false);
                }
                tags.remove(&MapKey::from(r.key));
                // Live extents never overlap each other, so only the one starting before the
                // new extent and those starting inside it can overlap it.
                let before = placed
                    .range((file, 0)..(file, r.page))
                    .next_back()
                    .map(|(a, b)| (*a, *b));
                let overlapping: Vec<((u16, u64), BlockKey)> = before
                    .into_iter()
                    .chain(
                        placed
                            .range((file, r.page)..(file, r.page + pages))
                            .map(|(a, b)| (*a, *b)),
                    )
                    .filter(|&((_, p), k)| {
                        let len = st.index.get(&MapKey::from(k)).map_or(0, |e| e.pages());
                        p + len > r.page
                    })
                    .collect();
                for (pos, k) in overlapping {
                    placed.remove(&pos);
                    st.drop_entry(k, false);
                    tags.remove(&MapKey::from(k));
                }
                if !st.extents[file as usize].reserve(r.page, pages) {
                    tracing::warn!(key = %r.key, "journal: extent not free, skipped");
                    continue;
                }
                let id = st.new_id(r.key);
                st.insert_ready(
                    r.key,
                    DEntry {
                        // Reserved above inside the file (≤ u32::MAX pages, checked at open).
                        page: r.page as u32,
                        checksum: r.checksum,
                        len: r.len,
                        id,
                        pins: 0,
                        file,
                        ns: r.ns,
                        state: DState::Ready,
                    },
                );
                placed.insert((file, r.page), r.key);
                labelable = Some((r.key, Kind::Put));
            }
        }
    }
    (namespaces, tags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;

    fn put(key: u128, page: u64, len: u32, seq: u64) -> Record {
        Record {
            kind: Kind::Put,
            ns: 1,
            key: BlockKey(key),
            page,
            len,
            file: 0,
            checksum: key as u64,
            seq,
            label: None,
        }
    }

    fn rm(key: u128, seq: u64) -> Record {
        Record {
            kind: Kind::Remove,
            seq,
            ..put(key, 0, 0, 0)
        }
    }

    fn state() -> State {
        State::new(1, 100, PolicyKind::Lru.build())
    }

    fn live(st: &State) -> Vec<(u128, u64)> {
        let mut v: Vec<(u128, u64)> = st
            .index
            .iter()
            .map(|(k, e)| (BlockKey::from(*k).0, e.first_page()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn remove_records_replay() {
        let mut st = state();
        replay(
            &mut st,
            &[put(1, 1, 4096, 1), put(2, 2, 4096, 2), rm(1, 3)],
            1,
            100,
        );
        assert_eq!(live(&st), vec![(2, 2)]);
        assert_eq!(st.blocks, 1);
        assert!(st.removes.is_empty(), "replay queues no new Remove records");
        // A later Put of the same key wins; the extent of the removed block is free again.
        let mut st = state();
        replay(
            &mut st,
            &[put(1, 1, 4096, 1), rm(1, 2), put(3, 1, 4096, 3)],
            1,
            100,
        );
        assert_eq!(live(&st), vec![(3, 1)]);
    }

    #[test]
    fn overlapping_extents_keep_the_later_record() {
        let mut st = state();
        // Block 1 at pages 1..4; block 2 written later at pages 3..5 overwrote its tail.
        replay(
            &mut st,
            &[put(1, 1, 3 * 4096, 1), put(2, 3, 2 * 4096, 2)],
            1,
            100,
        );
        assert_eq!(live(&st), vec![(2, 3)]);
        // Block 2 inside block 1's extent.
        let mut st = state();
        replay(
            &mut st,
            &[put(1, 1, 8 * 4096, 1), put(2, 4, 4096, 2)],
            1,
            100,
        );
        assert_eq!(live(&st), vec![(2, 4)]);
        assert!(
            st.extents[0].reserve(1, 3),
            "block 1's extent is free again"
        );
    }

    #[test]
    fn out_of_range_records_are_skipped() {
        let mut st = state();
        let mut bad_file = put(4, 1, 4096, 1);
        bad_file.file = 3;
        replay(
            &mut st,
            &[
                put(1, 0, 4096, 1),
                put(2, 100, 2 * 4096, 2),
                bad_file,
                put(5, 100, 4096, 3),
            ],
            1,
            100,
        );
        assert_eq!(live(&st), vec![(5, 100)]);
    }

    #[test]
    fn tags_label_the_put_right_before_them_only() {
        use crate::tags::EngineHash;
        let h = |b: u8| EngineHash::new(&[b; 32]).unwrap();
        let tag = |kind, key, b| Record::tag(kind, BlockKey(key), h(b));
        let mut st = state();
        let (_, tags) = replay(
            &mut st,
            &[
                // 1: hash and parent.
                put(1, 1, 4096, 1),
                tag(Kind::Hash, 1, 11),
                tag(Kind::Parent, 1, 10),
                // 2: hash only; a Parent after another block's records labels nothing.
                put(2, 2, 4096, 2),
                tag(Kind::Hash, 2, 22),
                put(3, 3, 4096, 3),
                tag(Kind::Parent, 2, 99),
                // A Hash for another key than the Put before it, and a Hash after a Remove.
                tag(Kind::Hash, 1, 99),
                rm(3, 4),
                tag(Kind::Hash, 3, 99),
                // 4: tagged, then removed and written again without a tag: no tag.
                put(4, 4, 4096, 5),
                tag(Kind::Hash, 4, 44),
                rm(4, 6),
                put(4, 5, 4096, 7),
                // 5: tagged, then overwritten by 6's extent: gone with its block.
                put(5, 6, 4096, 8),
                tag(Kind::Hash, 5, 55),
                put(6, 6, 4096, 9),
            ],
            1,
            100,
        );
        let got = |k: u128| tags.get(&MapKey::from(BlockKey(k))).copied();
        assert_eq!(
            got(1),
            Some(EngineTag {
                hash: h(11),
                parent: Some(h(10))
            })
        );
        assert_eq!(
            got(2),
            Some(EngineTag {
                hash: h(22),
                parent: None
            })
        );
        assert_eq!((got(3), got(4), got(5), got(6)), (None, None, None, None));
        assert_eq!(tags.len(), 2);
    }
}

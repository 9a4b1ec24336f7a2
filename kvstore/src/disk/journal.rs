//! The disk tier's index journal: a 64-byte header, then 64-byte records, each with its own
//! checksum. A block's Put may be followed by its engine tag records (Hash, then Parent), which
//! label the block the Put just placed. Replay stops at the first torn or corrupt record and truncates there. Compaction
//! (the checkpoint) rewrites only live records into a new file and renames it into place. The
//! byte layout is drawn in ARCHITECTURE.md ("Disk tier on-disk format").

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use crate::key::BlockKey;
use crate::tags::EngineHash;

pub(crate) const JOURNAL_MAGIC: &[u8; 8] = b"KVTJRNL\0";
/// 3: Hash and Parent records (engine tags) may follow a Put. 2: block checksums are the
/// chunked XXH3-64 of `crate::checksum` (1: plain XXH3-64). A version-2 journal is read as it
/// is (its records are version 3's without tags) and rewritten as version 3 at open; a
/// version-1 tier starts empty.
pub(crate) const VERSION: u32 = 3;
/// The oldest journal version read as it is.
pub(crate) const READABLE_FROM: u32 = 2;

/// The format version of the journal at `path`, if it is a kvtier journal whose header is
/// intact (to tell an older format from damage).
pub(crate) fn version_of(path: &std::path::Path) -> Option<u32> {
    use std::io::Read as _;
    let mut h = [0u8; REC];
    std::fs::File::open(path).ok()?.read_exact(&mut h).ok()?;
    let intact = &h[0..8] == JOURNAL_MAGIC
        && u64::from_le_bytes(h[56..64].try_into().ok()?) == xxh3_64(&h[..56]);
    intact.then(|| u32::from_le_bytes(h[8..12].try_into().unwrap_or_default()))
}
pub(crate) const REC: usize = 64;
const REC_MAGIC: u32 = 0x5244_564b; // "KVDR" little-endian

/// Record kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A block is durable at (file, page) with len and checksum.
    Put = 1,
    /// A block is gone.
    Remove = 2,
    /// Namespace id `page` has fingerprint `key`.
    Namespace = 3,
    /// The block the Put just before placed has engine hash `label`.
    Hash = 4,
    /// ... and its parent has engine hash `label`.
    Parent = 5,
}

/// One journal record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub kind: Kind,
    pub ns: u16,
    pub key: BlockKey,
    pub page: u64,
    pub len: u32,
    pub file: u32,
    pub checksum: u64,
    pub seq: u64,
    /// Hash and Parent records: the engine hash (None for the other kinds).
    pub label: Option<EngineHash>,
}

impl Record {
    /// A Hash (or Parent) record for `key`.
    pub(crate) fn tag(kind: Kind, key: BlockKey, label: EngineHash) -> Self {
        Record {
            kind,
            ns: 0,
            key,
            page: 0,
            len: 0,
            file: 0,
            checksum: 0,
            seq: 0,
            label: Some(label),
        }
    }

    pub(crate) fn encode(&self) -> [u8; REC] {
        let mut b = [0u8; REC];
        b[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = VERSION as u8;
        b[8..24].copy_from_slice(&self.key.to_bytes());
        if let Some(l) = &self.label {
            // Hash / Parent: [6] the hash's length, [24..56] its bytes (zero-padded).
            let h = l.as_bytes();
            b[6] = h.len() as u8;
            b[24..24 + h.len()].copy_from_slice(h);
            let c = xxh3_64(&b[..56]);
            b[56..64].copy_from_slice(&c.to_le_bytes());
            return b;
        }
        b[6..8].copy_from_slice(&self.ns.to_le_bytes());
        b[24..32].copy_from_slice(&self.page.to_le_bytes());
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b[36..40].copy_from_slice(&self.file.to_le_bytes());
        b[40..48].copy_from_slice(&self.checksum.to_le_bytes());
        b[48..56].copy_from_slice(&self.seq.to_le_bytes());
        let c = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Self> {
        let u32at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        if b.len() < REC || u32at(0) != REC_MAGIC || u64at(56) != xxh3_64(&b[..56]) {
            return None;
        }
        let kind = match b[4] {
            1 => Kind::Put,
            2 => Kind::Remove,
            3 => Kind::Namespace,
            4 => Kind::Hash,
            5 => Kind::Parent,
            _ => return None,
        };
        if !(READABLE_FROM..=VERSION).contains(&u32::from(b[5])) {
            return None;
        }
        let key = BlockKey::from_bytes(&b[8..24]).ok()?;
        if matches!(kind, Kind::Hash | Kind::Parent) {
            let n = usize::from(b[6]);
            if n == 0 || n > crate::tags::MAX_ENGINE_HASH {
                return None;
            }
            return Some(Record::tag(kind, key, EngineHash::new(&b[24..24 + n])?));
        }
        Some(Record {
            kind,
            ns: u16::from_le_bytes([b[6], b[7]]),
            key,
            page: u64at(24),
            len: u32at(32),
            file: u32at(36),
            checksum: u64at(40),
            seq: u64at(48),
            label: None,
        })
    }
}

fn header(instance: u64) -> [u8; REC] {
    let mut h = [0u8; REC];
    h[0..8].copy_from_slice(JOURNAL_MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(REC as u32).to_le_bytes());
    h[16..24].copy_from_slice(&instance.to_le_bytes());
    let c = xxh3_64(&h[..56]);
    h[56..64].copy_from_slice(&c.to_le_bytes());
    h
}

/// Errors that stop the tier from opening: the operator must look.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JournalError {
    #[error("{path}: not a kvtier journal or an unsupported version ({why})")]
    Foreign { path: PathBuf, why: &'static str },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// An open journal, appending.
pub(crate) struct Journal {
    path: PathBuf,
    file: File,
    end: u64,
    /// A checkpoint failed after its rename: `file` may be an unlinked inode, so every later
    /// write is refused rather than silently lost.
    poisoned: bool,
    /// Records in the file (live or not).
    pub(crate) records: u64,
    /// The format version of the file (older than [`VERSION`] until its first rewrite).
    pub(crate) version: u32,
    /// Records per block at the last rewrite (1 with no tags, up to 3): what a live block
    /// costs, to tell when dead records pile up.
    pub(crate) per_block: f64,
}

impl Journal {
    /// Creates a new, empty journal, atomically: it is written under a temporary name and
    /// renamed into place, so a crash never leaves a half-written journal.
    pub(crate) fn create(path: &Path, instance: u64) -> Result<Self, JournalError> {
        let io = |source| JournalError::Io {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        {
            let mut f = OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(&tmp)
                .map_err(io)?;
            f.write_all(&header(instance)).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)?;
        sync_dir(path).map_err(io)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            end: REC as u64,
            records: 0,
            poisoned: false,
            version: VERSION,
            per_block: 1.0,
        })
    }

    /// Opens and replays; returns the journal, its instance id, the valid records and how
    /// many records failed their checksum. A torn tail (a partial record, or bad records with
    /// no good one after them: a write cut short) is cut off; a bad record followed by good
    /// ones (damage in the middle) is skipped and the rest kept, so one flipped bit never costs
    /// the records after it.
    pub(crate) fn open(path: &Path) -> Result<(Self, u64, Vec<Record>, u64), JournalError> {
        let io = |source| JournalError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;
        let foreign = |why| JournalError::Foreign {
            path: path.to_path_buf(),
            why,
        };
        if bytes.len() < REC || &bytes[0..8] != JOURNAL_MAGIC {
            return Err(foreign("bad magic"));
        }
        let h = &bytes[..REC];
        if u64::from_le_bytes(h[56..64].try_into().unwrap_or_default()) != xxh3_64(&h[..56]) {
            return Err(foreign("header checksum"));
        }
        let version = u32::from_le_bytes(h[8..12].try_into().unwrap_or_default());
        if !(READABLE_FROM..=VERSION).contains(&version) {
            return Err(foreign("version"));
        }
        let instance = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default());
        let mut recs = Vec::new();
        let mut at = REC;
        // End of the last good record: everything after it is a torn tail.
        let mut good_end = REC;
        let mut bad_before = 0u64;
        let mut skipped = 0u64;
        while at + REC <= bytes.len() {
            match Record::decode(&bytes[at..at + REC]) {
                Some(r) => {
                    recs.push(r);
                    skipped += bad_before;
                    bad_before = 0;
                    good_end = at + REC;
                }
                None => bad_before += 1,
            }
            at += REC;
        }
        if skipped > 0 {
            tracing::error!(
                path = %path.display(),
                skipped,
                kept = recs.len(),
                "journal: records in the middle failed their checksum and were skipped (the blocks they described are lost; the rest are kept)"
            );
        }
        if good_end != bytes.len() {
            tracing::warn!(
                path = %path.display(),
                kept = recs.len(),
                dropped_bytes = bytes.len() - good_end,
                "journal: torn tail cut off"
            );
            file.set_len(good_end as u64).map_err(io)?;
            file.sync_all().map_err(io)?;
        }
        let records = recs.len() as u64;
        Ok((
            Self {
                path: path.to_path_buf(),
                file,
                end: good_end as u64,
                records,
                poisoned: false,
                version,
                per_block: 1.0,
            },
            instance,
            recs,
            skipped,
        ))
    }

    /// Appends records (not yet durable: call `sync`).
    pub(crate) fn append(&mut self, recs: &[Record]) -> io::Result<()> {
        self.check()?;
        if recs.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(recs.len() * REC);
        for r in recs {
            buf.extend_from_slice(&r.encode());
        }
        self.file.write_all_at(&buf, self.end)?;
        self.end += buf.len() as u64;
        self.records += recs.len() as u64;
        Ok(())
    }

    /// Makes everything appended durable.
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.check()?;
        self.file.sync_data()
    }

    fn check(&self) -> io::Result<()> {
        if self.poisoned {
            return Err(io::Error::other(format!(
                "{}: a checkpoint failed half-way; restart kvtierd to recover the journal",
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Checkpoint: writes `live` into a fresh file and atomically replaces the journal with it.
    pub(crate) fn rewrite(&mut self, instance: u64, live: &[Record]) -> io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        {
            let mut f = OpenOptions::new().create_new(true).write(true).open(&tmp)?;
            let mut buf = Vec::with_capacity((live.len() + 1) * REC);
            buf.extend_from_slice(&header(instance));
            for r in live {
                buf.extend_from_slice(&r.encode());
            }
            f.write_all(&buf)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        // From here `self.file` is the old, unlinked inode: switch to the new one or refuse
        // every later write.
        match OpenOptions::new().read(true).write(true).open(&self.path) {
            Ok(f) => self.file = f,
            Err(e) => {
                self.poisoned = true;
                return Err(e);
            }
        }
        self.end = ((live.len() + 1) * REC) as u64;
        self.records = live.len() as u64;
        self.version = VERSION;
        let puts = live.iter().filter(|r| r.kind == Kind::Put).count();
        let tags = live
            .iter()
            .filter(|r| matches!(r.kind, Kind::Hash | Kind::Parent))
            .count();
        self.per_block = 1.0 + tags as f64 / puts.max(1) as f64;
        if let Err(e) = sync_dir(&self.path) {
            self.poisoned = true;
            return Err(e);
        }
        Ok(())
    }
}

pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u64) -> Record {
        Record {
            kind: Kind::Put,
            ns: 3,
            key: BlockKey(u128::from(i) * 7 + 1),
            page: i * 10,
            len: 4096 * i as u32 + 1,
            file: 0,
            checksum: i ^ 0xabc,
            seq: i,
            label: None,
        }
    }

    #[test]
    fn roundtrip_torn_tail_and_rewrite() {
        let dir = tempdir();
        let p = dir.join("journal.kvj");
        let mut j = Journal::create(&p, 42).unwrap();
        j.append(&[rec(1), rec(2), rec(3)]).unwrap();
        j.sync().unwrap();
        drop(j);
        // Tear the last record.
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len((REC * 4 - 10) as u64).unwrap();
        let (mut j, inst, recs, bad) = Journal::open(&p).unwrap();
        assert_eq!((inst, bad), (42, 0));
        assert_eq!(recs, vec![rec(1), rec(2)]);
        j.append(&[rec(4)]).unwrap();
        j.sync().unwrap();
        let (_, _, recs, _) = Journal::open(&p).unwrap();
        assert_eq!(recs, vec![rec(1), rec(2), rec(4)]);
        // A flipped bit in a record in the middle skips that record only.
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[REC * 2 + 30] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let (_, _, recs, bad) = Journal::open(&p).unwrap();
        assert_eq!(recs, vec![rec(1), rec(4)]);
        assert_eq!(bad, 1);
        assert_eq!(
            std::fs::read(&p).unwrap(),
            bytes,
            "the file is left as it was found"
        );
        // Bad records at the end with nothing good after them: a torn tail, cut.
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n - 20] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let (mut j, _, recs, bad) = Journal::open(&p).unwrap();
        assert_eq!((recs, bad), (vec![rec(1)], 0));
        assert_eq!(std::fs::metadata(&p).unwrap().len(), (REC * 2) as u64);
        j.rewrite(42, &[rec(9)]).unwrap();
        let (_, _, recs, _) = Journal::open(&p).unwrap();
        assert_eq!(recs, vec![rec(9)]);
        std::fs::write(&p, b"garbage").unwrap();
        assert!(Journal::open(&p).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_crash_between_checkpoint_write_and_rename_keeps_the_old_journal() {
        let dir = tempdir();
        let p = dir.join("journal.kvj");
        let mut j = Journal::create(&p, 5).unwrap();
        j.append(&[rec(1), rec(2)]).unwrap();
        j.sync().unwrap();
        drop(j);
        // What a checkpoint that died before its rename leaves: a complete or partial
        // journal.tmp beside the journal.
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, &std::fs::read(&p).unwrap()[..100]).unwrap();
        let (mut j, inst, recs, bad) = Journal::open(&p).unwrap();
        assert_eq!((inst, recs, bad), (5, vec![rec(1), rec(2)], 0));
        // The next checkpoint replaces the leftover and the journal.
        j.rewrite(5, &[rec(2)]).unwrap();
        assert!(!tmp.exists());
        let (_, _, recs, _) = Journal::open(&p).unwrap();
        assert_eq!(recs, vec![rec(2)]);
        // A creation that died before its rename leaves journal.new and no journal.
        std::fs::remove_file(&p).unwrap();
        std::fs::write(p.with_extension("new"), b"half").unwrap();
        Journal::create(&p, 6).unwrap();
        assert!(!p.with_extension("new").exists());
        assert_eq!(Journal::open(&p).unwrap().1, 6);
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvtier-journal-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        // Each test runs on its own thread: its own directory.
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

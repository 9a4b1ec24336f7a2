//! Tests of retention and demotion.

use super::*;
use crate::{Admission, DiskConfig, Namespace, NsId, StoreConfig, TpShard};
use std::time::Duration;

const LEN: usize = 60_000;

fn cfg(dir: Option<&std::path::Path>, write_through: bool) -> StoreConfig {
    StoreConfig {
        capacity_bytes: 8 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10],
        shards: 4,
        disk: dir.map(|d| DiskConfig {
            dir: d.to_path_buf(),
            capacity_bytes: 64 << 20,
            admission: Admission::Always,
            write_through,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvtier-retain-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 7).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn data(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; LEN];
    crate::fill_pattern(&mut v, i);
    v
}

fn ns(s: &Store) -> NsId {
    s.register_namespace(&Namespace {
        model: "retain".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    })
    .unwrap()
}

fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
    r.map(key).collect()
}

fn put_all(s: &Store, id: NsId, r: std::ops::Range<u64>) {
    for i in r {
        s.put(id, key(i), &data(i)).unwrap();
    }
}

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn retained_session_outlives_traffic_that_evicts_the_rest() {
    // 8 MiB of 64 KiB slots: 128 blocks. Two sessions of 20 blocks, one retained; then 400
    // blocks of other traffic.
    let s = cfg(None, false).build().unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..20);
    put_all(&s, id, 1000..1020);
    let r = s.retain(Some("chat-1"), &keys(0..20), Duration::from_secs(600), 3);
    assert_eq!(r.refused, "");
    assert_eq!((r.present, r.retained, r.clipped), (20, 20, 0));
    assert_eq!(r.bytes, 20 * LEN as u64);
    assert!(r.clipped_by.is_empty());
    put_all(&s, id, 2000..2400);
    for i in 0..20 {
        assert!(s.in_host(&key(i)), "retained block {i} evicted");
    }
    // The control: the other session's blocks went.
    assert!((1000..1020).any(|i| !s.in_host(&key(i))));
    // And the retained bytes are the right ones.
    let mut buf = vec![0u8; LEN];
    assert_eq!(s.get_into(&key(7), &mut buf).unwrap(), Some(LEN));
    assert_eq!(buf, data(7));
    let st = s.retention_stats();
    assert_eq!(
        (st.retentions, st.blocks, st.bytes),
        (1, 20, 20 * LEN as u64)
    );
    assert_eq!(
        st.max_bytes,
        2 << 20,
        "a quarter of the host tier by default"
    );
}

#[test]
fn a_session_adds_to_what_it_holds() {
    let s = cfg(None, false).build().unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..12);
    s.retain(Some("a"), &keys(0..8), HOUR, 0);
    // The next turn: the same prefix and 4 more blocks. Pinned once each.
    let r = s.retain(Some("a"), &keys(0..12), HOUR, 0);
    assert_eq!((r.present, r.retained), (12, 12));
    assert_eq!(s.retention_stats().blocks, 12);
    // Absent keys end the prefix.
    let mut ks = keys(0..3);
    ks.push(key(99));
    ks.push(key(5));
    let r = s.retain(None, &ks, HOUR, 0);
    assert_eq!((r.present, r.retained), (3, 3));
    assert_eq!(s.retention_stats().retentions, 2);
}

#[test]
fn bounds_clip_displace_lower_priority_and_say_which() {
    let s = StoreConfig {
        retain_max_bytes: Some(10 * LEN as u64),
        retain_max_ttl: Duration::from_secs(60),
        ..cfg(None, false)
    }
    .build()
    .unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..40);
    let lo = s.retain(Some("lo"), &keys(0..8), Duration::from_secs(10), 1);
    assert_eq!(lo.retained, 8);
    // Higher priority: the low one makes room.
    let hi = s.retain(Some("hi"), &keys(10..16), Duration::from_secs(10), 5);
    assert_eq!((hi.retained, hi.clipped, hi.displaced), (6, 0, 8));
    assert_eq!(s.retention_stats().retentions, 1, "lo ended");
    // Equal priority ending later: the one that ends first makes room (the TTL asked is
    // shortened to the bound, and said so).
    let eq = s.retain(Some("eq"), &keys(20..26), Duration::from_secs(7200), 5);
    assert_eq!((eq.retained, eq.clipped, eq.displaced), (6, 0, 6));
    assert_eq!(eq.clipped_by, vec![RetainBound::Ttl]);
    assert_eq!(eq.ttl, Duration::from_secs(60));
    // Equal priority ending sooner displaces nothing: the leading blocks that fit, clipped by
    // the bound.
    let soon = s.retain(Some("soon"), &keys(30..36), Duration::from_secs(5), 5);
    assert_eq!((soon.retained, soon.clipped, soon.displaced), (4, 2, 0));
    assert_eq!(soon.clipped_by, vec![RetainBound::Bytes]);
    let st = s.retention_stats();
    assert_eq!((st.bytes, st.blocks), (10 * LEN as u64, 10));
    assert_eq!((st.displaced, st.clipped_blocks), (2, 2));
    // The clipped and displaced blocks hold no pin: every block can be evicted again but the
    // retained ones.
    put_all(&s, id, 100..400);
    assert!((0..16).all(|i| !s.in_host(&key(i))));
    assert!((20..26).all(|i| s.in_host(&key(i))));
    assert!((30..34).all(|i| s.in_host(&key(i))));
    assert!((34..36).all(|i| !s.in_host(&key(i))));
}

#[test]
fn refused_with_the_reason() {
    let s = StoreConfig {
        retain_max_bytes: Some(0),
        ..cfg(None, false)
    }
    .build()
    .unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..2);
    let r = s.retain(Some("a"), &keys(0..2), HOUR, 0);
    assert!(r.refused.contains("off"), "{}", r.refused);
    assert_eq!(r.retained, 0);
    let s = cfg(None, false).build().unwrap();
    let r = s.retain(Some(&"x".repeat(300)), &[], HOUR, 0);
    assert!(r.refused.contains("session name"), "{}", r.refused);
    let r = s.retain(Some(""), &[], HOUR, 0);
    assert!(!r.refused.is_empty());
}

#[test]
fn retention_ends_at_its_ttl() {
    let s = cfg(None, false).build().unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..10);
    s.retain(Some("a"), &keys(0..10), Duration::from_secs(5), 0);
    assert_eq!(s.inner.reap_retained(Instant::now()), 0);
    assert_eq!(
        s.inner
            .reap_retained(Instant::now() + Duration::from_secs(6)),
        1
    );
    let st = s.retention_stats();
    assert_eq!(
        (st.retentions, st.blocks, st.bytes, st.expired),
        (0, 0, 0, 1)
    );
    // Unpinned: ordinary traffic evicts them now.
    put_all(&s, id, 100..400);
    assert!((0..10).any(|i| !s.in_host(&key(i))));
}

#[test]
fn demote_moves_a_session_to_disk_and_frees_host_memory() {
    let d = tmp("demote");
    let s = cfg(Some(&d), false).build().unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..10);
    let used = s.stats().used_bytes;
    s.retain(Some("a"), &keys(0..10), HOUR, 0);
    // One block in use by a load: it stays.
    let loaded = s.load(&keys(9..10)).unwrap();
    let r = s.demote(Some("a"), &[]);
    assert_eq!((r.released, r.queued, r.busy, r.freed), (10, 9, 1, 0));
    assert!(s.sync(Duration::from_secs(30)));
    for i in 0..9 {
        assert!(!s.in_host(&key(i)), "block {i} still in host memory");
    }
    assert!(s.in_host(&key(9)));
    assert_eq!(s.stats().used_bytes, used - 9 * LEN as u64);
    drop(loaded);
    // Below, byte-exact, and loaded back on demand.
    let m = s.match_prefix(&keys(0..10));
    assert_eq!(m.n, 10);
    assert_eq!(m.tiers[0], crate::Tier::Disk);
    let mut buf = vec![0u8; LEN];
    for i in 0..10 {
        assert_eq!(s.get_into(&key(i), &mut buf).unwrap(), Some(LEN));
        assert_eq!(buf, data(i), "block {i}");
    }
    // Clean now (read back from disk): a second demote drops the host copies at once, and
    // writes block 9 (still dirty: it was busy) first.
    let r = s.demote(None, &keys(0..10));
    assert_eq!((r.released, r.freed, r.queued, r.not_in_host), (0, 9, 1, 0));
    assert!(s.sync(Duration::from_secs(30)));
    assert!((0..10).all(|i| !s.in_host(&key(i))));
    let st = s.retention_stats();
    assert_eq!(
        (st.demotes, st.demoted_freed, st.demoted_queued),
        (2, 9, 10)
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn demote_keys_releases_them_from_any_session_and_keeps_what_cannot_move() {
    // No tier below: dirty blocks have nowhere to go.
    let s = cfg(None, false).build().unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..6);
    s.retain(Some("a"), &keys(0..6), HOUR, 0);
    let r = s.demote(None, &keys(4..6));
    assert_eq!((r.released, r.kept), (2, 2));
    let st = s.retention_stats();
    assert_eq!((st.retentions, st.blocks), (1, 4));
    let r = s.demote(None, &[key(77)]);
    assert_eq!((r.released, r.not_in_host), (0, 1));
    let r = s.demote(Some("a"), &[]);
    assert_eq!((r.released, r.kept), (4, 4));
    assert_eq!(s.retention_stats().retentions, 0);
}

#[test]
fn kept_blocks_are_the_first_evicted() {
    // No tier below: a demote keeps the blocks but makes them the next victims, so the
    // application's "done for now" frees host memory for others before anything older.
    for policy in crate::PolicyKind::ALL {
        let s = StoreConfig {
            policy,
            ..cfg(None, false)
        }
        .build()
        .unwrap();
        let id = ns(&s);
        let slots = (8 << 20) / (64 << 10);
        put_all(&s, id, 0..slots);
        assert!((0..slots).all(|i| s.in_host(&key(i))));
        let cooled = keys(slots - 8..slots - 5);
        assert_eq!(s.demote(None, &cooled).kept, 3, "{}", policy.name());
        put_all(&s, id, slots..slots + 3);
        assert!(
            cooled.iter().all(|k| !s.in_host(k)),
            "{}: a demoted block outlived older ones",
            policy.name()
        );
        let kept = (0..slots + 3).filter(|&i| s.in_host(&key(i))).count();
        assert_eq!(kept as u64, slots, "{}", policy.name());
    }
}

#[test]
fn a_ttl_past_the_clock_is_a_long_retention_not_a_panic() {
    let s = StoreConfig {
        retain_max_ttl: Duration::MAX,
        ..cfg(None, false)
    }
    .build()
    .unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..2);
    let r = s.retain(Some("forever"), &keys(0..2), Duration::MAX, 0);
    assert_eq!((r.retained, r.clipped_by.len()), (2, 0));
    assert_eq!(s.inner.reap_retained(Instant::now()), 0);
}

#[test]
fn retentions_survive_a_restart_with_their_disk_blocks() {
    let d = tmp("restart");
    {
        let s = cfg(Some(&d), true).build().unwrap();
        let id = ns(&s);
        put_all(&s, id, 0..8);
        assert!(s.sync(Duration::from_secs(30)));
        assert_eq!(s.retain(Some("chat"), &keys(0..8), HOUR, 3).retained, 8);
        assert_eq!(s.retain(None, &keys(0..2), HOUR, 0).retained, 2);
    }
    let file = d.join(FILE);
    assert!(file.exists());
    {
        let s = cfg(Some(&d), true).build().unwrap();
        assert!(!file.exists(), "read once");
        let st = s.retention_stats();
        assert_eq!((st.retentions, st.blocks), (2, 10));
        // The session's blocks are pinned on disk, as they were, and come back byte-exact.
        assert_eq!(s.demote(Some("chat"), &[]).released, 8);
        for i in 0..8 {
            let b = s.get(&key(i)).expect("kept on disk");
            assert_eq!(&b[..], &data(i)[..]);
        }
    }
    // The anonymous one is kept again; a session demoted is not.
    let s = cfg(Some(&d), true).build().unwrap();
    let st = s.retention_stats();
    assert_eq!((st.retentions, st.blocks), (1, 2));
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_retentions_file_is_read_with_care() {
    let saved = vec![
        Saved {
            session: Some("chat-42".into()),
            priority: 3,
            until_ms: 5_000,
            keys: keys(0..4),
        },
        Saved {
            session: None,
            priority: 0,
            until_ms: 9_000,
            keys: keys(10..11),
        },
    ];
    let b = encode(&saved);
    assert_eq!(decode(&b).unwrap(), saved);
    // Torn, damaged, foreign or newer: refused with the reason, nothing restored.
    assert!(decode(&b[..b.len() - 1]).unwrap_err().contains("checksum"));
    let mut bad = b.clone();
    bad[20] ^= 1;
    assert!(decode(&bad).unwrap_err().contains("checksum"));
    assert!(decode(b"hello")
        .unwrap_err()
        .contains("not a retentions file"));
    let mut newer = b[..b.len() - 8].to_vec();
    newer[8..12].copy_from_slice(&2u32.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&newer);
    newer.extend_from_slice(&sum.to_le_bytes());
    assert!(decode(&newer).unwrap_err().contains("version 2"));
    // A count that promises more than the file holds.
    let mut short = b[..b.len() - 8].to_vec();
    short[12..16].copy_from_slice(&3u32.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&short);
    short.extend_from_slice(&sum.to_le_bytes());
    assert!(decode(&short).unwrap_err().contains("truncated"));
    // A TTL that ended while the store was down is not restored.
    let s = cfg(None, false).build().unwrap();
    let id = ns(&s);
    put_all(&s, id, 0..4);
    assert_eq!(s.inner.retain_saved(saved, 6_000), (0, 1));
    assert_eq!(s.retention_stats().retentions, 0);
}

#[test]
fn a_flush_writes_retained_blocks_that_admission_refused() {
    // Seen-twice admission: blocks put once are never written, unless retained.
    let d = tmp("flush-retained");
    let mut c = cfg(Some(&d), false);
    if let Some(disk) = c.disk.as_mut() {
        disk.admission = Admission::SeenTwice;
        disk.admit_all_below = 0.0;
    }
    {
        let s = c.clone().build().unwrap();
        let id = ns(&s);
        put_all(&s, id, 0..6);
        assert_eq!(s.retain(Some("agent"), &keys(0..4), HOUR, 1).retained, 4);
        assert_eq!(s.flush(), 4, "the retained blocks only");
        assert!(
            d.join(FILE).exists(),
            "kept at the flush, before the store closes"
        );
    }
    let s = c.build().unwrap();
    let st = s.retention_stats();
    assert_eq!((st.retentions, st.blocks), (1, 4));
    for i in 0..4 {
        assert_eq!(&s.get(&key(i)).expect("on disk")[..], &data(i)[..]);
    }
    assert!(s.get(&key(4)).is_none());
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

//! Tests of preloading from hints (a disk tier under the store, slowed where a test needs
//! the reader busy).

use super::*;
use crate::{Admission, DiskConfig, Namespace, StoreConfig, TpShard};
use std::time::Duration;

fn store_with(dir: &std::path::Path, inflight: u64, held: u64) -> Store {
    StoreConfig {
        capacity_bytes: 8 << 20,
        segment_bytes: 1 << 20,
        size_classes: vec![64 << 10],
        shards: 4,
        prefetch_max_inflight_bytes: inflight,
        prefetch_max_held_bytes: held,
        disk: Some(DiskConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: 64 << 20,
            admission: Admission::Always,
            write_through: true,
            ..Default::default()
        }),
        ..Default::default()
    }
    .build()
    .unwrap()
}

fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 11).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn data(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; 60_000];
    crate::fill_pattern(&mut v, i);
    v
}

fn ns(s: &Store) -> crate::NsId {
    s.register_namespace(&Namespace {
        model: "prefetch".into(),
        dtype: "bf16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Shared,
        tenant: String::new(),
        lora: String::new(),
    })
    .unwrap()
}

/// A store whose keys 0..n are on disk only (written through, then the store reopened).
fn on_disk(name: &str, n: u64, inflight: u64) -> (Store, std::path::PathBuf) {
    on_disk_with(name, n, inflight, inflight)
}

fn on_disk_with(name: &str, n: u64, inflight: u64, held: u64) -> (Store, std::path::PathBuf) {
    let d = std::env::temp_dir().join(format!("kvtier-prefetch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let s = store_with(&d, inflight, held);
    let id = ns(&s);
    for i in 0..n {
        s.put(id, key(i), &data(i)).unwrap();
    }
    assert!(s.sync(Duration::from_secs(30)));
    s.flush();
    drop(s);
    let s = store_with(&d, inflight, held);
    for i in 0..n {
        assert!(!s.in_host(&key(i)));
    }
    (s, d)
}

/// Every disk read of `s` takes `ms` longer.
fn slow_disk(s: &mut Store, ms: u64) {
    s.wrap_disk_engine(|inner| {
        let f = crate::io::fault::FaultEngine::new(inner);
        f.set_plan(crate::io::fault::FaultPlan {
            delay: Duration::from_millis(ms),
            ..Default::default()
        });
        std::sync::Arc::new(f)
    });
}

/// Waits until `done` holds, on the store's progress condition variable (every change the
/// worker or a request makes bumps it; a wait lasts 50 ms at most, for the conditions only
/// time changes, such as a deadline passing); fails naming `what` after `secs` seconds.
fn wait_for(s: &Store, what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        let seen = s.inner.progress.current();
        if done() {
            return;
        }
        assert!(
            Instant::now() < until,
            "{what}: not within {secs} s ({:?})",
            s.stats().prefetch
        );
        s.inner
            .progress
            .wait(seen, until.min(Instant::now() + Duration::from_millis(50)));
    }
}

/// Until the reader took every queued preload job (it takes a job off the queue as it
/// starts reading it).
fn wait_taken(s: &Store) {
    wait_for(s, "the reader takes the queued jobs", 10, || {
        s.stats().prefetch.queued_jobs == 0
    });
}

fn wait_in_host(s: &Store, keys: &[BlockKey]) {
    wait_for(s, "the preloads arrive", 20, || {
        keys.iter().all(|k| s.in_host(k))
    });
}

#[test]
fn a_hint_promotes_the_prefix_before_the_load_and_a_repeat_joins() {
    let (s, d) = on_disk("basic", 6, 0);
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    let far = Instant::now() + Duration::from_secs(60);
    let p = s.prefetch(&keys[..4], 0, far, 1);
    assert_eq!((p.present, p.queued, p.in_host), (4, 4, 0));
    // The same prefix hinted by 1,000 more requests: read once.
    for t in 0..1000 {
        let again = s.prefetch(&keys[..4], 0, far, 100 + t);
        assert_eq!((again.queued, again.present), (0, 4));
    }
    wait_in_host(&s, &keys[..4]);
    assert_eq!(s.stats().disk().unwrap().reads, 4, "one read per block");
    assert_eq!(s.stats().prefetch.held_bytes, 4 * 60_000);
    // Held for their load: a flood of other blocks does not evict them.
    let id = ns(&s);
    for i in 1000..1300 {
        s.put(id, key(i), &data(i)).unwrap();
    }
    assert!(
        keys[..4].iter().all(|k| s.in_host(k)),
        "a held preload was evicted"
    );
    let reads = s.stats().disk().unwrap().reads;
    // The load reads host memory only: no disk read during it, and the blocks are exact.
    let l = s.load(&keys[..4]).unwrap();
    assert_eq!(l.len(), 4);
    for i in 0..4 {
        assert_eq!(l.block(i), &data(i as u64)[..]);
    }
    drop(l);
    assert_eq!(s.stats().disk().unwrap().reads, reads);
    let st = s.stats().prefetch;
    assert_eq!((st.hinted, st.in_time), (4, 4));
    assert_eq!(st.held_bytes, 0, "used: no longer held");
    // A hint stops where the prefix ends.
    let gap = [key(0), key(99), key(5)];
    assert_eq!(s.prefetch(&gap, 0, far, 3).present, 1);
    drop(s);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_hint_holds_blocks_already_in_host_memory_until_the_load() {
    // A request far back in the queue: its blocks are in host memory when it is hinted and
    // must still be there when it loads, however much is written meanwhile.
    let (s, d) = on_disk("inhost", 0, 0);
    let id = ns(&s);
    let keys: Vec<BlockKey> = (0..3).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        s.put(id, *k, &data(i as u64)).unwrap();
    }
    let far = Instant::now() + Duration::from_secs(60);
    let p = s.prefetch(&keys, 0, far, 1);
    assert_eq!((p.present, p.in_host, p.held, p.queued), (3, 3, 3, 0));
    assert_eq!(s.prefetch(&keys, 0, far, 2).held, 0, "held once");
    assert_eq!(s.stats().prefetch.held_bytes, 3 * 60_000);
    for i in 1000..1300 {
        s.put(id, key(i), &data(i)).unwrap();
    }
    assert!(
        keys.iter().all(|k| s.in_host(k)),
        "a held block was evicted"
    );
    let l = s.load(&keys).unwrap();
    assert_eq!(l.len(), 3);
    drop(l);
    let st = s.stats().prefetch;
    assert_eq!(st.held_bytes, 0, "used: no longer held");
    assert_eq!(st.in_time, 0, "not read by a preload");
    // Held until the deadline, then let go (not a wasted read) and evictable again.
    let cold = key(50);
    s.put(id, cold, &data(50)).unwrap();
    let soon = Instant::now() + Duration::from_millis(300);
    assert_eq!(s.prefetch(&[cold], 0, soon, 3).held, 1);
    for i in 2000..2300 {
        s.put(id, key(i), &data(i)).unwrap();
    }
    assert!(s.in_host(&cold), "held until its deadline");
    // Past the deadline, a hint (any) reaps the hold.
    wait_for(&s, "the hold lapses at its deadline", 10, || {
        Instant::now() >= soon && {
            s.prefetch(&[], 0, far, 4);
            true
        }
    });
    let st = s.stats().prefetch;
    assert_eq!((st.held_bytes, st.wasted_bytes), (0, 0));
    let pins = |k: BlockKey| {
        let sh = s.inner.shard(k).lock();
        sh.map.get(&MapKey::from(k)).map(|e| sh.pins.count(&e))
    };
    assert_eq!(pins(cold), Some(0), "no longer held: its pin is gone");
    assert!(keys.iter().all(|k| pins(*k).unwrap_or(0) == 0));
    drop(s);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn held_preloads_are_bounded_apart_from_those_in_flight() {
    // Two 64 KiB blocks in flight at once, four held (in flight included).
    let (s, d) = on_disk_with("held", 8, 128 << 10, 256 << 10);
    let far = Instant::now() + Duration::from_secs(60);
    let (mut queued, mut waiting) = (0, 0);
    for i in 0..8 {
        let p = s.prefetch(&[key(i)], 0, far, i);
        queued += p.queued;
        waiting += p.waiting;
        // Let the reader finish it: what it read is held, no longer in flight.
        wait_for(&s, "the reader finishes the preload", 10, || {
            s.stats().prefetch.inflight_bytes == 0
        });
        let st = s.stats().prefetch;
        assert!(st.held_bytes + st.inflight_bytes <= 256 << 10, "{st:?}");
    }
    assert_eq!(
        (queued, waiting),
        (4, 4),
        "four held, the rest wait for room"
    );
    // The reader may be trying the first waiting hint again right now (it takes it off
    // the list and puts it back when there is no room): look again until it settled.
    wait_for(&s, "four keys wait", 5, || {
        s.stats().prefetch.waiting_keys == 4
    });
    let st = s.stats().prefetch;
    assert_eq!(
        (st.held_bytes, st.waiting_keys, st.waited),
        (4 * 60_000, 4, 4)
    );
    assert_eq!(st.dropped, 0);
    // A load uses one: its room comes back, and the first waiting hint (key 4) takes it by
    // itself; the others keep waiting.
    let mut out = vec![0u8; 60_000];
    assert!(s.get_into(&key(0), &mut out).unwrap().is_some());
    assert_eq!(out, data(0));
    wait_in_host(&s, &[key(4)]);
    // Room changed: the reader may be trying the next waiting hint right now (off the
    // list until it finds no room): look again until it settled.
    // (One read of both: the reader takes a hint off the list while it tries it, so a
    // second read may catch it there.)
    wait_for(&s, "three keys wait, the room all held", 5, || {
        let st = s.stats().prefetch;
        (st.held_bytes, st.waiting_keys) == (4 * 60_000, 3)
    });
    assert!(!s.in_host(&key(5)));
    // A new hint waits behind them; cancelling a waiting hint takes it off the list.
    assert_eq!(s.prefetch(&[key(0)], 0, far, 20).waiting, 1);
    assert_eq!(s.cancel_prefetch(5), 0, "nothing queued to cancel");
    // (If the reader was resuming hint 5 just then, it cancels what it had in hand once
    // it is done with it.)
    wait_for(&s, "three keys wait", 5, || {
        s.stats().prefetch.waiting_keys == 3
    });
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn cancel_and_disconnect_end_the_holds_of_their_hints() {
    let (s, d) = on_disk_with("cancel-holds", 8, 512 << 10, 512 << 10);
    let far = Instant::now() + Duration::from_secs(60);
    // Tag 1 preloads two blocks from disk; once read they are held for its load.
    assert_eq!(s.prefetch(&[key(0), key(1)], 0, far, 1).queued, 2);
    wait_in_host(&s, &[key(0), key(1)]);
    // Another engine (owner 7) preloads one, and holds one already in host memory.
    let q = PrefetchQuota {
        owner: 7,
        max_bytes: 256 << 10,
        max_waiting_keys: 8,
    };
    assert_eq!(s.prefetch_as(&[key(2)], 0, far, 2, q).queued, 1);
    wait_in_host(&s, &[key(2)]);
    let p = s.prefetch_as(&[key(1), key(3)], 0, far, 3, q);
    assert_eq!(
        (p.in_host, p.held, p.queued),
        (1, 0, 1),
        "key 1 is held by tag 1"
    );
    wait_in_host(&s, &[key(3)]);
    assert_eq!(s.stats().prefetch.held_bytes, 4 * 60_000);
    // Another client naming owner 7's tag cancels nothing of owner 7's.
    assert_eq!(s.cancel_prefetch_as(3, 8), 0);
    assert_eq!(s.stats().prefetch.held_bytes, 4 * 60_000);
    // The request of tag 1 finished without loading: its holds end at once, not at the
    // hint's deadline a minute from now.
    assert_eq!(s.cancel_prefetch(1), 2);
    assert_eq!(s.stats().prefetch.held_bytes, 2 * 60_000);
    assert_eq!(s.cancel_prefetch(1), 0);
    // Owner 7's engine went away: every hold its hints made ends.
    assert_eq!(s.cancel_prefetch_of_owner(7), 2);
    let st = s.stats().prefetch;
    // The four blocks were read from disk for loads that never came: wasted.
    assert_eq!((st.held_bytes, st.wasted_bytes), (0, 4 * 60_000), "{st:?}");
    assert_eq!(s.cancel_prefetch_of_owner(0), 0, "owner 0 is nobody");
    // The blocks stay cached, as ordinary blocks now: loads find them, eviction may take
    // them.
    for i in 0..4 {
        let mut out = vec![0u8; 60_000];
        assert!(s.get_into(&key(i), &mut out).unwrap().is_some());
        assert_eq!(out, data(i));
    }
    assert_eq!(
        s.stats().prefetch.in_time,
        0,
        "no hold was left for the loads"
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_hint_cancelled_while_its_preload_is_read_holds_nothing() {
    // A slow disk (200 ms a read): the cancel comes while the reader reads the hint's job.
    let (mut s, d) = on_disk("cancel-reading", 2, 0);
    slow_disk(&mut s, 200);
    let far = Instant::now() + Duration::from_secs(60);
    let keys: Vec<BlockKey> = (0..2).map(key).collect();
    assert_eq!(s.prefetch(&keys, 0, far, 5).queued, 2);
    wait_taken(&s);
    assert_eq!(s.cancel_prefetch(5), 0, "nothing queued or held yet");
    wait_in_host(&s, &keys);
    // Published (the bytes were read), but held for no request: not until the deadline a
    // minute away.
    // (The hold is dropped before the cancel is counted.)
    wait_for(&s, "the reader cancels what it published", 10, || {
        let st = s.stats().prefetch;
        st.held_bytes == 0 && st.cancelled >= 2
    });
    assert_eq!(s.stats().prefetch.cancelled, 2);
    // The next hint of the same blocks holds them again (a new request).
    assert_eq!(s.prefetch(&keys, 0, far, 6).held, 2);
    drop(s);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn one_owner_cannot_take_the_preload_room_of_another() {
    let (s, d) = on_disk_with("owners", 8, 512 << 10, 512 << 10);
    let far = Instant::now() + Duration::from_secs(60);
    let a = PrefetchQuota {
        owner: 1,
        max_bytes: 128 << 10,
        max_waiting_keys: 3,
    };
    let b = PrefetchQuota { owner: 2, ..a };
    // A: two blocks fit its quota, the rest of its hint waits (3 keys: its bound).
    let keys: Vec<BlockKey> = (0..5).map(key).collect();
    let p = s.prefetch_as(&keys, 0, far, 1, a);
    assert_eq!((p.queued, p.waiting, p.dropped), (2, 3, 0), "{p:?}");
    wait_in_host(&s, &keys[..2]);
    // More from A does not fit its waiting bound: dropped, nothing else waits.
    let more = s.prefetch_as(&[key(5)], 0, far, 2, a);
    assert_eq!((more.waiting, more.dropped), (0, 1), "{more:?}");
    // B's hint waits behind A's, but A is at its quota: the reader resumes B's first.
    let bk = [key(6), key(7)];
    assert_eq!(s.prefetch_as(&bk, 0, far, 3, b).waiting, 2);
    wait_in_host(&s, &bk);
    assert!(!s.in_host(&key(2)), "A went past its quota");
    // A's load uses one of its blocks: room in its quota, its waiting hint resumes.
    let mut out = vec![0u8; 60_000];
    assert!(s.get_into(&key(0), &mut out).unwrap().is_some());
    wait_in_host(&s, &[key(2)]);
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_staging_bound_holds_and_cancel_and_deadlines_drop_queued_preloads() {
    // Room for two 64 KiB blocks in flight.
    let (s, d) = on_disk("bound", 8, 128 << 10);
    let keys: Vec<BlockKey> = (0..8).map(key).collect();
    let far = Instant::now() + Duration::from_secs(60);
    // A flood of hints: never more than the bound in flight.
    let mut queued = 0;
    for i in 0..8 {
        let p = s.prefetch(&keys[i..i + 1], 0, far, 10 + i as u64);
        queued += p.queued;
        assert!(s.stats().prefetch.inflight_bytes <= 128 << 10);
    }
    assert!((2..8).contains(&queued), "{queued}");
    let st = s.stats().prefetch;
    assert!(st.waiting_keys > 0 && st.dropped == 0, "{st:?}");
    drop(s);
    let _ = std::fs::remove_dir_all(&d);

    // Cancel: queued preloads of a tag are dropped unread and their slots come back. A
    // slow disk (200 ms a read) keeps the reader busy with the first hint.
    let (mut s, d) = on_disk("cancel", 8, 0);
    slow_disk(&mut s, 200);
    let keys: Vec<BlockKey> = (0..8).map(key).collect();
    assert_eq!(s.prefetch(&keys[..2], 0, far, 7).queued, 2);
    wait_taken(&s);
    assert_eq!(s.prefetch(&keys[2..4], 0, far, 8).queued, 2);
    assert_eq!(s.cancel_prefetch(8), 2);
    assert_eq!(s.cancel_prefetch(8), 0);
    assert_eq!(s.stats().prefetch.cancelled, 2);
    wait_in_host(&s, &keys[..2]);
    // Nothing is left queued or being read that could still bring the cancelled ones up.
    wait_for(&s, "the read queue is idle", 10, || {
        let st = s.stats().prefetch;
        st.queued_jobs == 0 && st.inflight_bytes == 0
    });
    assert!(!s.in_host(&keys[2]) && !s.in_host(&keys[3]));
    // A later load still finds them (from disk).
    let l = s.load(&keys[2..4]).unwrap();
    assert_eq!(l.len(), 2);
    drop(l);
    // An expired deadline: dropped unread.
    let past = Instant::now() - Duration::from_millis(1);
    assert_eq!(s.prefetch(&keys[4..8], 0, past, 9).queued, 4);
    // (The reader takes the job off the queue before it counts it expired.)
    wait_for(&s, "the expired preloads are dropped", 10, || {
        let st = s.stats().prefetch;
        st.queued_jobs == 0 && st.expired >= 4 && st.inflight_bytes == 0
    });
    assert_eq!(s.stats().prefetch.expired, 4);
    assert!(!s.in_host(&keys[4]));
    assert_eq!(s.stats().prefetch.inflight_bytes, 0);
    // Keys 0 and 1 were preloaded and never loaded: held (until their hint's deadline, a
    // minute away). A hint with a short deadline: held, then let go unused (wasted).
    assert_eq!(s.stats().prefetch.held_bytes, 2 * 60_000);
    // (Its read takes 200 ms: the deadline leaves room for a slow machine.)
    let soon = Instant::now() + Duration::from_millis(1500);
    assert_eq!(s.prefetch(&keys[6..7], 0, soon, 10).queued, 1);
    // (A reap counts the waste before it drops the hold.)
    wait_for(&s, "the unused hold lapses, wasted", 10, || {
        s.prefetch(&[], 0, far, 11); // reaps
        let st = s.stats().prefetch;
        st.wasted_bytes >= 60_000 && st.held_bytes <= 2 * 60_000
    });
    assert_eq!(s.stats().prefetch.held_bytes, 2 * 60_000);
    assert!(s.in_host(&keys[6]), "let go, not removed");
    drop(s);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_load_overtakes_a_long_hint_after_one_preload_job() {
    // A slow disk (20 ms a block, one after the other): a hint of 40 blocks (2.4 MB) is read
    // in jobs of at most 1 MiB (17, 17 and 6 blocks), so a load that arrives while the first
    // is read waits for that one job (340 ms), not for the whole hint.
    let n = 41;
    let (mut s, d) = on_disk_with("overtake", n, 8 << 20, 8 << 20);
    slow_disk(&mut s, 20);
    let far = Instant::now() + Duration::from_secs(60);
    let keys: Vec<BlockKey> = (0..n).map(key).collect();
    assert_eq!(s.prefetch(&keys[..40], 0, far, 1).queued, 40);
    wait_for(&s, "the reader starts the first job", 10, || {
        s.stats().prefetch.queued_jobs == 2
    });
    // A real load of another block: read before the two preload jobs still queued.
    let l = s.load(&keys[40..]).unwrap();
    assert_eq!(l.len(), 1);
    drop(l);
    assert!(
        s.stats().prefetch.queued_jobs >= 1,
        "the load waited for the whole hint: {:?}",
        s.stats().prefetch
    );
    wait_in_host(&s, &keys[..40]);
    drop(s);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn a_hint_holds_the_blocks_an_earlier_request_saves_after_it() {
    // Key 0 is on disk; keys 1 and 2 do not exist yet: an earlier request in the engine's
    // queue is computing them. The hint of a request further back names all three.
    let (s, d) = on_disk_with("watch", 1, 4 << 20, 4 << 20);
    let id = ns(&s);
    let far = Instant::now() + Duration::from_secs(60);
    let keys: Vec<BlockKey> = (0..3).map(key).collect();
    let p = s.prefetch(&keys, 0, far, 5);
    assert_eq!((p.present, p.queued), (1, 1));
    assert_eq!(
        s.stats().prefetch.watching_keys,
        2,
        "its rest waits for key 1"
    );
    // An untagged hint cannot be ended by its engine: it watches nothing (it would hold the
    // blocks its own request saves next).
    s.prefetch(&[key(0), key(3)], 0, far, 0);
    assert_eq!(s.stats().prefetch.watching_keys, 2);
    // Another hint whose request went away before the blocks came: it holds nothing.
    s.prefetch(&[key(0), key(3)], 0, far, 6);
    assert_eq!(s.stats().prefetch.watching_keys, 3);
    s.cancel_prefetch(6);
    assert_eq!(s.stats().prefetch.watching_keys, 2);
    // The earlier request saves keys 1 and 2 (and key 3): the hint holds 1 and 2 as they are
    // committed, beside key 0 it preloaded.
    for i in 1..4 {
        s.put(id, key(i), &data(i)).unwrap();
    }
    wait_for(&s, "the saved blocks are held for the hint", 10, || {
        s.stats().prefetch.held_bytes == 3 * 60_000
    });
    assert_eq!(s.stats().prefetch.watching_keys, 0);
    // Many other blocks come and go: the held ones stay in host memory for their load.
    for i in 100..300 {
        s.put(id, key(i), &data(i)).unwrap();
    }
    assert!(keys.iter().all(|k| s.in_host(k)));
    let l = s.load(&keys).unwrap();
    assert_eq!(l.len(), 3);
    drop(l);
    let st = s.stats().prefetch;
    assert_eq!((st.held_bytes, st.in_time), (0, 1), "{st:?}");
    drop(s);
    let _ = std::fs::remove_dir_all(d);
}

#[test]
fn load_seconds_are_priced_from_the_tiers_measured_reads() {
    let (s, d) = on_disk("load-seconds", 24, 0);
    let len = data(0).len() as u64;
    let disk = vec![(crate::Tier::Disk, len); 24];
    // Not read yet: the disk tier is not measured (it counts nothing, and says so); host
    // blocks cost nothing.
    assert_eq!(s.load_seconds(&disk), (0.0, false));
    assert_eq!(s.load_seconds(&[(crate::Tier::Host, len)]), (0.0, true));
    // A load reads 16 of them (about 1 MiB: a batch that measures bandwidth).
    let keys: Vec<BlockKey> = (0..16).map(key).collect();
    assert_eq!(s.load(&keys).unwrap().len(), 16);
    let (secs, measured) = s.load_seconds(&disk);
    assert!(measured && secs > 0.0, "{secs} {measured}");
    // More bytes cost more.
    let (half, _) = s.load_seconds(&disk[..12]);
    assert!(half < secs, "{half} vs {secs}");
    drop(s);
    let _ = std::fs::remove_dir_all(&d);
}

//! A concurrency model of the pin / lease / evict / remove protocol, run under shuttle (which
//! explores thread interleavings). It uses the index's real transitions (`Shard::pin`,
//! `unpin`, `remove`, `publish`, `abort`) with the store's lock order (class, then shard) and a
//! model of one size class; every slot carries a tag saying which key's bytes it holds.
//!
//! Checked: a pinned reader always finds its own key's bytes in the slot (no slot is freed,
//! evicted or reused while pinned); no slot is in the free list twice; after every thread is
//! done, every slot is either free or held by exactly one visible block.

use std::collections::HashSet;

use shuttle::sync::{Arc, Mutex};
use shuttle::thread;

use crate::key::BlockKey;
use crate::types::MapKey;

use super::index::{Copy, Entry, Life, Removed, Shard, Slot};

const SLOTS: u32 = 2;

struct Class {
    free: Vec<u32>,
    used: Vec<bool>,
    keys: Vec<Option<u128>>,
}

struct Model {
    class: Mutex<Class>,
    shard: Mutex<Shard>,
    /// The "bytes" in each slot: the key whose block was last written there.
    tags: Vec<Mutex<Option<u128>>>,
}

fn mk(k: u128) -> MapKey {
    MapKey::from(BlockKey(k))
}

fn slot(idx: u32) -> Slot {
    Slot { class: 0, idx }
}

impl Model {
    fn new() -> Arc<Self> {
        Arc::new(Model {
            class: Mutex::new(Class {
                free: (0..SLOTS).rev().collect(),
                used: vec![false; SLOTS as usize],
                keys: vec![None; SLOTS as usize],
            }),
            shard: Mutex::new(Shard::default()),
            tags: (0..SLOTS).map(|_| Mutex::new(None)).collect(),
        })
    }

    fn release(&self, idx: u32) {
        let mut c = self.class.lock().unwrap();
        assert!(c.used[idx as usize], "slot {idx} freed twice");
        c.used[idx as usize] = false;
        c.keys[idx as usize] = None;
        assert!(!c.free.contains(&idx));
        c.free.push(idx);
    }

    /// reserve + fill + commit, evicting an unpinned Ready block if no slot is free (as
    /// `Inner::try_alloc` / `try_evict` do: class lock, then shard lock).
    fn put(&self, k: u128) -> bool {
        let idx = {
            let mut c = self.class.lock().unwrap();
            let idx = match c.free.pop() {
                Some(i) => Some(i),
                None => {
                    let mut victim = None;
                    for i in 0..SLOTS {
                        let Some(vk) = c.keys[i as usize] else {
                            continue;
                        };
                        let mut sh = self.shard.lock().unwrap();
                        let ok = sh
                            .map
                            .get(&mk(vk))
                            .is_some_and(|e| e.slot() == slot(i) && e.pins == 0 && e.ready());
                        if ok {
                            sh.map.remove(&mk(vk));
                            victim = Some(i);
                            break;
                        }
                    }
                    victim
                }
            };
            if let Some(i) = idx {
                c.used[i as usize] = true;
                c.keys[i as usize] = Some(k);
            }
            idx
        };
        let Some(idx) = idx else { return false };
        {
            let mut sh = self.shard.lock().unwrap();
            if sh.map.contains_key(&mk(k)) {
                drop(sh);
                self.release(idx);
                return false;
            }
            sh.map
                .insert(mk(k), Entry::new(slot(idx), 1, 0, Life::Filling, 0));
        }
        *self.tags[idx as usize].lock().unwrap() = Some(k);
        let published = self
            .shard
            .lock()
            .unwrap()
            .publish(mk(k), slot(idx), Copy::Dirty)
            .is_some();
        if !published {
            self.release(idx);
        }
        published
    }

    /// pin, read the slot's bytes, unpin (as a load and its lease release do).
    fn read(&self, k: u128) {
        let e = self.shard.lock().unwrap().pin(mk(k)).unwrap();
        let Some(e) = e else { return };
        let tag = *self.tags[e.idx as usize].lock().unwrap();
        assert_eq!(tag, Some(k), "a pinned block's slot holds another block");
        thread::yield_now();
        let tag = *self.tags[e.idx as usize].lock().unwrap();
        assert_eq!(
            tag,
            Some(k),
            "a pinned block's slot was reused under its pin"
        );
        let freed = self.shard.lock().unwrap().unpin(mk(k), e.slot());
        if freed {
            self.release(e.idx);
        }
    }

    fn remove(&self, k: u128) {
        let r = self.shard.lock().unwrap().remove(mk(k));
        if let Removed::Freed(s, ..) = r {
            self.release(s.idx);
        }
    }

    fn check_quiescent(&self) {
        let c = self.class.lock().unwrap();
        let sh = self.shard.lock().unwrap();
        assert!(sh.doomed.is_empty(), "a doomed slot was never freed");
        let free: HashSet<u32> = c.free.iter().copied().collect();
        assert_eq!(free.len(), c.free.len(), "a slot is free twice");
        for i in 0..SLOTS {
            let held: Vec<_> = sh.map.values().filter(|e| e.idx == i).collect();
            if free.contains(&i) {
                assert!(held.is_empty(), "slot {i} is free and held");
            } else {
                assert_eq!(held.len(), 1, "slot {i} is neither free nor held once");
                assert_eq!(held[0].pins, 0, "a pin leaked");
            }
        }
    }
}

fn scenario() {
    let m = Model::new();
    let m1 = m.clone();
    let m2 = m.clone();
    let m3 = m.clone();
    m.put(1);
    let a = thread::spawn(move || {
        m1.read(1);
        m1.read(2);
    });
    let b = thread::spawn(move || {
        m2.put(2);
        m2.put(3);
        m2.read(3);
    });
    let c = thread::spawn(move || {
        m3.remove(1);
        m3.put(1);
        m3.remove(2);
    });
    a.join().unwrap();
    b.join().unwrap();
    c.join().unwrap();
    m.check_quiescent();
}

#[test]
fn pin_evict_remove_protocol_random_interleavings() {
    shuttle::check_random(scenario, 3_000);
}

#[test]
fn pin_evict_remove_protocol_pct() {
    shuttle::check_pct(scenario, 3_000, 3);
}

//! The store's locks, threads and condition variables, in one place so that two things hold:
//!
//! - **A checked lock order.** Every lock has a [`Level`]; a thread may take a lock only above
//!   every lock it holds (a strictly higher level: two locks of one level, such as two shards,
//!   are never held together). Debug builds (and so every test) check it on each `lock` and
//!   panic naming both locks, so an inversion fails the first test that runs the path, whether
//!   or not the threads happened to meet. `try_lock` is not checked (it cannot wait). The order
//!   is listed in ARCHITECTURE.md ("Locks").
//! - **The real code under a deterministic scheduler.** Built with `--cfg kvtier_shuttle`, the
//!   same types are shuttle's (`shuttle::sync`, `shuttle::thread`), as tokio does with loom:
//!   `kvstore`'s shuttle tests then run the real `Store` (its worker threads included) under
//!   thousands of schedules (`scripts/test.sh`). A timed wait there yields and reports a
//!   timeout once its deadline passed (shuttle's own never times out).

use std::ops::{Deref, DerefMut};
use std::time::Instant;

/// A lock's place in the order: taken only while every lock held is lower.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Level(pub u8, pub &'static str);

/// The store's lock order (ARCHITECTURE.md, "Locks").
pub(crate) mod level {
    use super::Level;
    /// `Inner::registering`: namespace registration, one at a time.
    pub const REGISTERING: Level = Level(10, "registering");
    /// `Inner::namespaces`.
    pub const NAMESPACES: Level = Level(20, "namespaces");
    /// A size class (`Inner::classes`): its slots and policy.
    pub const CLASS: Level = Level(30, "class");
    /// The preload holds (`Inner::preloads`): taken before the shard of a held block.
    pub const HOLDS: Level = Level(40, "holds");
    /// A lower tier's own lock (a tier may ask the index, `still_wanted`, while holding it).
    #[cfg_attr(not(kvtier_shuttle), allow(dead_code))]
    pub const TIER: Level = Level(45, "tier");
    /// An index shard.
    pub const SHARD: Level = Level(50, "shard");
    /// Leaf locks: nothing is taken while one is held.
    pub const LEAF: Level = Level(100, "leaf");
}

#[cfg(all(debug_assertions, not(kvtier_shuttle)))]
mod order {
    use super::Level;
    use std::cell::RefCell;

    thread_local! {
        static HELD: RefCell<Vec<(Level, &'static str)>> = const { RefCell::new(Vec::new()) };
    }

    /// Checks that `name` (at `level`) may be taken now, and records it as held.
    pub(super) fn acquire(level: Level, name: &'static str, checked: bool) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if checked {
                if let Some((top, top_name)) = h.iter().max_by_key(|(l, _)| *l) {
                    assert!(
                        level > *top,
                        "lock order violated: taking `{name}` ({}, level {}) while holding `{top_name}` ({}, level {}); see ARCHITECTURE.md, \"Locks\"",
                        level.1,
                        level.0,
                        top.1,
                        top.0
                    );
                }
            }
            h.push((level, name));
        });
    }

    /// `name` was released (guards may drop in any order).
    pub(super) fn release(level: Level, name: &'static str) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|e| *e == (level, name)) {
                h.remove(i);
            }
        });
    }
}

#[cfg(not(all(debug_assertions, not(kvtier_shuttle))))]
mod order {
    use super::Level;
    #[inline(always)]
    pub(super) fn acquire(_: Level, _: &'static str, _: bool) {}
    #[inline(always)]
    pub(super) fn release(_: Level, _: &'static str) {}
}

/// Records a held lock until dropped (dropped after the backend's guard: see the guards'
/// field order).
struct Token(Level, &'static str);

impl Token {
    fn new(level: Level, name: &'static str, checked: bool) -> Self {
        order::acquire(level, name, checked);
        Token(level, name)
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        order::release(self.0, self.1);
    }
}

#[cfg(not(kvtier_shuttle))]
mod backend {
    pub(super) type Mutex<T> = parking_lot::Mutex<T>;
    pub(super) type Guard<'a, T> = parking_lot::MutexGuard<'a, T>;
    pub(super) type RwLock<T> = parking_lot::RwLock<T>;
    pub(super) type ReadGuard<'a, T> = parking_lot::RwLockReadGuard<'a, T>;
    pub(super) type WriteGuard<'a, T> = parking_lot::RwLockWriteGuard<'a, T>;
    pub(super) type Condvar = parking_lot::Condvar;

    pub(super) fn lock<T>(m: &Mutex<T>) -> Guard<'_, T> {
        m.lock()
    }
    pub(super) fn try_lock<T>(m: &Mutex<T>) -> Option<Guard<'_, T>> {
        m.try_lock()
    }
    pub(super) fn read<T>(m: &RwLock<T>) -> ReadGuard<'_, T> {
        m.read()
    }
    pub(super) fn write<T>(m: &RwLock<T>) -> WriteGuard<'_, T> {
        m.write()
    }
}

#[cfg(kvtier_shuttle)]
mod backend {
    pub(super) type Mutex<T> = shuttle::sync::Mutex<T>;
    pub(super) type Guard<'a, T> = shuttle::sync::MutexGuard<'a, T>;
    pub(super) type RwLock<T> = shuttle::sync::RwLock<T>;
    pub(super) type ReadGuard<'a, T> = shuttle::sync::RwLockReadGuard<'a, T>;
    pub(super) type WriteGuard<'a, T> = shuttle::sync::RwLockWriteGuard<'a, T>;
    pub(super) type Condvar = shuttle::sync::Condvar;

    // A panicking thread fails the whole shuttle run: poisoning is never observed.
    pub(super) fn lock<T>(m: &Mutex<T>) -> Guard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn try_lock<T>(m: &Mutex<T>) -> Option<Guard<'_, T>> {
        m.try_lock().ok()
    }
    pub(super) fn read<T>(m: &RwLock<T>) -> ReadGuard<'_, T> {
        m.read().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn write<T>(m: &RwLock<T>) -> WriteGuard<'_, T> {
        m.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// A mutex with a place in the lock order.
pub(crate) struct Mutex<T> {
    level: Level,
    name: &'static str,
    m: backend::Mutex<T>,
}

/// A held [`Mutex`].
pub(crate) struct MutexGuard<'a, T> {
    // Field order: the backend's guard is released before the token says so.
    g: Option<backend::Guard<'a, T>>,
    // Taken again after a timed wait under shuttle.
    #[cfg_attr(not(kvtier_shuttle), allow(dead_code))]
    m: &'a Mutex<T>,
    _token: Token,
}

impl<T> Mutex<T> {
    /// A mutex named `name` (in panics) at `level`.
    pub(crate) fn new(level: Level, name: &'static str, v: T) -> Self {
        Self {
            level,
            name,
            m: backend::Mutex::new(v),
        }
    }

    /// Takes the lock (debug builds: only above every lock this thread holds).
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        let token = Token::new(self.level, self.name, true);
        MutexGuard {
            g: Some(backend::lock(&self.m)),
            m: self,
            _token: token,
        }
    }

    /// Takes the lock if it is free (never waits, so never checked against the order).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        let g = backend::try_lock(&self.m)?;
        Some(MutexGuard {
            g: Some(g),
            m: self,
            _token: Token::new(self.level, self.name, false),
        })
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // The guard is `Some` except inside `Condvar::wait*`, which puts it back.
        self.g.as_deref().expect("guard present")
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.g.as_deref_mut().expect("guard present")
    }
}

/// A reader-writer lock with a place in the lock order.
pub(crate) struct RwLock<T> {
    level: Level,
    name: &'static str,
    m: backend::RwLock<T>,
}

/// A [`RwLock`] held for reading.
pub(crate) struct ReadGuard<'a, T> {
    g: backend::ReadGuard<'a, T>,
    _token: Token,
}

/// A [`RwLock`] held for writing.
pub(crate) struct WriteGuard<'a, T> {
    g: backend::WriteGuard<'a, T>,
    _token: Token,
}

impl<T> RwLock<T> {
    /// A lock named `name` at `level`.
    pub(crate) fn new(level: Level, name: &'static str, v: T) -> Self {
        Self {
            level,
            name,
            m: backend::RwLock::new(v),
        }
    }

    pub(crate) fn read(&self) -> ReadGuard<'_, T> {
        let token = Token::new(self.level, self.name, true);
        ReadGuard {
            g: backend::read(&self.m),
            _token: token,
        }
    }

    pub(crate) fn write(&self) -> WriteGuard<'_, T> {
        let token = Token::new(self.level, self.name, true);
        WriteGuard {
            g: backend::write(&self.m),
            _token: token,
        }
    }
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.g
    }
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.g
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.g
    }
}

/// Whether a timed wait ended by its deadline.
pub(crate) struct WaitResult(bool);

impl WaitResult {
    pub(crate) fn timed_out(&self) -> bool {
        self.0
    }
}

/// A condition variable for a [`Mutex`].
#[derive(Default)]
pub(crate) struct Condvar {
    cv: backend::Condvar,
}

impl Condvar {
    pub(crate) fn notify_one(&self) {
        self.cv.notify_one();
    }

    pub(crate) fn notify_all(&self) {
        self.cv.notify_all();
    }

    /// Releases the lock until notified (or woken spuriously), then takes it again.
    pub(crate) fn wait<T>(&self, g: &mut MutexGuard<'_, T>) {
        #[cfg(not(kvtier_shuttle))]
        if let Some(inner) = g.g.as_mut() {
            self.cv.wait(inner);
        }
        #[cfg(kvtier_shuttle)]
        if let Some(inner) = g.g.take() {
            g.g = Some(self.cv.wait(inner).unwrap_or_else(|e| e.into_inner()));
        }
    }

    /// [`Condvar::wait`] until `until` at the latest.
    pub(crate) fn wait_until<T>(&self, g: &mut MutexGuard<'_, T>, until: Instant) -> WaitResult {
        #[cfg(not(kvtier_shuttle))]
        {
            match g.g.as_mut() {
                Some(inner) => WaitResult(self.cv.wait_until(inner, until).timed_out()),
                None => WaitResult(true),
            }
        }
        #[cfg(kvtier_shuttle)]
        {
            // Shuttle's timed waits never time out, which would make every wait that ends by
            // its deadline look like a deadlock: release, let others run, take it again.
            drop(g.g.take());
            shuttle::thread::yield_now();
            g.g = Some(backend::lock(&g.m.m));
            WaitResult(Instant::now() >= until)
        }
    }
}

/// Spawns a named thread (a shuttle thread under `kvtier_shuttle`).
pub(crate) fn spawn<F>(name: String, f: F) -> std::io::Result<JoinHandle>
where
    F: FnOnce() + Send + 'static,
{
    #[cfg(not(kvtier_shuttle))]
    {
        std::thread::Builder::new().name(name).spawn(f)
    }
    #[cfg(kvtier_shuttle)]
    {
        shuttle::thread::Builder::new().name(name).spawn(f)
    }
}

/// A thread of [`spawn`].
#[cfg(not(kvtier_shuttle))]
pub(crate) type JoinHandle = std::thread::JoinHandle<()>;
/// A thread of [`spawn`].
#[cfg(kvtier_shuttle)]
pub(crate) type JoinHandle = shuttle::thread::JoinHandle<()>;

#[cfg(all(test, debug_assertions, not(kvtier_shuttle)))]
mod tests {
    use super::*;

    #[test]
    fn locks_in_order_pass_and_out_of_order_panic() {
        let class = Mutex::new(level::CLASS, "class", 0);
        let shard = Mutex::new(level::SHARD, "shard", 0);
        let leaf = Mutex::new(level::LEAF, "queue", 0);
        let other = Mutex::new(level::LEAF, "other", 0);
        {
            let _c = class.lock();
            let _s = shard.lock();
            let _l = leaf.lock();
        }
        // Released out of order: the thread holds nothing afterwards.
        {
            let c = class.lock();
            let s = shard.lock();
            drop(c);
            drop(s);
        }
        let _s = shard.lock();
        // A try_lock never waits: not checked.
        assert!(class.try_lock().is_some());
        drop(_s);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _s = shard.lock();
            let _c = class.lock();
        }));
        let msg = r.expect_err("shard then class must panic");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("taking `class`") && msg.contains("holding `shard`"),
            "{msg}"
        );
        // Two leaves at once: the deadlock of a hint against the reader (issue 35) had this
        // shape.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _a = leaf.lock();
            let _b = other.lock();
        }));
        assert!(r.is_err(), "two leaf locks at once must panic");
    }

    #[test]
    fn a_condvar_wait_keeps_the_lock_recorded() {
        let m = Mutex::new(level::LEAF, "q", 0u32);
        let cv = Condvar::default();
        let mut g = m.lock();
        let until = Instant::now();
        assert!(cv.wait_until(&mut g, until).timed_out());
        *g += 1;
        drop(g);
        assert_eq!(*m.lock(), 1);
    }
}

//! How a load and the reader meet: the reader fills in the outcome; a load that stops waiting
//! abandons it, and then the reader drops the pins it would have handed over.

use std::time::Instant;

use crate::sync::{level, Condvar, Mutex};

/// One promotion batch's outcome, handed from the reader to the load that waits for it.
pub(crate) struct Ticket {
    state: Mutex<TicketState>,
    cv: Condvar,
}

impl Default for Ticket {
    fn default() -> Self {
        Self {
            state: Mutex::new(level::LEAF, "ticket", TicketState::Pending),
            cv: Condvar::default(),
        }
    }
}

#[derive(Default)]
enum TicketState {
    #[default]
    Pending,
    Done(Vec<bool>),
    Abandoned,
}

impl Ticket {
    /// The outcome (one bool per item: published and pinned for the caller), or `None` if
    /// `until` passed first (the ticket is then abandoned: nothing is pinned for the caller).
    pub(crate) fn wait(&self, until: Instant) -> Option<Vec<bool>> {
        let mut s = self.state.lock();
        loop {
            match std::mem::take(&mut *s) {
                TicketState::Done(v) => return Some(v),
                TicketState::Abandoned => return None,
                TicketState::Pending => {}
            }
            if self.cv.wait_until(&mut s, until).timed_out() {
                if let TicketState::Done(v) = std::mem::take(&mut *s) {
                    return Some(v);
                }
                *s = TicketState::Abandoned;
                return None;
            }
        }
    }

    /// Nobody will wait for it (a preload): the reader drops the pins it would hand over.
    pub(super) fn abandon(&self) {
        *self.state.lock() = TicketState::Abandoned;
    }

    /// Hands the outcome over; false if the load gave up (the caller then owns the pins).
    pub(super) fn complete(&self, outcome: Vec<bool>) -> bool {
        let mut s = self.state.lock();
        match *s {
            TicketState::Pending => {
                *s = TicketState::Done(outcome);
                self.cv.notify_all();
                true
            }
            _ => false,
        }
    }
}

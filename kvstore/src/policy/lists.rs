//! Intrusive doubly linked lists over dense ids: `N` lists share one link table, and an id is
//! in at most one of them. Heads are the most recently inserted end. The half byte that says
//! which list an id is in has 2 bits to spare, which the policy may use ([`Lists::aux`]:
//! S3-FIFO's frequency 0..=3, SIEVE's visited bit), so a block costs 8.5 bytes however the
//! policy counts.

pub(super) const NIL: u32 = u32::MAX;

pub(super) struct Lists<const N: usize> {
    /// `(prev, next)` per id; `prev` points toward the head.
    links: Vec<(u32, u32)>,
    /// Two ids a byte, id `i` in the half at bit `4 * (i % 2)`: bits 0-1 0 in no list,
    /// `l + 1` in list `l`; bits 2-3 the policy's ([`Lists::aux`]).
    tag: Vec<u8>,
    head: [u32; N],
    tail: [u32; N],
    len: [usize; N],
}

impl<const N: usize> Default for Lists<N> {
    fn default() -> Self {
        Self {
            links: Vec::new(),
            tag: Vec::new(),
            head: [NIL; N],
            tail: [NIL; N],
            len: [0; N],
        }
    }
}

/// The tag bits naming the list.
const LIST: u8 = 3;

impl<const N: usize> Lists<N> {
    const FITS: () = assert!(N <= 3, "two tag bits name the list");

    /// Makes room for `id` in the tables.
    pub(super) fn ensure(&mut self, id: u32) {
        let i = id as usize;
        if self.links.len() <= i {
            self.links.resize(i + 1, (NIL, NIL));
            self.tag.resize(i / 2 + 1, 0);
        }
    }

    /// Sizes the tables for ids `0..ids` exactly.
    pub(super) fn reserve(&mut self, ids: usize) {
        super::reserve_total(&mut self.tag, ids.div_ceil(2));
        super::reserve_total(&mut self.links, ids);
    }

    /// The 4 tag bits of `id` (0 for an id never seen).
    fn tag_of(&self, id: u32) -> u8 {
        self.tag
            .get(id as usize / 2)
            .map_or(0, |t| (t >> (4 * (id % 2))) & 15)
    }

    /// Sets the 4 tag bits of `id` (room made for it).
    fn set_tag(&mut self, id: u32, v: u8) {
        let shift = 4 * (id % 2);
        let t = &mut self.tag[id as usize / 2];
        *t = (*t & !(15 << shift)) | ((v & 15) << shift);
    }

    /// The list `id` is in.
    pub(super) fn list_of(&self, id: u32) -> Option<usize> {
        #[allow(clippy::let_unit_value)]
        let () = Self::FITS;
        match self.tag_of(id) & LIST {
            0 => None,
            t => Some(t as usize - 1),
        }
    }

    /// The policy's 2 bits of `id` (0 for an id never seen). They stay through moves and
    /// unlinking: the policy resets them when it wants.
    pub(super) fn aux(&self, id: u32) -> u8 {
        self.tag_of(id) >> 2
    }

    /// Sets the policy's bits of `id` (`v` < 4).
    pub(super) fn set_aux(&mut self, id: u32, v: u8) {
        debug_assert!(v < 4);
        self.ensure(id);
        let t = self.tag_of(id);
        self.set_tag(id, (t & LIST) | (v << 2));
    }

    /// Ids the tables have room for.
    #[cfg(test)]
    pub(super) fn ids(&self) -> usize {
        self.links.len()
    }

    pub(super) fn len(&self, l: usize) -> usize {
        self.len[l]
    }

    pub(super) fn total(&self) -> usize {
        self.len.iter().sum()
    }

    /// The oldest id of list `l`.
    pub(super) fn back(&self, l: usize) -> Option<u32> {
        (self.tail[l] != NIL).then_some(self.tail[l])
    }

    /// The id after `id` toward the head of its list, or [`NIL`].
    pub(super) fn toward_head(&self, id: u32) -> u32 {
        self.links[id as usize].0
    }

    /// Takes `id` out of its list (no-op when it is in none).
    pub(super) fn unlink(&mut self, id: u32) {
        let Some(l) = self.list_of(id) else {
            return;
        };
        let (p, n) = self.links[id as usize];
        if p == NIL {
            self.head[l] = n;
        } else {
            self.links[p as usize].1 = n;
        }
        if n == NIL {
            self.tail[l] = p;
        } else {
            self.links[n as usize].0 = p;
        }
        self.links[id as usize] = (NIL, NIL);
        let t = self.tag_of(id);
        self.set_tag(id, t & !LIST);
        self.len[l] -= 1;
    }

    /// Puts `id` at the head of list `l` (out of any list it was in first).
    pub(super) fn push_front(&mut self, l: usize, id: u32) {
        self.ensure(id);
        self.unlink(id);
        let old = self.head[l];
        self.links[id as usize] = (NIL, old);
        if old == NIL {
            self.tail[l] = id;
        } else {
            self.links[old as usize].0 = id;
        }
        self.head[l] = id;
        let t = self.tag_of(id);
        self.set_tag(id, t | (l as u8 + 1));
        self.len[l] += 1;
    }

    /// Puts `id` at the oldest end of list `l` (out of any list it was in first).
    pub(super) fn push_back(&mut self, l: usize, id: u32) {
        self.ensure(id);
        self.unlink(id);
        let old = self.tail[l];
        self.links[id as usize] = (old, NIL);
        if old == NIL {
            self.head[l] = id;
        } else {
            self.links[old as usize].1 = id;
        }
        self.tail[l] = id;
        let t = self.tag_of(id);
        self.set_tag(id, t | (l as u8 + 1));
        self.len[l] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_keep_order_and_lengths() {
        let mut x: Lists<2> = Lists::default();
        for i in 0..5u32 {
            x.push_front(i as usize % 2, i);
        }
        assert_eq!((x.len(0), x.len(1), x.total()), (3, 2, 5));
        assert_eq!(x.back(0), Some(0));
        assert_eq!(x.toward_head(0), 2);
        x.push_front(1, 0);
        assert_eq!((x.len(0), x.len(1)), (2, 3));
        assert_eq!(x.back(0), Some(2));
        x.unlink(2);
        x.unlink(2);
        assert_eq!(x.back(0), Some(4));
        assert_eq!(x.list_of(2), None);
        assert_eq!(x.list_of(0), Some(1));
        x.unlink(4);
        assert_eq!(x.back(0), None);
        assert_eq!(x.total(), 3);
        // The oldest end: 3 goes behind 1's list (3 was its head), then walks to the head.
        x.push_back(1, 3);
        assert_eq!((x.back(1), x.len(1)), (Some(3), 3));
        let mut order = vec![3];
        let mut cur = x.toward_head(3);
        while cur != NIL {
            order.push(cur);
            cur = x.toward_head(cur);
        }
        assert_eq!(order, vec![3, 1, 0]);
        x.push_back(0, 5);
        assert_eq!((x.back(0), x.len(0), x.list_of(5)), (Some(5), 1, Some(0)));
        x.unlink(5);
        assert_eq!(x.back(0), None);
        // The spare bits ride along through moves and unlinking, apart from the list's, and
        // apart from the other id in the same byte (0 shares 1's).
        x.set_aux(1, 3);
        x.push_front(0, 1);
        assert_eq!((x.aux(1), x.list_of(1)), (3, Some(0)));
        assert_eq!((x.aux(0), x.list_of(0)), (0, Some(1)));
        x.unlink(1);
        assert_eq!((x.aux(1), x.list_of(1)), (3, None));
        x.set_aux(0, 2);
        x.set_aux(1, 1);
        assert_eq!((x.aux(0), x.list_of(0), x.aux(1)), (2, Some(1), 1));
        assert_eq!((x.aux(1), x.aux(1000)), (1, 0));
    }
}

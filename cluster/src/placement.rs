//! Placement without a master: each block's owners are the members with the highest
//! rendezvous (highest-random-weight) scores for its key, weighted by advertised capacity.
//! Every node and every engine computes the same owners from the same member list; a
//! membership change moves only the blocks whose owner joined or left.

use kvstore::BlockKey;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// One member of the cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// Its data-plane address, as every member names it (`host:port`).
    pub addr: String,
    /// Its weight (advertised capacity; any positive scale).
    pub weight: f64,
    seed: u64,
}

impl Member {
    /// A member; a weight that is not positive and finite counts as 1.
    pub fn new(addr: impl Into<String>, weight: f64) -> Self {
        let addr = addr.into();
        let seed = xxh3_64(addr.as_bytes());
        let weight = if weight.is_finite() && weight > 0.0 {
            weight
        } else {
            1.0
        };
        Self { addr, weight, seed }
    }

    /// Its score for `key`: `-w / ln(u)`, `u` uniform in (0, 1) from a hash of the member
    /// and the key (weighted rendezvous hashing: a member's share of keys is its weight's
    /// share of the total).
    pub fn score(&self, key: &BlockKey) -> f64 {
        let h = xxh3_64_with_seed(&key.0.to_be_bytes(), self.seed);
        // 53 random bits, never 0 or 1.
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        -self.weight / u.ln()
    }
}

/// The members, and the owners of any key among them.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    members: Vec<Member>,
}

impl Placement {
    /// A placement over `members` (sorted by address, duplicates dropped).
    pub fn new(mut members: Vec<Member>) -> Self {
        members.sort_by(|a, b| a.addr.cmp(&b.addr));
        members.dedup_by(|a, b| a.addr == b.addr);
        Self { members }
    }

    /// The members, by address.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The `r` owners of `key`, best first (indices into [`Placement::members`]).
    pub fn owners(&self, key: &BlockKey, r: usize) -> Vec<usize> {
        let mut s: Vec<(f64, usize)> = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| (m.score(key), i))
            .collect();
        s.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        s.into_iter().take(r.max(1)).map(|(_, i)| i).collect()
    }

    /// The first owner's address.
    pub fn owner(&self, key: &BlockKey) -> Option<&str> {
        self.owners(key, 1)
            .first()
            .map(|&i| self.members[i].addr.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u128) -> Vec<BlockKey> {
        (0..n)
            .map(|i| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) ^ 77))
            .collect()
    }

    fn nodes(n: usize) -> Vec<Member> {
        (0..n)
            .map(|i| Member::new(format!("10.0.0.{i}:7070"), 1.0))
            .collect()
    }

    #[test]
    fn owners_spread_evenly_and_agree_whatever_the_member_order() {
        let p = Placement::new(nodes(4));
        let mut rev = nodes(4);
        rev.reverse();
        let q = Placement::new(rev);
        let mut count = [0usize; 4];
        for k in keys(40_000) {
            assert_eq!(p.owner(&k), q.owner(&k));
            count[p.owners(&k, 1)[0]] += 1;
        }
        for c in count {
            assert!((9_000..11_000).contains(&c), "{count:?}");
        }
    }

    #[test]
    fn a_member_leaving_moves_only_its_own_blocks_and_joining_takes_a_fair_share() {
        let before = Placement::new(nodes(5));
        let after = Placement::new(nodes(4)); // 10.0.0.4 left
        let ks = keys(20_000);
        let mut moved = 0;
        for k in &ks {
            let (a, b) = (before.owner(k).unwrap(), after.owner(k).unwrap());
            if a != b {
                assert_eq!(a, "10.0.0.4:7070", "only the leaver's blocks move");
                moved += 1;
            }
        }
        // It held about a fifth.
        assert!((3_400..4_600).contains(&moved), "{moved}");
    }

    #[test]
    fn weights_set_the_shares() {
        let p = Placement::new(vec![Member::new("a:1", 1.0), Member::new("b:1", 3.0)]);
        let b = keys(40_000)
            .iter()
            .filter(|k| p.owner(k) == Some("b:1"))
            .count();
        assert!((29_000..31_000).contains(&b), "{b}");
    }

    #[test]
    fn replicas_are_distinct_and_the_first_is_the_owner() {
        let p = Placement::new(nodes(5));
        for k in keys(1000) {
            let o = p.owners(&k, 3);
            assert_eq!(o.len(), 3);
            assert_eq!(p.members()[o[0]].addr, p.owner(&k).unwrap());
            assert!(o[0] != o[1] && o[1] != o[2] && o[0] != o[2]);
        }
        assert_eq!(p.owners(&keys(1)[0], 9).len(), 5);
    }
}

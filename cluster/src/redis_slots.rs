//! A Redis Cluster's key slots, for the Redis tier's own routing: which master serves a key
//! (`CRC16(key) mod 16384`, hash tags included), the slot table read from `CLUSTER SLOTS`,
//! and the redirections (`MOVED`, `ASK`) a node answers with when the table is stale.
//! (Routing here rather than through the `redis` crate's cluster connection lets every call
//! run within one deadline, as a standalone server's do: the crate's timeout bounds each
//! socket read only.)

use std::io::{self, BufRead, Read};

/// Key slots in a Redis Cluster.
pub(crate) const SLOTS: u16 = 16384;

/// CRC16-XMODEM (polynomial 0x1021, initial 0), as Redis computes it for key slots.
fn crc16(data: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of `key`: of its hash tag (the bytes between its first `{` and the first `}`
/// after it) when that is not empty, else of the whole key.
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS
}

/// A redirection a node answered a command with.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Redirect {
    /// `MOVED slot host:port`: the slot lives there now (the table is stale).
    Moved(u16, String),
    /// `ASK slot host:port`: the slot is being migrated; ask there once, after `ASKING`.
    Ask(u16, String),
}

/// The redirection in an error reply's text (`MOVED 3999 127.0.0.1:6381`), if it is one.
pub(crate) fn redirect(text: &str) -> Option<Redirect> {
    let mut parts = text.split(' ');
    let kind = parts.next()?;
    let slot: u16 = parts.next()?.parse().ok().filter(|&s| s < SLOTS)?;
    let addr = parts.next().filter(|a| !a.is_empty())?.to_string();
    if parts.next().is_some() {
        return None;
    }
    match kind {
        "MOVED" => Some(Redirect::Moved(slot, addr)),
        "ASK" => Some(Redirect::Ask(slot, addr)),
        _ => None,
    }
}

/// The masters' addresses by slot range: what `CLUSTER SLOTS` said, sorted by first slot.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct SlotTable(Vec<(u16, u16, String)>);

impl SlotTable {
    /// The address of the master serving `slot`, if the table covers it.
    pub(crate) fn addr(&self, slot: u16) -> Option<&str> {
        let i = self.0.partition_point(|r| r.1 < slot);
        self.0.get(i).filter(|r| r.0 <= slot).map(|r| r.2.as_str())
    }

    /// `slot` moved to `addr` (a `MOVED` reply): the rest of the table stands until it is
    /// read again.
    pub(crate) fn moved(&mut self, slot: u16, addr: &str) {
        let mut out = Vec::with_capacity(self.0.len() + 2);
        for (a, b, at) in self.0.drain(..) {
            if a <= slot && slot <= b {
                if a < slot {
                    out.push((a, slot - 1, at.clone()));
                }
                if slot < b {
                    out.push((slot + 1, b, at));
                }
            } else {
                out.push((a, b, at));
            }
        }
        out.push((slot, slot, addr.to_string()));
        out.sort_unstable_by_key(|r| r.0);
        self.0 = out;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every master named, once each.
    pub(crate) fn addrs(&self) -> Vec<String> {
        let mut v: Vec<String> = self.0.iter().map(|r| r.2.clone()).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The table in a `CLUSTER SLOTS` reply, read from `rd`, asked of the node at `host`
    /// (which a master named by an empty address is: Redis's "the node you asked").
    pub(crate) fn read(rd: &mut impl BufRead, host: &str) -> io::Result<Self> {
        let mut budget = MAX_REPLY;
        let Resp::Array(ranges) = read_resp(rd, 0, &mut budget)? else {
            return Err(bad("CLUSTER SLOTS did not answer an array"));
        };
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let Resp::Array(r) = r else {
                return Err(bad("a CLUSTER SLOTS range is not an array"));
            };
            let (Some(Resp::Int(a)), Some(Resp::Int(b)), Some(Resp::Array(master))) =
                (r.first(), r.get(1), r.get(2))
            else {
                return Err(bad("a CLUSTER SLOTS range without its slots and master"));
            };
            let (Ok(a), Ok(b)) = (u16::try_from(*a), u16::try_from(*b)) else {
                return Err(bad(format!("slots {a}..{b}")));
            };
            if a > b || b >= SLOTS {
                return Err(bad(format!("slots {a}..{b}")));
            }
            // An endpoint that is empty or null (`cluster-preferred-endpoint-type
            // unknown-endpoint`) is the node asked's; `?` (a hostname preferred, none set) is
            // no address at all.
            let ip = match (master.first(), master.get(1)) {
                (Some(Resp::Bulk(ip)), Some(Resp::Int(_))) if ip.as_slice() == b"?" => {
                    return Err(bad("a CLUSTER SLOTS master with no known address (\"?\")"));
                }
                (Some(Resp::Bulk(ip)), Some(Resp::Int(_))) if !ip.is_empty() => {
                    String::from_utf8_lossy(ip).into_owned()
                }
                (Some(Resp::Bulk(_) | Resp::Nil), Some(Resp::Int(_))) => host.to_string(),
                _ => return Err(bad("a CLUSTER SLOTS master without its address")),
            };
            let Some(Resp::Int(port)) = master.get(1) else {
                unreachable!("matched above");
            };
            let port = u16::try_from(*port).map_err(|_| bad(format!("port {port}")))?;
            let addr = if ip.contains(':') {
                format!("[{ip}]:{port}")
            } else {
                format!("{ip}:{port}")
            };
            out.push((a, b, addr));
        }
        out.sort_unstable_by_key(|r| r.0);
        if out.windows(2).any(|w| w[0].1 >= w[1].0) {
            return Err(bad("CLUSTER SLOTS ranges overlap"));
        }
        Ok(SlotTable(out))
    }
}

/// The most bytes of a `CLUSTER SLOTS` reply read (a cluster of hundreds of nodes needs a
/// few tens of KiB).
const MAX_REPLY: usize = 4 << 20;
/// The deepest nesting read (the reply is three arrays deep, four with Redis 7's metadata).
const MAX_DEPTH: usize = 4;
const MAX_LINE: u64 = 4096;

fn bad(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("redis: {what}"))
}

/// A RESP2 reply, as `CLUSTER SLOTS` answers.
#[derive(Debug)]
enum Resp {
    Simple,
    Int(i64),
    Bulk(Vec<u8>),
    Nil,
    Array(Vec<Resp>),
}

/// Reads one reply, at most `budget` bytes of it (and of the replies read before it).
fn read_resp(rd: &mut impl BufRead, depth: usize, budget: &mut usize) -> io::Result<Resp> {
    let mut line = Vec::with_capacity(32);
    rd.take(MAX_LINE).read_until(b'\n', &mut line)?;
    *budget = budget
        .checked_sub(line.len())
        .ok_or_else(|| bad("a CLUSTER SLOTS reply too large"))?;
    let Some((&kind, rest)) = line.strip_suffix(b"\r\n").and_then(|b| b.split_first()) else {
        return Err(bad("a reply line cut short or empty"));
    };
    let text = String::from_utf8_lossy(rest);
    let int = || {
        text.parse::<i64>()
            .map_err(|_| bad(format!("a number {text:?}")))
    };
    match kind {
        b'+' => Ok(Resp::Simple),
        b'-' => Err(io::Error::other(format!("redis: {text}"))),
        b':' => Ok(Resp::Int(int()?)),
        b'$' => {
            let n = int()?;
            if n == -1 {
                return Ok(Resp::Nil);
            }
            let n = usize::try_from(n).map_err(|_| bad(format!("a value of length {n}")))?;
            *budget = budget
                .checked_sub(n + 2)
                .ok_or_else(|| bad("a CLUSTER SLOTS reply too large"))?;
            let mut v = vec![0u8; n + 2];
            rd.read_exact(&mut v)?;
            if !v.ends_with(b"\r\n") {
                return Err(bad("a value cut short"));
            }
            v.truncate(n);
            Ok(Resp::Bulk(v))
        }
        b'*' => {
            let n = int()?;
            if n == -1 {
                return Ok(Resp::Nil);
            }
            if depth == MAX_DEPTH {
                return Err(bad("a reply nested too deep"));
            }
            let n = usize::try_from(n).map_err(|_| bad(format!("an array of {n}")))?;
            // Each element takes at least 3 bytes: a longer array cannot fit the budget.
            if n > *budget / 3 {
                return Err(bad("a CLUSTER SLOTS reply too large"));
            }
            // Grown as elements arrive: a header alone reserves little.
            let mut v = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                v.push(read_resp(rd, depth + 1, budget)?);
            }
            Ok(Resp::Array(v))
        }
        k => Err(bad(format!("a reply of type {:?}", k as char))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_slots() {
        // The CRC's check value (CRC-16/XMODEM)…
        assert_eq!(crc16(b"123456789"), 0x31C3);
        // …and what Redis 7.0.15's `CLUSTER KEYSLOT` answered for these keys.
        for (key, want) in [
            (&b"foo"[..], 12182),
            (b"123456789", 12739),
            (b"{user1000}.following", 3443),
            (b"foo{}{bar}", 8363),
            (b"foo{{bar}}zap", 4015),
            (b"foo{bar}{zap}", 5061),
            (b"kvtier:0123456789abcdef0123456789abcdef", 5796),
            (b"kvtier:ffffffffffffffffffffffffffffffff", 9763),
            (b"", 0),
            (b"a", 15495),
        ] {
            assert_eq!(slot(key), want, "{}", String::from_utf8_lossy(key));
        }
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
        assert_eq!(slot(b"foo{bar}{zap}"), slot(b"bar"));
    }

    #[test]
    fn redirections_are_read_and_other_errors_are_not() {
        assert_eq!(
            redirect("MOVED 3999 127.0.0.1:6381"),
            Some(Redirect::Moved(3999, "127.0.0.1:6381".into()))
        );
        assert_eq!(
            redirect("ASK 3999 [::1]:6381"),
            Some(Redirect::Ask(3999, "[::1]:6381".into()))
        );
        for other in [
            "ERR unknown command",
            "MOVED 16384 h:1",
            "MOVED x h:1",
            "MOVED 1",
            "MOVED 1 h:1 more",
            "CLUSTERDOWN The cluster is down",
        ] {
            assert_eq!(redirect(other), None, "{other}");
        }
    }

    fn table(reply: &[u8]) -> io::Result<SlotTable> {
        SlotTable::read(&mut &reply[..], "10.0.0.9")
    }

    #[test]
    fn a_slot_table_is_read_from_cluster_slots() {
        // Two ranges (out of order), a replica, Redis 7's node id and metadata, and a master
        // that names no address (the node asked).
        let reply = b"*2\r\n\
            *4\r\n:5461\r\n:16383\r\n\
            *4\r\n$0\r\n\r\n:7001\r\n$2\r\nid\r\n*0\r\n\
            *3\r\n$9\r\n127.0.0.1\r\n:7004\r\n$2\r\nid\r\n\
            *3\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n";
        let t = table(reply).unwrap();
        assert_eq!(t.addr(0), Some("127.0.0.1:7000"));
        assert_eq!(t.addr(5460), Some("127.0.0.1:7000"));
        assert_eq!(t.addr(5461), Some("10.0.0.9:7001"));
        assert_eq!(t.addr(16383), Some("10.0.0.9:7001"));
        assert_eq!(t.addrs(), ["10.0.0.9:7001", "127.0.0.1:7000"]);
        let mut m = t.clone();
        m.moved(5461, "127.0.0.1:7002");
        assert_eq!(m.addr(5461), Some("127.0.0.1:7002"));
        assert_eq!(m.addr(5462), Some("10.0.0.9:7001"));
        assert_eq!(m.addr(5460), Some("127.0.0.1:7000"));
        // A null endpoint is the node asked's too.
        let t = table(b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$-1\r\n:7005\r\n").unwrap();
        assert_eq!(t.addr(77), Some("10.0.0.9:7005"));
        // An uncovered slot has no master.
        let t = table(b"*1\r\n*3\r\n:10\r\n:20\r\n*2\r\n$1\r\nh\r\n:1\r\n").unwrap();
        assert_eq!(
            (t.addr(9), t.addr(10), t.addr(21)),
            (None, Some("h:1"), None)
        );
    }

    #[test]
    fn bad_slot_tables_are_named() {
        for (reply, says) in [
            (&b"-ERR This instance has cluster support disabled\r\n"[..], "disabled"),
            (b"+OK\r\n", "not answer an array"),
            (b"*1\r\n:1\r\n", "not an array"),
            (b"*1\r\n*2\r\n:0\r\n:1\r\n", "without its slots"),
            (b"*1\r\n*3\r\n:5\r\n:1\r\n*2\r\n$1\r\nh\r\n:1\r\n", "slots 5..1"),
            (b"*1\r\n*3\r\n:0\r\n:16384\r\n*2\r\n$1\r\nh\r\n:1\r\n", "slots 0..16384"),
            (b"*1\r\n*3\r\n:0\r\n:1\r\n*2\r\n$1\r\nh\r\n:70000\r\n", "port 70000"),
            (b"*1\r\n*3\r\n:0\r\n:1\r\n*2\r\n$1\r\n?\r\n:1\r\n", "no known address"),
            (
                b"*2\r\n*3\r\n:0\r\n:9\r\n*2\r\n$1\r\nh\r\n:1\r\n*3\r\n:9\r\n:10\r\n*2\r\n$1\r\nh\r\n:2\r\n",
                "overlap",
            ),
            (b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", "too deep"),
            (b"*999999999\r\n", "too large"),
            (b"*1\r\n$5\r\nab", "failed to fill"),
        ] {
            let e = table(reply).unwrap_err();
            assert!(e.to_string().contains(says), "{e} (wanted {says:?})");
        }
    }
}

//! kvtier's remote tier: kvtierd nodes pool their blocks across a cluster.
//!
//! - [`membership`]: members registered in etcd under a lease, watched (or a static list).
//! - [`placement`]: each block's owner among the members, by weighted rendezvous hashing.
//! - [`wire`]: the data plane's framing (`proto/proto/cluster.proto`) and authentication.
//! - [`server`]: answers peers from this node's own tiers (tokio).
//! - [`remote`]: [`RemoteTier`], the store's `LowerTier` that asks the owners (blocking
//!   sockets, deadlines, circuit breakers).
//! - [`handoff`]: a clean stop hands the node's host blocks to their next owners.
//!
//! The daemon wires them: the store gets the remote tier last in its chain
//! (`StoreConfig::remote`), and the server runs beside the engine socket.

mod deadline;
#[cfg(test)]
mod fuzz_tests;
pub mod handoff;
pub mod membership;
mod nsmap;
pub mod placement;
mod redis_slots;
pub mod redis_tier;
pub mod remote;
pub mod server;
pub mod wire;

pub use handoff::{hand_over, HandOver};
pub use membership::{leave, run_etcd, EtcdConfig, MembershipState};
pub use placement::{Member, Placement};
pub use redis_tier::{RedisConfig, RedisTier};
pub use remote::{NodePrefix, PeerStatus, RemoteConfig, RemoteTier};
pub use server::{serve, ServerConfig, ServerStats};

/// Whether `addr` (`host:port`) is a loopback address: the only place a data plane without a
/// cluster secret may listen.
pub fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    match addr.to_socket_addrs() {
        Ok(mut a) => a.all(|a| a.ip().is_loopback()),
        Err(_) => false,
    }
}

//! `kvtier-bench`: kvtier's benchmark harness. Every subcommand measures its baseline in the same
//! run and, with `--json`, prints one JSON object as its last line:
//! `{"bench": NAME, "results": [{"case", "unit", "value", "baseline", "ratio"}, ...]}`.

mod alloc_count;
mod cluster_sim;
mod connector;
mod disk;
mod events;
mod host;
mod ipc;
mod peers;
mod plot;
mod remote;
mod replay;
mod report;
mod rng;
mod sidecar;
mod sim;
mod soak;
mod trace;
mod tracegen;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

#[derive(Parser)]
#[command(
    name = "kvtier-bench",
    version,
    about = "kvtier benchmarks, each against its baseline"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Host tier: put/get vs memcpy, match_prefix vs a hash-set probe, metadata bytes per block.
    Host(host::HostArgs),
    /// Disk tier: sequential block writes/reads vs fio, and a long prefix load vs fio's bound.
    Disk(disk::DiskArgs),
    /// Trace replay through the store, and every policy against Belady's optimum.
    Replay(Box<replay::ReplayArgs>),
    /// The same put/get workload against kvtier, Redis and Mooncake Store on this machine.
    Peers(peers::PeersArgs),
    /// kvtierd's KV event publisher: puts with events vs without, events/s delivered.
    Events(events::EventsArgs),
    /// Through the kvtierd sidecar vs embedded: lookup+lease latency, put/get bandwidth.
    Ipc(ipc::IpcArgs),
    /// The remote tier between two nodes on loopback vs iperf3 and Redis; lookup latency vs RTT.
    Remote(remote::RemoteArgs),
    /// The remote tier's placement at 8 to 512 nodes, simulated: hits under churn, load skew,
    /// keys and bytes moved per membership change.
    ClusterSim(cluster_sim::ClusterSimArgs),
    /// Save/load of a long prefix through the connector's CPU path vs memcpy, embedded and kvtierd.
    Connector(connector::ConnectorArgs),
    /// Engine processes against kvtierd for minutes, the daemon killed and restarted at random:
    /// wrong bytes served, lost acknowledged durable blocks, RSS drift.
    Soak(soak::SoakArgs),
    /// Writes a synthetic trace (chat, agent, docqa) in the Mooncake format.
    Tracegen(tracegen::TracegenArgs),
    /// One engine process of `soak` (started by it).
    #[command(hide = true)]
    SoakEngine(soak::EngineArgs),
}

/// Parses `123`, `256K`, `2M`, `1G` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let Ok(n) = num.parse::<u64>() else {
        bail!("{s:?} is not a size: use a number with an optional K, M or G suffix");
    };
    match n.checked_mul(mult) {
        Some(v) if v > 0 => Ok(v),
        _ => bail!("{s:?} is not a positive size that fits in 64 bits"),
    }
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Host(a) => host::run(a),
        Cmd::Disk(a) => disk::run(a),
        Cmd::Replay(a) => replay::run(*a),
        Cmd::Peers(a) => peers::run(a),
        Cmd::Remote(a) => remote::run(a),
        Cmd::ClusterSim(a) => cluster_sim::run(a),
        Cmd::Ipc(a) => ipc::run(a),
        Cmd::Events(a) => events::run(a),
        Cmd::Connector(a) => connector::run(a),
        Cmd::Soak(a) => soak::run(a),
        Cmd::SoakEngine(a) => soak::run_engine(a),
        Cmd::Tracegen(a) => tracegen::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256K").unwrap(), 256 << 10);
        assert_eq!(parse_size("2M").unwrap(), 2 << 20);
        assert_eq!(parse_size("7").unwrap(), 7);
        assert!(parse_size("x").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}

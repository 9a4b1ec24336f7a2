//! Fuzz target of the data plane (`kvtier-fuzz`, target `cluster-frames`): a peer that
//! authenticated sends any frames and raw bytes (headers of any length and content, payloads
//! short, long or missing) over a real loopback socket; the connection handler answers or
//! closes, never panics and never hangs (a payload that stops coming ends at the deadline),
//! and the store stays consistent and keeps serving.

use std::sync::Arc;
use std::time::Duration;

use kvstore::{Store, StoreConfig};
use kvtier_proto::cluster::{Auth, AuthReply, Hello, Reply, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::server::{connection, ServerConfig, ServerStats, SettingUp};
use crate::wire;

/// A fuzz input as pieces: `[kind u8][u16 little-endian length][body]` (a length past the end
/// takes what is left); an even kind is sent as a frame (its u32 length first), an odd one as
/// raw bytes (a payload, or a length prefix of the input's choosing).
fn pieces(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 3 <= bytes.len() {
        let kind = bytes[at];
        let n = u16::from_le_bytes([bytes[at + 1], bytes[at + 2]]) as usize;
        at += 3;
        let end = (at + n).min(bytes.len());
        if kind.is_multiple_of(2) {
            out.extend_from_slice(&((end - at) as u32).to_le_bytes());
        }
        out.extend_from_slice(&bytes[at..end]);
        at = end;
    }
    out
}

async fn peer(addr: std::net::SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.unwrap();
    let hello: Hello = wire::read_header_async(&mut c, wire::MAX_HEADER)
        .await
        .unwrap();
    let auth = Auth {
        version: hello.version,
        mac: wire::mac("fuzz", &hello.nonce),
        node: "fuzz".into(),
    };
    wire::write_header_async(&mut c, &auth).await.unwrap();
    let r: AuthReply = wire::read_header_async(&mut c, wire::MAX_HEADER)
        .await
        .unwrap();
    assert!(r.error.is_empty());
    c
}

/// Serves the next connection `listener` accepts, on a task of its own.
fn serve_next(
    listener: &Arc<TcpListener>,
    setting_up: &Arc<SettingUp>,
    cfg: &Arc<ServerConfig>,
    stats: &Arc<ServerStats>,
    store: &'static Store,
) -> tokio::task::JoinHandle<()> {
    let (l, su, cfg, stats) = (
        listener.clone(),
        setting_up.clone(),
        cfg.clone(),
        stats.clone(),
    );
    tokio::spawn(async move {
        let (sock, from) = l.accept().await.unwrap();
        let permit = su.enter(from.ip()).unwrap();
        let _ = connection(sock, store, &cfg, &stats, permit).await;
    })
}

#[test]
fn fuzz_cluster_frames() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store: &'static Store = Box::leak(Box::new(
        StoreConfig {
            capacity_bytes: 8 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![64 << 10, 256 << 10],
            shards: 4,
            populate: kvstore::Populate::Lazy,
            wait: Duration::from_millis(20),
            ..Default::default()
        }
        .build()
        .unwrap(),
    ));
    let cfg = Arc::new(ServerConfig {
        node: "fuzz".into(),
        secret: "fuzz".into(),
        capacity: store.capacity_bytes(),
        timeout: Duration::from_millis(200),
    });
    let stats = Arc::new(ServerStats::default());
    let setting_up = Arc::new(SettingUp::default());
    let listener = Arc::new(rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap());
    let addr = listener.local_addr().unwrap();
    let serve_one = |input: Vec<u8>| {
        rt.block_on(async {
            let server = serve_next(&listener, &setting_up, &cfg, &stats, store);
            let client = peer(addr).await;
            let (mut rd, mut wr) = client.into_split();
            let writer = tokio::spawn(async move {
                let _ = wr.write_all(&input).await;
                let _ = wr.shutdown().await;
            });
            // Replies are read meanwhile; the handler must end: it closes once the input
            // ends, or at its deadline on a frame or payload that stopped coming.
            let mut sink = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(30), rd.read_to_end(&mut sink));
            assert!(read.await.is_ok(), "the data plane hung on an input");
            let _ = writer.await;
            server.await.expect("the connection handler panicked");
        })
    };
    kvtier_fuzz::run("cluster-frames", |bytes| serve_one(pieces(bytes)));
    // Whatever came in: the store is consistent, no reservation was left behind, and a peer
    // is still answered.
    let s = store.stats();
    assert!(s.used_bytes <= s.capacity_bytes);
    let keys = [kvstore::BlockKey(7)];
    let exists = Request {
        id: 9,
        op: kvtier_proto::cluster::request::Op::Exists as i32,
        keys: wire::pack_keys(&keys),
        blocks: Vec::new(),
    };
    let mut input = wire::encode_header(&exists);
    input.extend(wire::encode_header(&exists));
    rt.block_on(async {
        let _server = serve_next(&listener, &setting_up, &cfg, &stats, store);
        let mut client = peer(addr).await;
        client.write_all(&input).await.unwrap();
        let r: Reply = wire::read_header_async(&mut client, wire::MAX_HEADER)
            .await
            .unwrap();
        assert_eq!(r.id, 9);
        assert_eq!(r.blocks.len(), 1);
    });
}

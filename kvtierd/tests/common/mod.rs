//! Shared helpers of the daemon tests: a real `kvtierd` on a temporary directory and ports.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvstore::{fill_pattern, BlockKey, Namespace, NsId, TpShard};
use kvtier_ipc::{IpcClient, SlotStatus};

pub struct Kvtierd {
    pub child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub grpc: String,
    pub metrics: String,
}

impl Kvtierd {
    pub fn start(name: &str, extra: &[&str], fresh: bool) -> Self {
        Self::start_with(name, extra, fresh, Stdio::inherit())
    }

    /// Like `start`, with the daemon's stderr going to `stderr`.
    pub fn start_with(name: &str, extra: &[&str], fresh: bool, stderr: Stdio) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("kvtierd-{name}-{}", std::process::id()));
        if fresh {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvtierd"))
            .arg("--data-dir")
            .arg(&dir)
            .args([
                "--host-capacity",
                "64M",
                "--disk-capacity",
                "128M",
                "--grpc",
                "127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
            ])
            .args(["--set", "host.segment=4M", "--set", "log=warn"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("kvtierd ready:"),
            "unexpected first line: {line:?}"
        );
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap()
                .to_string()
        };
        Self {
            socket: PathBuf::from(field("socket")),
            grpc: field("grpc"),
            metrics: field("metrics"),
            child,
            dir,
        }
    }

    pub fn client(&self) -> IpcClient {
        IpcClient::connect(&self.socket, "test").unwrap()
    }

    /// SIGTERM and wait; the data directory stays (a restart reuses it), so a test that does not
    /// restart removes it.
    pub fn term(mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let s = self.child.wait().unwrap();
        std::mem::forget(self);
        s
    }
}

impl Drop for Kvtierd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn namespace() -> Namespace {
    Namespace {
        model: "test/model".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

pub fn key(i: u64) -> BlockKey {
    BlockKey((u128::from(i) + 3).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

pub fn data(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; 100_000 + i as usize * 17];
    fill_pattern(&mut v, i);
    v
}

pub fn put_all(c: &mut IpcClient, ns: NsId, ids: std::ops::Range<u64>) {
    let keys: Vec<BlockKey> = ids.clone().map(key).collect();
    let lens: Vec<u32> = ids.clone().map(|i| data(i).len() as u32).collect();
    let slots = c.reserve(ns, &keys, &lens).unwrap();
    let mut tokens = Vec::new();
    for (i, s) in ids.zip(slots) {
        let SlotStatus::Slot { token, .. } = s else {
            panic!("no slot for {i}: {s:?}")
        };
        c.write(token, &data(i)).unwrap();
        tokens.push(token);
    }
    assert_eq!(c.commit(&tokens).unwrap().committed as usize, tokens.len());
}

pub fn get_all(c: &mut IpcClient, ids: std::ops::Range<u64>) -> usize {
    get_all_waiting(c, ids, None)
}

/// `get_all` with the load's own wait for blocks in flight (`None`: the daemon's default).
pub fn get_all_waiting(
    c: &mut IpcClient,
    ids: std::ops::Range<u64>,
    wait: Option<Duration>,
) -> usize {
    let keys: Vec<BlockKey> = ids.clone().map(key).collect();
    let loaded = c.load(&keys, Duration::from_secs(10), wait).unwrap();
    for (j, (i, b)) in ids.zip(&loaded.blocks).enumerate() {
        let mut buf = vec![0u8; b.len as usize];
        c.read(&loaded, j, &mut buf).unwrap();
        assert!(buf == data(i), "block {i}: wrong bytes through the arena");
    }
    if let Some(l) = loaded.lease {
        c.release(l).unwrap();
    }
    loaded.n
}

pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

pub fn read_reply(s: &mut UnixStream) -> String {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    use prost::Message;
    kvtier_proto::ipc::Response::decode(&body[..])
        .unwrap()
        .error
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Hello by hand, keeping the arena fd a well-behaved client would only map.
pub fn raw_hello(socket: &std::path::Path) -> (UnixStream, std::os::fd::OwnedFd) {
    raw_hello_as(socket, "")
}

/// Like `raw_hello`, presenting a tenant secret.
pub fn raw_hello_as(socket: &std::path::Path, secret: &str) -> (UnixStream, std::os::fd::OwnedFd) {
    use prost::Message;
    let s = UnixStream::connect(socket).unwrap();
    let hello = kvtier_proto::ipc::Request {
        id: 1,
        body: Some(kvtier_proto::ipc::request::Body::Hello(
            kvtier_proto::ipc::Hello {
                version: kvtier_proto::IPC_VERSION,
                client: "hostile".into(),
                tenant_secret: secret.into(),
            },
        )),
    };
    (&s).write_all(&frame(&hello.encode_to_vec())).unwrap();
    let mut buf = vec![0u8; 4096];
    let (n, fd) = kvtier_ipc::recv_with_fd(&s, &mut buf).unwrap();
    assert!(n > 4);
    (s, fd.expect("hello reply carries the arena fd"))
}

/// The daemon's resident memory, bytes.
pub fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Sends a raw frame and reads the reply's error text (empty if none).
pub fn raw_call(
    s: &mut UnixStream,
    req: &kvtier_proto::ipc::Request,
) -> kvtier_proto::ipc::Response {
    use prost::Message;
    s.write_all(&frame(&req.encode_to_vec())).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    kvtier_proto::ipc::Response::decode(&body[..]).unwrap()
}

/// A GET of /metrics with deadlines on every socket operation.
pub fn metrics(addr: &str) -> String {
    let deadline = Some(Duration::from_secs(30));
    let mut s = std::net::TcpStream::connect(addr).expect("metrics connect");
    s.set_read_timeout(deadline).unwrap();
    s.set_write_timeout(deadline).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .expect("metrics write");
    let mut out = String::new();
    s.read_to_string(&mut out)
        .expect("metrics answered in time");
    out
}

/// The value of the sample named exactly `sample` (with its labels) in /metrics.
pub fn metric(addr: &str, sample: &str) -> f64 {
    let m = metrics(addr);
    m.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {sample} in /metrics:\n{m}"))
}

//! Starts a `kvtierd` for a benchmark and stops it (by pid) when dropped.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{ensure, Context, Result};

/// A running kvtierd.
pub struct Sidecar {
    child: Child,
    dir: PathBuf,
    /// Its engine socket.
    pub socket: PathBuf,
    /// Its admin gRPC address.
    pub grpc: String,
    /// Its ready line (other listeners: `events=`, `metrics=`).
    pub ready: String,
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The kvtierd next to this binary, unless given.
pub fn binary(given: Option<&Path>) -> Result<PathBuf> {
    let bin = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()?.with_file_name("kvtierd"),
    };
    ensure!(
        bin.exists(),
        "{} not found: build it (cargo build --release -p kvtierd) or pass --kvtierd",
        bin.display()
    );
    Ok(bin)
}

impl Sidecar {
    /// Starts `bin` on a fresh `dir` (removed afterwards), loopback ports, with `args`.
    pub fn start(bin: &Path, dir: PathBuf, args: &[String]) -> Result<Self> {
        let _ = std::fs::remove_dir_all(&dir);
        let mut child = Command::new(bin)
            .arg("--data-dir")
            .arg(&dir)
            .args([
                "--grpc",
                "127.0.0.1:0",
                "--metrics",
                "127.0.0.1:0",
                "--set",
                "log=warn",
            ])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        // Wait for the ready line, but not forever.
        let out = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                anyhow::bail!("kvtierd printed no ready line within 120 s");
            }
        };
        let socket = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("socket="))
            .with_context(|| format!("kvtierd did not start: {line:?}"))?;
        let grpc = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("grpc="))
            .with_context(|| format!("kvtierd's ready line has no grpc= address: {line:?}"))?
            .to_string();
        Ok(Self {
            socket: PathBuf::from(socket),
            grpc,
            ready: line.clone(),
            child,
            dir,
        })
    }

    /// Waits (at most `limit`) until kvtierd's host arena is faulted in: puts before that find
    /// only the populated segments and evict, and the faulting competes for the CPU, so a
    /// measurement must not start earlier.
    pub fn wait_populated(&self, limit: std::time::Duration) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let end = std::time::Instant::now() + limit;
        rt.block_on(async {
            let mut c = kvtier_client::connect(&self.grpc, None).await?;
            loop {
                let h = c
                    .health(kvtier_client::pb::HealthRequest {})
                    .await
                    .map_err(kvtier_client::explain)?
                    .into_inner();
                if h.populated_segments >= h.total_segments {
                    return Ok(());
                }
                anyhow::ensure!(
                    std::time::Instant::now() < end,
                    "kvtierd's host arena: {} of {} segments populated after {limit:?}",
                    h.populated_segments,
                    h.total_segments
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        })
    }
}

//! Client of kvtierd's admin gRPC API: connection with an optional bearer token, and errors
//! that say what to do.

use std::time::Duration;

use kvtier_proto::admin::admin_client::AdminClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

pub use kvtier_proto::admin as pb;

/// Default admin address of a local kvtierd.
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50551";

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct Auth(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// An admin client.
pub type Client = AdminClient<InterceptedService<Channel, Auth>>;

/// Connects to `addr` (`host:port` or a URL), with an optional token.
pub async fn connect(addr: &str, token: Option<&str>) -> anyhow::Result<Client> {
    let url = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let ep = Endpoint::from_shared(url.clone())
        .map_err(|e| anyhow::anyhow!("{addr:?} is not an address: {e}"))?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(30));
    let channel = ep.connect().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach kvtierd at {url}: {} — is it running? (start it with `kvtierd`, or pass --addr)",
            root_cause(&e)
        )
    })?;
    let auth = match token.filter(|t| !t.is_empty()) {
        Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| {
            anyhow::anyhow!("the token contains characters not allowed in a header")
        })?),
        None => None,
    };
    Ok(AdminClient::with_interceptor(channel, Auth(auth)))
}

fn root_cause(e: &dyn std::error::Error) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

/// Turns a gRPC status into an operator-facing error.
pub fn explain(s: Status) -> anyhow::Error {
    match s.code() {
        Code::Unauthenticated => anyhow::anyhow!(
            "kvtierd rejected the call: {} (pass --token or set KVTIER_TOKEN)",
            s.message()
        ),
        Code::Unavailable => anyhow::anyhow!(
            "kvtierd is unavailable: {} (is it running and reachable at --addr?)",
            s.message()
        ),
        _ => anyhow::anyhow!("kvtierd: {} ({:?})", s.message(), s.code()),
    }
}

/// Parses a 32-hex-digit key.
pub fn parse_key(s: &str) -> anyhow::Result<Vec<u8>> {
    let s = s.trim();
    anyhow::ensure!(
        s.len() == 32 && s.chars().all(|c| c.is_ascii_hexdigit()),
        "{s:?} is not a block key: expected 32 hex digits"
    );
    Ok((0..16)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect())
}

/// Formats a key as hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Name of a tier.
pub fn tier_name(t: i32) -> &'static str {
    match pb::Tier::try_from(t) {
        Ok(pb::Tier::Host) => "host",
        Ok(pb::Tier::Disk) => "disk",
        Ok(pb::Tier::Remote) => "remote",
        _ => "?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        let k = parse_key("000102030405060708090a0b0c0d0e0f").unwrap();
        assert_eq!(k, (0u8..16).collect::<Vec<_>>());
        assert_eq!(hex(&k), "000102030405060708090a0b0c0d0e0f");
        assert!(parse_key("00").is_err());
        assert!(parse_key("zz0102030405060708090a0b0c0d0e0f").is_err());
    }
}

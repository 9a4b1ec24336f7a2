//! Block keys and namespaces.
//!
//! A [`BlockKey`] is a 128-bit content address. Every key is derived from a [`Namespace`]
//! fingerprint, so equal tokens under different models, dtypes, layouts, TP ranks or tenants can
//! never produce the same key. The byte-exact scheme is documented in `ARCHITECTURE.md` and pinned
//! by the test vectors in `kvstore/tests/vectors/keys.json`.

use std::fmt;

use xxhash_rust::xxh3::xxh3_128;

use crate::error::KeyError;

/// Domain separator that starts a namespace encoding (version 1 of the scheme).
const NS_MAGIC: &[u8] = b"kvtier/ns/v1";
/// Domain separator of a key derived from an engine's own block hash.
const ENGINE_TAG: u8 = b'E';
/// Domain separator of a key derived from token ids.
const TOKENS_TAG: u8 = b'T';

/// A 128-bit block key: names one block (and, because keys are chained, the whole prefix before
/// it) inside one namespace.
///
/// Its canonical byte form is the big-endian encoding of the 128-bit value (the same as xxHash's
/// canonical `XXH128` form), shown as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockKey(pub u128);

impl BlockKey {
    /// Length of a key in bytes.
    pub const LEN: usize = 16;

    /// The key as 16 big-endian bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Parses a key from exactly 16 big-endian bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        let arr: [u8; 16] = bytes.try_into().map_err(|_| KeyError::WrongLength {
            expected: Self::LEN,
            got: bytes.len(),
        })?;
        Ok(BlockKey(u128::from_be_bytes(arr)))
    }

    /// Parses a key from 32 hex digits.
    pub fn from_hex(s: &str) -> Result<Self, KeyError> {
        if s.len() != 32 {
            return Err(KeyError::BadHex(s.to_string()));
        }
        u128::from_str_radix(s, 16)
            .map(BlockKey)
            .map_err(|_| KeyError::BadHex(s.to_string()))
    }

    /// The key of a block whose content is named by an engine's own block hash (for example
    /// vLLM's 32-byte `sha256_cbor` block hash, which already chains the whole prefix).
    ///
    /// `key = xxh3_128(fingerprint ‖ 'E' ‖ u32_le(len) ‖ engine_hash)`.
    pub fn from_engine_hash(ns: &Fingerprint, engine_hash: &[u8]) -> Result<Self, KeyError> {
        if engine_hash.is_empty() || engine_hash.len() > 64 {
            return Err(KeyError::EngineHashLength(engine_hash.len()));
        }
        let mut buf = [0u8; 16 + 1 + 4 + 64];
        buf[..16].copy_from_slice(&ns.0.to_bytes());
        buf[16] = ENGINE_TAG;
        buf[17..21].copy_from_slice(&(engine_hash.len() as u32).to_le_bytes());
        buf[21..21 + engine_hash.len()].copy_from_slice(engine_hash);
        Ok(BlockKey(xxh3_128(&buf[..21 + engine_hash.len()])))
    }

    /// The key following `parent` for one block of token ids (chained scheme, for callers
    /// without an engine hash). The first block's parent is the namespace fingerprint.
    ///
    /// `key = xxh3_128(parent ‖ 'T' ‖ u32_le(n) ‖ n × u32_le(token) ‖ u32_le(m) ‖ extra[m])`.
    pub fn chain_tokens(parent: BlockKey, token_ids: &[u32], extra: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(16 + 1 + 4 + token_ids.len() * 4 + 4 + extra.len());
        buf.extend_from_slice(&parent.to_bytes());
        buf.push(TOKENS_TAG);
        buf.extend_from_slice(&(token_ids.len() as u32).to_le_bytes());
        for t in token_ids {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        buf.extend_from_slice(&(extra.len() as u32).to_le_bytes());
        buf.extend_from_slice(extra);
        BlockKey(xxh3_128(&buf))
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({:032x})", self.0)
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The fingerprint of a [`Namespace`]: `xxh3_128` of its canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint(pub BlockKey);

/// How the KV of a namespace is split across tensor-parallel ranks.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum TpShard {
    /// Every rank holds the same KV (MLA latents): stored once, shared by all ranks.
    Shared,
    /// The KV is sharded by head: this namespace holds rank `rank` of `size`.
    Rank {
        /// Number of tensor-parallel ranks.
        size: u32,
        /// This rank, `0..size`.
        rank: u32,
    },
}

/// Everything that makes two blocks with equal tokens incompatible. Its fingerprint is mixed into
/// every key.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Namespace {
    /// Model id and revision, e.g. `meta-llama/Llama-3.1-8B@5206a32`.
    pub model: String,
    /// KV dtype, e.g. `bfloat16`, `fp8_e4m3`.
    pub dtype: String,
    /// KV layout name as the connector describes it, e.g. `nhd`, `hnd`, `mla`.
    pub layout: String,
    /// Tokens per kvtier block.
    pub block_tokens: u32,
    /// Tensor-parallel sharding.
    pub tp: TpShard,
    /// Tenant or cache salt; blocks of different tenants never share keys.
    pub tenant: String,
    /// LoRA adapter name, empty for none.
    pub lora: String,
}

impl Namespace {
    /// The canonical byte encoding (see ARCHITECTURE.md, "Key scheme").
    pub fn encode(&self) -> Vec<u8> {
        fn put_str(buf: &mut Vec<u8>, s: &str) {
            buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
        let mut buf = Vec::with_capacity(64 + self.model.len());
        buf.extend_from_slice(NS_MAGIC);
        put_str(&mut buf, &self.model);
        put_str(&mut buf, &self.dtype);
        put_str(&mut buf, &self.layout);
        buf.extend_from_slice(&self.block_tokens.to_le_bytes());
        match self.tp {
            TpShard::Shared => {
                buf.push(0);
                buf.extend_from_slice(&0u32.to_le_bytes());
                buf.extend_from_slice(&0u32.to_le_bytes());
            }
            TpShard::Rank { size, rank } => {
                buf.push(1);
                buf.extend_from_slice(&size.to_le_bytes());
                buf.extend_from_slice(&rank.to_le_bytes());
            }
        }
        put_str(&mut buf, &self.tenant);
        put_str(&mut buf, &self.lora);
        buf
    }

    /// Parses the canonical encoding produced by [`Namespace::encode`].
    pub fn decode(b: &[u8]) -> Result<Self, KeyError> {
        let bad = |why: &str| KeyError::BadNamespace(format!("malformed encoding: {why}"));
        let rest = b
            .strip_prefix(NS_MAGIC)
            .ok_or_else(|| bad("missing kvtier/ns/v1"))?;
        let mut pos = 0usize;
        let u32_at = |pos: &mut usize| -> Result<u32, KeyError> {
            let v = rest.get(*pos..*pos + 4).ok_or_else(|| bad("truncated"))?;
            *pos += 4;
            Ok(u32::from_le_bytes([v[0], v[1], v[2], v[3]]))
        };
        let string = |pos: &mut usize| -> Result<String, KeyError> {
            let n = u32_at(pos)? as usize;
            let v = rest
                .get(*pos..*pos + n)
                .ok_or_else(|| bad("truncated string"))?;
            *pos += n;
            String::from_utf8(v.to_vec()).map_err(|_| bad("string is not UTF-8"))
        };
        let model = string(&mut pos)?;
        let dtype = string(&mut pos)?;
        let layout = string(&mut pos)?;
        let block_tokens = u32_at(&mut pos)?;
        let tag = *rest.get(pos).ok_or_else(|| bad("truncated"))?;
        pos += 1;
        let size = u32_at(&mut pos)?;
        let rank = u32_at(&mut pos)?;
        let tp = match tag {
            // One encoding per namespace: a shared TP carries zeros (anything else would be a
            // second encoding, and so a second fingerprint, of the same namespace).
            0 if size == 0 && rank == 0 => TpShard::Shared,
            0 => return Err(bad("shared TP with a size or rank")),
            1 => TpShard::Rank { size, rank },
            _ => return Err(bad("unknown TP tag")),
        };
        let tenant = string(&mut pos)?;
        let lora = string(&mut pos)?;
        if pos != rest.len() {
            return Err(bad("trailing bytes"));
        }
        let ns = Namespace {
            model,
            dtype,
            layout,
            block_tokens,
            tp,
            tenant,
            lora,
        };
        ns.validate()?;
        Ok(ns)
    }

    /// Checks the fields for values no engine can produce.
    pub fn validate(&self) -> Result<(), KeyError> {
        if self.model.is_empty() {
            return Err(KeyError::BadNamespace("model must not be empty".into()));
        }
        if self.block_tokens == 0 {
            return Err(KeyError::BadNamespace("block_tokens must be > 0".into()));
        }
        if let TpShard::Rank { size, rank } = self.tp {
            if size == 0 || rank >= size {
                return Err(KeyError::BadNamespace(format!(
                    "tp rank {rank} is not in 0..{size}"
                )));
            }
        }
        Ok(())
    }

    /// The namespace fingerprint: `xxh3_128(encode())`.
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint(BlockKey(xxh3_128(&self.encode())))
    }

    /// Keys for a token sequence: one per *full* block of `block_tokens` tokens (a trailing
    /// partial block gets no key). `extra` gives per-block extra bytes (LoRA, multimodal hashes,
    /// cache salt); missing entries count as empty.
    pub fn token_keys(&self, token_ids: &[u32], extra: &[&[u8]]) -> Vec<BlockKey> {
        let bt = self.block_tokens.max(1) as usize;
        let mut parent = self.fingerprint().0;
        token_ids
            .chunks_exact(bt)
            .enumerate()
            .map(|(i, chunk)| {
                parent =
                    BlockKey::chain_tokens(parent, chunk, extra.get(i).copied().unwrap_or(&[]));
                parent
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace {
            model: "m".into(),
            dtype: "bfloat16".into(),
            layout: "nhd".into(),
            block_tokens: 4,
            tp: TpShard::Rank { size: 2, rank: 0 },
            tenant: String::new(),
            lora: String::new(),
        }
    }

    #[test]
    fn namespaces_separate_keys() {
        let a = ns();
        let mut b = ns();
        b.tp = TpShard::Rank { size: 2, rank: 1 };
        let toks: Vec<u32> = (0..8).collect();
        assert_ne!(a.token_keys(&toks, &[]), b.token_keys(&toks, &[]));
        let h = [7u8; 32];
        assert_ne!(
            BlockKey::from_engine_hash(&a.fingerprint(), &h).unwrap(),
            BlockKey::from_engine_hash(&b.fingerprint(), &h).unwrap()
        );
    }

    #[test]
    fn chain_names_prefix() {
        let a = ns();
        let t1: Vec<u32> = (0..8).collect();
        let mut t2 = t1.clone();
        t2[1] = 99;
        let k1 = a.token_keys(&t1, &[]);
        let k2 = a.token_keys(&t2, &[]);
        assert_eq!(k1.len(), 2);
        // A change in the first block changes every later key.
        assert_ne!(k1[0], k2[0]);
        assert_ne!(k1[1], k2[1]);
        // Trailing partial block has no key.
        assert_eq!(a.token_keys(&t1[..7], &[]).len(), 1);
    }

    #[test]
    fn key_bytes_roundtrip_and_errors() {
        let k = BlockKey(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        assert_eq!(BlockKey::from_bytes(&k.to_bytes()).unwrap(), k);
        assert_eq!(BlockKey::from_hex(&k.to_string()).unwrap(), k);
        let e = BlockKey::from_bytes(&[0u8; 15]).unwrap_err();
        assert!(e.to_string().contains("16"), "{e}");
        assert!(BlockKey::from_hex("zz").is_err());
        assert!(BlockKey::from_engine_hash(&ns().fingerprint(), &[]).is_err());
    }

    #[test]
    fn decode_inverts_encode() {
        let n = ns();
        assert_eq!(Namespace::decode(&n.encode()).unwrap(), n);
        let mut e = n.encode();
        e.push(0);
        assert!(Namespace::decode(&e).is_err());
        assert!(Namespace::decode(&e[..10]).is_err());
        assert!(Namespace::decode(b"garbage").is_err());
    }

    #[test]
    fn validate_rejects_bad_rank() {
        let mut n = ns();
        n.tp = TpShard::Rank { size: 2, rank: 2 };
        assert!(n.validate().is_err());
        n.tp = TpShard::Shared;
        n.validate().unwrap();
    }
}

//! The key scheme matches the checked-in vectors (made by the Python reference
//! `tests/python/keyref.py` from ARCHITECTURE.md alone).

use kvstore::{BlockKey, Namespace, TpShard};
use serde_json::Value;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn keys_match_vectors() {
    let text = include_str!("vectors/keys.json");
    let cases: Vec<Value> = serde_json::from_str(text).unwrap();
    assert!(!cases.is_empty());
    for c in cases {
        let n = &c["namespace"];
        let s = |f: &str| n[f].as_str().unwrap().to_string();
        let ns = Namespace {
            model: s("model"),
            dtype: s("dtype"),
            layout: s("layout"),
            block_tokens: n["block_tokens"].as_u64().unwrap() as u32,
            tp: match n["tp"].as_array() {
                None => TpShard::Shared,
                Some(a) => TpShard::Rank {
                    size: a[0].as_u64().unwrap() as u32,
                    rank: a[1].as_u64().unwrap() as u32,
                },
            },
            tenant: s("tenant"),
            lora: s("lora"),
        };
        assert_eq!(ns.encode(), hex(c["namespace_bytes_hex"].as_str().unwrap()));
        let fp = ns.fingerprint();
        assert_eq!(fp.0.to_string(), c["fingerprint"].as_str().unwrap());
        let tokens: Vec<u32> = c["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let extras: Vec<Vec<u8>> = c["extras_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| hex(e.as_str().unwrap()))
            .collect();
        let extra_refs: Vec<&[u8]> = extras.iter().map(|e| e.as_slice()).collect();
        let keys: Vec<String> = ns
            .token_keys(&tokens, &extra_refs)
            .iter()
            .map(|k| k.to_string())
            .collect();
        let want: Vec<&str> = c["token_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        assert_eq!(keys, want);
        for e in c["engine_keys"].as_array().unwrap() {
            let k =
                BlockKey::from_engine_hash(&fp, &hex(e["engine_hash"].as_str().unwrap())).unwrap();
            assert_eq!(k.to_string(), e["key"].as_str().unwrap());
        }
    }
}

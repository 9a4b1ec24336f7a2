//! Fuzz target of the namespace encoding (see `kvtier-fuzz`): any bytes decode or are refused
//! with an error, never a panic; what decodes re-encodes to the same bytes.

use crate::key::Namespace;

#[test]
fn fuzz_namespace_decoding() {
    kvtier_fuzz::run("namespace", |bytes| {
        if let Ok(ns) = Namespace::decode(bytes) {
            assert_eq!(ns.encode(), bytes, "decode then encode changed the bytes");
            let _ = ns.validate();
            let _ = ns.fingerprint();
        }
    });
}

//! Generates the prost code (and, with the `grpc` feature, the tonic service code); protoc comes
//! from `protoc-bin-vendored` (nothing to install).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    }
    println!("cargo:rerun-if-changed=proto");
    // The engine protocol is plain prost messages: an engine that links the IPC client pulls no
    // gRPC stack.
    prost_build::compile_protos(&["proto/ipc.proto", "proto/cluster.proto"], &["proto"])?;
    #[cfg(feature = "grpc")]
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/admin.proto"], &["proto"])?;
    // The etcd v3 subset the cluster's membership uses (a client of a real etcd).
    #[cfg(feature = "grpc")]
    tonic_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&["proto/etcd.proto"], &["proto"])?;
    Ok(())
}

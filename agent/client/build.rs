//! Generates the engine API (messages, client and server stubs) from
//! `agent/proto/kvfabric/v1/engine.proto` with protoc (Debian
//! `protobuf-compiler`, installed by `e2e/setup.sh`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../proto/kvfabric/v1/engine.proto";
    println!("cargo:rerun-if-changed={proto}");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&[proto], &["../proto"])?;
    Ok(())
}

//! Generates the engine-API and peer-link stubs (client and server) from `gateway/proto/kvgate.proto`.
//! Needs `protoc` (Debian: protobuf-compiler); `PROTOC` overrides its path.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../proto/kvgate.proto";
    println!("cargo:rerun-if-changed={proto}");
    tonic_prost_build::configure().build_client(true).build_server(true).compile_protos(&[proto], &["../proto"])?;
    Ok(())
}

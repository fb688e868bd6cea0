//! Compiles the services of the .proto files with protox (a protobuf
//! compiler in Rust, so building needs no system `protoc`) and tonic-build.
//! The messages are gpuctl-core's (`extern_path`): one set of types, and
//! the core links no RPC stack.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/gpuctl/v1/common.proto",
        "proto/gpuctl/v1/operator.proto",
        "proto/gpuctl/v1/agent.proto",
        "proto/gpuctl/v1/scheduler.proto",
        "proto/gpuctl/v1/raft.proto",
        "proto/gpuctl/v1/access.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .extern_path(".gpuctl.v1", "::gpuctl_core::pb")
        // Smaller per-call buffers (see src/codec.rs).
        .codec_path("crate::codec::GpuctlCodec")
        .compile_fds(fds)?;
    Ok(())
}

//! Compiles the messages of the .proto files (kept with the API in
//! `proto/proto`) with protox and prost-build: plain structs, no services,
//! so this crate links no RPC stack. `gpuctl-proto` generates the services
//! and points them at these messages (`extern_path`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "../proto/proto/gpuctl/v1/common.proto",
        "../proto/proto/gpuctl/v1/operator.proto",
        "../proto/proto/gpuctl/v1/agent.proto",
        "../proto/proto/gpuctl/v1/scheduler.proto",
        "../proto/proto/gpuctl/v1/raft.proto",
        "../proto/proto/gpuctl/v1/access.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["../proto/proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}

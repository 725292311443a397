//! Compiles every `proto/brigade/v1/*.proto` with the vendored `protoc` (never a system one), for
//! clients and servers, and writes the file descriptor set that `tonic-reflection` serves.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The vendored binary makes the build independent of whatever protoc the machine has.
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Safe in a build script: it runs single-threaded, before anything reads the environment.
    std::env::set_var("PROTOC", protoc);

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let dir = root.join("brigade/v1");
    let mut protos: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "proto"))
        .collect();
    protos.sort();
    if protos.is_empty() {
        return Err(format!("no .proto files in {}", dir.display()).into());
    }
    println!("cargo:rerun-if-changed={}", dir.display());

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(out_dir.join("brigade_v1_descriptor.bin"))
        // Encoded frames travel as `Bytes` so the gRPC carrier hands them on without a copy.
        .bytes(".brigade.v1.FrameBytes.frame")
        .compile_protos(&protos, &[root])?;
    Ok(())
}

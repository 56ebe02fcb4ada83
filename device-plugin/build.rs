//! Generates the kubelet device-plugin API (v1beta1) and pod-resources API (v1) from our own
//! .proto files with protox, so the build needs no system `protoc`.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    let protos = ["proto/v1beta1/api.proto", "proto/podresources/v1/api.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

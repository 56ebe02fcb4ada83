//! Generates the kubelet device-plugin API (v1beta1) from our own .proto with protox, so the
//! build needs no system `protoc`.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    let proto = "proto/v1beta1/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

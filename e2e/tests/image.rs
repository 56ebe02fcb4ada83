//! The container image as `make image` builds it (hack/oci-image.py, no container engine),
//! from the binaries this test run built:
//! - it is self-contained: its root filesystem, unpacked from the OCI layout alone, runs each
//!   binary's `--version` under `chroot` (as the image's non-root user too);
//! - it is reproducible: two builds from the same binaries have the same manifest digest and
//!   the same archive bytes;
//! - its reference is the one the manifests deploy: the Helm chart's repository and appVersion,
//!   and the literal image of config/operator and config/device-plugin;
//! - its config runs as user 65532 and carries the OCI labels.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use gpuledger_e2e::sim::binaries::{bin_dir, build_gpuledger_binaries, repo_root};
use serde_json::Value;

fn build_image(out: &Path) -> String {
    let status = Command::new("python3")
        .arg(repo_root().join("hack/oci-image.py"))
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg("--out-dir")
        .arg(out)
        .arg("--revision")
        .arg("test")
        .status()
        .expect("python3 runs");
    assert!(status.success(), "hack/oci-image.py failed: {status}");
    std::fs::read_to_string(out.join("digest"))
        .unwrap()
        .trim()
        .to_string()
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
    layout.join("blobs/sha256").join(hex)
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Runs `args` inside `root` with `chroot` (through a user namespace when not root), as
/// `user` (`uid:gid`).
fn in_chroot(root: &Path, user: &str, args: &[&str]) -> String {
    let as_root = rustix::process::geteuid().is_root();
    let mut cmd = if as_root {
        Command::new("chroot")
    } else {
        let mut c = Command::new("unshare");
        c.args(["--map-root-user", "chroot"]);
        c
    };
    if as_root {
        cmd.arg(format!("--userspec={user}"));
    }
    let out = cmd.arg(root).args(args).output().expect("chroot runs");
    assert!(
        out.status.success(),
        "{args:?} in the image: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The image of the gpuledger container (the first of `containers`; init containers run other
/// images) of the workload in a manifest file.
fn manifest_image(path: &str) -> String {
    let text = std::fs::read_to_string(repo_root().join(path)).unwrap();
    let workload: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    workload["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap_or_else(|| panic!("{path} names no image"))
        .to_string()
}

fn chart_reference() -> String {
    let root = repo_root().join("charts/gpuledger");
    let values: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("values.yaml")).unwrap()).unwrap();
    let chart: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("Chart.yaml")).unwrap()).unwrap();
    let repository = values["image"]["repository"].as_str().unwrap().to_string();
    let tag = values["image"]["tag"]
        .as_str()
        .filter(|t| !t.is_empty())
        .or_else(|| chart["appVersion"].as_str())
        .unwrap()
        .to_string();
    format!("{repository}:{tag}")
}

#[test]
fn the_image_is_self_contained_reproducible_and_the_one_the_manifests_deploy() {
    build_gpuledger_binaries().unwrap();
    let first = tempfile::tempdir().unwrap();
    let second = tempfile::tempdir().unwrap();
    let digest = build_image(first.path());
    assert_eq!(
        build_image(second.path()),
        digest,
        "two builds differ: not reproducible"
    );
    let tag = chart_reference()
        .rsplit_once(':')
        .map(|(_, t)| t.to_string())
        .unwrap();
    let archive = format!("gpuledger-{tag}.oci.tar");
    assert_eq!(
        std::fs::read(first.path().join(&archive)).unwrap(),
        std::fs::read(second.path().join(&archive)).unwrap(),
        "the archives differ"
    );

    // The layout alone: index → manifest → config and layer.
    let layout = first.path().join("layout");
    assert_eq!(
        json(&layout.join("oci-layout"))["imageLayoutVersion"],
        "1.0.0"
    );
    let index = json(&layout.join("index.json"));
    let entry = &index["manifests"][0];
    assert_eq!(entry["digest"], digest.as_str());
    let reference = entry["annotations"]["io.containerd.image.name"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(reference, chart_reference(), "the chart's image");
    for path in [
        "config/operator/deployment.yaml",
        "config/device-plugin/daemonset.yaml",
    ] {
        assert_eq!(manifest_image(path), reference, "{path}");
    }
    let manifest = json(&blob(&layout, &digest));
    let config = json(&blob(
        &layout,
        manifest["config"]["digest"].as_str().unwrap(),
    ));
    assert_eq!(config["config"]["User"], "65532:65532");
    assert_eq!(
        config["config"]["Labels"]["org.opencontainers.image.version"],
        tag.as_str()
    );
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);

    // Unpack the root filesystem and run each binary in it.
    let root = tempfile::tempdir().unwrap();
    let layer = blob(&layout, layers[0]["digest"].as_str().unwrap());
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(&layer)
        .arg("-C")
        .arg(root.path())
        .status()
        .unwrap();
    assert!(status.success(), "unpacking the layer");
    for name in ["gpuledger-operator", "gpuledger-device-plugin"] {
        let path = format!("/usr/local/bin/{name}");
        let version = in_chroot(root.path(), "65532:65532", &[&path, "--version"]);
        assert_eq!(version, format!("{name} {}", env!("CARGO_PKG_VERSION")));
    }
}

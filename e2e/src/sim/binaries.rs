//! Where the gpuledger executables (`gpuledger-operator`, `gpuledger-device-plugin`) are: the
//! simulation runs them as real child processes, exactly as shipped.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::sim::SimNodeError;

/// Overrides the directory holding the gpuledger executables.
pub const BIN_DIR_ENV: &str = "GPULEDGER_BIN_DIR";
/// The operator executable.
pub const OPERATOR: &str = "gpuledger-operator";
/// The device plugin executable.
pub const DEVICE_PLUGIN: &str = "gpuledger-device-plugin";

/// The workspace root (the directory holding `config/`, `crds/` and `charts/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The directory of the gpuledger executables: [`BIN_DIR_ENV`], else the cargo profile
/// directory we run from (`target/debug` for a binary, its parent for a test in `deps/`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV).filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| repo_root().join("target/debug"));
    if exe_dir.file_name().is_some_and(|n| n == "deps") {
        exe_dir.parent().map_or(exe_dir.clone(), Path::to_path_buf)
    } else {
        exe_dir
    }
}

/// The path of executable `name` in [`bin_dir`], checked to exist. A release-profile bench
/// finds a debug build too, and the other way round. The one place the harness looks for the
/// gpuledger executables.
pub fn locate(name: &'static str) -> Result<PathBuf, SimNodeError> {
    let dir = bin_dir();
    let path = dir.join(name);
    if path.is_file() {
        return Ok(path);
    }
    let other_profile = if dir.ends_with("release") {
        "debug"
    } else {
        "release"
    };
    match dir.parent().map(|t| t.join(other_profile).join(name)) {
        Some(p) if p.is_file() => Ok(p),
        _ => Err(SimNodeError::MissingBinary { name, path }),
    }
}

/// Builds the operator and device-plugin executables with cargo (a no-op when they are up to
/// date), so a test of this crate alone runs against the current sources. Uses the cargo that
/// runs us (`$CARGO`) and at most two jobs.
pub fn build_gpuledger_binaries() -> Result<(), SimNodeError> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .current_dir(repo_root())
        .args(["build", "-q", "-j", "2", "--bins"])
        .args(["-p", OPERATOR, "-p", DEVICE_PLUGIN])
        .status()
        .map_err(|e| SimNodeError::Build(format!("cannot run {cargo:?}: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(SimNodeError::Build(format!(
            "cargo build -p {OPERATOR} -p {DEVICE_PLUGIN} failed ({status})"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repo_root_holds_the_manifests() {
        let root = repo_root();
        assert!(
            root.join("config/samples/devices-8gpu-2numa.yaml")
                .is_file()
        );
        assert!(root.join("crds/yaml").is_dir());
    }

    #[test]
    fn tests_look_beside_deps() {
        // A unit test runs from target/<profile>/deps: the binaries are one level up.
        let dir = bin_dir();
        assert_ne!(dir.file_name().and_then(|n| n.to_str()), Some("deps"));
    }
}

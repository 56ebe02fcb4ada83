//! Where the control-plane executables live. The Kubernetes binaries are built once per pinned
//! version by `e2e/k8s/build.sh` into a fixed cache directory; etcd comes from the
//! `etcd-bin-vendored-linux-amd64` crate, so it needs no Go toolchain.

use std::path::{Path, PathBuf};

use crate::cluster::ClusterError;

/// Overrides the directory `e2e/k8s/build.sh` builds into: kube-apiserver, kube-scheduler,
/// kube-controller-manager, helm, `gpuledger-sim-kubelet` and `gpuledger-kstatus`.
pub const K8S_BIN_ENV: &str = "GPULEDGER_K8S_BIN";
/// Overrides the cache root that `e2e/k8s/build.sh` builds into.
pub const CACHE_ENV: &str = "GPULEDGER_CACHE";
/// Overrides the etcd executable (by default the one vendored in the crate).
pub const ETCD_BIN_ENV: &str = "GPULEDGER_ETCD_BIN";
/// Cache root `e2e/k8s/build.sh` uses when [`CACHE_ENV`] is unset.
pub const DEFAULT_CACHE: &str = "/var/cache/gpuledger";

/// The Kubernetes version we pin (`e2e/k8s/VERSION`, e.g. `1.34.4`).
pub fn k8s_version() -> &'static str {
    include_str!("../../k8s/VERSION").trim()
}

/// The `/version` gitVersion the pinned binaries report (`v1.34.4`): build.sh sets it via ldflags.
pub fn expected_git_version() -> String {
    format!("v{}", k8s_version())
}

/// Paths of the four executables of the control plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binaries {
    /// etcd.
    pub etcd: PathBuf,
    /// kube-apiserver.
    pub kube_apiserver: PathBuf,
    /// kube-controller-manager.
    pub kube_controller_manager: PathBuf,
    /// kube-scheduler.
    pub kube_scheduler: PathBuf,
}

impl Binaries {
    /// Finds the binaries from the environment ([`K8S_BIN_ENV`], [`CACHE_ENV`], [`ETCD_BIN_ENV`])
    /// or the defaults, and checks that each exists.
    pub fn locate() -> Result<Self, ClusterError> {
        let k8s_dir = match std::env::var_os(K8S_BIN_ENV).filter(|v| !v.is_empty()) {
            Some(dir) => PathBuf::from(dir),
            None => {
                let cache = std::env::var_os(CACHE_ENV)
                    .filter(|v| !v.is_empty())
                    .map_or_else(|| PathBuf::from(DEFAULT_CACHE), PathBuf::from);
                default_k8s_dir(&cache)
            }
        };
        let etcd = match std::env::var_os(ETCD_BIN_ENV).filter(|v| !v.is_empty()) {
            Some(path) => PathBuf::from(path),
            None => vendored_etcd(),
        };
        Self::in_dir(&k8s_dir, etcd)
    }

    /// The Kubernetes binaries of `dir` plus `etcd`, each checked to exist.
    pub fn in_dir(dir: &Path, etcd: PathBuf) -> Result<Self, ClusterError> {
        let hint = format!(
            "build them with `make k8s-binaries` (e2e/k8s/build.sh) or point {K8S_BIN_ENV} at a directory holding kubernetes v{} binaries",
            k8s_version()
        );
        let found = |what: &'static str, path: PathBuf| {
            if path.is_file() {
                Ok(path)
            } else {
                Err(ClusterError::MissingBinary {
                    what,
                    path,
                    hint: hint.clone(),
                })
            }
        };
        let etcd = if etcd.is_file() {
            etcd
        } else {
            return Err(ClusterError::MissingBinary {
                what: "etcd",
                path: etcd,
                hint: format!(
                    "the etcd-bin-vendored-linux-amd64 crate ships it; or set {ETCD_BIN_ENV}"
                ),
            });
        };
        Ok(Binaries {
            etcd,
            kube_apiserver: found("kube-apiserver", dir.join("kube-apiserver"))?,
            kube_controller_manager: found(
                "kube-controller-manager",
                dir.join("kube-controller-manager"),
            )?,
            kube_scheduler: found("kube-scheduler", dir.join("kube-scheduler"))?,
        })
    }
}

/// `<cache>/k8s/v<version>/bin`, where `e2e/k8s/build.sh` puts the binaries.
pub fn default_k8s_dir(cache: &Path) -> PathBuf {
    cache
        .join("k8s")
        .join(format!("v{}", k8s_version()))
        .join("bin")
}

/// The etcd executable vendored by the `etcd-bin-vendored-linux-amd64` crate.
pub fn vendored_etcd() -> PathBuf {
    match etcd_bin_vendored_linux_amd64::etcd_bin_path() {
        Ok(path) => path.to_path_buf(),
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_a_pinned_1_34_release() {
        assert!(k8s_version().starts_with("1.34."), "{}", k8s_version());
        assert_eq!(expected_git_version(), format!("v{}", k8s_version()));
    }

    #[test]
    fn default_dir_matches_build_script_layout() {
        let dir = default_k8s_dir(Path::new("/var/cache/gpuledger"));
        assert_eq!(
            dir,
            PathBuf::from(format!("/var/cache/gpuledger/k8s/v{}/bin", k8s_version()))
        );
    }

    #[test]
    fn missing_binaries_are_named_with_a_hint() {
        let dir = tempfile::tempdir().unwrap();
        let err = Binaries::in_dir(dir.path(), vendored_etcd()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("kube-apiserver"), "{msg}");
        assert!(msg.contains("build.sh"), "{msg}");
    }

    #[test]
    fn present_binaries_are_found() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let bins = Binaries::in_dir(dir.path(), vendored_etcd()).unwrap();
        assert_eq!(bins.kube_scheduler, dir.path().join("kube-scheduler"));
        assert!(bins.etcd.is_file());
    }
}

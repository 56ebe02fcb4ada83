//! Allocate's answer for one container: the HAMi-core environment for the reservation's GPUs.
//!
//! The container always sees the GPUs the ledger reserved, never the GPUs behind the kubelet's
//! replica choice, so what runs is what is accounted for.

use std::path::{Path, PathBuf};

use gpuledger_crds::ContainerReservation;

use crate::api;

/// Container-side directory of HAMi-core's files (HAMi's `$HOOK_PATH/vgpu`).
pub const CONTAINER_VGPU_DIR: &str = "/usr/local/vgpu";

/// The environment and mounts for `container` of pod `pod_uid`.
///
/// - `NVIDIA_VISIBLE_DEVICES`: the reserved UUIDs, comma-separated, in reservation order.
/// - `CUDA_DEVICE_MEMORY_LIMIT_<i>`: `<MiB>m` for the i-th GPU.
/// - `CUDA_DEVICE_SM_LIMIT`: the cores of the first GPU (HAMi-core takes one SM limit).
/// - `CUDA_OVERSUBSCRIBE=true` when the node's memory scaling is above 1 (HAMi-core may then
///   page device memory to the host).
/// - With `hami_core_dir`: libvgpu.so (read-only), a per-container cache directory, the shared
///   lock directory and `/etc/ld.so.preload`, as HAMi's plugin mounts them.
pub fn container_response(
    pod_uid: &str,
    container: &ContainerReservation,
    hami_core_dir: Option<&Path>,
    oversubscribed: bool,
) -> api::ContainerAllocateResponse {
    let mut resp = api::ContainerAllocateResponse::default();
    let uuids: Vec<&str> = container.devices.iter().map(|d| d.uuid.as_str()).collect();
    resp.envs
        .insert("NVIDIA_VISIBLE_DEVICES".to_string(), uuids.join(","));
    for (i, d) in container.devices.iter().enumerate() {
        resp.envs.insert(
            format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"),
            format!("{}m", d.memory_mib),
        );
    }
    if let Some(first) = container.devices.first() {
        resp.envs
            .insert("CUDA_DEVICE_SM_LIMIT".to_string(), first.cores.to_string());
    }
    if oversubscribed {
        resp.envs
            .insert("CUDA_OVERSUBSCRIBE".to_string(), "true".to_string());
    }
    if let Some(dir) = hami_core_dir {
        let cache_dir = container_cache_dir(dir, pod_uid, container.index);
        resp.envs.insert(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE".to_string(),
            format!("{CONTAINER_VGPU_DIR}/{pod_uid}-{}.cache", container.index),
        );
        resp.mounts = vec![
            mount(
                &dir.join("libvgpu.so"),
                &format!("{CONTAINER_VGPU_DIR}/libvgpu.so"),
                true,
            ),
            mount(&cache_dir, CONTAINER_VGPU_DIR, false),
            mount(Path::new("/tmp/vgpulock"), "/tmp/vgpulock", false),
            mount(&dir.join("ld.so.preload"), "/etc/ld.so.preload", true),
        ];
    }
    resp
}

/// Whether `pod_uid` has the shape the API server gives a pod's UID (a UUID: 8-4-4-4-12
/// hexadecimal digits), and so can name a host directory. The UID comes from the allocation
/// Lease and the reservation, objects a node does not own alone; one holding `/` or `..` would
/// put the read-write cache mount anywhere on the host, and one of another shape would make a
/// directory the cache sweep ([`crate::hami_cache`]) does not take for ours.
pub fn is_pod_uid(pod_uid: &str) -> bool {
    pod_uid.len() == 36
        && pod_uid.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Host directory holding one container's HAMi-core cache (for a UID [`is_pod_uid`]).
pub fn container_cache_dir(hami_core_dir: &Path, pod_uid: &str, index: u32) -> PathBuf {
    hami_core_dir
        .join("containers")
        .join(format!("{pod_uid}_{index}"))
}

fn mount(host: &Path, container: &str, read_only: bool) -> api::Mount {
    api::Mount {
        container_path: container.to_string(),
        host_path: host.display().to_string(),
        read_only,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::ReservedDevice;

    fn container() -> ContainerReservation {
        ContainerReservation {
            index: 1,
            name: "main".into(),
            init: false,
            devices: vec![
                ReservedDevice {
                    uuid: "GPU-a".into(),
                    memory_mib: 4096,
                    cores: 30,
                    numa_node: Some(0),
                },
                ReservedDevice {
                    uuid: "GPU-b".into(),
                    memory_mib: 8000,
                    cores: 50,
                    numa_node: Some(1),
                },
            ],
        }
    }

    #[test]
    fn hami_core_environment_for_the_reserved_gpus() {
        let resp = container_response("uid-1", &container(), None, false);
        assert_eq!(resp.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(resp.envs["CUDA_DEVICE_MEMORY_LIMIT_0"], "4096m");
        assert_eq!(resp.envs["CUDA_DEVICE_MEMORY_LIMIT_1"], "8000m");
        assert_eq!(resp.envs["CUDA_DEVICE_SM_LIMIT"], "30");
        assert_eq!(
            resp.envs.len(),
            4,
            "no CUDA_OVERSUBSCRIBE without memory scaling"
        );
        assert!(resp.mounts.is_empty());
    }

    #[test]
    fn hami_core_mounts_only_with_the_flag() {
        let resp = container_response("uid-1", &container(), Some(Path::new("/opt/hami")), true);
        assert_eq!(resp.envs["CUDA_OVERSUBSCRIBE"], "true");
        let by_target = |t: &str| resp.mounts.iter().find(|m| m.container_path == t).unwrap();
        assert_eq!(
            by_target("/usr/local/vgpu/libvgpu.so").host_path,
            "/opt/hami/libvgpu.so"
        );
        assert!(by_target("/usr/local/vgpu/libvgpu.so").read_only);
        assert_eq!(
            by_target("/usr/local/vgpu").host_path,
            "/opt/hami/containers/uid-1_1"
        );
        assert_eq!(
            by_target("/etc/ld.so.preload").host_path,
            "/opt/hami/ld.so.preload"
        );
        assert_eq!(
            resp.envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"],
            "/usr/local/vgpu/uid-1-1.cache"
        );
    }
}

//! Pod admission the way the kubelet's device manager does it, per container (init containers
//! first) and per resource: choose devices, Allocate, PreStartContainer.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use gpuledger_device_plugin::api;

use super::devicemanager::{self, NumaPolicy, PreferredCall};
use super::{KubeletSimulator, SimError};

/// One container of a pod to admit.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    /// Container name.
    pub name: String,
    /// Whether it is an init container.
    pub init: bool,
    /// Device-plugin resources in `resources.limits` (e.g. `nvidia.com/gpu` → 1).
    pub requests: BTreeMap<String, usize>,
}

impl ContainerSpec {
    /// A container asking for `count` of `resource`.
    pub fn new(name: &str, init: bool, resource: &str, count: usize) -> Self {
        ContainerSpec {
            name: name.to_string(),
            init,
            requests: BTreeMap::from([(resource.to_string(), count)]),
        }
    }
}

/// A pod to admit.
#[derive(Debug, Clone, Default)]
pub struct PodSpec {
    /// Pod UID.
    pub uid: String,
    /// Containers; init containers are admitted first, each group in the given order.
    pub containers: Vec<ContainerSpec>,
}

/// What the kubelet got for one (container, resource).
#[derive(Debug, Clone)]
pub struct AdmittedContainer {
    /// Container name.
    pub name: String,
    /// Resource name.
    pub resource: String,
    /// The device IDs the device manager chose (sorted).
    pub device_ids: Vec<String>,
    /// `container_responses[0]` of Allocate.
    pub response: api::ContainerAllocateResponse,
}

impl KubeletSimulator {
    /// Admits a pod like the kubelet: per container (init containers first) and per resource,
    /// choose devices (with GetPreferredAllocation when advertised), Allocate, and
    /// PreStartContainer when required. On failure the pod's devices are freed again.
    pub async fn admit(
        &self,
        pod: &PodSpec,
        policy: NumaPolicy,
    ) -> Result<Vec<AdmittedContainer>, SimError> {
        let _serial = self.admission.lock().await;
        let result = self.admit_serialized(pod, policy).await;
        if result.is_err() {
            self.release(&pod.uid);
        }
        result
    }

    async fn admit_serialized(
        &self,
        pod: &PodSpec,
        policy: NumaPolicy,
    ) -> Result<Vec<AdmittedContainer>, SimError> {
        let mut ordered: Vec<&ContainerSpec> = pod.containers.iter().filter(|c| c.init).collect();
        ordered.extend(pod.containers.iter().filter(|c| !c.init));
        let mut reusable: HashMap<String, BTreeSet<String>> = HashMap::new();
        let mut out = Vec::new();
        for container in ordered {
            for (resource, &count) in &container.requests {
                let admitted = self
                    .admit_one(
                        pod,
                        container,
                        resource,
                        count,
                        policy,
                        reusable.entry(resource.clone()).or_default(),
                    )
                    .await?;
                let reuse = reusable.entry(resource.clone()).or_default();
                for id in &admitted.device_ids {
                    if container.init {
                        reuse.insert(id.clone());
                    } else {
                        reuse.remove(id);
                    }
                }
                out.push(admitted);
            }
        }
        Ok(out)
    }

    async fn admit_one(
        &self,
        pod: &PodSpec,
        container: &ContainerSpec,
        resource: &str,
        count: usize,
        policy: NumaPolicy,
        reusable: &BTreeSet<String>,
    ) -> Result<AdmittedContainer, SimError> {
        let (devices, options, client, allocated) = {
            let inner = self.state.lock();
            let (_, e) = inner
                .endpoints
                .get(resource)
                .ok_or_else(|| SimError::NotRegistered(resource.to_string()))?;
            let allocated: BTreeSet<String> = inner
                .allocated
                .get(resource)
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            (e.devices.clone(), e.options, e.client.clone(), allocated)
        };
        let preferred = options.get_preferred_allocation_available.then(|| {
            let client = client.clone();
            move |call: PreferredCall| {
                let mut client = client.clone();
                async move {
                    let request = api::PreferredAllocationRequest {
                        container_requests: vec![api::ContainerPreferredAllocationRequest {
                            available_device_i_ds: call.available,
                            must_include_device_i_ds: call.must_include,
                            allocation_size: i32::try_from(call.size).unwrap_or(i32::MAX),
                        }],
                    };
                    let resp = client
                        .get_preferred_allocation(request)
                        .await
                        .map_err(|s| format!("{}: {}", s.code(), s.message()))?;
                    Ok(resp
                        .into_inner()
                        .container_responses
                        .into_iter()
                        .next()
                        .map(|c| c.device_i_ds)
                        .unwrap_or_default())
                }
            }
        });
        let chosen = devicemanager::choose(
            resource, count, &devices, &allocated, reusable, policy, preferred,
        )
        .await
        .map_err(|source| SimError::Choose {
            container: container.name.clone(),
            source,
        })?;
        let device_ids: Vec<String> = chosen.into_iter().collect();
        {
            let mut inner = self.state.lock();
            let held = inner.allocated.entry(resource.to_string()).or_default();
            for id in &device_ids {
                held.insert(id.clone(), pod.uid.clone());
            }
        }
        let mut client = client;
        let request = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: device_ids.clone(),
            }],
        };
        let response = client
            .allocate(request)
            .await
            .map_err(|status| SimError::Allocate {
                container: container.name.clone(),
                status,
            })?
            .into_inner()
            .container_responses
            .into_iter()
            .next()
            .ok_or_else(|| SimError::EmptyAllocateResponse {
                container: container.name.clone(),
            })?;
        if options.pre_start_required {
            client
                .pre_start_container(api::PreStartContainerRequest {
                    devices_ids: device_ids.clone(),
                })
                .await
                .map_err(|status| SimError::PreStart {
                    container: container.name.clone(),
                    status,
                })?;
        }
        Ok(AdmittedContainer {
            name: container.name.clone(),
            resource: resource.to_string(),
            device_ids,
            response,
        })
    }

    /// Frees every device held by pod `uid` (the pod ended).
    pub fn release(&self, uid: &str) {
        let mut inner = self.state.lock();
        for held in inner.allocated.values_mut() {
            held.retain(|_, owner| owner != uid);
        }
    }

    /// Devices of `resource` held by pods.
    pub fn allocated(&self, resource: &str) -> BTreeMap<String, String> {
        self.state
            .lock()
            .allocated
            .get(resource)
            .cloned()
            .unwrap_or_default()
    }
}

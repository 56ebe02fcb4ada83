//! What the kubelet of a simulated node did with the pods bound to it. The kubelet
//! (`gpuledger-sim-kubelet`, see [`crate::sim::node_kubelet`]) admits each pod with the real
//! device and topology managers, reports it Running or Failed, and appends one JSON line per
//! admission to its `admissions.jsonl`; [`follow`] reads those lines into [`Admissions`], which
//! tests and the demo wait on.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpuledger_device_plugin::api;
use serde::Deserialize;
use tokio::sync::watch;

use crate::kubelet::{AdmittedContainer, NumaPolicy};

/// How the simulated kubelet dealt with one pod.
#[derive(Debug, Clone)]
pub struct Admission {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// The Topology Manager policy applied (the NUMA node of the pod's CPUs).
    pub policy: NumaPolicy,
    /// What happened.
    pub outcome: AdmissionOutcome,
}

/// The result of an admission.
#[derive(Debug, Clone)]
pub enum AdmissionOutcome {
    /// Admitted: what each GPU container got from Allocate. The pod is Running.
    Admitted(Vec<AdmittedContainer>),
    /// Rejected: the pod is Failed with this reason and message.
    Rejected {
        /// Kubelet reason (`UnexpectedAdmissionError`, `TopologyAffinityError`).
        reason: String,
        /// Kubelet message.
        message: String,
    },
}

impl Admission {
    /// The containers' Allocate answers when admitted.
    pub fn admitted(&self) -> Option<&[AdmittedContainer]> {
        match &self.outcome {
            AdmissionOutcome::Admitted(c) => Some(c),
            AdmissionOutcome::Rejected { .. } => None,
        }
    }

    /// The NUMA node of the pod's CPUs, when the Topology Manager restricted it.
    pub fn cpu_numa(&self) -> Option<i64> {
        match self.policy {
            NumaPolicy::SingleNumaNode(n) => Some(n),
            NumaPolicy::None => None,
        }
    }
}

/// Admissions by `namespace/name`, with a change counter to wait on.
#[derive(Clone)]
pub struct Admissions {
    by_pod: Arc<Mutex<BTreeMap<String, Admission>>>,
    changes: watch::Sender<u64>,
}

impl Default for Admissions {
    fn default() -> Self {
        Admissions {
            by_pod: Arc::default(),
            changes: watch::channel(0).0,
        }
    }
}

impl Admissions {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Admission>> {
        self.by_pod.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, admission: Admission) {
        let key = format!("{}/{}", admission.namespace, admission.name);
        self.lock().insert(key, admission);
        self.changes.send_modify(|n| *n += 1);
    }

    /// The admission of pod `namespace/name` with UID `uid` (any UID when `None`), if done.
    pub fn get(&self, namespace: &str, name: &str, uid: Option<&str>) -> Option<Admission> {
        self.lock()
            .get(&format!("{namespace}/{name}"))
            .filter(|a| uid.is_none_or(|u| a.uid == u))
            .cloned()
    }

    /// A receiver that changes whenever an admission is recorded.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// One line of the kubelet's `admissions.jsonl` (e2e/k8s/simkubelet/admit.go).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LoggedAdmission {
    namespace: String,
    name: String,
    uid: String,
    cpu_numa: Option<i64>,
    admitted: bool,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    containers: Option<Vec<LoggedContainer>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LoggedContainer {
    name: String,
    resource: String,
    #[serde(default)]
    device_ids: Option<Vec<String>>,
    #[serde(default)]
    envs: Option<HashMap<String, String>>,
    #[serde(default)]
    mounts: Option<Vec<LoggedMount>>,
    #[serde(default)]
    devices: Option<Vec<LoggedDevice>>,
    #[serde(default)]
    annotations: Option<HashMap<String, String>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LoggedMount {
    container_path: String,
    host_path: String,
    read_only: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LoggedDevice {
    container_path: String,
    host_path: String,
    permissions: String,
}

impl LoggedContainer {
    /// What the runtime was given, in the device-plugin API's own shape.
    fn into_admitted(self) -> AdmittedContainer {
        let mut device_ids = self.device_ids.unwrap_or_default();
        device_ids.sort();
        AdmittedContainer {
            name: self.name,
            resource: self.resource,
            device_ids,
            response: api::ContainerAllocateResponse {
                envs: self.envs.unwrap_or_default(),
                mounts: (self.mounts.unwrap_or_default().into_iter())
                    .map(|m| api::Mount {
                        container_path: m.container_path,
                        host_path: m.host_path,
                        read_only: m.read_only,
                    })
                    .collect(),
                devices: (self.devices.unwrap_or_default().into_iter())
                    .map(|d| api::DeviceSpec {
                        container_path: d.container_path,
                        host_path: d.host_path,
                        permissions: d.permissions,
                    })
                    .collect(),
                annotations: self.annotations.unwrap_or_default(),
                cdi_devices: Vec::new(),
            },
        }
    }
}

/// Parses one line of `admissions.jsonl`.
pub fn parse_admission(line: &str) -> Result<Admission, serde_json::Error> {
    let logged: LoggedAdmission = serde_json::from_str(line)?;
    let policy = logged
        .cpu_numa
        .map_or(NumaPolicy::None, NumaPolicy::SingleNumaNode);
    let outcome = if logged.admitted {
        let containers = logged.containers.unwrap_or_default();
        AdmissionOutcome::Admitted(
            containers
                .into_iter()
                .map(LoggedContainer::into_admitted)
                .collect(),
        )
    } else {
        AdmissionOutcome::Rejected {
            reason: logged.reason,
            message: logged.message,
        }
    };
    Ok(Admission {
        namespace: logged.namespace,
        name: logged.name,
        uid: logged.uid,
        policy,
        outcome,
    })
}

/// Follows the kubelet's admission log until the task is aborted, recording every line. The log
/// survives kubelet restarts (the Go program appends), so one follower serves a node's life.
pub async fn follow(log: PathBuf, admissions: Admissions) {
    let mut offset = 0usize;
    let mut pending = String::new();
    loop {
        if let Ok(bytes) = tokio::fs::read(&log).await
            && bytes.len() > offset
        {
            pending.push_str(&String::from_utf8_lossy(&bytes[offset..]));
            offset = bytes.len();
            while let Some(end) = pending.find('\n') {
                let line: String = pending.drain(..=end).collect();
                match parse_admission(line.trim()) {
                    Ok(a) => {
                        tracing::info!(pod = %format!("{}/{}", a.namespace, a.name), policy = ?a.policy, outcome = ?a.outcome, "admission");
                        admissions.record(a);
                    }
                    Err(e) => {
                        tracing::warn!(log = %log.display(), error = %e, "unreadable admission line")
                    }
                }
            }
        }
        tokio::time::sleep(FOLLOW_INTERVAL).await;
    }
}

/// How often the admission log is read.
const FOLLOW_INTERVAL: Duration = Duration::from_millis(25);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admitted_line_gives_each_container_its_run_options() {
        let line = r#"{"namespace":"ns","name":"p","uid":"u1","cpuNuma":1,"admitted":true,
            "containers":[{"name":"main","resource":"nvidia.com/gpu","deviceIds":["b::1","a::0"],
            "envs":{"NVIDIA_VISIBLE_DEVICES":"GPU-a"},"mounts":null,"devices":[{"containerPath":"/dev/x",
            "hostPath":"/dev/x","permissions":"rw"}],"annotations":{}}]}"#;
        let a = parse_admission(line).unwrap();
        assert_eq!(a.cpu_numa(), Some(1));
        let c = &a.admitted().unwrap()[0];
        assert_eq!(c.device_ids, ["a::0", "b::1"]);
        assert_eq!(c.response.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-a");
        assert_eq!(c.response.devices[0].permissions, "rw");
    }

    #[test]
    fn a_rejected_line_keeps_the_kubelet_reason_and_message() {
        let line = r#"{"namespace":"ns","name":"p","uid":"u1","cpuNuma":null,"admitted":false,
            "reason":"TopologyAffinityError","message":"Resources cannot be allocated","containers":null}"#;
        let a = parse_admission(line).unwrap();
        assert_eq!(a.cpu_numa(), None);
        match a.outcome {
            AdmissionOutcome::Rejected { reason, message } => {
                assert_eq!(reason, "TopologyAffinityError");
                assert_eq!(message, "Resources cannot be allocated");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_garbled_line_is_an_error() {
        assert!(parse_admission("{\"namespace\":").is_err());
    }
}

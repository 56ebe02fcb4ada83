//! `RefitRequest`: the device plugin's request to move one container's reservation onto GPUs the
//! kubelet's Topology Manager allows. The spec is immutable; the operator answers in the status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::conditions::Condition;

pub use gpuledger_fit::MAX_ALLOWED_DEVICES;

/// What the device plugin asks for.
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "gpuledger.io",
    doc = "A device plugin's request to move one container's reservation onto GPUs the kubelet's Topology Manager allows; the operator answers in status.",
    version = "v1alpha1",
    kind = "RefitRequest",
    plural = "refitrequests",
    shortname = "refit",
    category = "gpuledger",
    namespaced,
    status = "RefitRequestStatus",
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.podName"}"#,
    printcolumn = r#"{"name":"Container","type":"string","jsonPath":".spec.containerName"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Result","type":"string","jsonPath":".status.result","description":"New devices, or why the refit was refused"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("spec is immutable; create a new RefitRequest instead"))]
#[serde(rename_all = "camelCase")]
pub struct RefitRequestSpec {
    /// Name of the pod being admitted (same namespace).
    #[schemars(length(min = 1, max = 253))]
    pub pod_name: String,
    /// UID of that pod.
    #[schemars(length(min = 1, max = 64))]
    #[serde(rename = "podUID")]
    pub pod_uid: String,
    /// Node whose kubelet is admitting the pod; must be the pod's node.
    #[schemars(length(min = 1, max = 253))]
    pub node_name: String,
    /// Name of the pod's GpuReservation.
    #[schemars(length(min = 1, max = 253))]
    pub reservation: String,
    /// Position of the container in the pod, init containers first.
    pub container_index: u32,
    /// Name of that container, cross-checked against the pod.
    #[schemars(length(min = 1, max = 253))]
    pub container_name: String,
    /// Physical GPU UUIDs the kubelet allows for this container.
    #[schemars(length(min = 1, max = 512), extend("x-kubernetes-list-type" = "set"))]
    #[x_kube(validation = Rule::new("self.all(u, size(u) > 0 && size(u) <= 128)").message("allowed device UUIDs must be 1 to 128 characters"))]
    pub allowed_devices: Vec<String>,
    /// After this instant the request must not be committed. Microsecond precision: the plugin
    /// waits about two seconds in all, so whole seconds would cost it up to half its budget.
    pub deadline: MicroTime,
}

/// Outcome of a refit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RefitPhase {
    /// Not answered yet.
    #[default]
    Pending,
    /// The reservation now holds `devices` (possibly unchanged when already allowed).
    Succeeded,
    /// Refused; `reason` says why. The reservation is unchanged.
    Failed,
}

impl RefitPhase {
    /// Whether the request has been answered.
    pub fn is_terminal(self) -> bool {
        !matches!(self, RefitPhase::Pending)
    }
}

/// The operator's answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RefitRequestStatus {
    /// Generation of the spec the operator processed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RefitPhase>,
    /// On success: the container's GPUs after the refit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    /// On failure: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Devices or reason, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// Whether the reservation was moved (false for the no-op success).
    #[serde(default)]
    pub moved: bool,
    /// When the operator answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// The GitOps conditions: `Reconciling` until answered, then `Ready` (answered) or `Stalled`
    /// (refused), see [`crate::kstatus`].
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

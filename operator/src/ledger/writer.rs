//! Every write the operator makes to GpuReservations. Each one carries a precondition (create
//! fails if the name exists; updates, status applies and deletes carry the resourceVersion the
//! caller decided on), so a write based on a stale read fails with [`WriteError::Conflict`]
//! instead of overwriting; the caller re-reads and decides again. Successful writes go straight
//! into the index (read-your-writes).

use std::sync::Arc;

use gpuledger_crds::conditions::Condition;
use gpuledger_crds::names::{OPERATOR_MANAGER, RESERVATION_FINALIZER};
use gpuledger_crds::{GpuReservation, GpuReservationSpec, ReservationPhase, kstatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::{Value, json};

use super::index::{LedgerIndex, ReservationKey, rv};

/// Why a ledger write failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The object changed since the caller read it (or, for a create, already exists).
    #[error("reservation {key} changed concurrently (expected resourceVersion {expected:?})")]
    Conflict {
        /// The reservation.
        key: ReservationKey,
        /// The version the caller based its write on.
        expected: Option<String>,
    },
    /// The object is gone.
    #[error("reservation {key} not found")]
    NotFound {
        /// The reservation.
        key: ReservationKey,
    },
    /// Any other API error.
    #[error("{action} reservation {key}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// The reservation.
        key: ReservationKey,
        /// The client error.
        #[source]
        source: kube::Error,
    },
    /// The spec could not be encoded as a patch.
    #[error("encode the spec of reservation {key}: {source}")]
    Encode {
        /// The reservation.
        key: ReservationKey,
        /// The encoding error.
        #[source]
        source: serde_json::Error,
    },
}

impl WriteError {
    /// A short name of the failure, for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            WriteError::Conflict { .. } => "conflict",
            WriteError::NotFound { .. } => "not_found",
            WriteError::Api { .. } => "api",
            WriteError::Encode { .. } => "encode",
        }
    }
}

impl WriteError {
    fn from_kube(
        action: &'static str,
        key: &ReservationKey,
        rv: Option<&str>,
        e: kube::Error,
    ) -> Self {
        match &e {
            kube::Error::Api(s) if s.is_conflict() || s.is_already_exists() => {
                WriteError::Conflict {
                    key: key.clone(),
                    expected: rv.map(str::to_string),
                }
            }
            kube::Error::Api(s) if s.is_not_found() => WriteError::NotFound { key: key.clone() },
            _ => WriteError::Api {
                action,
                key: key.clone(),
                source: e,
            },
        }
    }
}

/// The status fields the operator owns (the device plugin owns `allocation`; it is never part
/// of these writes, so neither side removes the other's fields). `conditions` is written
/// whole: it starts from the object the write is guarded by ([`OperatorStatus::of`]), so the
/// plugin's `KubeletMismatch` on that version goes back unchanged.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OperatorStatus {
    /// Generation of the spec processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Phase.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<ReservationPhase>,
    /// When the phase last changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase_since: Option<Time>,
    /// Short device list for `kubectl get`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<String>,
    /// NUMA nodes for `kubectl get`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub numa: Option<String>,
    /// Every condition on the reservation after the write (one left out is removed).
    pub conditions: Vec<Condition>,
}

impl OperatorStatus {
    /// The operator-owned part of `r`'s current status.
    pub fn of(r: &GpuReservation) -> Self {
        let s = r.status.clone().unwrap_or_default();
        Self {
            observed_generation: s.observed_generation,
            phase: s.phase,
            phase_since: s.phase_since,
            devices: s.devices,
            numa: s.numa,
            conditions: s.conditions,
        }
    }
}

/// Spec writes carry the operator's field manager, so `metadata.managedFields` tells the
/// operator's spec from anyone else's: the audit reports a reservation whose spec another
/// manager wrote (a hand edit) as no longer the operator's decision.
fn operator_writes() -> PostParams {
    PostParams {
        field_manager: Some(OPERATOR_MANAGER.to_string()),
        ..PostParams::default()
    }
}

/// Merge patches, under the operator's field manager like [`operator_writes`].
pub(crate) fn operator_patches() -> PatchParams {
    PatchParams {
        field_manager: Some(OPERATOR_MANAGER.to_string()),
        ..PatchParams::default()
    }
}

/// A merge patch that makes `part` (`"spec"` or `"status"`) of a reservation `value`, guarded
/// by `rv`. A merge patch keeps every field it leaves out, so each of `optional` that `value`
/// does not have is sent as `null`; a list is replaced whole.
fn guarded_patch(
    part: &str,
    value: &impl Serialize,
    optional: &[&str],
    rv: Option<&str>,
) -> Result<Value, serde_json::Error> {
    let mut fields = serde_json::to_value(value)?;
    if let Value::Object(fields) = &mut fields {
        for field in optional {
            fields.entry(*field).or_insert(Value::Null);
        }
    }
    Ok(json!({ "metadata": { "resourceVersion": rv }, part: fields }))
}

/// The merge patch that makes a reservation's spec `spec`, guarded by `rv`.
fn spec_patch(spec: &GpuReservationSpec, rv: Option<&str>) -> Result<Value, serde_json::Error> {
    guarded_patch("spec", spec, SPEC_OPTIONAL_FIELDS, rv)
}

/// The spec's fields that are left out when empty.
const SPEC_OPTIONAL_FIELDS: &[&str] = &["alignmentSource"];

/// The annotation [`LedgerWriter::fence`] stamps: when a refit last settled a move of unknown
/// outcome by making sure it cannot apply.
pub const FENCE_ANNOTATION: &str = "gpuledger.io/refit-fenced-at";

/// The merge patch that makes the operator's share of a reservation's status `status`,
/// guarded by `rv`: each of its fields, `conditions` whole, and nothing of the plugin's
/// `allocation`.
///
/// A merge patch rather than a server-side apply, for what it costs kube-apiserver: it parses
/// an apply body with its YAML parser (about 325 KiB allocated per apply of this 2 kB body, in
/// an allocation profile of the refit bench) and tracks every field's manager, and the bytes it
/// allocates set how often its collector runs (see `gpuledger_e2e::bench::go_runtime`). The
/// resourceVersion guard already makes the write the operator's decision on one version, which
/// is what the apply's ownership bought.
fn status_patch(status: &OperatorStatus, rv: Option<&str>) -> Result<Value, serde_json::Error> {
    guarded_patch("status", status, STATUS_OPTIONAL_FIELDS, rv)
}

/// The operator's status fields that are left out when empty.
const STATUS_OPTIONAL_FIELDS: &[&str] = &[
    "observedGeneration",
    "phase",
    "phaseSince",
    "devices",
    "numa",
];

/// Writes reservations and keeps the index in step.
#[derive(Clone)]
pub struct LedgerWriter {
    client: Client,
    index: Arc<LedgerIndex>,
}

impl LedgerWriter {
    /// A writer that records into `index`.
    pub fn new(client: Client, index: Arc<LedgerIndex>) -> Self {
        Self { client, index }
    }

    /// The index this writer records into.
    pub fn index(&self) -> &Arc<LedgerIndex> {
        &self.index
    }

    fn api(&self, namespace: &str) -> Api<GpuReservation> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// Creates `r`; fails with `Conflict` when the name is taken.
    pub async fn create(&self, r: &GpuReservation) -> Result<GpuReservation, WriteError> {
        let key = ReservationKey::of(r);
        let created = self
            .api(&key.namespace)
            .create(&operator_writes(), r)
            .await
            .map_err(|e| WriteError::from_kube("create", &key, None, e))?;
        self.index.record_write(created.clone());
        Ok(created)
    }

    /// Stamps `current` with [`FENCE_ANNOTATION`] (now), guarded by the resourceVersion it was
    /// read at, and nothing else: a write that changes the version, so that no other write
    /// guarded by that version (one sent before whose outcome is unknown) can apply after it.
    /// A write that changed nothing would not do: the API server skips it, version and all.
    pub async fn fence(&self, current: &GpuReservation) -> Result<GpuReservation, WriteError> {
        let patch = json!({ "metadata": {
            "resourceVersion": current.resource_version(),
            "annotations": { FENCE_ANNOTATION: Timestamp::now().to_string() },
        }});
        self.patch_recorded(current, "fence", &patch).await
    }

    /// Sends merge patch `patch` (guarded by whatever version it names) to `current` and
    /// records the answer in the index; `action` names the write in its error.
    async fn patch_recorded(
        &self,
        current: &GpuReservation,
        action: &'static str,
        patch: &Value,
    ) -> Result<GpuReservation, WriteError> {
        let key = ReservationKey::of(current);
        let written = self
            .api(&key.namespace)
            .patch(&key.name, &operator_patches(), &Patch::Merge(patch))
            .await
            .map_err(|e| {
                WriteError::from_kube(action, &key, current.resource_version().as_deref(), e)
            })?;
        self.index.record_write(written.clone());
        Ok(written)
    }

    /// Writes `spec` as the spec of `current`, guarded by the resourceVersion `current` was
    /// read at. Only the spec is sent (a merge patch): the index keeps a trimmed copy of each
    /// reservation (see [`super::index::trimmed`]), so the object the caller holds must never be
    /// written back whole, or the labels and owner it lacks would be erased.
    pub async fn write_spec(
        &self,
        current: &GpuReservation,
        spec: &GpuReservationSpec,
    ) -> Result<GpuReservation, WriteError> {
        let patch = spec_patch(spec, current.resource_version().as_deref()).map_err(|source| {
            WriteError::Encode {
                key: ReservationKey::of(current),
                source,
            }
        })?;
        self.patch_recorded(current, "write the spec of", &patch)
            .await
    }

    /// Writes the operator's status fields on `current` (`status_patch`), guarded by its
    /// resourceVersion. Every status the operator writes is a decision on `current`'s spec, so
    /// it records that generation as observed, and the GitOps conditions for what the status
    /// now says ([`gpuledger_crds::kstatus::reservation`]).
    pub async fn write_status(
        &self,
        current: &GpuReservation,
        status: &OperatorStatus,
    ) -> Result<GpuReservation, WriteError> {
        let key = ReservationKey::of(current);
        let rv = current.resource_version();
        let mut status = status.clone();
        status.observed_generation = current.metadata.generation;
        kstatus::reservation(status.phase, &status.conditions).record(
            &mut status.conditions,
            status.observed_generation,
            Time(Timestamp::now()),
        );
        // The version this status was decided on: a newer object refuses the write.
        let patch = status_patch(&status, rv.as_deref()).map_err(|source| WriteError::Encode {
            key: key.clone(),
            source,
        })?;
        let updated = self
            .api(&key.namespace)
            .patch_status(&key.name, &operator_patches(), &Patch::Merge(&patch))
            .await
            .map_err(|e| WriteError::from_kube("write the status of", &key, rv.as_deref(), e))?;
        self.index.record_write(updated.clone());
        Ok(updated)
    }

    /// Deletes `current` if it is still at its resourceVersion. Already gone is success. The
    /// operator's finalizer is taken off first (at the same resourceVersion), so the object
    /// goes at once; a crash between the two writes leaves a reservation without the finalizer,
    /// which the next reconcile deletes.
    pub async fn delete(&self, current: &GpuReservation) -> Result<(), WriteError> {
        let key = ReservationKey::of(current);
        let unguarded;
        let current = if current
            .finalizers()
            .iter()
            .any(|f| f == RESERVATION_FINALIZER)
        {
            match self.remove_finalizer(current).await? {
                Some(updated) => {
                    unguarded = updated;
                    &unguarded
                }
                None => return Ok(()),
            }
        } else {
            current
        };
        let rv = current.resource_version();
        let params = DeleteParams::default().preconditions(Preconditions {
            resource_version: rv.clone(),
            uid: current.uid(),
        });
        let floor = self.index.deletion_floor(&key).max(version_of(current));
        match self.api(&key.namespace).delete(&key.name, &params).await {
            Ok(_) => {
                self.index.record_delete(&key, version_of(current));
                Ok(())
            }
            Err(e) => match WriteError::from_kube("delete", &key, rv.as_deref(), e) {
                WriteError::NotFound { .. } => {
                    self.index.record_delete(&key, floor);
                    Ok(())
                }
                // A UID precondition failure also arrives as a conflict: the name now belongs
                // to a newer object, which this delete must not touch.
                other => Err(other),
            },
        }
    }

    /// Puts the operator's finalizer back on `current` (guarded by its resourceVersion): a
    /// reservation written before the finalizer existed, or one an admin took it off without
    /// deleting it, is held again until its pod's GPU containers are gone.
    pub async fn add_finalizer(
        &self,
        current: &GpuReservation,
    ) -> Result<GpuReservation, WriteError> {
        let key = ReservationKey::of(current);
        let mut finalizers: Vec<&String> = current.finalizers().iter().collect();
        let ours = RESERVATION_FINALIZER.to_string();
        finalizers.push(&ours);
        let updated = self
            .set_finalizers(current, &finalizers)
            .await
            .map_err(|e| {
                let rv = current.resource_version();
                WriteError::from_kube("add the finalizer to", &key, rv.as_deref(), e)
            })?;
        self.index.record_write(updated.clone());
        Ok(updated)
    }

    /// Replaces `current`'s finalizers with `finalizers`, under the operator's field manager and
    /// guarded by the resourceVersion it was read at.
    async fn set_finalizers(
        &self,
        current: &GpuReservation,
        finalizers: &[&String],
    ) -> Result<GpuReservation, kube::Error> {
        let key = ReservationKey::of(current);
        let rv = current.resource_version();
        let patch = json!({ "metadata": { "finalizers": finalizers, "resourceVersion": rv } });
        let params = operator_patches();
        self.api(&key.namespace)
            .patch(&key.name, &params, &Patch::Merge(&patch))
            .await
    }

    /// Takes the operator's finalizer off `current` (guarded by its resourceVersion). `None`:
    /// the object is gone (it was already being deleted, or was never there).
    async fn remove_finalizer(
        &self,
        current: &GpuReservation,
    ) -> Result<Option<GpuReservation>, WriteError> {
        let key = ReservationKey::of(current);
        let rv = current.resource_version();
        let kept: Vec<&String> = current
            .finalizers()
            .iter()
            .filter(|f| *f != RESERVATION_FINALIZER)
            .collect();
        let floor = self.index.deletion_floor(&key).max(version_of(current));
        match self.set_finalizers(current, &kept).await {
            Ok(updated) if updated.metadata.deletion_timestamp.is_some() && kept.is_empty() => {
                // Already marked for deletion: without finalizers it is gone now.
                self.index
                    .record_delete(&key, floor.max(version_of(&updated)));
                Ok(None)
            }
            Ok(updated) => {
                self.index.record_write(updated.clone());
                Ok(Some(updated))
            }
            Err(e) => {
                match WriteError::from_kube("remove the finalizer of", &key, rv.as_deref(), e) {
                    WriteError::NotFound { .. } => {
                        self.index.record_delete(&key, floor);
                        Ok(None)
                    }
                    other => Err(other),
                }
            }
        }
    }

    /// Reads the current object from the API server (after a conflict) and records it.
    pub async fn reread(&self, key: &ReservationKey) -> Result<Option<GpuReservation>, WriteError> {
        let floor = self.index.deletion_floor(key);
        match self.api(&key.namespace).get_opt(&key.name).await {
            Ok(Some(r)) => {
                self.index.record_write(r.clone());
                Ok(Some(r))
            }
            Ok(None) => {
                self.index.record_delete(key, floor);
                Ok(None)
            }
            Err(e) => Err(WriteError::from_kube("read", key, None, e)),
        }
    }
}

/// `r`'s resourceVersion as a number (0 when it has none: never from the API server).
fn version_of(r: &GpuReservation) -> u64 {
    rv(r).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::conditions::reasons::OTHER_POD_HOLDS_REPLICAS;

    fn keys(v: &Value) -> Vec<String> {
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    }

    #[test]
    fn a_spec_patch_names_every_field_so_nothing_old_survives_it() {
        let full = GpuReservationSpec {
            alignment_source: Some("default".into()),
            ..GpuReservationSpec::default()
        };
        let every_field = keys(&serde_json::to_value(&full).unwrap());
        let bare = GpuReservationSpec::default();
        let patch = spec_patch(&bare, Some("42")).unwrap();
        assert_eq!(keys(&patch["spec"]), every_field, "{patch}");
        assert_eq!(patch["spec"]["alignmentSource"], Value::Null);
        assert_eq!(patch["metadata"]["resourceVersion"], "42");
        assert_eq!(
            keys(&patch),
            ["metadata", "spec"],
            "labels and owners are not touched"
        );
        let kept = spec_patch(&full, Some("42")).unwrap();
        assert_eq!(kept["spec"]["alignmentSource"], "default");
    }

    #[test]
    fn a_status_patch_names_every_operator_field_and_never_the_allocation() {
        let full = OperatorStatus {
            observed_generation: Some(3),
            phase: Some(ReservationPhase::Allocated),
            phase_since: Some(Time(Timestamp::UNIX_EPOCH)),
            devices: Some("0:8192/10".into()),
            numa: Some("0".into()),
            conditions: vec![Condition {
                type_: "KubeletMismatch".into(),
                status: "True".into(),
                reason: OTHER_POD_HOLDS_REPLICAS.into(),
                message: "the plugin's, kept as read".into(),
                observed_generation: Some(3),
                last_transition_time: Time(Timestamp::UNIX_EPOCH),
            }],
        };
        let every_field = keys(&serde_json::to_value(&full).unwrap());
        let patch = status_patch(&OperatorStatus::default(), Some("7")).unwrap();
        assert_eq!(keys(&patch["status"]), every_field, "{patch}");
        for optional in STATUS_OPTIONAL_FIELDS {
            assert_eq!(patch["status"][optional], Value::Null, "{optional}");
        }
        // An empty list clears the conditions: a merge patch replaces a list whole.
        assert_eq!(patch["status"]["conditions"], json!([]));
        assert_eq!(patch["metadata"]["resourceVersion"], "7");
        assert_eq!(keys(&patch), ["metadata", "status"]);
        let kept = status_patch(&full, Some("7")).unwrap();
        assert_eq!(kept["status"]["phase"], "Allocated");
        assert_eq!(kept["status"]["observedGeneration"], 3);
        assert_eq!(kept["status"]["conditions"][0]["type"], "KubeletMismatch");
        assert!(kept["status"].get("allocation").is_none(), "{kept}");
    }

    /// The patch replaces `conditions` whole, so the operator's share must start from every
    /// condition it read: dropping the plugin's `KubeletMismatch` here would erase it.
    #[test]
    fn the_operators_share_keeps_the_plugins_condition_as_read() {
        let mismatch = Condition {
            type_: "KubeletMismatch".into(),
            status: "True".into(),
            reason: OTHER_POD_HOLDS_REPLICAS.into(),
            message: "replica GPU-a-1 held by other/pod".into(),
            observed_generation: Some(1),
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
        };
        let r = GpuReservation {
            metadata: Default::default(),
            spec: GpuReservationSpec::default(),
            status: Some(gpuledger_crds::GpuReservationStatus {
                phase: Some(ReservationPhase::Allocated),
                conditions: vec![mismatch.clone()],
                ..Default::default()
            }),
        };
        let patch = status_patch(&OperatorStatus::of(&r), Some("5")).unwrap();
        assert_eq!(
            patch["status"]["conditions"],
            json!([serde_json::to_value(&mismatch).unwrap()])
        );
    }
}

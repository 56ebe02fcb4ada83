//! The story `make demo` tells, in the user's terms:
//!
//! 1. the ledger of an idle cluster (`kubectl get gpunodes,gpureservations,refitrequests`);
//! 2. a NumaPolicy: pods labelled `workload=training` get `best-effort` NUMA alignment;
//! 3. `inference` (no policy, alignment `none`), its CPUs on NUMA 1: scheduled onto a NUMA-1
//!    GPU (the default `spread` policy fills the highest NUMA node first), aligned as it is;
//! 4. `trainer` (matched by the policy), its CPUs on NUMA 0: scheduled onto a NUMA-1 GPU too,
//!    but the kubelet's Topology Manager only allows NUMA-0 GPUs, so the device plugin asks
//!    for a refit and the operator moves the reservation onto a NUMA-0 GPU;
//! 5. `pinned-strict` (`strict`, pinned with `nvidia.com/use-gpuuuid` to NUMA-1 GPUs), its CPUs
//!    on NUMA 0: no allowed GPU may hold it, the refit is refused, and the kubelet rejects the
//!    pod with the refusal as its reason;
//! 6. the ledger again, the operator's ledger audit, and the check that `trainer`'s GPU sits
//!    on its CPUs' NUMA node.

use std::time::Duration;

use gpuledger_crds::conditions::types::MISALIGNED;
use gpuledger_crds::{
    Alignment, GpuNode, GpuReservation, NumaPolicy, NumaPolicySpec, RefitPhase, ReservationPhase,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, ListParams, PostParams};

use crate::cluster::{ensure_namespace, wait_for};
use crate::demo::{DemoError, Progress, kubectl, step};
use crate::sim::pods::{
    GpuPod, pod_events, refit_requests, reserved_uuids, wait_bound, wait_pod_phase,
    wait_reservation,
};
use crate::sim::{Admission, AdmissionOutcome, SimCluster, SimNode};

/// Namespace of the story's pods.
pub const NS: &str = "demo";
/// Generous bound for anything the cluster has to do (two shared cores).
const WAIT: Duration = Duration::from_secs(120);
/// What `kubectl get` shows as the ledger.
const LEDGER: &str = "gpunodes,gpureservations,refitrequests";

/// Tells the story on a running cluster.
pub async fn tell(cluster: &SimCluster, progress: &mut Progress) -> Result<(), DemoError> {
    let kubeconfig = cluster.cp.kubeconfig().to_path_buf();
    step(progress, "the ledger before any pod", async {
        ensure_namespace(&cluster.cp.client(), NS).await?;
        let out = kubectl(&kubeconfig, &["get", LEDGER, "-A"]).await?;
        Ok(out)
    })
    .await
    .map(|out| progress.say(&format!("$ kubectl get {LEDGER} -A\n{out}")))?;

    let policy = step(
        progress,
        "NumaPolicy training-best-effort: pods labelled workload=training get best-effort alignment",
        apply_policy(cluster, &kubeconfig),
    )
    .await?;
    progress.say(&policy);

    let inference = step(
        progress,
        "pod inference (1 GPU, 8 GiB, 20% SMs; no policy → alignment none), CPUs on NUMA 1",
        run_pod(
            cluster,
            GpuPod::new(NS, "inference")
                .gpu_container("main", 1, 8192, 20)
                .cpu_numa(1),
        ),
    )
    .await?;
    progress.say(&inference.summary);

    let trainer = step(
        progress,
        "pod trainer (label workload=training → best-effort), CPUs on NUMA 0",
        run_pod(
            cluster,
            GpuPod::new(NS, "trainer")
                .gpu_container("main", 1, 16384, 40)
                .label("workload", "training")
                .cpu_numa(0),
        ),
    )
    .await?;
    progress.say(&trainer.summary);
    let refit = step(
        progress,
        "trainer: the kubelet allows only NUMA-0 GPUs → RefitRequest → reservation moved",
        check_refit(cluster, &trainer),
    )
    .await?;
    progress.say(&refit);

    let numa1 = numa1_gpus(cluster);
    let strict = step(
        progress,
        "pod pinned-strict (strict, pinned to the NUMA-1 GPUs), CPUs on NUMA 0 → refused",
        check_strict_refusal(
            cluster,
            GpuPod::new(NS, "pinned-strict")
                .gpu_container("main", 1, 4096, 10)
                .alignment("strict")
                .use_gpus(&numa1)
                .cpu_numa(0),
        ),
    )
    .await?;
    progress.say(&strict);

    let after = step(progress, "the ledger after", async {
        wait_usage_published(cluster, 2).await?;
        wait_policy_matched(cluster).await?;
        let ledger = kubectl(&kubeconfig, &["get", LEDGER, "-A"]).await?;
        let policies = kubectl(&kubeconfig, &["get", "numapolicies", "-n", NS]).await?;
        let events = kubectl(
            &kubeconfig,
            &["get", "events", "-n", NS, "--sort-by=.lastTimestamp"],
        )
        .await?;
        Ok(format!(
            "$ kubectl get {LEDGER} -A\n{ledger}\n$ kubectl get numapolicies -n {NS}\n{policies}\n$ kubectl get events -n {NS}\n{events}"
        ))
    })
    .await?;
    progress.say(&after);

    let audit = step(
        progress,
        "gpuledger-operator audit: no over-commit, no orphan, no silent misalignment",
        audit(&kubeconfig),
    )
    .await?;
    progress.say(&audit);

    let verdict = step(
        progress,
        "check: trainer's GPU is on its CPUs' NUMA node",
        final_check(cluster, &trainer),
    )
    .await?;
    progress.say(&verdict);
    println!(
        "\nmake demo: done in {:.0}s; stopping every process. Logs stay in {}.",
        progress.elapsed().as_secs_f64(),
        cluster.cp.run_dir().display(),
    );
    Ok(())
}

/// Runs the operator's ledger audit against the cluster; findings fail the step.
async fn audit(kubeconfig: &std::path::Path) -> Result<String, DemoError> {
    let binary = crate::sim::binaries::locate(crate::sim::binaries::OPERATOR)?;
    let out = tokio::process::Command::new(&binary)
        .arg("audit")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| DemoError::Unexpected(format!("cannot run {}: {e}", binary.display())))?;
    let report = format!(
        "$ gpuledger-operator audit\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(report)
    } else {
        Err(DemoError::Unexpected(format!(
            "the ledger audit found problems ({}):\n{report}",
            out.status
        )))
    }
}

/// A pod the kubelet simulator dealt with, and where.
struct Ran {
    name: String,
    node: String,
    admission: Admission,
    summary: String,
}

fn node_of<'a>(cluster: &'a SimCluster, name: &str) -> Result<&'a SimNode, DemoError> {
    cluster
        .node(name)
        .ok_or_else(|| DemoError::Unexpected(format!("pod bound to unknown node {name}")))
}

fn numa1_gpus(cluster: &SimCluster) -> Vec<String> {
    cluster
        .nodes
        .iter()
        .flat_map(|n| n.gpus_on_numa(1))
        .collect()
}

fn gpu_text(node: &SimNode, uuids: &[String]) -> String {
    uuids
        .iter()
        .map(|u| match node.numa_of(u) {
            Some(n) => format!("{u} (NUMA {n})"),
            None => u.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn apply_policy(
    cluster: &SimCluster,
    kubeconfig: &std::path::Path,
) -> Result<String, DemoError> {
    let policy = NumaPolicy::new(
        "training-best-effort",
        NumaPolicySpec {
            pod_selector: LabelSelector {
                match_labels: Some([("workload".to_string(), "training".to_string())].into()),
                ..Default::default()
            },
            alignment: Alignment::BestEffort,
            priority: 10,
        },
    );
    let api: Api<NumaPolicy> = Api::namespaced(cluster.cp.client(), NS);
    api.create(&PostParams::default(), &policy)
        .await
        .map_err(|e| crate::cluster::ClusterError::kube("create NumaPolicy", e))?;
    let out = kubectl(kubeconfig, &["get", "numapolicies", "-n", NS]).await?;
    Ok(format!("$ kubectl get numapolicies -n {NS}\n{out}"))
}

/// Creates the pod, waits until the scheduler bound it and the node's kubelet admitted it, and
/// until its reservation is Allocated.
async fn run_pod(cluster: &SimCluster, pod: GpuPod) -> Result<Ran, DemoError> {
    let client = cluster.cp.client();
    let created = pod.create(&client).await?;
    let name = created.metadata.name.clone().unwrap_or_default();
    let uid = created.metadata.uid.clone();
    let node_name = wait_bound(&client, NS, &name, WAIT).await?;
    let node = node_of(cluster, &node_name)?;
    let admission = node.wait_admission(NS, &name, uid.as_deref(), WAIT).await?;
    if let AdmissionOutcome::Rejected { reason, message } = &admission.outcome {
        return Err(DemoError::Unexpected(format!(
            "the kubelet rejected {name}: {reason}: {message}"
        )));
    }
    wait_pod_phase(&client, NS, &name, &["Running"], WAIT).await?;
    let r = wait_reservation(&client, NS, &name, "Allocated", WAIT, |r| {
        phase(r) == ReservationPhase::Allocated
    })
    .await?;
    let uuids = reserved_uuids(&r);
    let env = admission
        .admitted()
        .and_then(|c| c.first())
        .map(|c| {
            [
                "NVIDIA_VISIBLE_DEVICES",
                "CUDA_DEVICE_MEMORY_LIMIT_0",
                "CUDA_DEVICE_SM_LIMIT",
            ]
            .iter()
            .map(|k| {
                format!(
                    "{k}={}",
                    c.response.envs.get(*k).cloned().unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
        })
        .unwrap_or_default();
    let bound = pod_events(&client, NS, &name)
        .await?
        .into_iter()
        .find(|(reason, _)| reason == "Bound")
        .map_or_else(String::new, |(_, message)| message);
    let summary = format!(
        "extender: {bound}\nkubelet: CPUs on NUMA {}; admitted\nledger now: {} [{}]\nAllocate gave the container: {env}",
        admission
            .cpu_numa()
            .map_or_else(|| "-".to_string(), |n| n.to_string()),
        gpu_text(node, &uuids),
        r.spec.alignment,
    );
    Ok(Ran {
        name,
        node: node_name,
        admission,
        summary,
    })
}

/// Waits until the GpuNodes' usage summaries (published by the operator, rate-limited) count
/// `pods` reservations in all, so the ledger printed next is current.
async fn wait_usage_published(cluster: &SimCluster, pods: u32) -> Result<(), DemoError> {
    let api: Api<GpuNode> = Api::all(cluster.cp.client());
    wait_for(format!("GpuNode usage to count {pods} pods"), WAIT, || {
        let api = api.clone();
        async move {
            let nodes = api.list(&ListParams::default()).await?;
            let counted: u32 = nodes
                .items
                .iter()
                .filter_map(|n| n.status.as_ref()?.usage.as_ref())
                .map(|u| u.reservations)
                .sum();
            Ok::<_, kube::Error>((counted >= pods).then_some(()))
        }
    })
    .await?;
    Ok(())
}

/// Waits until the NumaPolicy reports the pod it decides (trainer).
async fn wait_policy_matched(cluster: &SimCluster) -> Result<(), DemoError> {
    let api: Api<NumaPolicy> = Api::namespaced(cluster.cp.client(), NS);
    wait_for(
        "NumaPolicy training-best-effort to count trainer",
        WAIT,
        || {
            let api = api.clone();
            async move {
                let p = api.get("training-best-effort").await?;
                let matched = p.status.map_or(0, |s| s.matched_pods);
                Ok::<_, kube::Error>((matched >= 1).then_some(()))
            }
        },
    )
    .await?;
    Ok(())
}

fn phase(r: &GpuReservation) -> ReservationPhase {
    r.status.as_ref().and_then(|s| s.phase).unwrap_or_default()
}

/// The trainer's refit: a Succeeded RefitRequest and the reservation on the CPUs' NUMA node.
async fn check_refit(cluster: &SimCluster, trainer: &Ran) -> Result<String, DemoError> {
    let client = cluster.cp.client();
    let node = node_of(cluster, &trainer.node)?;
    let refits = refit_requests(&client, NS, &trainer.name).await?;
    let Some(refit) = refits.first() else {
        let r = reservation(cluster, &trainer.name).await?;
        let misaligned = r
            .status
            .as_ref()
            .is_some_and(|s| gpuledger_crds::conditions::is_true(&s.conditions, MISALIGNED));
        return Err(DemoError::Unexpected(format!(
            "no RefitRequest was made for trainer (reservation {}, Misaligned={misaligned}); \
             does this build include the NUMA refit (issue 7)?",
            gpu_text(node, &reserved_uuids(&r))
        )));
    };
    let status = refit.status.clone().unwrap_or_default();
    if status.phase != Some(RefitPhase::Succeeded) {
        return Err(DemoError::Unexpected(format!(
            "trainer's RefitRequest ended {:?}: {}",
            status.phase,
            status.reason.unwrap_or_default()
        )));
    }
    let events = pod_events(&client, NS, &trainer.name).await?;
    let said: Vec<String> = events
        .iter()
        .filter(|(reason, _)| reason.starts_with("NumaRefit"))
        .map(|(reason, message)| format!("event {reason}: {message}"))
        .collect();
    Ok(format!(
        "RefitRequest {}: allowed [{}] → Succeeded: {}\n{}",
        refit.metadata.name.clone().unwrap_or_default(),
        gpu_text(node, &refit.spec.allowed_devices),
        gpu_text(node, &status.devices),
        said.join("\n")
    ))
}

async fn reservation(cluster: &SimCluster, pod: &str) -> Result<GpuReservation, DemoError> {
    let api: Api<GpuReservation> = Api::namespaced(cluster.cp.client(), NS);
    api.get(pod)
        .await
        .map_err(|e| crate::cluster::ClusterError::kube(format!("get reservation {pod}"), e).into())
}

/// The strict pod: rejected by the kubelet with the refusal as its reason.
async fn check_strict_refusal(cluster: &SimCluster, pod: GpuPod) -> Result<String, DemoError> {
    let client = cluster.cp.client();
    let created = pod.create(&client).await?;
    let name = created.metadata.name.clone().unwrap_or_default();
    let uid = created.metadata.uid.clone();
    let node_name = wait_bound(&client, NS, &name, WAIT).await?;
    let node = node_of(cluster, &node_name)?;
    let admission = node.wait_admission(NS, &name, uid.as_deref(), WAIT).await?;
    let AdmissionOutcome::Rejected { reason, message } = &admission.outcome else {
        return Err(DemoError::Unexpected(format!(
            "the kubelet admitted {name}, a strict pod that cannot be aligned"
        )));
    };
    let failed = wait_pod_phase(&client, NS, &name, &["Failed"], WAIT).await?;
    let status = failed.status.unwrap_or_default();
    let refits = refit_requests(&client, NS, &name).await?;
    let refused = refits
        .iter()
        .filter_map(|r| r.status.as_ref())
        .map(|s| {
            let phase = s
                .phase
                .map_or_else(|| "Pending".to_string(), |p| format!("{p:?}"));
            format!("{phase}: {}", s.reason.clone().unwrap_or_default())
        })
        .collect::<Vec<_>>()
        .join("; ");
    Ok(format!(
        "scheduled to {node_name}; RefitRequest {refused}\npod {}: {} — {}\n(kubelet: {reason}: {message})",
        status.phase.unwrap_or_default(),
        status.reason.unwrap_or_default(),
        status.message.unwrap_or_default(),
    ))
}

/// The demo's acceptance: trainer's reserved GPU is on the NUMA node of its CPUs, and what the
/// container sees is that GPU.
async fn final_check(cluster: &SimCluster, trainer: &Ran) -> Result<String, DemoError> {
    let node = node_of(cluster, &trainer.node)?;
    let r = reservation(cluster, &trainer.name).await?;
    let uuids = reserved_uuids(&r);
    let cpu = trainer.admission.cpu_numa();
    let gpu_numas: Vec<Option<u32>> = uuids.iter().map(|u| node.numa_of(u)).collect();
    let aligned = cpu.is_some() && gpu_numas.iter().all(|n| n.map(i64::from) == cpu);
    let visible = trainer
        .admission
        .admitted()
        .and_then(|c| c.first())
        .and_then(|c| c.response.envs.get("NVIDIA_VISIBLE_DEVICES").cloned())
        .unwrap_or_default();
    if !aligned || visible != uuids.join(",") {
        return Err(DemoError::Unexpected(format!(
            "trainer's CPUs are on NUMA {cpu:?} but its reservation holds {} and the container sees {visible}",
            gpu_text(node, &uuids)
        )));
    }
    Ok(format!(
        "trainer: CPUs on NUMA {}, GPU {} — the kubelet, the container and the ledger agree ✓",
        cpu.unwrap_or_default(),
        gpu_text(node, &uuids)
    ))
}

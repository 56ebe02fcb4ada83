//! A storm: 100 ordinary GPU pods and 50 attack attempts, all at once, across two simulated
//! nodes (each the real kubelet device manager, with a plugin on its node-bound ServiceAccount
//! token), through the RBAC and admission policies of `config/`. The attempts are those the
//! trust issue found, as a namespace user bound to `edit`, a node's device plugin and a careless
//! cluster admin would make them:
//!
//! - the user: GPU pods with `spec.nodeName` preset, memory-only pods, pods whose
//!   `use-gpuuuid` and `nouse-gpuuuid` name the same GPU, `gpucores` over 100, deleting
//!   reservations;
//! - node 1's plugin: taking the operator's leader Lease, deleting node 2's allocation Lease,
//!   setting `status.phase=Released` on a running pod's reservation, filing a refit for a
//!   pod of node 2;
//! - the admin: lowering a reservation's memory by hand.
//!
//! Every attempt must be refused (or, for the pods the API accepts, never bound), every ordinary
//! pod must run with exactly its reservation in its container's environment, and the audit,
//! including the comparison with what the kubelets allocated, must find nothing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod e2e_support;

use std::time::Duration;

use e2e_support::{assert_audit_clean, assert_env, env_of};
use futures::future::join_all;
use gpuledger_crds::names::{DEFAULT_NAMESPACE, reservation_name};
use gpuledger_crds::{GpuReservation, RefitRequest, RefitRequestSpec, ReservationPhase};
use gpuledger_e2e::cluster::{ensure_namespace, wait_for};
use gpuledger_e2e::sim::binaries::build_gpuledger_binaries;
use gpuledger_e2e::sim::pods::{GpuPod, reserved_uuids};
use gpuledger_e2e::sim::{DEVICE_PLUGIN_SA, Quiet, SimCluster, SimClusterOptions};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{Timestamp, ToSpan};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "storm";
const NORMAL: usize = 100;
const WAIT: Duration = Duration::from_secs(300);
const MEMORY_MIB: u64 = 1024;
const CORES: u32 = 5;

/// What one attack attempt came to.
#[derive(Debug)]
enum Outcome {
    /// The API server refused it with this status code.
    Refused(u16),
    /// The API server took the object, which must then never be bound or booked (checked at
    /// the end).
    Accepted(String),
    /// It went through: the defence is missing.
    Succeeded(String),
}

fn outcome<T>(what: &str, r: Result<T, kube::Error>) -> Outcome {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 || s.code == 422 => Outcome::Refused(s.code),
        Err(e) => Outcome::Succeeded(format!("{what}: unexpected error {e}")),
        Ok(_) => Outcome::Succeeded(what.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_attacks_leaves_the_ledger_exact() {
    build_gpuledger_binaries().unwrap();
    let cluster = SimCluster::start(SimClusterOptions::default(), &mut Quiet)
        .await
        .unwrap();
    let admin = cluster.cp.client();
    ensure_namespace(&admin, NS).await.unwrap();
    let alice = namespace_user(&cluster, "alice").await;
    let node1 = cluster.nodes[0].name().to_string();
    let node2 = cluster.nodes[1].name().to_string();
    let plugin1 = cluster
        .cp
        .client_for_service_account_on_node(DEFAULT_NAMESPACE, DEVICE_PLUGIN_SA, &node1)
        .await
        .unwrap();

    let normal = (0..NORMAL).map(|i| {
        let alice = alice.clone();
        async move {
            let pod = GpuPod::new(NS, &format!("n-{i:03}"))
                .gpu_container("main", 1, MEMORY_MIB, CORES)
                .build();
            Api::<Pod>::namespaced(alice, NS)
                .create(&PostParams::default(), &pod)
                .await
                .unwrap();
        }
    });
    let attacks = attacks(&cluster, &alice, &plugin1, &node1, &node2);
    let (_, outcomes) = tokio::join!(join_all(normal), join_all(attacks));

    assert_eq!(outcomes.len(), 50, "fifty attempts");
    let mut accepted = Vec::new();
    let mut refused = std::collections::BTreeMap::<String, usize>::new();
    for (what, o) in &outcomes {
        match o {
            Outcome::Refused(code) => *refused.entry(format!("{what} ({code})")).or_default() += 1,
            Outcome::Accepted(pod) => accepted.push(pod.clone()),
            Outcome::Succeeded(how) => panic!("attack {what} went through: {how}"),
        }
    }
    eprintln!("refused: {refused:#?}\naccepted by the API server: {accepted:?}");

    // Every ordinary pod runs with exactly its reservation.
    let reservations: Api<GpuReservation> = Api::namespaced(admin.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    for i in 0..NORMAL {
        let name = format!("n-{i:03}");
        let r = wait_for(format!("{name} allocated"), WAIT, || {
            let reservations = reservations.clone();
            let name = name.clone();
            async move {
                let r = reservations.get_opt(&reservation_name(&name)).await?;
                Ok::<_, kube::Error>(r.filter(|r| {
                    r.status
                        .as_ref()
                        .is_some_and(|s| s.phase == Some(ReservationPhase::Allocated))
                }))
            }
        })
        .await
        .unwrap();
        let pod = pods.get(&name).await.unwrap();
        assert_eq!(pod.uid().as_deref(), Some(r.spec.pod_uid.as_str()));
        let node = cluster
            .nodes
            .iter()
            .find(|n| Some(n.name()) == pod.spec.as_ref().and_then(|s| s.node_name.as_deref()))
            .unwrap_or_else(|| panic!("{name} not on a simulated node"));
        assert_eq!(r.spec.node_name, node.name());
        let admission = node.wait_admission(NS, &name, None, WAIT).await.unwrap();
        let admitted = admission.admitted().expect("admitted");
        assert_env(
            env_of(admitted, "main"),
            &reserved_uuids(&r),
            MEMORY_MIB,
            CORES,
        );
    }
    // What the API server took from the user is never bound and never booked.
    for name in &accepted {
        let pod = pods.get(name).await.unwrap();
        assert!(
            pod.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none(),
            "{name} was bound"
        );
        assert!(
            reservations
                .get_opt(&reservation_name(name))
                .await
                .unwrap()
                .is_none(),
            "{name} was booked"
        );
    }
    // The admin's edits were refused, so every reservation is still the operator's; the
    // audit, with the kubelets' allocations, finds nothing.
    assert_audit_clean(&cluster);
}

/// ServiceAccount `name` of [`NS`], bound to the built-in `edit` role there.
async fn namespace_user(cluster: &SimCluster, name: &str) -> Client {
    let binding = RoleBinding {
        metadata: ObjectMeta {
            name: Some(format!("{name}-edit")),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: "edit".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: name.into(),
            namespace: Some(NS.into()),
            ..Default::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(cluster.cp.client(), NS)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    cluster
        .cp
        .client_for_service_account(NS, name)
        .await
        .unwrap()
}

type Attempt = std::pin::Pin<Box<dyn std::future::Future<Output = (String, Outcome)> + Send>>;

/// The fifty attempts, ten kinds of five each.
fn attacks(
    cluster: &SimCluster,
    alice: &Client,
    plugin1: &Client,
    node1: &str,
    node2: &str,
) -> Vec<Attempt> {
    let admin = cluster.cp.client();
    let gpu_of_node2 = cluster.nodes[1].gpus_on_numa(0)[0].clone();
    let mut all: Vec<Attempt> = Vec::new();
    for i in 0..5 {
        let user_pods: Api<Pod> = Api::namespaced(alice.clone(), NS);
        // A GPU pod that names its node (twice: whole GPU, and memory on an init-free pod).
        for (j, memory) in [(0, 0u64), (1, 2048)] {
            let api = user_pods.clone();
            let node = if j == 0 { node1 } else { node2 }.to_string();
            all.push(Box::pin(async move {
                let mut pod = GpuPod::new(NS, &format!("nodename-{i}-{j}"));
                pod = if memory == 0 {
                    pod.gpu_container("main", 1, MEMORY_MIB, CORES)
                } else {
                    pod.gpu_container("main", 1, memory, 0)
                };
                let mut pod = pod.build();
                pod.spec.as_mut().unwrap().node_name = Some(node);
                let what = "GPU pod with spec.nodeName".to_string();
                let o = outcome(&what, api.create(&PostParams::default(), &pod).await);
                (what, o)
            }));
        }
        // Memory without a GPU count: the kubelet would never call the plugin for it.
        let api = user_pods.clone();
        all.push(Box::pin(async move {
            let name = format!("memonly-{i}");
            let mut pod = GpuPod::new(NS, &name)
                .gpu_container("main", 1, MEMORY_MIB, CORES)
                .build();
            let limits = pod.spec.as_mut().unwrap().containers[0]
                .resources
                .as_mut()
                .unwrap()
                .limits
                .as_mut()
                .unwrap();
            limits.remove("nvidia.com/gpu");
            accepted_pod(
                "memory-only pod",
                &name,
                api.create(&PostParams::default(), &pod).await,
            )
        }));
        // The same GPU both required and excluded.
        let api = user_pods.clone();
        let gpu = gpu_of_node2.clone();
        all.push(Box::pin(async move {
            let name = format!("useandnot-{i}");
            let pod = GpuPod::new(NS, &name)
                .gpu_container("main", 1, MEMORY_MIB, CORES)
                .use_gpus(std::slice::from_ref(&gpu))
                .annotate("nvidia.com/nouse-gpuuuid", &gpu)
                .build();
            accepted_pod(
                "use and nouse of one GPU",
                &name,
                api.create(&PostParams::default(), &pod).await,
            )
        }));
        // More than a whole GPU's cores.
        let api = user_pods.clone();
        all.push(Box::pin(async move {
            let name = format!("cores-{i}");
            let pod = GpuPod::new(NS, &name)
                .gpu_container("main", 1, MEMORY_MIB, 150)
                .build();
            accepted_pod(
                "gpucores over 100",
                &name,
                api.create(&PostParams::default(), &pod).await,
            )
        }));
        // The user deletes a reservation (whether or not it exists yet: RBAC says no first).
        let reservations: Api<GpuReservation> = Api::namespaced(alice.clone(), NS);
        all.push(Box::pin(async move {
            let what = "user deleting a reservation".to_string();
            let r = reservations
                .delete(
                    &reservation_name(&format!("n-{i:03}")),
                    &DeleteParams::default(),
                )
                .await;
            (what.clone(), outcome(&what, r))
        }));
        // Node 1's plugin takes the operator's leader Lease, or deletes node 2's allocation
        // Lease.
        let leases: Api<Lease> = Api::namespaced(plugin1.clone(), DEFAULT_NAMESPACE);
        let node2_lease = format!("gpuledger-alloc-{node2}");
        all.push(Box::pin(async move {
            if i % 2 == 0 {
                let what = "plugin taking the leader Lease".to_string();
                let patch = json!({"spec": {"holderIdentity": "node-1-plugin"}});
                let r = leases
                    .patch(
                        "gpuledger-operator-leader",
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await;
                (what.clone(), outcome(&what, r))
            } else {
                let what = "plugin deleting node 2's allocation Lease".to_string();
                let r = leases.delete(&node2_lease, &DeleteParams::default()).await;
                let o = match r {
                    // Deleting what does not exist yet says nothing; writing it must be refused.
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        let lease = Lease {
                            metadata: ObjectMeta {
                                name: Some(node2_lease.clone()),
                                ..Default::default()
                            },
                            ..Default::default()
                        };
                        outcome(&what, leases.create(&PostParams::default(), &lease).await)
                    }
                    other => outcome(&what, other),
                };
                (what, o)
            }
        }));
        // Node 1's plugin frees a running pod's GPUs by setting its phase.
        let as_plugin: Api<GpuReservation> = Api::namespaced(plugin1.clone(), NS);
        let as_admin: Api<GpuReservation> = Api::namespaced(admin.clone(), NS);
        let node1 = node1.to_string();
        all.push(Box::pin(async move {
            let what = "plugin setting phase Released".to_string();
            let target = booked_on(&as_admin, &node1).await;
            let patch = json!({"status": {"phase": "Released"}});
            let r = as_plugin
                .patch_status(&target, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            (what.clone(), outcome(&what, r))
        }));
        // Node 1's plugin files a refit for a pod of node 2.
        let refits: Api<RefitRequest> = Api::namespaced(plugin1.clone(), NS);
        let as_admin: Api<GpuReservation> = Api::namespaced(admin.clone(), NS);
        let (node2, gpu) = (node2.to_string(), gpu_of_node2.clone());
        all.push(Box::pin(async move {
            let what = "plugin refitting a pod of another node".to_string();
            let target = booked_on(&as_admin, &node2).await;
            let r = as_admin.get(&target).await.unwrap();
            let deadline = Timestamp::now().checked_add(5.seconds()).unwrap();
            let req = RefitRequest::new(
                &format!("forged-{i}"),
                RefitRequestSpec {
                    pod_name: r.spec.pod_name.clone(),
                    pod_uid: r.spec.pod_uid.clone(),
                    node_name: node2,
                    reservation: target,
                    container_index: 0,
                    container_name: "main".into(),
                    allowed_devices: vec![gpu],
                    deadline: MicroTime(deadline),
                },
            );
            (
                what.clone(),
                outcome(&what, refits.create(&PostParams::default(), &req).await),
            )
        }));
        // A careless admin lowers a reservation's memory by hand.
        let as_admin: Api<GpuReservation> = Api::namespaced(admin.clone(), NS);
        // Alternately on node 1 and node 2.
        let node = cluster.nodes[i % 2].name().to_string();
        all.push(Box::pin(async move {
            let what = "admin editing a reservation's spec".to_string();
            let target = booked_on(&as_admin, &node).await;
            let mut r = as_admin.get(&target).await.unwrap();
            r.spec.containers[0].devices[0].memory_mib = 1;
            // A patch, as `kubectl edit` sends: no resourceVersion to conflict on.
            let patch = json!({ "spec": r.spec });
            let o = outcome(
                &what,
                as_admin
                    .patch(&target, &PatchParams::default(), &Patch::Merge(&patch))
                    .await,
            );
            (what, o)
        }));
    }
    all
}

/// A pod the API server may take (no webhook runs here), which the extender must refuse.
fn accepted_pod(what: &str, name: &str, r: Result<Pod, kube::Error>) -> (String, Outcome) {
    let o = match r {
        Ok(_) => Outcome::Accepted(name.to_string()),
        Err(e) => outcome(what, Err::<Pod, _>(e)),
    };
    (what.to_string(), o)
}

/// The name of some reservation booked on `node`, once the storm has written one.
async fn booked_on(api: &Api<GpuReservation>, node: &str) -> String {
    wait_for(format!("a reservation on {node}"), WAIT, || async {
        let list = api.list(&Default::default()).await?;
        Ok::<_, kube::Error>(
            list.items
                .iter()
                .find(|r| r.spec.node_name == node)
                .map(ResourceExt::name_any),
        )
    })
    .await
    .unwrap()
}

//! The drift gate: `crds/yaml/` must be exactly what the Rust types generate. Changing a field
//! without running `make crds` fails here (and so in CI).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

fn yaml_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("yaml")
}

/// Every place the generated CRDs are committed: the reference copy, kustomize's base and the Helm
/// chart's `crds/` directory.
fn all_yaml_dirs() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    vec![
        yaml_dir(),
        root.join("config/crd/bases"),
        root.join("charts/gpuledger/crds"),
    ]
}

#[test]
fn committed_yaml_matches_the_types() {
    for (dir, crd) in all_yaml_dirs().into_iter().flat_map(|d| {
        gpuledger_crds::crds()
            .into_iter()
            .map(move |c| (d.clone(), c))
    }) {
        let file = dir.join(gpuledger_crds::crd_file_name(&crd));
        let committed = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}; run `make crds`", file.display()));
        let generated = gpuledger_crds::crd_yaml(&crd).unwrap();
        assert!(
            committed == generated,
            "{} is out of date with the Rust types; run `make crds` and commit the result",
            file.display()
        );
    }
}

#[test]
fn yaml_dirs_hold_exactly_the_five_crds() {
    let expected: BTreeSet<String> = gpuledger_crds::crds()
        .iter()
        .map(gpuledger_crds::crd_file_name)
        .collect();
    assert_eq!(expected.len(), 5);
    for dir in all_yaml_dirs() {
        let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml"))
            .collect();
        assert_eq!(on_disk, expected, "{}", dir.display());
    }
}

#[test]
fn every_crd_is_in_the_group_with_category_status_and_columns() {
    let want = [
        (
            "GpuNode",
            "Cluster",
            "gnode",
            vec!["GPUs", "NUMA", "Healthy", "Reserved", "Config", "Age"],
        ),
        (
            "GpuReservation",
            "Namespaced",
            "gres",
            vec![
                "Pod",
                "Node",
                "Devices",
                "NUMA",
                "Alignment",
                "Phase",
                "Age",
            ],
        ),
        (
            "RefitRequest",
            "Namespaced",
            "refit",
            vec!["Pod", "Container", "Phase", "Result", "Age"],
        ),
        (
            "NumaPolicy",
            "Namespaced",
            "numapol",
            vec!["Alignment", "Priority", "Matched", "Ready", "Age"],
        ),
        (
            "GpuConfig",
            "Cluster",
            "gconf",
            vec!["Scope", "Ready", "Refused", "Age"],
        ),
    ];
    let crds = gpuledger_crds::crds();
    assert_eq!(crds.len(), want.len());
    for (crd, (kind, scope, short, columns)) in crds.iter().zip(want) {
        assert_eq!(crd.spec.group, "gpuledger.io");
        assert_eq!(crd.spec.names.kind, kind);
        assert_eq!(crd.spec.scope, scope, "{kind}");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&[short.to_string()][..])
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["gpuledger".to_string()][..])
        );
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{kind}"
        );
        let got: Vec<&str> = v
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(got, columns, "{kind}");
        let schema = serde_json::to_string(&v.schema).unwrap();
        assert!(
            schema.contains("observedGeneration"),
            "{kind} status lacks observedGeneration"
        );
        assert!(
            schema.contains("conditions"),
            "{kind} status lacks conditions"
        );
    }
}

#[test]
fn refit_request_spec_is_immutable_and_bounded() {
    let crd = gpuledger_crds::crds()
        .into_iter()
        .find(|c| c.spec.names.kind == "RefitRequest")
        .unwrap();
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["x-kubernetes-validations"][0]["rule"],
        "self == oldSelf"
    );
    let allowed = &spec["properties"]["allowedDevices"];
    assert_eq!(allowed["minItems"], 1);
    assert_eq!(allowed["maxItems"], 512);
}

#[test]
fn alignment_is_an_enum_in_the_schema() {
    for kind in ["GpuReservation", "NumaPolicy"] {
        let crd = gpuledger_crds::crds()
            .into_iter()
            .find(|c| c.spec.names.kind == kind)
            .unwrap();
        let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
        let alignment = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"]["alignment"];
        let text = alignment.to_string();
        for v in ["none", "best-effort", "strict"] {
            assert!(text.contains(&format!("\"{v}\"")), "{kind}: {text}");
        }
        assert!(text.contains("enum"), "{kind}: {text}");
    }
}

/// The pod API refuses a pod with more GPU containers than a reservation's schema accepts, so
/// the two bounds must be one number.
#[test]
fn a_reservation_holds_as_many_containers_as_the_pod_api_admits() {
    use kube::CustomResourceExt;
    let crd = serde_json::to_value(gpuledger_crds::GpuReservation::crd()).unwrap();
    let containers = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        ["properties"]["containers"];
    assert_eq!(
        containers["maxItems"].as_u64(),
        Some(gpuledger_fit::podapi::MAX_GPU_CONTAINERS as u64),
        "{containers}"
    );
}

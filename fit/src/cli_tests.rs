//! The fit CLI on JSON strings.

use serde_json::{Value, json};

use super::cli::{CliError, evaluate};

fn scenario() -> Value {
    json!({
        "nodes": [
            {"name": "n1", "devices": [
                {"uuid": "GPU-a", "index": 0, "model": "NVIDIA A100", "memoryMiB": 40000, "cores": 100,
                 "numaNode": 0, "splitCount": 10, "healthy": true, "mig": false},
                {"uuid": "GPU-b", "index": 1, "model": "NVIDIA A100", "memoryMiB": 40000, "cores": 100,
                 "numaNode": 1, "splitCount": 10, "healthy": true, "mig": false}
            ]},
            {"name": "n2", "devices": [
                {"uuid": "GPU-c", "memoryMiB": 16000}
            ]}
        ],
        "usage": [{"uuid": "GPU-a", "sharers": 2, "memoryMiB": 10000, "cores": 20}],
        "pod": {"namespace": "default", "name": "p", "annotations": {},
                "initContainers": [],
                "containers": [
                    {"name": "sidecar"},
                    {"name": "main", "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000", "nvidia.com/gpucores": "30"}}
                ]},
        "policy": {"node": "binpack", "gpu": "binpack"}
    })
}

fn run(v: &Value) -> Result<Value, CliError> {
    Ok(serde_json::to_value(evaluate(&v.to_string())?)?)
}

#[test]
fn places_the_pod_and_explains_the_other_nodes() {
    let out = run(&scenario()).unwrap();
    assert_eq!(
        out,
        json!({
            "fits": true,
            "node": "n1",
            "containers": [
                {"name": "sidecar", "devices": []},
                {"name": "main", "devices": [{"uuid": "GPU-a", "memoryMiB": 20000, "cores": 30}]}
            ],
            "reasons": {"n2": "1/1 CardInsufficientMemory"}
        })
    );
}

/// HAMi's device config: `nvidia.com/gpumem: 50` in GiB (memoryFactor 1024) is 51200 MiB; with
/// memory scaled 1.5× each 40000 MiB GPU is published as 60000. Binpack would take the used
/// GPU-a, but its 50000 MiB left are too few: GPU-b (as HAMi's fit decides on the registered,
/// scaled sizes). n2's 16000 MiB become 24000, still too few.
#[test]
fn config_scales_devices_and_sets_the_memory_unit() {
    let mut s = scenario();
    s["pod"]["containers"][1]["limits"]["nvidia.com/gpumem"] = json!("50");
    s["config"] = json!({"memoryFactor": 1024, "deviceMemoryScaling": 1.5});
    let out = run(&s).unwrap();
    assert_eq!(
        out["containers"][1]["devices"],
        json!([{"uuid": "GPU-b", "memoryMiB": 51200, "cores": 30}])
    );
    assert_eq!(out["reasons"]["n2"], "1/1 CardInsufficientMemory");
    // Without the config the same pod asks 50 MiB and binpacks onto GPU-a.
    s.as_object_mut().unwrap().remove("config");
    let out = run(&s).unwrap();
    assert_eq!(
        out["containers"][1]["devices"],
        json!([{"uuid": "GPU-a", "memoryMiB": 50, "cores": 30}])
    );
    // defaultMemory applies to a container that gives no memory.
    let mut d = scenario();
    d["pod"]["containers"][1]["limits"] =
        json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"});
    d["config"] = json!({"defaultMemory": 3000});
    assert_eq!(
        run(&d).unwrap()["containers"][1]["devices"],
        json!([{"uuid": "GPU-a", "memoryMiB": 3000, "cores": 30}])
    );
    // Cores scaled 2×: GPU-a's 200 less the 20 in use leave room for 100, so binpack keeps it;
    // unscaled, its 80 left are too few and GPU-b is taken.
    d["pod"]["containers"][1]["limits"] = json!({"nvidia.com/gpu": "1",
        "nvidia.com/gpumem": "1000", "nvidia.com/gpucores": "100"});
    d["config"] = json!({"deviceCoreScaling": 2});
    assert_eq!(
        run(&d).unwrap()["containers"][1]["devices"][0]["uuid"],
        "GPU-a"
    );
    d.as_object_mut().unwrap().remove("config");
    assert_eq!(
        run(&d).unwrap()["containers"][1]["devices"][0]["uuid"],
        "GPU-b"
    );
}

#[test]
fn spread_policy_from_the_input_changes_the_gpu() {
    let mut s = scenario();
    s["policy"]["gpu"] = json!("spread");
    let out = run(&s).unwrap();
    assert_eq!(out["containers"][1]["devices"][0]["uuid"], "GPU-b");
}

#[test]
fn topology_aware_reads_link_scores_and_takes_the_linked_pair() {
    let dev = |uuid: &str, i: u32, links: Value| json!({"uuid": uuid, "index": i, "memoryMiB": 40000, "numaNode": 0, "linkScores": links});
    let mut s = scenario();
    s["nodes"] = json!([{"name": "n1", "devices": [
        dev("GPU-a", 0, json!({"GPU-b": 420, "GPU-c": 10})),
        dev("GPU-b", 1, json!({"GPU-a": 420, "GPU-c": 10})),
        dev("GPU-c", 2, json!({"GPU-a": 10, "GPU-b": 10})),
    ]}]);
    s["usage"] = json!([]);
    s["policy"]["gpu"] = json!("spread");
    s["pod"]["containers"][1]["limits"]["nvidia.com/gpu"] = json!("2");
    let uuids = |out: &Value| -> Vec<String> {
        out["containers"][1]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["uuid"].as_str().unwrap().to_string())
            .collect()
    };
    // Plain spread walks c, b, a and takes the first two.
    assert_eq!(uuids(&run(&s).unwrap()), ["GPU-c", "GPU-b"]);
    s["pod"]["annotations"]["hami.io/gpu-scheduler-policy"] = json!("topology-aware");
    assert_eq!(uuids(&run(&s).unwrap()), ["GPU-b", "GPU-a"]);
    s["nodes"][0]["devices"][0]["linkScores"] = json!({"GPU-z": 1});
    let err = run(&s).unwrap_err().to_string();
    assert!(
        err.contains("nodes[0].devices[0].linkScores.GPU-z"),
        "{err}"
    );
}

#[test]
fn reports_every_node_when_nothing_fits() {
    let mut s = scenario();
    s["pod"]["containers"][1]["limits"]["nvidia.com/gpumem"] = json!("50000");
    let out = run(&s).unwrap();
    assert_eq!(
        out,
        json!({"fits": false, "reasons": {
            "n1": "2/2 CardInsufficientMemory",
            "n2": "1/1 CardInsufficientMemory"
        }})
    );
}

#[test]
fn allowed_restricts_the_fit_to_the_named_node() {
    let mut s = scenario();
    s["allowed"] = json!(["GPU-b"]);
    s["node"] = json!("n1");
    let out = run(&s).unwrap();
    assert_eq!(out["fits"], true);
    assert_eq!(out["containers"][1]["devices"][0]["uuid"], "GPU-b");

    s["allowed"] = json!(["GPU-b-0"]);
    let out = run(&s).unwrap();
    assert_eq!(
        out,
        json!({"fits": false, "reasons": {"n1": "AllowedDeviceSetUnmatched"}})
    );
}

#[test]
fn current_turns_it_into_a_refit() {
    let mut s = scenario();
    s["usage"] = json!([{"uuid": "GPU-a", "sharers": 1, "memoryMiB": 20000, "cores": 30}]);
    s["allowed"] = json!(["GPU-b"]);
    s["node"] = json!("n1");
    s["current"] = json!([{"uuid": "GPU-a", "memoryMiB": 20000, "cores": 30}]);
    s["container"] = json!(1);
    let out = run(&s).unwrap();
    assert_eq!(
        out,
        json!({"fits": true, "node": "n1", "moved": true, "containers": [
            {"name": "main", "devices": [{"uuid": "GPU-b", "memoryMiB": 20000, "cores": 30}]}
        ]})
    );
    s["allowed"] = json!(["GPU-a", "GPU-b"]);
    let out = run(&s).unwrap();
    assert_eq!(out["moved"], false);
    assert_eq!(out["containers"][0]["devices"][0]["uuid"], "GPU-a");
}

#[test]
fn a_pod_without_gpus_fits_anywhere() {
    let mut s = scenario();
    s["pod"]["containers"] = json!([{"name": "plain"}]);
    let out = run(&s).unwrap();
    assert_eq!(out["fits"], true);
    assert_eq!(out["node"], Value::Null);
}

/// A change to the scenario and the text its error must contain.
type BadInput = (Box<dyn Fn(&mut Value)>, &'static str);

/// Each bad input names the offending field.
#[test]
fn bad_input_names_the_field() {
    let cases: Vec<BadInput> = vec![
        (
            Box::new(|s| s["nodes"][0]["devices"][1]["memoryMiB"] = json!("lots")),
            "nodes[0].devices[1].memoryMiB",
        ),
        (
            Box::new(|s| {
                s["nodes"][1]["devices"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("memoryMiB");
            }),
            "nodes[1].devices[0].memoryMiB: missing",
        ),
        (
            Box::new(|s| s["nodes"][0]["devices"][0]["healthy"] = json!("yes")),
            "nodes[0].devices[0].healthy",
        ),
        (
            Box::new(|s| s["nodes"][1]["name"] = json!("n1")),
            "nodes[1].name: duplicate",
        ),
        (
            Box::new(|s| s["nodes"][1]["devices"][0]["uuid"] = json!("GPU-a")),
            "nodes[1].devices[0].uuid: duplicate",
        ),
        (
            Box::new(|s| s["usage"][0]["uuid"] = json!("GPU-z")),
            "usage[0].uuid",
        ),
        (
            Box::new(|s| s["usage"][0]["cores"] = json!(-1)),
            "usage[0].cores",
        ),
        (
            Box::new(|s| s["policy"]["gpu"] = json!("mutex")),
            "policy.gpu",
        ),
        (
            Box::new(|s| s["config"] = json!({"deviceMemoryScaling": 0})),
            "config.deviceMemoryScaling",
        ),
        (
            Box::new(|s| s["config"] = json!({"deviceSplitCount": 4})),
            "config.deviceSplitCount: unknown",
        ),
        (
            Box::new(|s| {
                s.as_object_mut().unwrap().remove("pod");
            }),
            "pod: missing",
        ),
        (
            Box::new(|s| {
                s.as_object_mut().unwrap().remove("nodes");
            }),
            "nodes: missing",
        ),
        (
            Box::new(|s| s["allowed"] = json!(["GPU-a"])),
            "node: missing",
        ),
        (
            Box::new(|s| {
                s["allowed"] = json!(["GPU-a"]);
                s["node"] = json!("n9");
            }),
            "node: no node named",
        ),
        (
            Box::new(|s| s["allowed"] = json!("GPU-a")),
            "allowed: expected an array",
        ),
        (
            Box::new(|s| s["pod"]["containers"][1]["limits"]["nvidia.com/gpu"] = json!("1.5")),
            "nvidia.com/gpu",
        ),
        (
            Box::new(|s| s["pod"]["annotations"]["nvidia.com/numa-bind"] = json!("maybe")),
            "nvidia.com/numa-bind",
        ),
    ];
    for (mutate, want) in cases {
        let mut s = scenario();
        mutate(&mut s);
        let err = run(&s).unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} should mention {want:?}");
    }
    assert!(matches!(evaluate("{nope"), Err(CliError::Json(_))));
    assert!(
        evaluate("[]")
            .unwrap_err()
            .to_string()
            .contains("input: expected an object")
    );
}

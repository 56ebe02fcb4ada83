//! The shipped manifests are valid against a real API server: `kubectl kustomize config/default`
//! and the Helm chart rendered with `helm template` (default values, and with simulated
//! devices) each pass `kubectl apply --dry-run=server`, which runs the API server's full
//! validation and admission (schemas, CRD structural checks, RBAC escalation checks, Pod
//! Security). The chart duplicates config/rbac and config/admission, so their rules must be
//! equal; and the operator and device-plugin arguments in both must parse with the real
//! binaries.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_e2e::cluster::apply::parse_manifests;
use gpuledger_e2e::cluster::{
    Binaries, ControlPlane, ControlPlaneOptions, apply_path, ensure_namespace, k8s_version,
};
use gpuledger_e2e::sim::binaries::{
    DEVICE_PLUGIN, OPERATOR, build_gpuledger_binaries, locate, repo_root,
};
use serde_json::Value;

fn kubectl() -> PathBuf {
    gpuledger_e2e::demo::kubectl_binary()
}

fn helm() -> PathBuf {
    let bins = Binaries::locate().unwrap();
    bins.kube_apiserver.parent().unwrap().join("helm")
}

fn run(program: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(program)
        .args(args)
        .current_dir(repo_root())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

fn ok_stdout(program: &Path, args: &[&str], stdin: Option<&str>) -> String {
    let out = run(program, args, stdin);
    assert!(
        out.status.success(),
        "{} {}: {}\n{}",
        program.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn kustomize_default() -> String {
    ok_stdout(&kubectl(), &["kustomize", "config/default"], None)
}

fn helm_template(extra: &[&str]) -> String {
    let version = k8s_version();
    let mut args = vec![
        "template",
        "gpuledger",
        "charts/gpuledger",
        "--namespace",
        DEFAULT_NAMESPACE,
        "--kube-version",
        version,
        "--include-crds",
    ];
    args.extend_from_slice(extra);
    ok_stdout(&helm(), &args, None)
}

/// `helm template` of the chart with `extra` values, which must fail: its error output.
fn helm_template_refused(extra: &[&str]) -> String {
    let mut args = vec![
        "template",
        "gpuledger",
        "charts/gpuledger",
        "--kube-version",
        k8s_version(),
    ];
    args.extend_from_slice(extra);
    let out = run(&helm(), &args, None);
    assert!(!out.status.success(), "helm rendered {extra:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every object of a rendered YAML stream as JSON, keyed by `Kind/name`.
fn objects(yaml: &str) -> BTreeMap<String, Value> {
    parse_manifests(Path::new("<rendered>"), yaml)
        .unwrap()
        .into_iter()
        .map(|m| {
            let v = serde_json::to_value(&m.object).unwrap();
            let name = v["metadata"]["name"].as_str().unwrap().to_string();
            (format!("{}/{name}", m.gvk.kind), v)
        })
        .collect()
}

/// `kubectl apply --dry-run=server` of `yaml`; returns kubectl's report.
fn dry_run(kubeconfig: &Path, yaml: &str) -> String {
    let k = kubeconfig.to_str().unwrap();
    ok_stdout(
        &kubectl(),
        &["--kubeconfig", k, "apply", "--dry-run=server", "-f", "-"],
        Some(yaml),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_apply_with_server_side_dry_run_and_agree() {
    build_gpuledger_binaries().unwrap();
    let mut opts = ControlPlaneOptions::default().without_scheduler();
    opts.controller_manager = false;
    let cp = ControlPlane::start(opts).await.unwrap();
    // Dry-run cannot create what later objects need: the namespace and the CRDs go in for real.
    let admin = cp.client();
    ensure_namespace(&admin, DEFAULT_NAMESPACE).await.unwrap();
    apply_path(&admin, &repo_root().join("crds/yaml"))
        .await
        .unwrap();

    let kustomized = kustomize_default();
    let report = dry_run(cp.kubeconfig(), &kustomized);
    eprintln!("config/default:\n{report}");
    assert_every_object_reported(&kustomized, &report);

    let chart = helm_template(&[]);
    let report = dry_run(cp.kubeconfig(), &chart);
    eprintln!("chart (defaults):\n{report}");
    assert_every_object_reported(&chart, &report);

    // Every combination of values the README documents, each on its own.
    for values in [
        &["--set", "image.repository=registry.example/gpuledger"][..],
        &["--set", "devicePlugin.isolation.enabled=false"],
        &[
            "--set",
            "operator.extender.selfSigned=false",
            "--set",
            "webhook.certManagerCertificate=gpuledger-serving",
        ],
        &[
            "--set",
            "operator.extender.selfSigned=false",
            "--set",
            "webhook.caBundle=LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==",
        ],
        &["--set", "operator.extender.anonymousCallers=true"],
        &[
            "--set",
            "operator.extender.selfSigned=false",
            "--set",
            "operator.extender.anonymousCallers=true",
            "--set",
            "webhook.certManagerCertificate=gpuledger-serving",
        ],
        &[
            "--set",
            "scheduler.enabled=false",
            "--set",
            "scheduler.name=default-scheduler",
        ],
        &["--set", "devicePlugin.podResourcesCheck=false"],
        &["--set", "devicePlugin.health.recovery=10m"],
        &[
            "--set-json",
            r#"nodeConfigs=[{"name":"pool","nodeSelector":{"matchLabels":{"pool":"a"}},"deviceSplitCount":4,"filterDevices":{"index":[7]}}]"#,
        ],
        &["--set", "deviceConfig.enabled=false"],
    ] {
        let rendered = helm_template(values);
        let report = dry_run(cp.kubeconfig(), &rendered);
        eprintln!("chart {values:?}: {} objects", objects(&rendered).len());
        assert_every_object_reported(&rendered, &report);
    }

    // The webhook sends GPU pods to the scheduler the chart names: its own by default, or the
    // admin's scheduler with the extender merged in; without a name for that one the chart does
    // not render (GPU pods would be sent to a scheduler that is not installed).
    let operator_flag = |flag: &str, values: &[&str]| {
        container_args(&objects(&helm_template(values))["Deployment/gpuledger-operator"])
            .into_iter()
            .filter(|a| a.starts_with(flag))
            .collect::<Vec<_>>()
    };
    let scheduler_flag = |values: &[&str]| operator_flag("--scheduler-name=", values);
    assert_eq!(
        scheduler_flag(&[]),
        ["--scheduler-name=gpuledger-scheduler"]
    );
    assert_eq!(
        scheduler_flag(&["--set", "scheduler.name=gpu-scheduler"]),
        ["--scheduler-name=gpu-scheduler"]
    );
    assert_eq!(
        scheduler_flag(&[
            "--set",
            "scheduler.enabled=false",
            "--set",
            "scheduler.name=default-scheduler"
        ]),
        ["--scheduler-name=default-scheduler"]
    );
    let others = |values: &[&str]| operator_flag("--other-gpu-schedulers", values);
    assert!(others(&[]).is_empty());
    assert_eq!(
        others(&["--set", "scheduler.otherGpuSchedulers={gpu-batch,gpu-low}"]),
        ["--other-gpu-schedulers=gpu-batch,gpu-low"]
    );
    let unnamed = helm_template_refused(&["--set", "scheduler.enabled=false"]);
    assert!(
        unnamed.contains("set scheduler.name to the scheduler"),
        "{unnamed}"
    );

    // The device configuration: the cluster-wide GpuConfig by default, per-node ones on request,
    // and a per-node entry that picks no node is refused at render time (it would be a second
    // cluster-wide config).
    let configs = objects(&chart);
    assert_eq!(configs["GpuConfig/default"]["spec"]["defaultGPUNum"], 1);
    let pooled = objects(&helm_template(&[
        "--set-json",
        r#"nodeConfigs=[{"name":"pool","nodeNames":["n1"],"deviceSplitCount":4}]"#,
    ]));
    assert_eq!(pooled["GpuConfig/pool"]["spec"]["nodeNames"][0], "n1");
    assert!(
        !objects(&helm_template(&["--set", "deviceConfig.enabled=false"]))
            .contains_key("GpuConfig/default")
    );
    let unpicked = helm_template_refused(&[
        "--set-json",
        r#"nodeConfigs=[{"name":"everywhere","deviceSplitCount":4}]"#,
    ]);
    assert!(
        unpicked.contains("\"everywhere\" needs nodeNames or a nodeSelector"),
        "{unpicked}"
    );

    let simulated = helm_template(&[
        "--set-file",
        "devicePlugin.simulatedDevices=config/samples/devices-8gpu-2numa.yaml",
    ]);
    let report = dry_run(cp.kubeconfig(), &simulated);
    assert_every_object_reported(&simulated, &report);
    let sim_objects = objects(&simulated);
    let cm = &sim_objects["ConfigMap/gpuledger-simulated-devices"];
    assert!(
        cm["data"]["devices.yaml"]
            .as_str()
            .unwrap()
            .contains("GPU-00000007"),
        "{cm}"
    );
    let ds = &sim_objects["DaemonSet/gpuledger-device-plugin"];
    let args = container_args(ds);
    assert!(
        args.contains(&"--devices-from=/etc/gpuledger/devices.yaml".to_string()),
        "{args:?}"
    );
    // XID health: the default list always, recovery only when asked for.
    assert!(
        args.contains(&"--ignored-xids=13,31,43,45,68,109".to_string()),
        "{args:?}"
    );
    assert!(
        !args.iter().any(|a| a.starts_with("--xid-recovery")),
        "{args:?}"
    );
    let recovering = objects(&helm_template(&[
        "--set",
        "devicePlugin.health.recovery=10m",
    ]));
    let args = container_args(&recovering["DaemonSet/gpuledger-device-plugin"]);
    assert!(args.contains(&"--xid-recovery=10m".to_string()), "{args:?}");

    // Nothing was created by the dry runs.
    let out = ok_stdout(
        &kubectl(),
        &[
            "--kubeconfig",
            cp.kubeconfig().to_str().unwrap(),
            "get",
            "deployments,daemonsets,clusterroles",
            "-A",
            "-o",
            "name",
        ],
        None,
    );
    assert!(!out.contains("gpuledger"), "{out}");

    chart_rbac_and_admission_equal_kustomize(&kustomized, &chart);
    container_arguments_parse_with_the_real_binaries(&kustomized, "config/default");
    container_arguments_parse_with_the_real_binaries(&chart, "chart");
    container_arguments_parse_with_the_real_binaries(&simulated, "chart with simulated devices");
}

/// kubectl prints one `<kind>/<name> <verb> (server dry run)` line per object.
fn assert_every_object_reported(yaml: &str, report: &str) {
    let objs = objects(yaml);
    assert!(objs.len() >= 10, "only {} objects rendered", objs.len());
    for (key, v) in &objs {
        let name = v["metadata"]["name"].as_str().unwrap();
        let line = report
            .lines()
            .find(|l| l.contains(&format!("/{name} ")) && l.ends_with("(server dry run)"));
        assert!(
            line.is_some(),
            "{key} missing from the dry-run report:\n{report}"
        );
    }
}

/// Every difference between the chart's copies of config/rbac and config/admission and the
/// originals (rules, bindings, accounts, the policy), and the workloads' accounts.
fn rbac_and_admission_differences(kustomized: &str, chart: &str) -> Vec<String> {
    let k = objects(kustomized);
    let c = objects(chart);
    let mut diffs = Vec::new();
    let mut differ = |key: &str, field: &str| {
        let theirs = c.get(key).map(|o| &o[field]);
        if theirs != Some(&k[key][field]) {
            diffs.push(format!(
                "{key} {field}: kustomize {} vs chart {theirs:?}",
                k[key][field]
            ));
        }
    };
    let roles: Vec<&String> = k
        .keys()
        .filter(|key| key.starts_with("ClusterRole/") || key.starts_with("Role/"))
        .collect();
    assert_eq!(
        roles.len(),
        9,
        "config/rbac has 8 roles, config/scheduler one: {roles:?}"
    );
    for key in roles {
        differ(key, "rules");
    }
    for key in k.keys().filter(|key| key.contains("Binding/")) {
        differ(key, "roleRef");
        differ(key, "subjects");
    }
    for key in [
        "ValidatingAdmissionPolicy/gpuledger-device-plugin-node-scope",
        "ValidatingAdmissionPolicyBinding/gpuledger-device-plugin-node-scope",
        "ValidatingAdmissionPolicy/gpuledger-device-plugin-own-lease",
        "ValidatingAdmissionPolicyBinding/gpuledger-device-plugin-own-lease",
        "ValidatingAdmissionPolicy/gpuledger-reservation-spec-by-the-operator",
        "ValidatingAdmissionPolicyBinding/gpuledger-reservation-spec-by-the-operator",
        "ValidatingAdmissionPolicy/gpuledger-gpu-pods-through-the-scheduler",
    ] {
        differ(key, "spec");
    }
    // The roles for people reach users only through their aggregation labels.
    let aggregation = |o: &Value| -> Vec<(String, Value)> {
        o["metadata"]["labels"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(l, _)| l.starts_with("rbac.authorization.k8s.io/aggregate-to-"))
            .map(|(l, v)| (l.clone(), v.clone()))
            .collect()
    };
    for key in k.keys().filter(|key| key.starts_with("ClusterRole/")) {
        let theirs = c.get(key).map(aggregation);
        if theirs.as_ref() != Some(&aggregation(&k[key])) {
            diffs.push(format!("{key} aggregation labels differ: chart {theirs:?}"));
        }
    }
    for key in k.keys().filter(|key| key.starts_with("ServiceAccount/")) {
        if !c.contains_key(key) {
            diffs.push(format!("chart lacks {key}"));
        }
    }
    // The workloads run as those accounts.
    for (objs, what) in [(&k, "kustomize"), (&c, "chart")] {
        for (workload, account) in [
            ("Deployment/gpuledger-operator", "gpuledger-operator"),
            (
                "DaemonSet/gpuledger-device-plugin",
                "gpuledger-device-plugin",
            ),
        ] {
            let sa = &objs[workload]["spec"]["template"]["spec"]["serviceAccountName"];
            if sa != account {
                diffs.push(format!("{what} {workload} runs as {sa}, not {account}"));
            }
        }
    }
    diffs
}

fn chart_rbac_and_admission_equal_kustomize(kustomized: &str, chart: &str) {
    let diffs = rbac_and_admission_differences(kustomized, chart);
    assert!(diffs.is_empty(), "{diffs:#?}");
}

fn container_args(workload: &Value) -> Vec<String> {
    let c = &workload["spec"]["template"]["spec"]["containers"][0];
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            a.as_str()
                .unwrap()
                .replace("$(POD_NAMESPACE)", DEFAULT_NAMESPACE)
        })
        .collect()
}

fn container_command(workload: &Value) -> Vec<String> {
    workload["spec"]["template"]["spec"]["containers"][0]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// Flag names (`--x`) of a `--help` text.
fn help_flags(help: &str) -> Vec<String> {
    help.split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| {
            w.trim_end_matches([',', '.'])
                .split('=')
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// Runs `binary <prefix> <args>` with an unreadable kubeconfig, so the program stops soon after
/// parsing. clap's usage errors exit with 2 and print the usage; any other outcome (the missing
/// kubeconfig, or a later refusal such as the operator's of `--tls-cert`, which it does not serve
/// yet) means the arguments parsed.
fn parses(binary: &Path, prefix: &[&str], args: &[String], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.arg("60").arg(binary).args(prefix).args(args);
    cmd.arg("--kubeconfig=/nonexistent/gpuledger-manifests-test/kubeconfig");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null()).output().unwrap()
}

fn container_arguments_parse_with_the_real_binaries(yaml: &str, what: &str) {
    let objs = objects(yaml);
    let cases = [
        ("Deployment/gpuledger-operator", OPERATOR, vec!["run"]),
        ("DaemonSet/gpuledger-device-plugin", DEVICE_PLUGIN, vec![]),
    ];
    for (key, bin, prefix) in cases {
        let workload = &objs[key];
        let command = container_command(workload);
        assert_eq!(command[0], bin, "{what} {key}");
        assert_eq!(&command[1..], prefix.as_slice(), "{what} {key}");
        let binary = locate(bin).unwrap();
        let mut help_args: Vec<&str> = prefix.clone();
        help_args.push("--help");
        let help = ok_stdout(&binary, &help_args, None);
        let known = help_flags(&help);
        let args = container_args(workload);
        for arg in &args {
            let flag = arg.split('=').next().unwrap();
            assert!(
                known.iter().any(|k| k == flag),
                "{what} {key}: {flag} is not a flag of {bin} {}: {known:?}",
                prefix.join(" ")
            );
        }
        // The environment the manifests set from the downward API.
        let env = [
            ("NODE_NAME", "gpu-node-1"),
            ("POD_NAMESPACE", DEFAULT_NAMESPACE),
        ];
        let out = parses(&binary, &prefix, &args, &env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(
            out.status.code(),
            Some(2),
            "{what} {key}: {args:?}\n{stderr}"
        );
        assert!(
            !stderr.contains("error: unexpected argument")
                && !stderr.contains("error: invalid value"),
            "{what} {key}: {stderr}"
        );
        assert!(!stderr.contains("Usage:"), "{what} {key}: {stderr}");
    }
}

#[test]
fn help_flags_are_extracted() {
    let help = "Usage: x [OPTIONS]\n  --node-name <NODE_NAME>  Name [env: NODE_NAME=]\n  --refit <REFIT>  [default: true]\n  -h, --help  Print help\n";
    assert_eq!(help_flags(help), ["--node-name", "--refit", "--help"]);
}

#[test]
fn rbac_or_policy_drift_between_chart_and_kustomize_is_caught() {
    let kustomized = kustomize_default();
    let chart = helm_template(&[]);
    chart_rbac_and_admission_equal_kustomize(&kustomized, &chart);
    // A verb dropped from one copy, or a changed policy expression, must fail the comparison.
    let drifts = [
        chart.replacen(", \"deletecollection\"", "", 1),
        chart.replacen("endsWith(':gpuledger-device-plugin')", "endsWith(':x')", 1),
    ];
    for drifted in drifts {
        assert_ne!(drifted, chart, "the mutation must apply");
        let diffs = rbac_and_admission_differences(&kustomized, &drifted);
        assert_eq!(diffs.len(), 1, "{diffs:#?}");
    }
}

/// The metric series a registry's exposition offers: each `# TYPE` line's name with the
/// suffixes its samples carry (`_total` for a counter; `_bucket`, `_sum`, `_count` for a
/// histogram). Families not yet touched still declare their type.
fn exported_series(exposition: &str) -> Vec<String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .flat_map(|l| {
            let mut parts = l.split(' ');
            let name = parts.next().unwrap_or_default().to_string();
            let suffixes: &[&str] = match parts.next() {
                Some("counter") => &["_total"],
                Some("histogram") => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            suffixes
                .iter()
                .map(move |s| format!("{name}{s}"))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every vector selector of `expr`: the metric's name and its label matchers.
fn selectors(expr: &promql_parser::parser::Expr) -> Vec<(String, Vec<(String, String)>)> {
    use promql_parser::parser::Expr;
    let vector = |vs: &promql_parser::parser::VectorSelector| {
        let labels = vs
            .matchers
            .matchers
            .iter()
            .map(|m| (m.name.clone(), m.value.clone()))
            .collect();
        (vs.name.clone().unwrap_or_default(), labels)
    };
    match expr {
        Expr::VectorSelector(vs) => vec![vector(vs)],
        Expr::MatrixSelector(ms) => vec![vector(&ms.vs)],
        Expr::Aggregate(a) => selectors(&a.expr),
        Expr::Unary(u) => selectors(&u.expr),
        Expr::Binary(b) => [selectors(&b.lhs), selectors(&b.rhs)].concat(),
        Expr::Paren(p) => selectors(&p.expr),
        Expr::Subquery(s) => selectors(&s.expr),
        Expr::Call(c) => c.args.args.iter().flat_map(|a| selectors(a)).collect(),
        _ => Vec::new(),
    }
}

/// The chart's Prometheus Operator objects, off by default: PodMonitors for the operator and
/// the device plugins that select exactly their pods and name a port they declare, and a
/// PrometheusRule whose every expression is valid PromQL over series the operator or the device
/// plugin really exports, so an alert cannot go silent because a metric was renamed.
/// Each PodMonitor and the workload whose pods it must scrape.
const MONITORED: [(&str, &str); 2] = [
    (
        "PodMonitor/gpuledger-operator",
        "Deployment/gpuledger-operator",
    ),
    (
        "PodMonitor/gpuledger-device-plugin",
        "DaemonSet/gpuledger-device-plugin",
    ),
];

/// Each PodMonitor of `monitors` selects its workload's pods in `installed`, and only them, by
/// a port their containers declare.
fn monitors_select_their_pods(
    monitors: &BTreeMap<String, Value>,
    installed: &BTreeMap<String, Value>,
) {
    for (monitor, workload) in MONITORED {
        let monitor = &monitors[monitor];
        let pod = &installed[workload]["spec"]["template"];
        assert_eq!(
            monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"],
            "{workload}: the PodMonitor must select its pods and only them"
        );
        let port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
            .as_str()
            .unwrap();
        let declared = pod["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
            .any(|p| p["name"] == port);
        assert!(declared, "{workload} declares no port named {port}");
    }
}

/// config/monitoring, for an install from config/default: its alerts are the chart's (one
/// source, rendered by `make monitoring`), and its PodMonitors scrape config/default's pods.
#[test]
fn config_monitoring_has_the_charts_alerts_and_scrapes_config_defaults_pods() {
    let config = objects(&ok_stdout(
        &kubectl(),
        &["kustomize", "config/monitoring"],
        None,
    ));
    let chart = objects(&helm_template(&[
        "--set",
        "monitoring.prometheusRule.enabled=true",
    ]));
    let rule = "PrometheusRule/gpuledger-alerts";
    assert!(
        config[rule]["spec"] == chart[rule]["spec"],
        "config/monitoring's alerts differ from the chart's: run `make monitoring`"
    );
    assert_eq!(config[rule]["metadata"]["namespace"], DEFAULT_NAMESPACE);
    monitors_select_their_pods(&config, &objects(&kustomize_default()));
}

#[test]
fn the_charts_alerts_and_pod_monitors_watch_what_gpuledger_exports() {
    let defaults = objects(&helm_template(&[]));
    assert!(
        !defaults
            .keys()
            .any(|k| k.starts_with("PodMonitor/") || k.starts_with("PrometheusRule/")),
        "monitoring objects rendered without being asked for"
    );
    let rendered = objects(&helm_template(&[
        "--set",
        "monitoring.podMonitors.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.podMonitors.labels.release=kps",
        "--set",
        "monitoring.prometheusRule.labels.release=kps",
    ]));

    monitors_select_their_pods(&rendered, &rendered);
    for monitor in MONITORED.map(|(monitor, _)| monitor) {
        assert_eq!(rendered[monitor]["metadata"]["labels"]["release"], "kps");
    }

    // What a running operator exports: its watches started (each exports its error counts at 0).
    let operator = gpuledger_operator::telemetry::Metrics::new();
    let health = gpuledger_operator::telemetry::Health::new(
        gpuledger_operator::telemetry::WATCH_STALL_LIMIT,
        operator.watch_errors.clone(),
    );
    health.watch_started("gpureservations");
    let expositions = [
        operator.encode().unwrap(),
        gpuledger_device_plugin::metrics::Metrics::default().render(),
    ];
    let exported: Vec<String> = expositions
        .iter()
        .flat_map(|e| exported_series(e))
        .collect();
    let samples: Vec<&str> = expositions
        .iter()
        .flat_map(|e| e.lines())
        .filter(|l| !l.starts_with('#'))
        .collect();
    assert!(
        exported.contains(&"gpuledger_watch_errors_total".to_string()),
        "{exported:?}"
    );
    assert!(exported.contains(&"gpuledger_device_plugin_gpus".to_string()));

    let rule = &rendered["PrometheusRule/gpuledger-alerts"];
    assert_eq!(rule["metadata"]["labels"]["release"], "kps");
    let mut alerts = Vec::new();
    for group in rule["spec"]["groups"].as_array().unwrap() {
        for r in group["rules"].as_array().unwrap() {
            let alert = r["alert"].as_str().unwrap().to_string();
            let severity = r["labels"]["severity"].as_str().unwrap_or_default();
            assert!(
                ["critical", "warning", "info"].contains(&severity),
                "{alert}: severity {severity:?}"
            );
            for field in ["summary", "description"] {
                assert!(
                    r["annotations"][field]
                        .as_str()
                        .is_some_and(|s| !s.is_empty()),
                    "{alert}: no {field}"
                );
            }
            let expr = r["expr"].as_str().unwrap();
            let parsed = promql_parser::parser::parse(expr)
                .unwrap_or_else(|e| panic!("{alert}: {expr}: {e}"));
            for (metric, labels) in selectors(&parsed) {
                assert!(
                    exported.contains(&metric),
                    "{alert} reads {metric}, which nothing exports"
                );
                // A matcher on a label the binaries write must name a value they export (each
                // such series is exported at 0 from the start); the labels Prometheus adds to
                // a PodMonitor's targets are not theirs to check.
                let wanted: Vec<String> = labels
                    .iter()
                    .filter(|(l, _)| {
                        !["namespace", "pod", "container", "job"].contains(&l.as_str())
                    })
                    .map(|(l, v)| format!("{l}=\"{v}\""))
                    .collect();
                if !wanted.is_empty() {
                    let found = samples.iter().any(|line| {
                        line.starts_with(&format!("{metric}{{"))
                            && wanted.iter().all(|w| line.contains(w.as_str()))
                    });
                    assert!(
                        found,
                        "{alert}: no {metric} series with {wanted:?} is exported"
                    );
                }
            }
            alerts.push(alert);
        }
    }
    let count = alerts.len();
    alerts.sort();
    alerts.dedup();
    assert_eq!(alerts.len(), count, "alert names repeat");
    assert!(count >= 10, "{alerts:?}");
}

/// The pod webhooks as installed, by kustomize and by the chart: the pod mutation is called
/// again after later mutating webhooks (a proxy they add is shown no GPU too), and debug
/// containers added to GPU pods go through their own webhook, which fails closed.
#[test]
fn the_pod_webhooks_are_reinvoked_and_watch_debug_containers() {
    for (what, yaml) in [
        ("kustomize", kustomize_default()),
        ("chart", helm_template(&[])),
    ] {
        let all = objects(&yaml);
        let mutating = &all["MutatingWebhookConfiguration/gpuledger-pods"];
        let hooks = mutating["webhooks"].as_array().unwrap();
        let hook = |name: &str| {
            hooks
                .iter()
                .find(|w| w["name"] == name)
                .unwrap_or_else(|| panic!("{what}: no webhook {name}"))
        };
        let pods = hook("mutate.pods.gpuledger.io");
        assert_eq!(pods["reinvocationPolicy"], "IfNeeded", "{what}");
        let debug = hook("mutate-ephemeral.pods.gpuledger.io");
        assert_eq!(debug["failurePolicy"], "Fail", "{what}");
        assert_eq!(
            debug["clientConfig"]["service"]["path"], "/mutate-ephemeral-containers",
            "{what}"
        );
        assert_eq!(
            debug["rules"][0]["resources"],
            serde_json::json!(["pods/ephemeralcontainers"]),
            "{what}"
        );
        assert_eq!(
            debug["rules"][0]["operations"],
            serde_json::json!(["UPDATE"]),
            "{what}"
        );
    }
}

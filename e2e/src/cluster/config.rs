//! Command lines and configuration files of the control-plane components. Pure functions, so the
//! exact flags are unit-tested and readable in one place; `control_plane.rs` only runs them.
//!
//! Choices that matter (see `docs/control-plane.md`):
//! - everything binds 127.0.0.1 on ports reserved at start, so runs never collide;
//! - the API server authenticates a static admin token (`system:masters`) and ServiceAccount
//!   tokens, and authorizes with Node + RBAC, so least-privilege identities meet real RBAC;
//! - admission plugin `ServiceAccount` is off: without a kubelet nobody mounts tokens, and it
//!   would reject pods in a namespace whose `default` ServiceAccount the controller has not yet
//!   created (a race right after namespace creation);
//! - admission plugin `TaintNodesByCondition` is off and the controller manager runs without the
//!   node-lifecycle controller: fake nodes have no kubelet, so on a busy two-core machine a late
//!   heartbeat would taint them `unreachable:NoExecute` and evict test pods at random. Fake nodes
//!   still renew their Lease, for code that reads it.

use std::path::Path;

use serde_json::{Value, json};

use crate::cluster::pki::Pki;

/// Where kube-scheduler sends `nvidia.com/gpu` pods: the operator's extender on its local default.
pub const DEFAULT_EXTENDER_URL: &str = "http://127.0.0.1:9443";
/// The resource the extender manages.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Service CIDR; the `kubernetes` Service gets its first address.
pub const SERVICE_CIDR: &str = "10.0.0.0/24";
/// Issuer (and default audience) of ServiceAccount tokens, as in a default cluster.
pub const SA_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// Controllers run by kube-controller-manager: ownerReference garbage collection, namespace
/// deletion, the `default` ServiceAccount of each namespace, and ServiceAccount token Secrets.
pub const CONTROLLERS: [&str; 6] = [
    // gpuledger's roles for people join the built-in view/edit/admin roles by aggregation.
    "clusterrole-aggregation-controller",
    "garbage-collector-controller",
    "namespace-controller",
    // Writes ResourceQuota usage beside gpuledger's GPU keys, as on every real cluster.
    "resourcequota-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
];

/// Loopback ports of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    /// etcd client port.
    pub etcd_client: u16,
    /// etcd peer port (single member, but etcd insists on listening).
    pub etcd_peer: u16,
    /// kube-apiserver secure port.
    pub apiserver: u16,
    /// kube-scheduler secure port (health checks).
    pub scheduler: u16,
    /// kube-controller-manager secure port (health checks).
    pub controller_manager: u16,
}

fn flag(name: &str, value: impl std::fmt::Display) -> String {
    format!("--{name}={value}")
}

/// etcd: one member on loopback, without fsync (the data is thrown away anyway).
pub fn etcd_args(data_dir: &Path, ports: &Ports) -> Vec<String> {
    let client = format!("http://127.0.0.1:{}", ports.etcd_client);
    let peer = format!("http://127.0.0.1:{}", ports.etcd_peer);
    vec![
        flag("name", "default"),
        flag("data-dir", data_dir.display()),
        flag("listen-client-urls", &client),
        flag("advertise-client-urls", &client),
        flag("listen-peer-urls", &peer),
        flag("initial-advertise-peer-urls", &peer),
        flag("initial-cluster", format!("default={peer}")),
        flag("unsafe-no-fsync", true),
        flag("log-level", "warn"),
    ]
}

/// kube-apiserver on loopback with our PKI, token auth and Node+RBAC authorization.
pub fn apiserver_args(pki: &Pki, ports: &Ports, cert_dir: &Path) -> Vec<String> {
    vec![
        flag(
            "etcd-servers",
            format!("http://127.0.0.1:{}", ports.etcd_client),
        ),
        flag("bind-address", "127.0.0.1"),
        flag("advertise-address", "127.0.0.1"),
        flag("secure-port", ports.apiserver),
        flag("cert-dir", cert_dir.display()),
        flag("tls-cert-file", pki.serving_cert.display()),
        flag("tls-private-key-file", pki.serving_key.display()),
        flag("client-ca-file", pki.ca_cert.display()),
        flag("token-auth-file", pki.tokens_csv.display()),
        flag("authorization-mode", "Node,RBAC"),
        flag("service-cluster-ip-range", SERVICE_CIDR),
        flag("service-account-issuer", SA_ISSUER),
        flag("service-account-key-file", pki.sa_pub.display()),
        flag("service-account-signing-key-file", pki.sa_key.display()),
        flag("allow-privileged", true),
        // No real endpoints to reconcile: the `kubernetes` Service points nowhere useful.
        flag("endpoint-reconciler-type", "none"),
        flag(
            "disable-admission-plugins",
            "ServiceAccount,TaintNodesByCondition",
        ),
        // As every real cluster: a kubelet may create only mirror pods, of its own node.
        flag("enable-admission-plugins", "NodeRestriction"),
        // Publishes a front-proxy CA in kube-system/extension-apiserver-authentication, which the
        // scheduler and controller manager read for delegated authentication; without it they
        // log an error every few seconds. No front-proxy certificate is ever issued.
        flag("requestheader-client-ca-file", pki.ca_cert.display()),
        flag("requestheader-allowed-names", "front-proxy-client"),
        flag("requestheader-username-headers", "X-Remote-User"),
        flag("requestheader-group-headers", "X-Remote-Group"),
        flag("requestheader-extra-headers-prefix", "X-Remote-Extra-"),
        flag("profiling", false),
    ]
}

/// Turns on kube-apiserver's `/debug/pprof` endpoints in `args` (off by default, as in a
/// hardened cluster): for a benchmark that profiles where the API server's CPU goes.
pub fn enable_profiling(args: &mut [String]) {
    for a in args.iter_mut().filter(|a| a.starts_with("--profiling=")) {
        *a = flag("profiling", true);
    }
}

/// Flags shared by the scheduler and the controller manager: health endpoints on loopback,
/// delegated authn/authz through the admin kubeconfig, no leader election (one replica).
fn component_args(kubeconfig: &Path, port: u16, cert_dir: &Path) -> Vec<String> {
    vec![
        flag("authentication-kubeconfig", kubeconfig.display()),
        flag("authorization-kubeconfig", kubeconfig.display()),
        flag("bind-address", "127.0.0.1"),
        flag("secure-port", port),
        flag("cert-dir", cert_dir.display()),
        flag("profiling", false),
    ]
}

/// The Deployment and ReplicaSet controllers, added to [`CONTROLLERS`] on request.
pub const WORKLOAD_CONTROLLERS: [&str; 2] = ["deployment-controller", "replicaset-controller"];

/// kube-controller-manager with [`CONTROLLERS`] (and [`WORKLOAD_CONTROLLERS`] when `workloads`),
/// running as the admin.
pub fn controller_manager_args(
    kubeconfig: &Path,
    pki: &Pki,
    port: u16,
    cert_dir: &Path,
    workloads: bool,
) -> Vec<String> {
    let mut controllers = CONTROLLERS.to_vec();
    if workloads {
        controllers.extend(WORKLOAD_CONTROLLERS);
    }
    let mut args = vec![
        flag("kubeconfig", kubeconfig.display()),
        flag("leader-elect", false),
        flag("controllers", controllers.join(",")),
        flag("service-account-private-key-file", pki.sa_key.display()),
        flag("root-ca-file", pki.ca_cert.display()),
        flag("use-service-account-credentials", false),
        flag("cluster-name", "gpuledger-e2e"),
    ];
    args.extend(component_args(kubeconfig, port, cert_dir));
    args
}

/// kube-scheduler reading `config` (see [`scheduler_config_yaml`]).
pub fn scheduler_args(config: &Path, kubeconfig: &Path, port: u16, cert_dir: &Path) -> Vec<String> {
    let mut args = vec![flag("config", config.display())];
    args.extend(component_args(kubeconfig, port, cert_dir));
    args
}

/// The KubeSchedulerConfiguration: admin kubeconfig, no leader election and, when `extender` is
/// given, the gpuledger extender for `nvidia.com/gpu` pods (filter, prioritize and bind; it
/// receives node names only, since it keeps its own node cache).
pub fn scheduler_config(kubeconfig: &Path, extender: Option<&str>) -> Value {
    let mut cfg = json!({
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": { "kubeconfig": kubeconfig.display().to_string() },
        "leaderElection": { "leaderElect": false },
    });
    if let Some(url) = extender {
        cfg["extenders"] = json!([{
            "urlPrefix": url,
            "filterVerb": "filter",
            "prioritizeVerb": "prioritize",
            "bindVerb": "bind",
            "weight": 1,
            "enableHTTPS": false,
            "nodeCacheCapable": true,
            "httpTimeout": "5s",
            "ignorable": false,
            // Nodes advertise only nvidia.com/gpu (the device plugin's replicas); memory and
            // cores are the extender's business, so kube-scheduler must not look for them in
            // the node's allocatable, or no pod asking for them would ever fit.
            "managedResources": [
                { "name": GPU_RESOURCE, "ignoredByScheduler": false },
                { "name": "nvidia.com/gpumem", "ignoredByScheduler": true },
                { "name": "nvidia.com/gpumem-percentage", "ignoredByScheduler": true },
                { "name": "nvidia.com/gpucores", "ignoredByScheduler": true },
                { "name": "nvidia.com/priority", "ignoredByScheduler": true },
            ],
        }]);
    }
    cfg
}

/// A client-side rate limit of a Kubernetes component: sustained requests per second, and the
/// burst allowed above it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClientRate {
    pub qps: f32,
    pub burst: u32,
}

/// [`scheduler_config`] as YAML, with kube-scheduler's client held to `rate` when given.
pub fn scheduler_config_yaml(
    kubeconfig: &Path,
    extender: Option<&str>,
    rate: Option<ClientRate>,
) -> Result<String, serde_yaml::Error> {
    let mut cfg = scheduler_config(kubeconfig, extender);
    if let Some(rate) = rate {
        cfg["clientConnection"]["qps"] = json!(rate.qps);
        cfg["clientConnection"]["burst"] = json!(rate.burst);
    }
    serde_yaml::to_string(&cfg)
}

/// A kubeconfig with one cluster, one token user and one context, trusting `ca`.
pub fn kubeconfig(server: &str, ca: &Path, user: &str, token: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "gpuledger-e2e", "cluster": {
            "server": server,
            "certificate-authority": ca.display().to_string(),
        }}],
        "users": [{ "name": user, "user": { "token": token } }],
        "contexts": [{ "name": user, "context": { "cluster": "gpuledger-e2e", "user": user } }],
        "current-context": user,
    })
}

/// [`kubeconfig`] as YAML.
pub fn kubeconfig_yaml(
    server: &str,
    ca: &Path,
    user: &str,
    token: &str,
) -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&kubeconfig(server, ca, user, token))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn ports() -> Ports {
        Ports {
            etcd_client: 2379,
            etcd_peer: 2380,
            apiserver: 6443,
            scheduler: 10259,
            controller_manager: 10257,
        }
    }

    fn pki() -> Pki {
        let d = PathBuf::from("/run/x");
        Pki {
            ca_cert: d.join("ca.crt"),
            ca_key: d.join("ca.key"),
            serving_cert: d.join("apiserver.crt"),
            serving_key: d.join("apiserver.key"),
            sa_key: d.join("sa.key"),
            sa_pub: d.join("sa.pub"),
            tokens_csv: d.join("tokens.csv"),
            admin_token: "t".into(),
        }
    }

    #[test]
    fn everything_listens_on_loopback_only() {
        let p = ports();
        let mut all = etcd_args(Path::new("/d"), &p);
        all.extend(apiserver_args(&pki(), &p, Path::new("/c")));
        all.extend(scheduler_args(
            Path::new("/s"),
            Path::new("/k"),
            1,
            Path::new("/c"),
        ));
        all.extend(controller_manager_args(
            Path::new("/k"),
            &pki(),
            2,
            Path::new("/c"),
            true,
        ));
        let network = |a: &&String| {
            a.contains("-urls=") || a.contains("address=") || a.starts_with("--etcd-servers=")
        };
        assert!(all.iter().filter(network).count() >= 8);
        for a in all.iter().filter(network) {
            assert!(a.contains("127.0.0.1"), "{a}");
        }
    }

    #[test]
    fn profiling_is_off_unless_asked_for() {
        let mut args = apiserver_args(&pki(), &ports(), Path::new("/c"));
        assert!(args.contains(&"--profiling=false".to_string()));
        enable_profiling(&mut args);
        let profiling: Vec<&String> = args.iter().filter(|a| a.contains("profiling")).collect();
        assert_eq!(profiling, ["--profiling=true"]);
    }

    #[test]
    fn apiserver_uses_rbac_tokens_and_our_keys() {
        let args = apiserver_args(&pki(), &ports(), Path::new("/c"));
        for want in [
            "--authorization-mode=Node,RBAC",
            "--token-auth-file=/run/x/tokens.csv",
            "--service-account-signing-key-file=/run/x/sa.key",
            "--service-account-key-file=/run/x/sa.pub",
            "--etcd-servers=http://127.0.0.1:2379",
            "--secure-port=6443",
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            "--enable-admission-plugins=NodeRestriction",
        ] {
            assert!(args.iter().any(|a| a == want), "missing {want}: {args:?}");
        }
    }

    #[test]
    fn controller_manager_runs_only_the_controllers_the_tests_need() {
        let controllers = |workloads| {
            let args =
                controller_manager_args(Path::new("/k"), &pki(), 2, Path::new("/c"), workloads);
            args.iter()
                .find_map(|a| a.strip_prefix("--controllers="))
                .unwrap()
                .to_string()
        };
        let plain = controllers(false);
        assert!(plain.contains("garbage-collector-controller"));
        assert!(plain.contains("serviceaccount-token-controller"));
        assert!(plain.contains("clusterrole-aggregation-controller"));
        assert!(!plain.contains("node-lifecycle"));
        assert!(!plain.contains("deployment-controller"));
        assert!(!plain.contains('*'));
        let with_workloads = controllers(true);
        assert!(with_workloads.contains("deployment-controller"));
        assert!(with_workloads.contains("replicaset-controller"));
    }

    #[test]
    fn scheduler_config_declares_the_gpu_extender() {
        let cfg = scheduler_config(Path::new("/k"), Some(DEFAULT_EXTENDER_URL));
        let ext = &cfg["extenders"][0];
        assert_eq!(ext["urlPrefix"], "http://127.0.0.1:9443");
        assert_eq!(ext["filterVerb"], "filter");
        assert_eq!(ext["prioritizeVerb"], "prioritize");
        assert_eq!(ext["bindVerb"], "bind");
        assert_eq!(ext["nodeCacheCapable"], true);
        assert_eq!(ext["weight"], 1);
        assert_eq!(ext["httpTimeout"], "5s");
        assert_eq!(ext["managedResources"][0]["name"], "nvidia.com/gpu");
        assert_eq!(ext["managedResources"][0]["ignoredByScheduler"], false);
        assert_eq!(ext["managedResources"][1]["name"], "nvidia.com/gpumem");
        assert_eq!(ext["managedResources"][3]["name"], "nvidia.com/gpucores");
        assert_eq!(ext["managedResources"][3]["ignoredByScheduler"], true);
        let yaml = scheduler_config_yaml(Path::new("/k"), Some("http://x"), None).unwrap();
        let back: Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(back["extenders"][0]["urlPrefix"], "http://x");
        assert!(
            back["clientConnection"].get("qps").is_none(),
            "kube-scheduler's own default unless asked"
        );
        let rate = ClientRate {
            qps: 1000.0,
            burst: 2000,
        };
        let yaml = scheduler_config_yaml(Path::new("/k"), None, Some(rate)).unwrap();
        let back: Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(back["clientConnection"]["qps"], 1000.0);
        assert_eq!(back["clientConnection"]["burst"], 2000);
        assert_eq!(back["clientConnection"]["kubeconfig"], "/k");
        assert!(
            scheduler_config(Path::new("/k"), None)
                .get("extenders")
                .is_none()
        );
    }

    #[test]
    fn kubeconfig_loads_with_kube() {
        let yaml = kubeconfig_yaml(
            "https://127.0.0.1:6443",
            Path::new("/run/x/ca.crt"),
            "admin",
            "secret",
        )
        .unwrap();
        let kc = kube::config::Kubeconfig::from_yaml(&yaml).unwrap();
        assert_eq!(kc.current_context.as_deref(), Some("admin"));
        let cluster = kc.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:6443"));
        assert_eq!(
            cluster.certificate_authority.as_deref(),
            Some("/run/x/ca.crt")
        );
    }
}

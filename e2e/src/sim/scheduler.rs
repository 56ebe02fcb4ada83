//! [`GpuledgerScheduler`]: the Helm chart's own `gpuledger-scheduler` on the local control plane —
//! the upstream kube-scheduler binary running the configuration the chart renders, with the
//! chart's RBAC for it, next to the cluster's default scheduler — trusting the CA the operator
//! created for itself ([`operator_tls_args`]).
//!
//! Only what a local cluster cannot have is changed in the rendered configuration: the
//! extender's URL names the operator's Service, which has no DNS here, so it points at the
//! operator on 127.0.0.1 with `tlsConfig.serverName` set to the Service's name (the certificate
//! is still checked against that name and the CA), and the client connection uses the
//! `gpuledger-scheduler` ServiceAccount's token instead of the in-cluster one.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpuledger_crds::names::DEFAULT_NAMESPACE;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use serde::Deserialize;
use serde_yaml::Value;

use crate::cluster::binaries::{Binaries, expected_git_version};
use crate::cluster::process::ProcessGroup;
use crate::cluster::{ClusterError, ControlPlane, apply_path, free_port, wait_for};
use crate::sim::{STARTUP_TIMEOUT, SimNodeError, binaries};

/// The scheduler's name, its Deployment's, ServiceAccount's and leader-election Lease's.
pub const GPULEDGER_SCHEDULER: &str = "gpuledger-scheduler";
/// The Helm release name the chart is rendered with.
const RELEASE: &str = "gpuledger";

/// The Secret the operator keeps its certificate in (the chart's and config/'s default).
pub const TLS_SECRET: &str = "gpuledger-extender-tls";
/// The name of the pod webhook configurations (config/webhook, the chart).
pub const WEBHOOK_CONFIGURATION: &str = "gpuledger-pods";

/// The operator Service's DNS name, which its certificate is for.
pub fn service_name() -> String {
    format!("{RELEASE}-operator.{DEFAULT_NAMESPACE}.svc")
}

/// The operator's flags for a chart-like install on the local cluster: its own certificate in
/// the chart's Secret, for the Service's name and for 127.0.0.1 (the API server calls the
/// webhook by URL here), and the webhook configurations' caBundle kept by it.
pub fn operator_tls_args() -> Vec<String> {
    vec![
        format!("--self-signed-tls={TLS_SECRET}"),
        format!("--tls-names={},127.0.0.1", service_name()),
        format!("--webhook-configuration={WEBHOOK_CONFIGURATION}"),
    ]
}

/// The operator's CA (`ca.crt` of its Secret), as it created it.
pub async fn operator_ca(cp: &ControlPlane) -> Result<String, SimNodeError> {
    operator_secret_entry(cp, "ca.crt").await
}

/// Entry `key` of the operator's certificate Secret (`ca.crt`, or gpuledger-scheduler's
/// `client.crt` and `client.key`), once the operator has written it.
pub async fn operator_secret_entry(cp: &ControlPlane, key: &str) -> Result<String, SimNodeError> {
    let secrets: Api<Secret> = Api::namespaced(cp.client(), DEFAULT_NAMESPACE);
    let entry = wait_for(
        format!("{key} in the operator's certificate Secret"),
        STARTUP_TIMEOUT,
        || {
            let secrets = secrets.clone();
            async move {
                let s = secrets.get_opt(TLS_SECRET).await?;
                Ok::<_, kube::Error>(
                    s.and_then(|s| s.data)
                        .and_then(|d| d.get(key).cloned())
                        .and_then(|b| String::from_utf8(b.0).ok()),
                )
            }
        },
    )
    .await?;
    Ok(entry)
}

/// The objects `helm template` renders for the chart (release `gpuledger` in
/// `gpuledger-system`, for the pinned Kubernetes version).
pub fn rendered_chart() -> Result<Vec<Value>, SimNodeError> {
    let helm = Binaries::locate()?
        .kube_apiserver
        .parent()
        .map(|d| d.join("helm"))
        .unwrap_or_default();
    let chart = binaries::repo_root().join("charts/gpuledger");
    let out = Command::new(&helm)
        .args(["template", RELEASE])
        .arg(&chart)
        .args(["--namespace", DEFAULT_NAMESPACE])
        .args(["--kube-version", &expected_git_version()])
        .output()
        .map_err(|source| ClusterError::Spawn {
            name: "helm".into(),
            program: helm.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(SimNodeError::Build(format!(
            "helm template {}: {}",
            chart.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_slice(&out.stdout) {
        let v = Value::deserialize(doc)
            .map_err(|e| SimNodeError::Build(format!("helm template output: {e}")))?;
        if !v.is_null() {
            objects.push(v);
        }
    }
    Ok(objects)
}

/// `(kind, name)` of a rendered object.
pub fn kind_name(v: &Value) -> (String, String) {
    (
        v["kind"].as_str().unwrap_or_default().to_string(),
        v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

/// The chart's scheduler running on the local control plane. Dropping it kills the process.
#[derive(Debug)]
pub struct GpuledgerScheduler {
    process: ProcessGroup,
    config: Value,
    log: PathBuf,
}

impl GpuledgerScheduler {
    /// Applies the chart's RBAC for the scheduler, writes its rendered configuration pointed at
    /// the operator's extender on `127.0.0.1:extender_port` (see the module docs), starts
    /// kube-scheduler with it and waits until it holds its leader-election Lease.
    pub async fn start(
        cp: &ControlPlane,
        extender_port: u16,
        dir: &Path,
    ) -> Result<Self, SimNodeError> {
        let chart = rendered_chart()?;
        let rbac: Vec<&Value> = chart
            .iter()
            .filter(|v| {
                let (kind, name) = kind_name(v);
                name.starts_with(GPULEDGER_SCHEDULER)
                    && [
                        "ServiceAccount",
                        "ClusterRoleBinding",
                        "RoleBinding",
                        "Role",
                    ]
                    .contains(&kind.as_str())
            })
            .collect();
        apply_docs(cp, &rbac, &dir.join("gpuledger-scheduler-rbac.yaml")).await?;
        let rendered = chart
            .iter()
            .find(|v| kind_name(v) == ("ConfigMap".into(), format!("{GPULEDGER_SCHEDULER}-config")))
            .and_then(|cm| cm["data"]["config.yaml"].as_str())
            .ok_or_else(|| {
                SimNodeError::Build("the chart renders no gpuledger-scheduler-config".into())
            })?;
        let mut config: Value = serde_yaml::from_str(rendered)
            .map_err(|e| SimNodeError::Build(format!("gpuledger-scheduler-config: {e}")))?;
        let extender = &mut config["extenders"][0];
        extender["urlPrefix"] = Value::from(format!("https://127.0.0.1:{extender_port}"));
        // The Secret's entries where the chart mounts them, each under the field that names it.
        for (key, field) in [
            ("ca.crt", "caFile"),
            ("client.crt", "certFile"),
            ("client.key", "keyFile"),
        ] {
            let file = dir.join(format!("operator-{key}"));
            std::fs::write(&file, operator_secret_entry(cp, key).await?)
                .map_err(|e| SimNodeError::io("write", &file, e))?;
            if extender["tlsConfig"][field].is_null() {
                return Err(SimNodeError::Build(format!(
                    "the chart's gpuledger-scheduler-config has no extenders[0].tlsConfig.{field}"
                )));
            }
            extender["tlsConfig"][field] = Value::from(file.display().to_string());
        }
        extender["tlsConfig"]["serverName"] = Value::from(service_name());
        let kubeconfig = cp
            .service_account_kubeconfig(DEFAULT_NAMESPACE, GPULEDGER_SCHEDULER, None)
            .await?;
        config["clientConnection"]["kubeconfig"] = Value::from(kubeconfig.display().to_string());
        let config_path = dir.join("gpuledger-scheduler.yaml");
        let text = serde_yaml::to_string(&config)
            .map_err(|e| SimNodeError::Build(format!("gpuledger-scheduler config: {e}")))?;
        std::fs::write(&config_path, text)
            .map_err(|e| SimNodeError::io("write", &config_path, e))?;
        let cert_dir = dir.join("gpuledger-scheduler-certs");
        std::fs::create_dir_all(&cert_dir).map_err(|e| SimNodeError::io("create", &cert_dir, e))?;
        let admin = cp.kubeconfig().display().to_string();
        let log = dir.join("gpuledger-scheduler.log");
        let mut process = ProcessGroup::new()?;
        process.spawn(
            GPULEDGER_SCHEDULER,
            &Binaries::locate()?.kube_scheduler,
            &[
                format!("--config={}", config_path.display()),
                format!("--authentication-kubeconfig={admin}"),
                format!("--authorization-kubeconfig={admin}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port()?),
                format!("--cert-dir={}", cert_dir.display()),
            ],
            &log,
        )?;
        let leases: Api<Lease> = Api::namespaced(cp.client(), DEFAULT_NAMESPACE);
        wait_for("gpuledger-scheduler to lead", STARTUP_TIMEOUT, || {
            let leases = leases.clone();
            async move {
                let lease = leases.get_opt(GPULEDGER_SCHEDULER).await?;
                Ok::<_, kube::Error>(
                    lease
                        .and_then(|l| l.spec)
                        .and_then(|s| s.holder_identity)
                        .map(|_| ()),
                )
            }
        })
        .await?;
        Ok(GpuledgerScheduler {
            process,
            config,
            log,
        })
    }

    /// The configuration it runs (the chart's, with the local changes).
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// Its log.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Pids of kube-scheduler and its group's watchdog.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut pids = self.process.pids();
        pids.push(("scheduler-watchdog".into(), self.process.pgid()));
        pids
    }

    /// Fails if kube-scheduler exited.
    pub fn check_running(&mut self) -> Result<(), SimNodeError> {
        Ok(self.process.check_running()?)
    }
}

/// Applies the chart's pod webhook configurations as rendered, except that each webhook calls
/// the operator at `https://127.0.0.1:<port>` (no Service DNS here) and that no caBundle is
/// set, then waits until the operator (run with [`operator_tls_args`]) has written its CA into
/// every webhook of both. Returns the configurations as applied.
pub async fn install_webhooks(cp: &ControlPlane, port: u16) -> Result<Vec<Value>, SimNodeError> {
    let mut hooks: Vec<Value> = rendered_chart()?
        .into_iter()
        .filter(|v| kind_name(v).0.ends_with("WebhookConfiguration"))
        .collect();
    for hook in &mut hooks {
        let (kind, name) = kind_name(hook);
        let webhooks = hook["webhooks"].as_sequence_mut().ok_or_else(|| {
            SimNodeError::Build(format!("the chart's {kind} {name} has no webhooks"))
        })?;
        for w in webhooks {
            let path = w["clientConfig"]["service"]["path"]
                .as_str()
                .ok_or_else(|| {
                    SimNodeError::Build(format!(
                        "a webhook of the chart's {kind} {name} has no clientConfig.service.path"
                    ))
                })?
                .to_string();
            let mut client_config = serde_yaml::Mapping::new();
            client_config.insert(
                "url".into(),
                Value::from(format!("https://127.0.0.1:{port}{path}")),
            );
            w["clientConfig"] = Value::Mapping(client_config);
        }
    }
    let docs: Vec<&Value> = hooks.iter().collect();
    apply_docs(cp, &docs, &cp.run_dir().join("webhooks.yaml")).await?;
    let ca = operator_ca(cp).await?;
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(cp.client());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(cp.client());
    wait_for(
        "the operator's CA in both webhook configurations",
        STARTUP_TIMEOUT,
        || async {
            let m = mutating.get(WEBHOOK_CONFIGURATION).await?;
            let v = validating.get(WEBHOOK_CONFIGURATION).await?;
            let mut bundles = m
                .webhooks
                .iter()
                .flatten()
                .map(|w| w.client_config.ca_bundle.clone())
                .chain(
                    v.webhooks
                        .iter()
                        .flatten()
                        .map(|w| w.client_config.ca_bundle.clone()),
                );
            let set = bundles.all(|b| b.is_some_and(|b| b.0 == ca.as_bytes()));
            Ok::<_, kube::Error>(set.then_some(()))
        },
    )
    .await?;
    Ok(hooks)
}

/// Writes `docs` to `path` and applies them (server-side, as `cluster::apply_path` does).
pub async fn apply_docs(
    cp: &ControlPlane,
    docs: &[&Value],
    path: &Path,
) -> Result<(), SimNodeError> {
    let mut yaml = String::new();
    for d in docs {
        let text = serde_yaml::to_string(d)
            .map_err(|e| SimNodeError::Build(format!("rendering {}: {e}", path.display())))?;
        yaml.push_str("---\n");
        yaml.push_str(&text);
    }
    std::fs::write(path, yaml).map_err(|e| SimNodeError::io("write", path, e))?;
    apply_path(&cp.client(), path).await?;
    Ok(())
}

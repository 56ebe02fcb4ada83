//! Flags of `gpuledger-operator run` (each also read from an environment variable).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use gpuledger_crds::duration::{parse_duration, parse_positive_duration};

use gpuledger_crds::Alignment;
use gpuledger_crds::names::DEFAULT_NAMESPACE;
use gpuledger_crds::podapi::SchedulerPolicy;

use crate::controllers::extender_endpoint::{ExtenderEndpoint, ThisPod};

fn parse_policy(raw: &str) -> Result<SchedulerPolicy, String> {
    SchedulerPolicy::parse("policy", raw).map_err(|e| e.to_string())
}

fn parse_alignment(raw: &str) -> Result<Alignment, String> {
    Alignment::parse("--default-alignment", raw).map_err(|e| e.to_string())
}

/// The shortest `--watch-stall-limit` accepted. Zero would have the liveness probe restart the
/// operator on a single refused request (a Role being re-applied, a CRD being upgraded).
const MIN_WATCH_STALL_LIMIT: Duration = Duration::from_secs(1);

fn parse_stall_limit(raw: &str) -> Result<Duration, String> {
    let limit = parse_duration(raw).map_err(|e| e.to_string())?;
    if limit < MIN_WATCH_STALL_LIMIT {
        return Err(format!(
            "{raw}: at least {}s, or one refused request restarts the operator",
            MIN_WATCH_STALL_LIMIT.as_secs()
        ));
    }
    Ok(limit)
}

/// `gpuledger-operator run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunConfig {
    /// Kubeconfig file; when absent, $KUBECONFIG (one path or a list) or ~/.kube/config, else
    /// the in-cluster config.
    #[arg(long, env = "GPULEDGER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Address of the scheduler extender (HTTP, or HTTPS with --tls-cert/--tls-key).
    #[arg(
        long,
        env = "GPULEDGER_EXTENDER_ADDR",
        default_value = "127.0.0.1:9443"
    )]
    pub extender_addr: SocketAddr,
    /// PEM certificate chain for the extender (in-cluster use).
    #[arg(long, env = "GPULEDGER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for the extender.
    #[arg(long, env = "GPULEDGER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Keep the extender's and the webhook's serving certificate in this Secret of --namespace,
    /// created and renewed by the operator itself (instead of --tls-cert/--tls-key).
    #[arg(long, env = "GPULEDGER_SELF_SIGNED_TLS", conflicts_with = "tls_cert")]
    pub self_signed_tls: Option<String>,
    /// DNS names and IP addresses of that certificate, comma-separated (default: the operator
    /// Service's names, `gpuledger-operator.<namespace>.svc` and its shorter forms). Only with
    /// --self-signed-tls: a certificate from --tls-cert carries its own names.
    #[arg(long, env = "GPULEDGER_TLS_NAMES", value_delimiter = ',')]
    pub tls_names: Vec<String>,
    /// PEM CA whose client certificates may call the extender's filter, prioritize and bind;
    /// only with --tls-cert. With --self-signed-tls the operator's own CA plays this part (it
    /// signs gpuledger-scheduler's client certificate in the same Secret), so no flag is needed.
    #[arg(long, env = "GPULEDGER_EXTENDER_CLIENT_CA", requires = "tls_cert")]
    pub extender_client_ca: Option<PathBuf>,
    /// Common names of the client certificates that may call filter, prioritize and bind,
    /// comma-separated: a CA may sign certificates for others than the scheduler.
    #[arg(
        long,
        env = "GPULEDGER_EXTENDER_CLIENT_NAMES",
        value_delimiter = ',',
        default_value = crate::certs::SCHEDULER_CLIENT
    )]
    pub extender_client_names: Vec<String>,
    /// Answer filter, prioritize and bind over TLS without a client certificate. Anything that
    /// reaches the port can then bind any pod to any node: only where the port is reachable from
    /// the scheduler alone (a NetworkPolicy, say).
    #[arg(long, env = "GPULEDGER_EXTENDER_ANONYMOUS_CALLERS")]
    pub extender_anonymous_callers: bool,
    /// Mutating and validating webhook configurations (one name) whose caBundle the operator
    /// keeps equal to its CA; only with --self-signed-tls (with --tls-cert the caBundle is the
    /// installer's to keep); empty: none.
    #[arg(long, env = "GPULEDGER_WEBHOOK_CONFIGURATION", default_value = "")]
    pub webhook_configuration: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "GPULEDGER_METRICS_ADDR", default_value = "127.0.0.1:9090")]
    pub metrics_addr: SocketAddr,
    /// Namespace of the operator's Leases (leader election and per-node allocation).
    #[arg(long, env = "GPULEDGER_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Alignment of pods that have neither an annotation nor a matching NumaPolicy.
    #[arg(long, env = "GPULEDGER_DEFAULT_ALIGNMENT", default_value = "none", value_parser = parse_alignment)]
    pub default_alignment: Alignment,
    /// Take part in leader election; without it this replica always leads (single replica).
    #[arg(long, env = "GPULEDGER_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Identity in leader election (defaults to hostname and process id).
    #[arg(long, env = "GPULEDGER_IDENTITY")]
    pub identity: Option<String>,
    /// How long the API server may keep refusing a watch (403, 404 …) before `/healthz` (the
    /// liveness probe) reports it. A watch failing because the server does not serve (down,
    /// restarting, overloaded) is never reported: a restart would not cure it.
    #[arg(long, env = "GPULEDGER_WATCH_STALL_LIMIT", default_value = "90s", value_parser = parse_stall_limit)]
    pub watch_stall_limit: Duration,
    /// How long a reservation may stay Allocating before it fails and frees the node's Lease.
    #[arg(long, env = "GPULEDGER_ALLOCATING_TIMEOUT", default_value = "5m", value_parser = parse_positive_duration)]
    pub allocating_timeout: Duration,
    /// Default node choice policy (pods may override with hami.io/node-scheduler-policy).
    #[arg(long, env = "GPULEDGER_NODE_POLICY", default_value = "binpack", value_parser = parse_policy)]
    pub node_policy: SchedulerPolicy,
    /// Default GPU choice policy (pods may override with hami.io/gpu-scheduler-policy).
    #[arg(long, env = "GPULEDGER_GPU_POLICY", default_value = "spread", value_parser = parse_policy)]
    pub gpu_policy: SchedulerPolicy,
    /// How long bind waits for a node's allocation Lease held by another pod being admitted.
    #[arg(long, env = "GPULEDGER_LEASE_WAIT", default_value = "3s", value_parser = parse_positive_duration)]
    pub lease_wait: Duration,
    /// Minimum interval between two writes of one GpuNode's status.usage (a display field for
    /// `kubectl get gpunodes`: under churn every busy node costs one write per interval); also
    /// the beat of GPU quota usage and of the upkeep of the extender's fit views.
    #[arg(long, env = "GPULEDGER_USAGE_INTERVAL", default_value = "5s", value_parser = parse_positive_duration)]
    pub usage_interval: Duration,
    /// How long answered RefitRequests are kept (for `kubectl get refit`) before deletion.
    #[arg(long, env = "GPULEDGER_REFIT_TTL", default_value = "10m", value_parser = parse_duration)]
    pub refit_ttl: Duration,
    /// The scheduler the admission webhook sends GPU pods to (`schedulerName`), the chart's
    /// gpuledger-scheduler by default.
    #[arg(
        long,
        env = "GPULEDGER_SCHEDULER_NAME",
        default_value = "gpuledger-scheduler"
    )]
    pub scheduler_name: String,
    /// Other schedulers GPU pods may name, comma-separated: only ones that call gpuledger's
    /// extender (another profile of a kube-scheduler that has it). A GPU pod naming any other is
    /// refused by the webhook: that scheduler would bind it without a reservation.
    #[arg(long, env = "GPULEDGER_OTHER_GPU_SCHEDULERS", value_delimiter = ',')]
    pub other_gpu_schedulers: Vec<String>,
    /// How long a bound GPU pod may go without a reservation on its node before the operator
    /// books it (or reports that it cannot): well above how far the reservation watch lags.
    #[arg(long, env = "GPULEDGER_REPAIR_AFTER", default_value = "5s", value_parser = parse_duration)]
    pub repair_after: Duration,
    /// Service (in --namespace) that reaches the extender and the webhook: while this replica
    /// leads, it keeps that Service's one endpoint (EndpointSlice `<service>-leader`) on its own
    /// pod, so the Service needs no selector and every warm replica can be Ready. Needs
    /// --pod-name, --pod-uid and --pod-ip; empty: no endpoint is written (one replica, or a
    /// Service that selects its pods itself).
    #[arg(long, env = "GPULEDGER_EXTENDER_SERVICE", default_value = "")]
    pub extender_service: String,
    /// This replica's pod name (downward API `metadata.name`).
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// This replica's pod UID (downward API `metadata.uid`): the owner of its endpoint.
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,
    /// This replica's pod IP (downward API `status.podIP`).
    #[arg(long, env = "POD_IP")]
    pub pod_ip: Option<std::net::IpAddr>,
}

/// A flag combination `run` cannot work with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// --extender-service without the pod it would name.
    #[error("--extender-service {service} needs {missing} (the downward API's pod fields)")]
    ExtenderServiceWithoutPod {
        /// The Service.
        service: String,
        /// The flags that are missing.
        missing: String,
    },
    /// --tls-cert without saying who may call the extender.
    #[error(
        "--tls-cert serves the extender without knowing its callers: give --extender-client-ca \
         (the CA of kube-scheduler's client certificate), or --extender-anonymous-callers where \
         only the scheduler can reach the port"
    )]
    TlsWithoutCallers,
    /// A flag that only the operator's own certificate reads, without --self-signed-tls.
    #[error(
        "{flag} is read only with --self-signed-tls (with --tls-cert the certificate and the \
         webhooks' caBundle are the installer's to keep): remove it, or use --self-signed-tls"
    )]
    SelfSignedOnly {
        /// The flag given.
        flag: &'static str,
    },
}

impl RunConfig {
    /// Whether the extender's routes insist on a caller's client certificate: over TLS, unless
    /// --extender-anonymous-callers. Plain HTTP (a local run, tests) has no certificates to ask
    /// for. Refuses --tls-cert that names neither the callers' CA nor anonymous callers.
    pub fn callers_certified(&self) -> Result<bool, ConfigError> {
        if self.extender_anonymous_callers {
            return Ok(false);
        }
        if self.tls_cert.is_some() && self.extender_client_ca.is_none() {
            return Err(ConfigError::TlsWithoutCallers);
        }
        Ok(self.tls_cert.is_some() || self.self_signed_tls.is_some())
    }

    /// Refuses the flags of the operator's own certificate without --self-signed-tls, where
    /// they would be ignored without a word. (Checked here rather than by clap: clap waives a
    /// required flag when one it conflicts with, --tls-cert, is given.)
    pub fn check_self_signed_only(&self) -> Result<(), ConfigError> {
        if self.self_signed_tls.is_some() {
            return Ok(());
        }
        if !self.tls_names.is_empty() {
            return Err(ConfigError::SelfSignedOnly {
                flag: "--tls-names",
            });
        }
        if !self.webhook_configuration.is_empty() {
            return Err(ConfigError::SelfSignedOnly {
                flag: "--webhook-configuration",
            });
        }
        Ok(())
    }

    /// The Service endpoint this replica keeps while it leads, `None` without
    /// --extender-service.
    pub fn extender_endpoint(&self) -> Result<Option<ExtenderEndpoint>, ConfigError> {
        if self.extender_service.is_empty() {
            return Ok(None);
        }
        let (Some(name), Some(uid), Some(ip)) = (&self.pod_name, &self.pod_uid, self.pod_ip) else {
            let missing: Vec<&str> = [
                ("--pod-name", self.pod_name.is_none()),
                ("--pod-uid", self.pod_uid.is_none()),
                ("--pod-ip", self.pod_ip.is_none()),
            ]
            .into_iter()
            .filter_map(|(flag, absent)| absent.then_some(flag))
            .collect();
            return Err(ConfigError::ExtenderServiceWithoutPod {
                service: self.extender_service.clone(),
                missing: missing.join(", "),
            });
        };
        Ok(Some(ExtenderEndpoint {
            service: self.extender_service.clone(),
            namespace: self.namespace.clone(),
            pod: ThisPod {
                name: name.clone(),
                uid: uid.clone(),
                ip,
            },
            extender_port: self.extender_addr.port(),
            metrics_port: self.metrics_addr.port(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunConfig,
    }

    #[test]
    fn defaults_match_the_contract() {
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.run.extender_addr.to_string(), "127.0.0.1:9443");
        assert_eq!(cli.run.namespace, "gpuledger-system");
        assert_eq!(cli.run.default_alignment, Alignment::None);
        assert_eq!(cli.run.allocating_timeout, Duration::from_secs(300));
        assert_eq!(
            cli.run.watch_stall_limit,
            crate::telemetry::WATCH_STALL_LIMIT
        );
        assert_eq!(cli.run.node_policy, SchedulerPolicy::Binpack);
        assert_eq!(cli.run.gpu_policy, SchedulerPolicy::Spread);
        assert!(!cli.run.leader_elect);
        assert_eq!(cli.run.refit_ttl, Duration::from_secs(600));
        assert_eq!(cli.run.repair_after, Duration::from_secs(5));
        assert_eq!(cli.run.extender_client_names, ["gpuledger-scheduler"]);
        let two = Cli::try_parse_from(["x", "--extender-client-names=a,b"]).unwrap();
        assert_eq!(two.run.extender_client_names, ["a", "b"]);
    }

    #[test]
    fn a_stall_limit_under_a_second_is_refused_naming_the_flag() {
        for short in ["0s", "0", "500ms"] {
            let err = Cli::try_parse_from(["x", "--watch-stall-limit", short])
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains("--watch-stall-limit"), "{err}");
            assert!(err.contains("at least 1s"), "{err}");
        }
        let one = Cli::try_parse_from(["x", "--watch-stall-limit=1s"]).unwrap();
        assert_eq!(one.run.watch_stall_limit, Duration::from_secs(1));
    }

    /// Zero would make the usage, view and endpoint loops spin without a pause, fail every
    /// Allocating reservation at once, or give up every Lease wait before it starts.
    #[test]
    fn a_zero_period_or_wait_is_refused_naming_the_flag() {
        for flag in ["--usage-interval", "--lease-wait", "--allocating-timeout"] {
            let err = Cli::try_parse_from(["x", flag, "0s"])
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(flag) && err.contains("above zero"), "{err}");
            assert!(Cli::try_parse_from(["x", flag, "250ms"]).is_ok());
        }
    }

    #[test]
    fn an_extender_service_needs_the_pod_it_names() {
        let none = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(none.run.extender_endpoint(), Ok(None));
        let lonely =
            Cli::try_parse_from(["x", "--extender-service", "svc", "--pod-name", "a"]).unwrap();
        let err = lonely.run.extender_endpoint().unwrap_err();
        assert_eq!(
            err.to_string(),
            "--extender-service svc needs --pod-uid, --pod-ip (the downward API's pod fields)"
        );
        let full = Cli::try_parse_from([
            "x",
            "--extender-service=svc",
            "--pod-name=a",
            "--pod-uid=u",
            "--pod-ip=10.0.0.5",
            "--extender-addr=0.0.0.0:8443",
        ])
        .unwrap();
        let endpoint = full.run.extender_endpoint().unwrap().unwrap();
        assert_eq!(endpoint.slice_name(), "svc-leader");
        assert_eq!(endpoint.extender_port, 8443);
        assert_eq!(endpoint.pod.ip.to_string(), "10.0.0.5");
        assert!(Cli::try_parse_from(["x", "--pod-ip", "not-an-ip"]).is_err());
    }

    #[test]
    fn rejects_bad_alignment_and_lonely_tls_flags() {
        assert!(Cli::try_parse_from(["x", "--default-alignment", "always"]).is_err());
        assert!(Cli::try_parse_from(["x", "--tls-cert", "c.pem"]).is_err());
    }

    #[test]
    fn flags_of_the_own_certificate_are_refused_without_it() {
        // Over plain HTTP and with a certificate from files alike: ignored without a word
        // before, so a typo'd install would run with a certificate missing the names it meant.
        for (lonely, flag) in [
            ("--tls-names=a.example", "--tls-names"),
            (
                "--webhook-configuration=gpuledger-pods",
                "--webhook-configuration",
            ),
        ] {
            for tls in [&[][..], &["--tls-cert=c", "--tls-key=k"][..]] {
                let mut args = vec!["x", lonely];
                args.extend_from_slice(tls);
                let cli = Cli::try_parse_from(args).unwrap();
                let err = cli.run.check_self_signed_only().unwrap_err();
                assert_eq!(
                    err,
                    ConfigError::SelfSignedOnly { flag },
                    "{lonely} {tls:?}"
                );
                assert!(err.to_string().contains("--self-signed-tls"), "{err}");
            }
        }
        let together = Cli::try_parse_from([
            "x",
            "--self-signed-tls=s",
            "--tls-names=a.example,10.0.0.1",
            "--webhook-configuration=gpuledger-pods",
        ])
        .unwrap();
        assert_eq!(together.run.check_self_signed_only(), Ok(()));
        assert_eq!(together.run.tls_names, ["a.example", "10.0.0.1"]);
        let plain = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(plain.run.check_self_signed_only(), Ok(()));
        let cli = Cli::try_parse_from(["x", "--default-alignment", "Strict"]).unwrap();
        assert_eq!(cli.run.default_alignment, Alignment::Strict);
    }

    #[test]
    fn tls_asks_callers_for_a_certificate_unless_told_otherwise() {
        let callers = |args: &[&str]| {
            let mut all = vec!["x"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all).unwrap().run.callers_certified()
        };
        assert_eq!(callers(&[]), Ok(false), "plain HTTP has no certificates");
        assert_eq!(callers(&["--self-signed-tls=s"]), Ok(true));
        assert_eq!(
            callers(&["--tls-cert=c", "--tls-key=k", "--extender-client-ca=ca"]),
            Ok(true)
        );
        let err = callers(&["--tls-cert=c", "--tls-key=k"]).unwrap_err();
        assert!(err.to_string().contains("--extender-client-ca"), "{err}");
        assert_eq!(
            callers(&[
                "--tls-cert=c",
                "--tls-key=k",
                "--extender-anonymous-callers"
            ]),
            Ok(false)
        );
        assert_eq!(
            callers(&["--self-signed-tls=s", "--extender-anonymous-callers"]),
            Ok(false)
        );
        assert!(
            Cli::try_parse_from(["x", "--extender-client-ca=ca"]).is_err(),
            "a client CA means nothing without --tls-cert"
        );
    }
}

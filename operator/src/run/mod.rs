//! `gpuledger-operator run`: wires the watches, the ledger, leader election, the extender, the
//! controllers and the telemetry server together, and runs them until shutdown.

pub mod config;
mod extender_thread;
mod probes;
mod shutdown;

use std::future::Future;
use std::sync::Arc;

use gpuledger_crds::kubeclient::{self, ClientError};

use crate::controllers::pod_facts::PodFactsCache;
use futures::{FutureExt, StreamExt, TryStreamExt};
use gpuledger_crds::{GpuConfig, GpuNode, GpuReservation, NumaPolicy};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, ResourceQuota};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::events::Recorder;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use tokio::net::TcpListener;

use crate::context::{Caches, Context, Defaults, Ledger, PodApiSetting, Timing};
use crate::events::EventQueue;
use crate::events::reporter;
use crate::lease::leader;
use crate::lease::watched::WatchedLeases;
use crate::ledger::feed::feed_index;
use crate::ledger::{LedgerIndex, LedgerWriter, NodeLocks, QuotaLocks};
use crate::schedule::Policy;
use crate::telemetry::{Health, Metrics};
use crate::watches::{
    BackoffExceptExpired, InventoryVersions, drive, streamed_watcher, strip_managed_fields, tracked,
};
use crate::{certs, controllers, extender, ledger, webhook};
use config::RunConfig;

/// Why the operator could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No usable Kubernetes client.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A listener could not be bound.
    #[error("listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The flags do not go together.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// The extender's TLS identity could not be loaded.
    #[error(transparent)]
    Tls(#[from] extender::tls::TlsError),
    /// The operator's own certificate could not be issued or read.
    #[error("serving certificate: {0}")]
    Cert(#[from] certs::CertError),
    /// The extender's thread or its runtime could not be started.
    #[error("starting the extender's thread: {0}")]
    ExtenderThread(#[source] std::io::Error),
    /// A server or essential task ended.
    #[error("{0} stopped unexpectedly")]
    TaskEnded(&'static str),
}

/// Creates the Lease namespace when it does not exist yet (best effort: without the right
/// to create namespaces, the operator relies on it being installed).
async fn ensure_namespace(client: &Client, ns: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    if let Ok(None) = api.get_opt(ns).await {
        let obj = Namespace {
            metadata: ObjectMeta {
                name: Some(ns.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        if let Err(e) = api.create(&PostParams::default(), &obj).await {
            tracing::debug!(namespace = ns, error = %e, "could not create Lease namespace");
        }
    }
}

/// Runs the operator until `shutdown` completes or an essential task ends.
pub async fn run(config: RunConfig, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let extender_endpoint = config.extender_endpoint()?;
    config.check_self_signed_only()?;
    let callers_certified = config.callers_certified()?;
    let tls_from_files = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => {
            let callers = match &config.extender_client_ca {
                Some(ca) => Some(extender::tls::callers_from_file(ca)?),
                None => None,
            };
            Some(extender::tls::acceptor(cert, key, callers)?)
        }
        _ => None,
    };
    let identity = config
        .identity
        .clone()
        .unwrap_or_else(leader::default_identity);
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::new(
        config.watch_stall_limit,
        metrics.watch_errors.clone(),
    ));
    // `client` carries what the leader decides, each try of a write only in the term it was
    // sent in; `unfenced` what any replica writes (the election, its handover, the namespace
    // and certificate a replica needs to start).
    let kubeclient::FencedClients {
        fenced: client,
        unfenced,
        writes,
    } = kubeclient::fenced_clients(
        config.kubeconfig.as_deref(),
        leader::fence(&health, &metrics),
    )
    .await?;
    let index = Arc::new(LedgerIndex::new());

    // Ledger: one watch feeds the index (its own relist/rv logic, see ledger::index) and then
    // triggers the lifecycle controller, which is spawned below once the context exists.
    let mut tasks = tokio::task::JoinSet::new();
    let reservations = {
        let api: Api<GpuReservation> = Api::all(client.clone());
        let restart = Arc::new(tokio::sync::Notify::new());
        tasks.spawn(ledger::feed::watchdog(
            index.clone(),
            restart.clone(),
            metrics.clone(),
        ));
        let events = ledger::feed::restartable(api, restart);
        tracked(
            "gpureservations",
            health.clone(),
            feed_index(index.clone(), metrics.clone(), events),
        )
    };
    let (gpunodes, writer) = reflector::store::<GpuNode>();
    let node_clocks = index.clone();
    let stream = streamed_watcher(
        Api::<GpuNode>::all(client.clone()),
        watcher::Config::default(),
    )
    .backoff_except_expired()
    .modify(strip_managed_fields)
    .reflect(writer)
    // After the store took each change: filter's cached views of the nodes it changed are
    // then stale (a relist replaces the whole store at its end, and names only those).
    .inspect_ok({
        let mut versions = InventoryVersions::default();
        move |event| {
            for node in versions.changed_by(event) {
                node_clocks.inventory_changed(&node);
            }
        }
    });
    tasks.spawn(drive("gpunodes", stream, health.clone()));
    let (policies, writer) = reflector::store::<NumaPolicy>();
    let stream = watcher(
        Api::<NumaPolicy>::all(client.clone()),
        watcher::Config::default(),
    )
    .backoff_except_expired()
    .modify(strip_managed_fields)
    .reflect(writer);
    tasks.spawn(drive("numapolicies", stream, health.clone()));
    let (quotas, writer) = reflector::store::<ResourceQuota>();
    let stream = watcher(
        Api::<ResourceQuota>::all(client.clone()),
        watcher::Config::default(),
    )
    .backoff_except_expired()
    .modify(strip_managed_fields)
    .reflect(writer);
    tasks.spawn(drive("resourcequotas", stream, health.clone()));
    // GpuConfigs: the cluster-wide one sets the pod-API defaults, recomputed after every event
    // (the store is updated before the event passes on).
    let pod_api = PodApiSetting::default();
    let (configs, writer) = reflector::store::<GpuConfig>();
    let stream = watcher(
        Api::<GpuConfig>::all(client.clone()),
        watcher::Config::default(),
    )
    .backoff_except_expired()
    .modify(strip_managed_fields)
    .reflect(writer)
    .inspect({
        let store = configs.clone();
        let pod_api = pod_api.clone();
        move |_| {
            let all: Vec<GpuConfig> = store.state().iter().map(|c| (**c).clone()).collect();
            pod_api.refresh(&all);
        }
    });
    tasks.spawn(drive("gpuconfigs", stream, health.clone()));
    // The allocation Leases (and the leader Lease, which the feed leaves out) of our namespace:
    // a bind waiting for a node's Lease waits for this watch to show it released.
    let leases = Arc::new(WatchedLeases::default());
    let leader_freed = Arc::new(tokio::sync::Notify::new());
    let stream = watcher(
        Api::<Lease>::namespaced(client.clone(), &config.namespace),
        watcher::Config::default(),
    )
    .backoff_except_expired()
    .inspect_ok({
        let leases = leases.clone();
        let freed = leader_freed.clone();
        move |event| {
            leases.apply(event);
            // A stopping leader freed its Lease: try for it now, not at the next round.
            if let watcher::Event::Apply(lease) = event
                && leader::is_freed(lease)
            {
                freed.notify_one();
            }
        }
    });
    tasks.spawn(drive("leases", stream, health.clone()));

    if extender_endpoint.is_some() {
        // Before anyone can lead: a leader serves (`/readyz`) only once its endpoint names it.
        health.keeps_endpoint();
    }
    if config.leader_elect {
        tasks.spawn(leader::run(
            unfenced.clone(),
            config.namespace.clone(),
            identity.clone(),
            health.clone(),
            metrics.clone(),
            leader_freed,
        ));
    } else {
        health.set_leader(true);
        metrics.leader.set(1);
    }

    let ctx = Arc::new(Context {
        client: client.clone(),
        namespace: config.namespace.clone(),
        ledger: Ledger {
            writer: LedgerWriter::new(client.clone(), index.clone()),
            index: index.clone(),
            node_locks: Arc::new(NodeLocks::new()),
            quota_locks: Arc::new(QuotaLocks::new()),
            holds: Default::default(),
            binds: Default::default(),
        },
        caches: Caches {
            gpunodes: gpunodes.clone(),
            policies,
            views: Default::default(),
            pods: Arc::new(PodFactsCache::new(pod_api.clone())),
            quotas: quotas.clone(),
            configs: configs.clone(),
            leases,
        },
        defaults: Defaults {
            pod_api,
            policies: Policy {
                node: config.node_policy,
                gpu: config.gpu_policy,
            },
            alignment: config.default_alignment,
            scheduler_name: config.scheduler_name.clone(),
            other_gpu_schedulers: config.other_gpu_schedulers.clone(),
        },
        timing: Timing {
            lease_wait: config.lease_wait,
            allocating_timeout: config.allocating_timeout,
            repair_after: config.repair_after,
        },
        turns: Default::default(),
        metrics: metrics.clone(),
        health: health.clone(),
        events: EventQueue::start(
            Recorder::new(client.clone(), reporter(&identity)),
            metrics.clone(),
        ),
    });

    // Probes and metrics are served from here on, before the caches are listed: `/healthz`
    // must answer through a cold start of any length (the liveness probe counts a refused
    // connection as a failure, and would restart an operator still listing a large cluster),
    // and must report a watch the API server refuses from the start; `/warmz` and `/readyz`
    // say "not yet" until the lists are in.
    let tel_listener = listen(config.metrics_addr).await?;
    let tel_app = probes::router(ctx.clone());
    tasks.spawn(async move {
        if let Err(e) = axum::serve(tel_listener, tel_app).await {
            tracing::error!(error = %e, "telemetry server failed");
        }
    });
    tracing::info!(metrics = %config.metrics_addr, "serving probes and metrics");
    // Only now: with the API server unreachable this may wait out a connect timeout, and the
    // liveness probe must answer meanwhile.
    ensure_namespace(&unfenced, &config.namespace).await;

    // The extender's and webhook's certificate: from files, or the operator's own, read or
    // issued once the API server serves (it may still be starting too).
    let (tls, cert_keeper) = match self_signed(&config) {
        None => (tls_from_files, None),
        Some(keeper) => {
            let identity = keeper.first(&unfenced, &metrics, &health).await?;
            let live = Arc::new(certs::LiveCert::new(&identity)?);
            let tls = extender::tls::acceptor_resolving(live.clone())?;
            (Some(tls), Some((keeper, live, identity)))
        }
    };

    // The lifecycle controller drives the reservation watch, so it starts before the wait for
    // the index; it reconciles nothing until the index is synced (`Context::may_write`).
    tasks.spawn(controllers::reservation::run(ctx.clone(), reservations));

    // The extender answers only once the caches it decides on are complete.
    decision_caches_synced(&index, &ctx.caches).await?;
    tracing::info!(identity = %identity, reservations = index.all().len(), "ledger index synced");

    let ext_listener = listen(config.extender_addr).await?;
    tracing::info!(extender = %config.extender_addr, "serving");
    // The admission webhook shares the extender's listener, Service and certificate.
    if let Some((keeper, live, identity)) = cert_keeper {
        tasks.spawn(certs::keep_current(
            unfenced.clone(),
            keeper,
            live,
            identity,
            metrics.clone(),
        ));
    }
    let mut extender_routes = extender::server::router(ctx.clone());
    if callers_certified {
        let policy = Arc::new(extender::tls::CallerPolicy {
            names: config.extender_client_names.clone(),
            metrics: metrics.clone(),
        });
        extender_routes = extender_routes.route_layer(axum::middleware::from_fn_with_state(
            policy,
            extender::tls::require_client,
        ));
    }
    let ext_app = extender_routes.merge(webhook::server::router(ctx.clone()));
    // Kept until `run` stops it or is dropped: the extender stops with the operator.
    let (extender, extender_stopped) = extender_thread::spawn(
        ext_listener,
        tls,
        metrics.extender_handshake_failures.clone(),
        ext_app,
    )
    .map_err(RunError::ExtenderThread)?;
    health.extender_listens();
    let extender_stopped = extender_stopped.shared();
    tasks.spawn({
        let stopped = extender_stopped.clone();
        async move {
            let _ = stopped.await;
        }
    });
    tasks.spawn(controllers::numapolicy::run(ctx.clone()));
    tasks.spawn(controllers::gpuconfig::run(ctx.clone()));
    tasks.spawn(controllers::refit::run(ctx.clone(), config.refit_ttl));
    tasks.spawn(controllers::fit_views::run(
        ctx.clone(),
        config.usage_interval,
    ));
    tasks.spawn(controllers::gpunode_usage::run(
        ctx.clone(),
        config.usage_interval,
    ));
    if let Some(endpoint) = extender_endpoint {
        tasks.spawn(controllers::extender_endpoint::run(
            ctx.clone(),
            endpoint,
            config.usage_interval,
        ));
    }
    tasks.spawn(controllers::quota_usage::run(
        ctx.clone(),
        config.usage_interval,
    ));

    let outcome = tokio::select! {
        () = shutdown => {
            tracing::info!("shutting down");
            Ok(())
        }
        _ = tasks.join_next() => Err(RunError::TaskEnded("an essential task")),
    };
    let stopping = shutdown::Stopping {
        health,
        extender,
        extender_stopped: extender_stopped.map(|_| ()).boxed(),
        tasks,
        writes,
    };
    let handover = config
        .leader_elect
        .then(|| Api::<Lease>::namespaced(unfenced.clone(), &config.namespace));
    stopping.stop(handover, &identity).await;
    outcome
}

/// Where the operator keeps its own serving certificate, with `--self-signed-tls`.
fn self_signed(config: &RunConfig) -> Option<certs::SelfSigned> {
    let secret = config.self_signed_tls.as_ref()?;
    let names = if config.tls_names.is_empty() {
        let ns = &config.namespace;
        vec![
            format!("gpuledger-operator.{ns}.svc"),
            format!("gpuledger-operator.{ns}"),
            "gpuledger-operator".to_string(),
        ]
    } else {
        config.tls_names.clone()
    };
    Some(certs::SelfSigned {
        secret: secret.clone(),
        namespace: config.namespace.clone(),
        names,
        webhook_configuration: Some(config.webhook_configuration.clone()).filter(|n| !n.is_empty()),
    })
}

/// A listener on `addr`, the error naming it.
async fn listen(addr: std::net::SocketAddr) -> Result<TcpListener, RunError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Listen { addr, source })
}

/// Waits until the ledger index and every cache a decision reads hold their first full list;
/// the error names the watch that ended before it did. A decision made earlier would be made on
/// part of the cluster: a pod read with the wrong defaults (GpuConfigs), a namespace's first
/// pods let past its quota (ResourceQuotas), a pod placed under the default alignment instead
/// of its NumaPolicy's, a node judged to have no GPUs (GpuNodes).
async fn decision_caches_synced(index: &LedgerIndex, caches: &Caches) -> Result<(), RunError> {
    index.wait_synced().await;
    let ended = |watch| move |_| RunError::TaskEnded(watch);
    caches
        .gpunodes
        .wait_until_ready()
        .await
        .map_err(ended("GpuNode watch"))?;
    caches
        .configs
        .wait_until_ready()
        .await
        .map_err(ended("GpuConfig watch"))?;
    caches
        .quotas
        .wait_until_ready()
        .await
        .map_err(ended("ResourceQuota watch"))?;
    caches
        .policies
        .wait_until_ready()
        .await
        .map_err(ended("NumaPolicy watch"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kube::runtime::reflector::store::Writer;

    use super::*;

    /// The writers of the four stores a decision reads, as their watches hold them.
    struct Watches {
        gpunodes: Writer<GpuNode>,
        configs: Writer<GpuConfig>,
        quotas: Writer<ResourceQuota>,
        policies: Writer<NumaPolicy>,
    }

    fn caches() -> (Caches, Watches) {
        let (gpunodes, gpunodes_w) = reflector::store();
        let (configs, configs_w) = reflector::store();
        let (quotas, quotas_w) = reflector::store();
        let (policies, policies_w) = reflector::store();
        let caches = Caches {
            gpunodes,
            policies,
            views: Default::default(),
            pods: Arc::new(PodFactsCache::new(PodApiSetting::default())),
            quotas,
            configs,
            leases: Arc::default(),
        };
        let watches = Watches {
            gpunodes: gpunodes_w,
            configs: configs_w,
            quotas: quotas_w,
            policies: policies_w,
        };
        (caches, watches)
    }

    /// A first list, empty, seen to its end.
    fn listed<K>(w: &mut Writer<K>)
    where
        K: kube::Resource + Clone,
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        w.apply_watcher_event(&watcher::Event::Init);
        w.apply_watcher_event(&watcher::Event::InitDone);
    }

    fn synced_index() -> LedgerIndex {
        let index = LedgerIndex::new();
        index.apply_shared(watcher::Event::Init);
        index.apply_shared(watcher::Event::InitDone);
        index
    }

    async fn completes(index: &LedgerIndex, caches: &Caches) -> bool {
        tokio::time::timeout(
            Duration::from_millis(50),
            decision_caches_synced(index, caches),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }

    #[tokio::test]
    async fn the_extender_waits_for_every_cache_a_decision_reads() {
        // Each cache in turn is the one whose first list has not ended: nothing is served.
        for missing in ["gpunodes", "configs", "quotas", "policies", "index"] {
            let (caches, mut w) = caches();
            let index = if missing == "index" {
                LedgerIndex::new()
            } else {
                synced_index()
            };
            if missing != "gpunodes" {
                listed(&mut w.gpunodes);
            }
            if missing != "configs" {
                listed(&mut w.configs);
            }
            if missing != "quotas" {
                listed(&mut w.quotas);
            }
            if missing != "policies" {
                listed(&mut w.policies);
            }
            assert!(
                !completes(&index, &caches).await,
                "served without {missing}"
            );
        }
        let (caches, mut w) = caches();
        let index = synced_index();
        listed(&mut w.gpunodes);
        listed(&mut w.configs);
        listed(&mut w.quotas);
        assert!(!completes(&index, &caches).await);
        listed(&mut w.policies);
        assert!(completes(&index, &caches).await, "every cache listed");
    }

    #[tokio::test]
    async fn a_watch_that_ends_before_its_first_list_is_named() {
        let (caches, mut w) = caches();
        let index = synced_index();
        listed(&mut w.gpunodes);
        listed(&mut w.configs);
        listed(&mut w.quotas);
        drop(w.policies);
        let err = decision_caches_synced(&index, &caches)
            .await
            .expect_err("the NumaPolicy watch ended");
        assert_eq!(
            err.to_string(),
            RunError::TaskEnded("NumaPolicy watch").to_string()
        );
    }
}

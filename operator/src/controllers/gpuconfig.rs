//! GpuConfig status: which values apply and which are refused, with why
//! ([`gpuledger_crds::gpuconfig::review`], the judgement the device plugins apply too), the
//! config's scope, and the GitOps conditions. The values themselves are applied by their
//! readers: the pod-API defaults by the operator's GpuConfig watch ([`crate::context::PodApiSetting`]),
//! the node settings by each node's device plugin.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpuledger_crds::gpuconfig::review;
use gpuledger_crds::names::OPERATOR_MANAGER;
use gpuledger_crds::protocol::status::apply_body;
use gpuledger_crds::{GpuConfig, kstatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::context::Context;

/// How often every config is reviewed again: a second cluster-wide config being deleted changes
/// the verdict on the other without touching it.
const REFRESH: Duration = Duration::from_secs(15);

/// How soon a config the config cache does not hold yet is looked at again.
const CACHE_LAG_RECHECK: Duration = Duration::from_millis(200);

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Writing the status failed.
    #[error("writing the status of GpuConfig {config}: {source}")]
    WriteStatus {
        /// Its name.
        config: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// Runs the controller until the process ends.
pub async fn run(ctx: Arc<Context>) {
    let api: Api<GpuConfig> = Api::all(ctx.client.clone());
    crate::watches::controller(api, watcher::Config::default())
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

fn error_policy(c: Arc<GpuConfig>, e: &ConfigError, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .reconcile_failed("gpuconfigs", "api", &c.name_any(), e);
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(c: Arc<GpuConfig>, ctx: Arc<Context>) -> Result<Action, ConfigError> {
    if !ctx.may_write() {
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    // Judged against the config cache, which another watch fills: until it holds this spec,
    // the verdict would be on the old one (a second cluster-wide config "already" winning, say,
    // and written as Stalled at the new generation, which GitOps tools read as failed).
    if !crate::watches::cache_holds_spec_of(&ctx.caches.configs, &c) {
        return Ok(Action::requeue(CACHE_LAG_RECHECK));
    }
    let name = c.name_any();
    let all: Vec<GpuConfig> = ctx
        .caches
        .configs
        .state()
        .iter()
        .map(|c| (**c).clone())
        .collect();
    let refused = review(&c, &all);
    let scope = c.spec.scope();
    let generation = c.meta().generation;
    let status = c.status.clone().unwrap_or_default();
    let mut conditions = status.conditions.clone();
    kstatus::gpu_config(&refused).record(&mut conditions, generation, Time(Timestamp::now()));
    let unchanged = status.observed_generation == generation
        && status.scope.as_deref() == Some(scope.as_str())
        && status.refused == refused
        && status.conditions == conditions;
    if !unchanged {
        let body = apply_body::<GpuConfig>(
            &name,
            None,
            json!({
                "observedGeneration": generation,
                "scope": scope,
                "refused": refused,
                "conditions": conditions,
            }),
        );
        let api: Api<GpuConfig> = Api::all(ctx.client.clone());
        api.patch_status(
            &name,
            &PatchParams::apply(OPERATOR_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(|source| ConfigError::WriteStatus {
            config: name.clone(),
            source,
        })?;
    }
    Ok(Action::requeue(REFRESH))
}

#[cfg(test)]
mod tests {
    use gpuledger_crds::GpuConfigSpec;
    use kube::runtime::reflector;

    use super::*;
    use crate::controllers::refit::commit::tests::context;

    fn config(uid: &str, generation: i64) -> GpuConfig {
        let mut c = GpuConfig::new("defaults", GpuConfigSpec::default());
        c.metadata.uid = Some(uid.into());
        c.metadata.generation = Some(generation);
        c
    }

    #[tokio::test]
    async fn no_verdict_until_the_config_cache_holds_the_configs_spec() {
        let (store, mut cache) = reflector::store::<GpuConfig>();
        let mut ctx = context();
        ctx.caches.configs = store;
        let ctx = Arc::new(ctx);
        let current = Arc::new(config("u1", 2));
        let wait = Action::requeue(CACHE_LAG_RECHECK);
        // Not in the cache yet, then held at an older spec, then another object under the name:
        // nothing is judged, and soon again.
        let got = reconcile(current.clone(), ctx.clone()).await;
        assert_eq!(got.ok(), Some(wait.clone()));
        cache.apply_watcher_event(&watcher::Event::Apply(config("u1", 1)));
        let got = reconcile(current.clone(), ctx.clone()).await;
        assert_eq!(got.ok(), Some(wait.clone()));
        cache.apply_watcher_event(&watcher::Event::Apply(config("u0", 7)));
        let got = reconcile(current.clone(), ctx.clone()).await;
        assert_eq!(got.ok(), Some(wait));
        // Held: the verdict is written (this context reaches no API server).
        cache.apply_watcher_event(&watcher::Event::Apply(config("u1", 2)));
        let got = reconcile(current, ctx).await;
        assert!(
            matches!(got, Err(ConfigError::WriteStatus { .. })),
            "{got:?}"
        );
    }
}

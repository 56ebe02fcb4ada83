//! NumaPolicy status: how many GPU pods of its namespace this policy currently decides the
//! alignment of (the pod has no annotation and this policy wins the tie-break), and the GitOps
//! conditions (`Ready` when its selector can be evaluated, `Stalled` with why when it cannot). The alignment itself is resolved at
//! bind and recorded in each reservation. A policy's status is written only once the cache bind
//! reads holds its current spec: `Ready` then means the next bind applies it (this controller
//! has its own watch, which may be ahead of that cache).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpuledger_crds::alignment::AlignmentSource;
use gpuledger_crds::names::OPERATOR_MANAGER;
use gpuledger_crds::numapolicy::validate_selector;
use gpuledger_crds::protocol::status::apply_body;
use gpuledger_crds::{NumaPolicy, kstatus};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::context::Context;

/// Pods per list request when counting a policy's pods.
const LIST_PAGE: u32 = 500;

/// How soon a policy the binds' cache does not hold yet is looked at again.
const CACHE_LAG_RECHECK: Duration = Duration::from_millis(200);

/// How often matched counts are refreshed (pods come and go without touching the policy).
const REFRESH: Duration = Duration::from_secs(15);

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Listing pods or writing status failed.
    #[error("{action} for NumaPolicy {policy}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// namespace/name.
        policy: String,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// Runs the controller until the process ends.
pub async fn run(ctx: Arc<Context>) {
    let api: Api<NumaPolicy> = Api::all(ctx.client.clone());
    crate::watches::spec_controller(api, watcher::Config::default())
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

fn error_policy(p: Arc<NumaPolicy>, e: &PolicyError, ctx: Arc<Context>) -> Action {
    let kind = match e {
        PolicyError::Api { .. } => "api",
    };
    let policy = format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
    ctx.metrics
        .reconcile_failed("numapolicies", kind, &policy, e);
    Action::requeue(Duration::from_secs(5))
}

/// Whether the NumaPolicy cache bind resolves alignments from holds `p`'s spec (its
/// generation or a newer one, of this very object).
fn binds_see(ctx: &Context, p: &NumaPolicy) -> bool {
    crate::watches::cache_holds_spec_of(&ctx.caches.policies, p)
}

/// Whether a pod's alignment is decided by `policy` (given the resolved source).
fn decided_by(source: &AlignmentSource, policy: &str) -> bool {
    matches!(source, AlignmentSource::Policy(name) if name == policy)
}

async fn reconcile(p: Arc<NumaPolicy>, ctx: Arc<Context>) -> Result<Action, PolicyError> {
    if !ctx.may_write() {
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    if !binds_see(&ctx, &p) {
        return Ok(Action::requeue(CACHE_LAG_RECHECK));
    }
    let ns = p.namespace().unwrap_or_default();
    let name = p.name_any();
    let id = format!("{ns}/{name}");
    let api_err = |action, source| PolicyError::Api {
        action,
        policy: id.clone(),
        source,
    };
    let selector_check = validate_selector(&p.spec.pod_selector);
    let mut matched = 0u32;
    if selector_check.is_ok() {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        // Page by page: a namespace of 20 000 pods must not be held in memory at once.
        let mut params = ListParams::default().limit(LIST_PAGE);
        loop {
            let page = pods
                .list(&params)
                .await
                .map_err(|e| api_err("list pods", e))?;
            for pod in &page.items {
                let live = !matches!(
                    pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                );
                let gpu = matches!(ctx.gpu_request(pod), Ok(Some(_)));
                if live
                    && gpu
                    && ctx
                        .resolve_alignment(pod)
                        .is_ok_and(|r| decided_by(&r.source, &name))
                {
                    matched += 1;
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
    }
    let mut conditions = p.status.clone().unwrap_or_default().conditions;
    let verdict = kstatus::numa_policy(selector_check.clone().map_err(|e| e.to_string()));
    verdict.record(&mut conditions, p.meta().generation, Time(Timestamp::now()));
    let status = p.status.clone().unwrap_or_default();
    let unchanged = status.matched_pods == matched
        && status.observed_generation == p.meta().generation
        && status.conditions == conditions;
    if !unchanged {
        let body = apply_body::<NumaPolicy>(
            &name,
            Some(&ns),
            json!({
                "observedGeneration": p.meta().generation,
                "matchedPods": matched,
                "conditions": conditions,
            }),
        );
        let api: Api<NumaPolicy> = Api::namespaced(ctx.client.clone(), &ns);
        api.patch_status(
            &name,
            &PatchParams::apply(OPERATOR_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(|e| api_err("write status", e))?;
    }
    Ok(Action::requeue(REFRESH))
}

#[cfg(test)]
mod tests {
    use gpuledger_crds::{Alignment, NumaPolicySpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use kube::runtime::reflector;

    use super::*;
    use crate::controllers::refit::commit::tests::context;

    fn policy(generation: i64) -> NumaPolicy {
        let mut p = NumaPolicy::new(
            "ml",
            NumaPolicySpec {
                pod_selector: LabelSelector::default(),
                alignment: Alignment::BestEffort,
                priority: 1,
            },
        );
        p.metadata.namespace = Some("team".into());
        p.metadata.uid = Some("u-ml".into());
        p.metadata.generation = Some(generation);
        p
    }

    #[tokio::test]
    async fn no_status_until_the_cache_binds_read_holds_the_policys_spec() {
        let (store, mut cache) = reflector::store::<NumaPolicy>();
        let mut ctx = context();
        ctx.caches.policies = store;
        let ctx = Arc::new(ctx);
        let current = Arc::new(policy(2));
        let wait = Action::requeue(CACHE_LAG_RECHECK);
        // Not in the binds' cache yet: nothing is asked of the API server, and soon again.
        let got = reconcile(current.clone(), ctx.clone()).await;
        assert_eq!(got.ok(), Some(wait.clone()));
        // Held at an older spec: the same.
        cache.apply_watcher_event(&watcher::Event::Apply(policy(1)));
        let got = reconcile(current.clone(), ctx.clone()).await;
        assert_eq!(got.ok(), Some(wait));
        // Deleted and created again under its name, the cache still holding the old object at
        // a higher generation: not this policy's spec.
        let mut older_object = policy(5);
        older_object.metadata.uid = Some("deleted-since".into());
        cache.apply_watcher_event(&watcher::Event::Apply(older_object));
        let got = reconcile(current.clone(), ctx.clone()).await;
        assert_eq!(got.ok(), Some(Action::requeue(CACHE_LAG_RECHECK)));
        // Held: it goes on to count the policy's pods (this context reaches no API server).
        cache.apply_watcher_event(&watcher::Event::Apply(policy(2)));
        let got = reconcile(current, ctx).await;
        assert!(
            matches!(
                got,
                Err(PolicyError::Api {
                    action: "list pods",
                    ..
                })
            ),
            "{got:?}"
        );
    }
}

//! The fault proxy against a real control plane: requests pass through (lists and streaming
//! watches), a `Delay` rule holds a request back, a `DropResponse` rule loses the answer of
//! a create that nonetheless happened, and a `QuietAfterLines` rule lets a watch's first events
//! through and then nothing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuledger_e2e::cluster::{
    ControlPlane, ControlPlaneOptions, FaultAction, FaultProxy, FaultRule, client_from_kubeconfig,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::ResourceExt;
use kube::api::{Api, ListParams, ObjectMeta, PostParams, WatchEvent, WatchParams};

const NS: &str = "default";

fn config_map(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        data: Some([("k".to_string(), "v".to_string())].into()),
        ..ConfigMap::default()
    }
}

fn post_configmaps(action: FaultAction, times: Option<usize>) -> FaultRule {
    FaultRule {
        method: Some(http::Method::POST),
        path_contains: "/configmaps".to_string(),
        action,
        times,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_passes_through_delays_and_drops_responses() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let admin = cp.client();
    let proxy = FaultProxy::start(admin.clone())
        .await
        .expect("proxy starts");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    proxy.write_kubeconfig(&kubeconfig).unwrap();
    let client = client_from_kubeconfig(&kubeconfig, "fault-proxy")
        .await
        .expect("client for the proxy");
    eprintln!("proxy at {}", proxy.url());

    // Plain pass-through.
    let namespaces = Api::<Namespace>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list namespaces through the proxy");
    assert!(namespaces.items.iter().any(|n| n.name_any() == NS));

    // A watch streams: an object created after the watch started shows up on it.
    let via_proxy = Api::<ConfigMap>::namespaced(client.clone(), NS);
    let direct = Api::<ConfigMap>::namespaced(admin.clone(), NS);
    let version = via_proxy
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .expect("list has a resourceVersion");
    let mut events = via_proxy
        .watch(&WatchParams::default().timeout(60), &version)
        .await
        .expect("watch through the proxy")
        .boxed();
    direct
        .create(&PostParams::default(), &config_map("watched"))
        .await
        .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = events.next().await {
            if let WatchEvent::Added(cm) = event.expect("watch event")
                && cm.name_any() == "watched"
            {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        seen,
        Ok(true),
        "the watch did not deliver the new ConfigMap"
    );
    drop(events);

    // Delay: the create waits before it is forwarded.
    let delay = proxy.add_rule(post_configmaps(
        FaultAction::Delay(Duration::from_millis(1500)),
        None,
    ));
    let started = Instant::now();
    via_proxy
        .create(&PostParams::default(), &config_map("delayed"))
        .await
        .expect("delayed create succeeds");
    let took = started.elapsed();
    eprintln!("delayed create took {took:?}");
    assert!(took >= Duration::from_millis(1500), "took only {took:?}");
    assert_eq!(proxy.hits(delay), 1);
    proxy.clear_rules();

    // DropResponse: the client sees a transport error, yet the ConfigMap exists.
    let drop_rule = proxy.add_rule(post_configmaps(FaultAction::DropResponse, Some(1)));
    let err = via_proxy
        .create(&PostParams::default(), &config_map("dropped"))
        .await
        .expect_err("the response was dropped");
    eprintln!("dropped create failed with: {err:?}");
    assert!(
        matches!(err, kube::Error::HyperError(_) | kube::Error::Service(_)),
        "expected a transport error, got {err:?}"
    );
    let created = direct
        .get("dropped")
        .await
        .expect("the create reached the API server");
    assert_eq!(created.data.unwrap()["k"], "v");
    assert_eq!(proxy.hits(drop_rule), 1);

    // The rule is spent: the next create goes through.
    via_proxy
        .create(&PostParams::default(), &config_map("after-drop"))
        .await
        .expect("create after the spent rule");
    assert_eq!(proxy.hits(drop_rule), 1);
    assert_eq!(proxy.hits(delay), 1);

    // QuietAfterLines: a watch from the start shows two of the namespace's ConfigMaps (there
    // are at least four), then goes quiet without ending, though the API server sends the
    // others and one created meanwhile.
    let quiet = proxy.add_rule(FaultRule {
        method: Some(http::Method::GET),
        path_contains: "/configmaps?&watch=true".to_string(),
        action: FaultAction::QuietAfterLines(2),
        times: Some(1),
    });
    let mut events = via_proxy
        .watch(&WatchParams::default().timeout(60), "0")
        .await
        .expect("watch through the proxy")
        .boxed();
    let mut added = Vec::new();
    for _ in 0..2 {
        let next = tokio::time::timeout(Duration::from_secs(30), events.next()).await;
        match next {
            Ok(Some(Ok(WatchEvent::Added(cm)))) => added.push(cm.name_any()),
            other => panic!("expected an ADDED event, got {other:?}"),
        }
    }
    assert_eq!(added.len(), 2);
    direct
        .create(&PostParams::default(), &config_map("unseen"))
        .await
        .unwrap();
    let more = tokio::time::timeout(Duration::from_secs(3), events.next()).await;
    assert!(more.is_err(), "the watch was to go quiet, got {more:?}");
    assert_eq!(proxy.hits(quiet), 1);
}

//! The operator's commits on this node's reservations, heard while a refit waits.
//!
//! The operator moves a reservation (its spec) before it writes the RefitRequest's answer, so
//! the plugin that sees the move has its answer one API write early. One watch per node, of the
//! GpuReservations labelled with it, is shared by every refit: a watch per refit would cost a
//! connection (and a TLS handshake) per refit on API servers that serve watches over HTTP/1.
//!
//! A version is the commit of the refit waiting on it only when its spec changed after the
//! reservation the refit started from (a higher `metadata.generation`: the watch may deliver
//! versions older than that read) and it holds the container on allowed GPUs only.

use std::sync::Arc;

use futures::StreamExt;
use gpuledger_crds::GpuReservation;
use gpuledger_crds::kubeclient::watch_backoff::BackoffExceptExpired;
use gpuledger_crds::names::NODE_LABEL;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use crate::metrics::{Metrics, WATCH_RESERVATIONS};

/// How many reservation versions a slow refit may fall behind before it stops hearing commits
/// (and waits for the answer alone).
const BACKLOG: usize = 256;

/// One watch of this node's reservations, heard by every refit of the node. The watch ends
/// when this is dropped.
pub struct NodeCommits {
    versions: broadcast::Sender<Arc<GpuReservation>>,
    /// The watch's task; none when the caller feeds the versions (tests).
    watch: Option<JoinHandle<()>>,
}

impl NodeCommits {
    /// Starts watching the reservations of `node` (retried with backoff when the API server
    /// fails, listed again at once when told its version expired; refits meanwhile wait for
    /// their answers alone).
    pub fn start(client: Client, node: &str, metrics: Arc<Metrics>) -> Self {
        let (versions, _) = broadcast::channel(BACKLOG);
        let sender = versions.clone();
        let api: Api<GpuReservation> = Api::all(client);
        let config = watcher::Config::default().labels(&format!("{NODE_LABEL}={node}"));
        let watch = tokio::spawn(async move {
            let stream = watcher(api, config)
                .backoff_except_expired()
                .applied_objects();
            let mut stream = std::pin::pin!(stream);
            while let Some(seen) = stream.next().await {
                match seen {
                    // No refit listening is no error.
                    Ok(r) => drop(sender.send(Arc::new(r))),
                    // Retried with backoff; meanwhile refits wait for the answers alone, which
                    // is slower but correct, so it is worth a warning (missing RBAC, say).
                    Err(e) => {
                        metrics.watch_error(WATCH_RESERVATIONS, &e);
                        tracing::warn!(
                            error = %e,
                            "watching this node's reservations failed; refits wait for the operator's answers alone"
                        )
                    }
                }
            }
        });
        NodeCommits {
            versions,
            watch: Some(watch),
        }
    }

    /// The versions seen from now on.
    pub fn hear(&self) -> broadcast::Receiver<Arc<GpuReservation>> {
        self.versions.subscribe()
    }

    /// A channel fed by the caller instead of a watch, for tests of the waiting side.
    #[cfg(test)]
    pub fn fed() -> (Self, broadcast::Sender<Arc<GpuReservation>>) {
        let (versions, _) = broadcast::channel(BACKLOG);
        (
            NodeCommits {
                versions: versions.clone(),
                watch: None,
            },
            versions,
        )
    }
}

impl Drop for NodeCommits {
    fn drop(&mut self) {
        if let Some(watch) = &self.watch {
            watch.abort();
        }
    }
}

/// What a refit waits for: the commit of container `index` of the reservation `read` (as the
/// refit read it) onto GPUs among `allowed`.
pub struct Awaited<'a> {
    /// The reservation as the refit read it.
    pub read: &'a GpuReservation,
    /// The container's position in the pod.
    pub index: u32,
    /// The GPUs the kubelet allows.
    pub allowed: &'a [String],
}

impl Awaited<'_> {
    /// The container's GPUs when `seen` is the commit awaited.
    pub fn commit_in(&self, seen: &GpuReservation) -> Option<Vec<String>> {
        let same = seen.uid().is_some()
            && seen.uid() == self.read.uid()
            && seen.spec.pod_uid == self.read.spec.pod_uid;
        // Without both generations there is no telling a later spec from an earlier one.
        let newer = match (seen.metadata.generation, self.read.metadata.generation) {
            (Some(seen), Some(read)) => seen > read,
            _ => false,
        };
        if !(same && newer) {
            return None;
        }
        let devices: Vec<String> = seen
            .spec
            .container(self.index)?
            .devices
            .iter()
            .map(|d| d.uuid.clone())
            .collect();
        let allowed = !devices.is_empty() && devices.iter().all(|d| self.allowed.contains(d));
        allowed.then_some(devices)
    }

    /// Waits on `heard` for the commit; `None` when the watch is gone or this wait fell too far
    /// behind to be sure it saw every version.
    pub async fn commit(
        &self,
        mut heard: broadcast::Receiver<Arc<GpuReservation>>,
    ) -> Option<Vec<String>> {
        loop {
            match heard.recv().await {
                Ok(seen) => {
                    if let Some(devices) = self.commit_in(&seen) {
                        return Some(devices);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::debug!(missed, "a refit fell behind this node's reservations");
                    return None;
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuledger_crds::{ContainerReservation, GpuReservationSpec, ReservedDevice};

    #[tokio::test(start_paused = true)]
    async fn the_watch_lists_again_at_once_when_its_version_expired() {
        use gpuledger_crds::scripted_api::{scripted, watch_expired_once};
        let (client, api) = scripted(watch_expired_once(
            "/apis/gpuledger.io/v1alpha1/gpureservations",
            &[("labelSelector", &format!("{NODE_LABEL}=n1"))],
        ));
        let metrics = Arc::new(Metrics::default());
        let commits = NodeCommits::start(client, "n1", metrics.clone());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        // The 410 was an error the server's recovery cures, counted as such (read before the
        // script ends: its end breaks the last watch off, one more such error).
        assert_eq!(errors(&metrics, "not_served"), 1);
        assert_eq!(errors(&metrics, "refused"), 0);
        api.finish().await;
        drop(commits);
    }

    /// A list the API server refuses (the plugin's RBAC without GpuReservations) is counted as
    /// refused, for the alert that someone must fix the install.
    #[tokio::test(start_paused = true)]
    async fn a_refused_watch_is_counted_as_refused() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        let (client, api) = scripted(vec![
            expect(
                http::Method::GET,
                "/apis/gpuledger.io/v1alpha1/gpureservations",
            )
            .query("labelSelector", &format!("{NODE_LABEL}=n1"))
            .reply(403, status(403, "Forbidden", "cannot list gpureservations")),
        ]);
        let metrics = Arc::new(Metrics::default());
        let commits = NodeCommits::start(client, "n1", metrics.clone());
        // Shorter than the first backoff step: the one list only.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        api.finish().await;
        drop(commits);
        assert_eq!(errors(&metrics, "refused"), 1);
        assert_eq!(errors(&metrics, "not_served"), 0);
    }

    fn errors(metrics: &Metrics, failure: &str) -> u64 {
        metrics
            .watch_errors
            .get_or_create(&crate::metrics::WatchErrorLabels {
                watch: WATCH_RESERVATIONS.into(),
                failure: failure.into(),
            })
            .get()
    }

    fn version(
        uid: &str,
        pod_uid: &str,
        generation: i64,
        index: u32,
        gpus: &[&str],
    ) -> GpuReservation {
        let mut r = GpuReservation::new(
            "train",
            GpuReservationSpec {
                pod_uid: pod_uid.into(),
                containers: vec![ContainerReservation {
                    index,
                    name: "main".into(),
                    init: false,
                    devices: gpus
                        .iter()
                        .map(|g| ReservedDevice {
                            uuid: g.to_string(),
                            memory_mib: 1000,
                            cores: 10,
                            numa_node: None,
                        })
                        .collect(),
                }],
                ..Default::default()
            },
        );
        r.metadata.uid = Some(uid.into());
        r.metadata.generation = Some(generation);
        r
    }

    /// Container 2 of `read`, waited for on `allowed`.
    fn awaiting<'a>(read: &'a GpuReservation, allowed: &'a [String]) -> Awaited<'a> {
        Awaited {
            read,
            index: 2,
            allowed,
        }
    }

    fn allowed() -> Vec<String> {
        vec!["GPU-a".into(), "GPU-b".into()]
    }

    #[test]
    fn a_commit_is_a_newer_spec_holding_the_container_on_allowed_gpus_only() {
        let read = version("r1", "p1", 3, 2, &["GPU-x"]);
        let allowed = allowed();
        let awaited = awaiting(&read, &allowed);
        assert_eq!(
            awaited.commit_in(&version("r1", "p1", 4, 2, &["GPU-a", "GPU-b"])),
            Some(vec!["GPU-a".to_string(), "GPU-b".to_string()])
        );
        // None of these is the commit, whatever the container holds.
        for (uid, pod, generation, container, devices, why) in [
            ("r1", "p1", 4, 2, &["GPU-x"][..], "not moved yet"),
            ("r1", "p1", 4, 2, &["GPU-a", "GPU-x"][..], "half moved"),
            ("r1", "p1", 4, 2, &[][..], "holding nothing"),
            ("r1", "p1", 4, 3, &["GPU-a"][..], "another container"),
            ("r1", "p1", 3, 2, &["GPU-a"][..], "the version read"),
            ("r1", "p1", 2, 2, &["GPU-a"][..], "older than the read"),
            (
                "r2",
                "p1",
                9,
                2,
                &["GPU-a"][..],
                "another reservation's UID",
            ),
            ("r1", "p2", 9, 2, &["GPU-a"][..], "another pod's UID"),
        ] {
            let v = version(uid, pod, generation, container, devices);
            assert_eq!(awaited.commit_in(&v), None, "{why}");
        }
        // No generation on either side: no telling.
        let mut unnumbered = version("r1", "p1", 4, 2, &["GPU-a"]);
        unnumbered.metadata.generation = None;
        assert_eq!(awaited.commit_in(&unnumbered), None);
        let mut read_unnumbered = read.clone();
        read_unnumbered.metadata.generation = None;
        let blind = awaiting(&read_unnumbered, &allowed);
        assert_eq!(
            blind.commit_in(&version("r1", "p1", 4, 2, &["GPU-a"])),
            None
        );
    }

    #[tokio::test]
    async fn the_wait_passes_over_other_versions_and_ends_with_the_watch() {
        let read = version("r1", "p1", 3, 2, &["GPU-x"]);
        let allowed = allowed();
        let awaited = awaiting(&read, &allowed);
        let (commits, feed) = NodeCommits::fed();
        let heard = commits.hear();
        for v in [
            version("other", "p9", 1, 0, &["GPU-a"]),
            version("r1", "p1", 3, 2, &["GPU-a"]),
            version("r1", "p1", 4, 2, &["GPU-b"]),
        ] {
            feed.send(Arc::new(v)).unwrap();
        }
        assert_eq!(awaited.commit(heard).await, Some(vec!["GPU-b".to_string()]));

        // The watch gone: nothing more to hear.
        let heard = commits.hear();
        drop(feed);
        drop(commits);
        assert_eq!(awaited.commit(heard).await, None);
    }

    #[tokio::test]
    async fn a_wait_that_fell_behind_leaves_the_answer_to_the_request() {
        let read = version("r1", "p1", 3, 2, &["GPU-x"]);
        let allowed = allowed();
        let awaited = awaiting(&read, &allowed);
        let (commits, feed) = NodeCommits::fed();
        let heard = commits.hear();
        for _ in 0..=BACKLOG {
            feed.send(Arc::new(version("other", "p9", 1, 0, &[])))
                .unwrap();
        }
        assert_eq!(awaited.commit(heard).await, None);
    }
}

//! The kubelet's Registration service and the per-plugin endpoint it opens on Register.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpuledger_device_plugin::api;
use gpuledger_device_plugin::api::device_plugin_client::DevicePluginClient;
use gpuledger_device_plugin::uds::dial;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::State;

/// The API versions the kubelet accepts.
pub const SUPPORTED_VERSIONS: &[&str] = &["v1beta1"];

/// A registered plugin as the kubelet keeps it.
pub struct Endpoint {
    /// The plugin's socket.
    pub socket: PathBuf,
    /// Options from GetDevicePluginOptions (not from the RegisterRequest).
    pub options: api::DevicePluginOptions,
    /// The last ListAndWatch list; all turn Unhealthy when the stream ends.
    pub devices: Vec<api::Device>,
    /// Whether the ListAndWatch stream is open.
    pub streaming: bool,
    /// The client for allocation calls.
    pub client: DevicePluginClient<Channel>,
    /// The ListAndWatch task.
    pub stream_task: tokio::task::AbortHandle,
}

/// The Registration service on kubelet.sock.
pub struct Registration {
    pub(super) state: Arc<State>,
    pub(super) dir: PathBuf,
}

/// Whether `name` is an extended resource name a device plugin may register
/// (`domain/name`, not in the kubernetes.io namespaces).
pub fn is_extended_resource_name(name: &str) -> bool {
    let Some((domain, rest)) = name.split_once('/') else {
        return false;
    };
    !domain.is_empty()
        && !rest.is_empty()
        && !rest.contains('/')
        && domain != "kubernetes.io"
        && !domain.ends_with(".kubernetes.io")
        && !name.starts_with("requests.")
}

#[tonic::async_trait]
impl api::registration_server::Registration for Registration {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let req = request.into_inner();
        if !SUPPORTED_VERSIONS.contains(&req.version.as_str()) {
            return Err(Status::invalid_argument(format!(
                "Unsupported API version {:?}; supported versions: {SUPPORTED_VERSIONS:?}",
                req.version
            )));
        }
        if !is_extended_resource_name(&req.resource_name) {
            return Err(Status::invalid_argument(format!(
                "invalid resource name {:?}: not an extended resource name",
                req.resource_name
            )));
        }
        // Like the kubelet: dial the endpoint and read its options before answering, so the
        // plugin must already be serving while its Register call is in flight.
        let socket = self.dir.join(&req.endpoint);
        let channel = tokio::time::timeout(Duration::from_secs(10), dial(&socket))
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!("dialing {} timed out", socket.display()))
            })?
            .map_err(|e| Status::unavailable(format!("dialing {}: {e}", socket.display())))?;
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(api::Empty {})
            .await
            .map_err(|e| {
                Status::unavailable(format!(
                    "GetDevicePluginOptions on {}: {e}",
                    socket.display()
                ))
            })?
            .into_inner();
        let state = self.state.clone();
        let resource = req.resource_name.clone();
        let stream_client = client.clone();
        // The stream starts once the endpoint is in place, and only updates that generation.
        let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<u64>();
        let task = tokio::spawn(async move {
            if let Ok(generation) = gate_rx.await {
                list_and_watch(state, resource, generation, stream_client).await;
            }
        });
        let generation = self.state.replace_endpoint(
            &req.resource_name,
            Endpoint {
                socket,
                options,
                devices: Vec::new(),
                streaming: false,
                client,
                stream_task: task.abort_handle(),
            },
        );
        let _ = gate_tx.send(generation);
        Ok(Response::new(api::Empty {}))
    }
}

/// Keeps the endpoint's device list current until the stream ends, then marks every device
/// Unhealthy (the kubelet keeps capacity but zeroes allocatable).
async fn list_and_watch(
    state: Arc<State>,
    resource: String,
    generation: u64,
    mut client: DevicePluginClient<Channel>,
) {
    match client.list_and_watch(api::Empty {}).await {
        Ok(stream) => {
            let mut stream = stream.into_inner();
            state.update_endpoint(&resource, generation, |e| e.streaming = true);
            while let Ok(Some(msg)) = stream.message().await {
                state.update_endpoint(&resource, generation, |e| e.devices = msg.devices);
            }
        }
        Err(e) => tracing::warn!(%resource, error = %e, "ListAndWatch failed"),
    }
    state.update_endpoint(&resource, generation, |e| {
        e.streaming = false;
        for d in &mut e.devices {
            d.health = "Unhealthy".to_string();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names() {
        assert!(is_extended_resource_name("nvidia.com/gpu"));
        for bad in [
            "gpu",
            "kubernetes.io/gpu",
            "x.kubernetes.io/gpu",
            "nvidia.com/",
            "/gpu",
            "a/b/c",
        ] {
            assert!(!is_extended_resource_name(bad), "{bad}");
        }
    }
}

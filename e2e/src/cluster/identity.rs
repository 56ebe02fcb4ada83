//! Least-privilege identities as real ServiceAccount tokens, minted with the TokenRequest API —
//! exactly what an in-cluster operator or device plugin presents — so RBAC tests exercise the
//! same path production does.

use std::path::PathBuf;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::cluster::apply::ensure_namespace;
use crate::cluster::control_plane::{client_from_kubeconfig, client_from_kubeconfig_as};
use crate::cluster::{ClusterError, ControlPlane, config};

/// Lifetime of minted tokens: long enough for a demo session.
pub const TOKEN_SECONDS: i64 = 24 * 3600;

impl ControlPlane {
    /// Creates ServiceAccount `namespace/name` (and its namespace) unless they exist, and mints a
    /// token for it. With `node`, the token is bound to that Node, so it carries the
    /// `authentication.kubernetes.io/node-name` claim a kubelet-projected token of a pod on that
    /// node has (what config/admission checks for the device plugin).
    pub async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
        node: Option<&str>,
    ) -> Result<String, ClusterError> {
        let client = self.client();
        let bound_object_ref = match node {
            None => None,
            Some(node) => {
                let nodes: Api<Node> = Api::all(client.clone());
                let found = nodes.get(node).await.map_err(|e| {
                    ClusterError::kube(format!("get node {node} to bind a token to"), e)
                })?;
                Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(node.to_string()),
                    uid: found.metadata.uid,
                })
            }
        };
        ensure_namespace(&client, namespace).await?;
        let sas: Api<ServiceAccount> = Api::namespaced(client, namespace);
        let sa = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..Default::default()
            },
            ..Default::default()
        };
        match sas.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => {
                return Err(ClusterError::kube(
                    format!("create service account {namespace}/{name}"),
                    e,
                ));
            }
        }
        let request = TokenRequest {
            spec: TokenRequestSpec {
                // Empty: the API server's own audience, as for an in-cluster token.
                audiences: Vec::new(),
                expiration_seconds: Some(TOKEN_SECONDS),
                bound_object_ref,
            },
            ..Default::default()
        };
        let minted = sas
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(|e| {
                ClusterError::kube(format!("request a token for {namespace}/{name}"), e)
            })?;
        minted
            .status
            .map(|s| s.token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| ClusterError::NoToken {
                namespace: namespace.to_string(),
                name: name.to_string(),
            })
    }

    /// Writes a kubeconfig authenticating as ServiceAccount `namespace/name` (created if
    /// missing; token bound to `node` if given, see [`ControlPlane::service_account_token`])
    /// into the run dir and returns its path; for components run as processes.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
        node: Option<&str>,
    ) -> Result<PathBuf, ClusterError> {
        let token = self.service_account_token(namespace, name, node).await?;
        let user = format!("system:serviceaccount:{namespace}:{name}");
        let yaml = config::kubeconfig_yaml(self.server_url(), self.ca_cert(), &user, &token)
            .map_err(|source| ClusterError::Yaml {
                path: PathBuf::from("<service account kubeconfig>"),
                source,
            })?;
        let path = self
            .run_dir()
            .join(format!("sa-{namespace}-{name}.kubeconfig"));
        std::fs::write(&path, yaml).map_err(|e| ClusterError::io("write", &path, e))?;
        Ok(path)
    }

    /// A client authenticated as ServiceAccount `namespace/name` (created if missing): its
    /// permissions are exactly what RBAC grants that account.
    pub async fn client_for_service_account(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Client, ClusterError> {
        let path = self
            .service_account_kubeconfig(namespace, name, None)
            .await?;
        client_from_kubeconfig(&path, &format!("{namespace}/{name}")).await
    }

    /// Like [`ControlPlane::client_for_service_account`], with a token bound to Node `node`: a
    /// device plugin's identity on that node.
    pub async fn client_for_service_account_on_node(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
    ) -> Result<Client, ClusterError> {
        let path = self
            .service_account_kubeconfig(namespace, name, Some(node))
            .await?;
        client_from_kubeconfig(&path, &format!("{namespace}/{name} on {node}")).await
    }

    /// A client acting as the kubelet of Node `node`: user `system:node:<node>` in group
    /// `system:nodes`, what a kubelet's client certificate says. The admin impersonates it, so
    /// the Node authorizer, NodeRestriction and every admission policy see a kubelet.
    pub async fn client_as_kubelet(&self, node: &str) -> Result<Client, ClusterError> {
        let user = format!("system:node:{node}");
        client_from_kubeconfig_as(
            self.kubeconfig(),
            &user,
            Some((&user, &["system:nodes", "system:authenticated"])),
        )
        .await
    }
}

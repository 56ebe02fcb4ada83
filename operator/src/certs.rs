//! The operator's own serving certificate (`--self-signed-tls <secret>`), for the extender and
//! the admission webhook, which share one HTTPS port, and the client certificate with which
//! gpuledger-scheduler proves itself to the extender.
//!
//! The operator keeps a CA, a serving certificate and a client certificate in a Secret of its
//! namespace (`tls.crt`, `tls.key`, `client.crt`, `client.key`, `ca.crt`, and `ca.key` so that a
//! renewal keeps the CA every client already trusts), renews both certificates a month before
//! they expire, serves whatever the Secret holds without a restart, and keeps the webhook
//! configurations' `caBundle` equal to `ca.crt` (`--webhook-configuration`). gpuledger-scheduler
//! mounts the same Secret's `ca.crt`, `client.crt` and `client.key`; kube-scheduler reads a
//! client certificate given as files again when they change, so a renewal needs no restart.
//! The extender answers `filter`, `prioritize` and `bind` only to a caller whose certificate this
//! CA signed for client use ([`LiveCert`] is also the handshake's client verifier): `bind` posts
//! Bindings, and anyone else who could reach the port could bind any pod to any node. Replicas
//! race only at creation: the first create wins and the others use what it wrote.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use gpuledger_crds::kubeclient::failure::ApiFailure;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, Resource};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use serde::de::DeserializeOwned;
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::ring::default_provider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::{
    ClientHello, ResolvesServerCert, VerifierBuilderError, WebPkiClientVerifier,
};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{
    DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
};

use crate::telemetry::{Health, Metrics};

/// Annotation on the Secret: when its serving certificate expires (RFC 3339).
pub const NOT_AFTER: &str = "gpuledger.io/not-after";
/// How long a serving certificate is valid.
const VALIDITY: SignedDuration = SignedDuration::from_hours(365 * 24);
/// How long before expiry it is renewed.
const RENEW_BEFORE: SignedDuration = SignedDuration::from_hours(30 * 24);
/// How often the Secret and the webhook configurations are looked at again.
pub const RECHECK_EVERY: Duration = Duration::from_secs(10);
/// First wait before asking for the Secret again at start-up when the API server did not
/// serve the request; it doubles up to [`LAST_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(250);
/// Longest wait between those tries: the certificate follows the server's return by at most
/// this.
const LAST_RETRY: Duration = Duration::from_secs(4);

/// What went wrong with the certificate.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// Generating a key or a certificate failed.
    #[error("generating the {what}: {source}")]
    Generate {
        /// Which one.
        what: &'static str,
        /// Why.
        source: rcgen::Error,
    },
    /// The Secret holds something unusable.
    #[error("Secret {secret}: {problem}")]
    BadSecret {
        /// `namespace/name`.
        secret: String,
        /// What is wrong.
        problem: String,
    },
    /// An API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// Why.
        source: kube::Error,
    },
    /// rustls refused the certificate and key.
    #[error("the certificate and key do not form a TLS identity: {0}")]
    Tls(#[from] tokio_rustls::rustls::Error),
    /// The CA cannot verify the extender's callers.
    #[error("ca.crt: {0}")]
    CallerCa(#[from] CallerCaError),
}

/// Why a CA cannot verify the extender's callers.
#[derive(Debug, thiserror::Error)]
pub enum CallerCaError {
    /// The text is not PEM.
    #[error("not PEM: {0}")]
    Pem(#[from] tokio_rustls::rustls::pki_types::pem::Error),
    /// It holds no certificate.
    #[error("holds no certificate")]
    Empty,
    /// A certificate in it is not one a CA can be.
    #[error("not a usable CA certificate: {0}")]
    Root(tokio_rustls::rustls::Error),
    /// rustls refused to build a verifier from it.
    #[error("{0}")]
    Verifier(#[from] VerifierBuilderError),
}

/// The common name of the client certificate gpuledger-scheduler presents to the extender.
pub const SCHEDULER_CLIENT: &str = "gpuledger-scheduler";

/// One serving identity and the scheduler's client identity, as PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The serving certificate.
    pub cert: String,
    /// Its key.
    pub key: String,
    /// The client certificate gpuledger-scheduler presents to the extender.
    pub client_cert: String,
    /// Its key.
    pub client_key: String,
    /// The CA certificate clients trust.
    pub ca: String,
    /// The CA key (kept to renew under the same CA).
    pub ca_key: String,
    /// When the serving certificate expires (the client certificate expires the same day).
    pub not_after: Timestamp,
}

fn generate(what: &'static str) -> impl FnOnce(rcgen::Error) -> CertError {
    move |source| CertError::Generate { what, source }
}

fn ca_params() -> Result<CertificateParams, CertError> {
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(generate("CA"))?;
    ca.distinguished_name
        .push(DnType::CommonName, "gpuledger-operator-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    Ok(ca)
}

/// `(year, month, day)` of `t` in UTC: certificates here carry day-resolution validity.
fn ymd(t: Timestamp) -> (i32, u8, u8) {
    let d = t.to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC).date();
    (
        i32::from(d.year()),
        u8::try_from(d.month()).unwrap_or(1),
        u8::try_from(d.day()).unwrap_or(1),
    )
}

macro_rules! day {
    ($t:expr) => {{
        let (y, m, d) = ymd($t);
        rcgen::date_time_ymd(y, m, d)
    }};
}

/// A serving certificate for `names` valid from `now`, under the CA of `ca_key` (a new CA when
/// `None`). The CA certificate is rebuilt from its key and fixed subject, so certificates issued
/// after a renewal verify against the `ca.crt` clients already hold.
pub fn issue(
    names: &[String],
    ca: Option<(&str, &str)>,
    now: Timestamp,
) -> Result<Identity, CertError> {
    let (ca_key, ca_pem) = match ca {
        Some((cert, key)) => (
            KeyPair::from_pem(key).map_err(generate("CA key"))?,
            cert.to_string(),
        ),
        None => {
            let key = KeyPair::generate().map_err(generate("CA key"))?;
            let mut params = ca_params()?;
            params.not_before = day!(now - SignedDuration::from_hours(24));
            params.not_after = day!(now + SignedDuration::from_hours(10 * 365 * 24));
            let cert = params
                .self_signed(&key)
                .map_err(generate("CA certificate"))?;
            (key, cert.pem())
        }
    };
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca_params()?, ca_key);
    let key = KeyPair::generate().map_err(generate("serving key"))?;
    let mut params =
        CertificateParams::new(names.to_vec()).map_err(generate("serving certificate"))?;
    params.distinguished_name.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_default(),
    );
    // A day of slack before now: day resolution, and clocks a little behind ours.
    params.not_before = day!(now - SignedDuration::from_hours(24));
    let not_after = now + VALIDITY;
    params.not_after = day!(not_after);
    // Each certificate for its one use: the serving key cannot pass for a caller, nor the
    // scheduler's for the operator.
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(generate("serving certificate"))?;
    let (client_cert, client_key) = client_certificate(&issuer, SCHEDULER_CLIENT, &params)?;
    Ok(Identity {
        cert: cert.pem(),
        key: key.serialize_pem(),
        client_cert,
        client_key,
        ca: ca_pem,
        ca_key: ca_key_pem,
        not_after,
    })
}

/// A client certificate (PEM certificate, PEM key) for common name `name`, for client use only,
/// valid when `serving` is.
fn client_certificate(
    issuer: &Issuer<'_, KeyPair>,
    name: &str,
    serving: &CertificateParams,
) -> Result<(String, String), CertError> {
    let key = KeyPair::generate().map_err(generate("client key"))?;
    let mut params =
        CertificateParams::new(Vec::<String>::new()).map_err(generate("client certificate"))?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.not_before = serving.not_before;
    params.not_after = serving.not_after;
    let cert = params
        .signed_by(&key, issuer)
        .map_err(generate("client certificate"))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A client certificate for `name` under `id`'s CA: what a CA that signs for others than the
/// scheduler hands out.
#[cfg(test)]
pub(crate) fn client_certificate_named(id: &Identity, name: &str) -> (String, String) {
    let key = KeyPair::from_pem(&id.ca_key).unwrap_or_else(|e| panic!("CA key: {e}"));
    let issuer = Issuer::new(ca_params().unwrap_or_else(|e| panic!("{e}")), key);
    let mut validity = CertificateParams::default();
    let now = Timestamp::now();
    validity.not_before = day!(now - SignedDuration::from_hours(24));
    validity.not_after = day!(now + VALIDITY);
    client_certificate(&issuer, name, &validity).unwrap_or_else(|e| panic!("{e}"))
}

/// Whether an identity expiring at `not_after` must be renewed at `now`.
pub fn due(not_after: Timestamp, now: Timestamp) -> bool {
    not_after - RENEW_BEFORE <= now
}

fn secret_of(name: &str, namespace: &str, id: &Identity) -> Secret {
    let data = [
        ("tls.crt", &id.cert),
        ("tls.key", &id.key),
        ("client.crt", &id.client_cert),
        ("client.key", &id.client_key),
        ("ca.crt", &id.ca),
        ("ca.key", &id.ca_key),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
    .collect();
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            annotations: Some([(NOT_AFTER.to_string(), id.not_after.to_string())].into()),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".into()),
        data: Some(data),
        ..Default::default()
    }
}

/// The text of `key` in a Secret's data.
fn field(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()?
        .get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

/// The CA (certificate, key) a Secret holds, complete identity or not: a Secret written before
/// the client certificate existed is renewed under the CA its clients already trust.
fn ca_of(secret: &Secret) -> Option<(String, String)> {
    Some((field(secret, "ca.crt")?, field(secret, "ca.key")?))
}

/// The identity a Secret holds, when it holds a complete one.
fn identity_of(secret: &Secret) -> Option<Identity> {
    let field = |k: &str| field(secret, k);
    let not_after = secret
        .metadata
        .annotations
        .as_ref()?
        .get(NOT_AFTER)?
        .parse()
        .ok()?;
    Some(Identity {
        cert: field("tls.crt")?,
        key: field("tls.key")?,
        client_cert: field("client.crt")?,
        client_key: field("client.key")?,
        ca: field("ca.crt")?,
        ca_key: field("ca.key")?,
        not_after,
    })
}

/// Where the identity lives and what it is for.
#[derive(Clone, Debug)]
pub struct SelfSigned {
    /// The Secret's name.
    pub secret: String,
    /// Its namespace (the operator's).
    pub namespace: String,
    /// DNS names and IP addresses of the serving certificate.
    pub names: Vec<String>,
    /// Mutating and validating webhook configurations whose `caBundle` to keep in step.
    pub webhook_configuration: Option<String>,
}

impl SelfSigned {
    /// The identity to serve first, as [`Self::ensure`] reads or issues it, asked again for as
    /// long as the API server does not serve the request (no connection, a 5xx, 429): an
    /// operator started while its control plane is away (a power-on of the whole cluster, a
    /// control-plane upgrade) waits for it, its probes answering, instead of exiting and
    /// sitting out the kubelet's crash-loop backoff (up to five minutes) once the server is
    /// back. A refusal (403 without the Role, a Secret it cannot use) ends it with the error:
    /// only a fix of the install helps there.
    /// `health` names the wait meanwhile (`/warmz`, `/readyz`).
    pub async fn first(
        &self,
        client: &Client,
        metrics: &Metrics,
        health: &Health,
    ) -> Result<Identity, CertError> {
        let mut wait = FIRST_RETRY;
        loop {
            match self.ensure(client).await {
                Err(CertError::Kube { action, source })
                    if ApiFailure::of_request(&source) == ApiFailure::NotServed =>
                {
                    metrics.certificate_failures.inc();
                    tracing::warn!(%action, error = %source, retry_in = ?wait,
                        "the API server does not serve the serving certificate's Secret yet");
                    health.starting_waits_on(Some(format!(
                        "the serving certificate: the API server does not serve it ({action}: {source})"
                    )));
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(LAST_RETRY);
                }
                other => {
                    health.starting_waits_on(None);
                    return other;
                }
            }
        }
    }

    /// The identity to serve: the Secret's, renewed (or first created) when due.
    pub async fn ensure(&self, client: &Client) -> Result<Identity, CertError> {
        let api: Api<Secret> = Api::namespaced(client.clone(), &self.namespace);
        let what = |action: &str| format!("{action} Secret {}/{}", self.namespace, self.secret);
        let current = api
            .get_opt(&self.secret)
            .await
            .map_err(|source| CertError::Kube {
                action: what("read"),
                source,
            })?;
        let now = Timestamp::now();
        let held = current.as_ref().and_then(identity_of);
        if let Some(id) = held.as_ref().filter(|id| !due(id.not_after, now)) {
            return Ok(id.clone());
        }
        let ca = current.as_ref().and_then(ca_of);
        let ca = ca.as_ref().map(|(cert, key)| (cert.as_str(), key.as_str()));
        let fresh = issue(&self.names, ca, now)?;
        let mut secret = secret_of(&self.secret, &self.namespace, &fresh);
        let written = match &current {
            None => api.create(&PostParams::default(), &secret).await,
            Some(old) => {
                secret.metadata.resource_version = old.meta().resource_version.clone();
                api.replace(&self.secret, &PostParams::default(), &secret)
                    .await
            }
        };
        match written {
            Ok(_) => {
                tracing::info!(secret = %self.secret, not_after = %fresh.not_after, "serving certificate issued");
                Ok(fresh)
            }
            // Another replica wrote first: serve what it wrote.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let theirs = api
                    .get(&self.secret)
                    .await
                    .map_err(|source| CertError::Kube {
                        action: what("re-read"),
                        source,
                    })?;
                identity_of(&theirs).ok_or_else(|| CertError::BadSecret {
                    secret: format!("{}/{}", self.namespace, self.secret),
                    problem: "written by another replica without a complete identity".into(),
                })
            }
            Err(source) => Err(CertError::Kube {
                action: what("write"),
                source,
            }),
        }
    }

    /// Sets `caBundle` of every webhook of the mutating and validating configurations to `ca`,
    /// where it differs. A configuration that does not exist (yet) is left for the next check.
    pub async fn publish_ca(&self, client: &Client, ca: &str) -> Result<(), CertError> {
        let Some(name) = &self.webhook_configuration else {
            return Ok(());
        };
        let bundle = STANDARD.encode(ca.as_bytes());
        patch_bundles::<MutatingWebhookConfiguration>(client, name, &bundle).await?;
        patch_bundles::<ValidatingWebhookConfiguration>(client, name, &bundle).await
    }
}

/// Sets `caBundle` on every webhook of configuration `name` of kind `K` (a merge patch of the
/// whole `webhooks` list, guarded by the resourceVersion it was read at).
async fn patch_bundles<K>(client: &Client, name: &str, bundle: &str) -> Result<(), CertError>
where
    K: Resource<Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::all(client.clone());
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let kube_err = |action: &str| {
        let action = format!("{action} {kind} {name}");
        move |source| CertError::Kube { action, source }
    };
    let Some(config) = api.get_opt(name).await.map_err(kube_err("read"))? else {
        return Ok(());
    };
    let mut doc = serde_json::to_value(&config).unwrap_or_default();
    let Some(webhooks) = doc.get_mut("webhooks").and_then(|w| w.as_array_mut()) else {
        return Ok(());
    };
    let mut changed = false;
    for w in webhooks.iter_mut() {
        if w["clientConfig"]["caBundle"].as_str() != Some(bundle) {
            w["clientConfig"]["caBundle"] = serde_json::Value::from(bundle);
            changed = true;
        }
    }
    if !changed {
        return Ok(());
    }
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": config.meta().resource_version },
        "webhooks": webhooks,
    });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube_err("set caBundle of"))?;
    tracing::info!(%kind, name, "webhook caBundle set to the operator's CA");
    Ok(())
}

/// The certificate the TLS listener serves and the CA its callers' certificates must chain to,
/// both replaceable while it runs.
#[derive(Debug)]
pub struct LiveCert {
    current: RwLock<Arc<CertifiedKey>>,
    callers: RwLock<Arc<dyn ClientCertVerifier>>,
}

/// A handshake verifier for client certificates signed by `ca_pem` for client use. A caller
/// without a certificate still completes the handshake (the API server calls the webhook
/// without one); the extender's routes then refuse it (`extender::tls::require_client`).
pub fn callers_of(ca_pem: &str) -> Result<Arc<dyn ClientCertVerifier>, CallerCaError> {
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(ca?).map_err(CallerCaError::Root)?;
    }
    if roots.is_empty() {
        return Err(CallerCaError::Empty);
    }
    Ok(
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::new(default_provider()))
            .allow_unauthenticated()
            .build()?,
    )
}

fn certified(id: &Identity) -> Result<Arc<CertifiedKey>, CertError> {
    let bad = |problem: String| CertError::BadSecret {
        secret: "serving identity".into(),
        problem,
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(id.cert.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| bad(format!("tls.crt: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(id.key.as_bytes())
        .map_err(|e| bad(format!("tls.key: {e}")))?;
    let signing = default_provider().key_provider.load_private_key(key)?;
    Ok(Arc::new(CertifiedKey::new(chain, signing)))
}

impl LiveCert {
    /// Serves `id` to begin with, and takes callers whose certificates `id.ca` signed.
    pub fn new(id: &Identity) -> Result<Self, CertError> {
        Ok(LiveCert {
            current: RwLock::new(certified(id)?),
            callers: RwLock::new(callers_of(&id.ca)?),
        })
    }

    /// Serves `id`, and takes callers of its CA, from the next handshake on.
    pub fn replace(&self, id: &Identity) -> Result<(), CertError> {
        let next = certified(id)?;
        let callers = callers_of(&id.ca)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
        *self.callers.write().unwrap_or_else(|e| e.into_inner()) = callers;
        Ok(())
    }

    fn callers(&self) -> Arc<dyn ClientCertVerifier> {
        self.callers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Every question is answered by the verifier of the CA served now.
impl ClientCertVerifier for LiveCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints are optional; kube-scheduler sends its one certificate either way.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, tokio_rustls::rustls::Error> {
        self.callers()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.callers().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        self.callers().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.callers().supported_verify_schemes()
    }
}

impl ResolvesServerCert for LiveCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }
}

/// Keeps the identity and the webhooks' `caBundle` current until the task is aborted. The
/// served certificate's expiry and every failure go to `metrics`: a renewal that keeps failing
/// shows as an expiry that no longer moves, weeks before it matters.
pub async fn keep_current(
    client: Client,
    cfg: SelfSigned,
    live: Arc<LiveCert>,
    mut serving: Identity,
    metrics: Arc<Metrics>,
) {
    let expiry = &metrics.certificate_expiry;
    expiry.set(serving.not_after.as_second());
    loop {
        match cfg.ensure(&client).await {
            Ok(id) if id != serving => match live.replace(&id) {
                Ok(()) => {
                    expiry.set(id.not_after.as_second());
                    serving = id;
                }
                Err(e) => {
                    metrics.certificate_failures.inc();
                    tracing::error!(error = %e, "cannot serve the renewed certificate")
                }
            },
            Ok(_) => {}
            Err(e) => {
                metrics.certificate_failures.inc();
                tracing::warn!(error = %e, "checking the serving certificate")
            }
        }
        if let Err(e) = cfg.publish_ca(&client, &serving.ca).await {
            metrics.certificate_failures.inc();
            tracing::warn!(error = %e, "publishing the CA to the webhook configurations");
        }
        tokio::time::sleep(RECHECK_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At start-up: asked for again while the API server does not serve it (503, 429), each
    /// try counted; a refusal (403) ends the wait at once with an error naming the Secret.
    #[tokio::test(start_paused = true)]
    async fn the_first_certificate_waits_for_the_server_but_not_past_a_refusal() {
        use gpuledger_crds::scripted_api::{expect, scripted, status};
        use http::Method;
        let keeper = SelfSigned {
            secret: "tls".into(),
            namespace: "ns".into(),
            names: names(),
            webhook_configuration: None,
        };
        let held = issue(&names(), None, Timestamp::now()).unwrap();
        let stored = serde_json::to_value(secret_of("tls", "ns", &held)).unwrap();
        let path = "/api/v1/namespaces/ns/secrets/tls";
        let (client, api) = scripted(vec![
            expect(Method::GET, path).reply(503, status(503, "ServiceUnavailable", "starting")),
            expect(Method::GET, path).reply(429, status(429, "TooManyRequests", "busy")),
            expect(Method::GET, path).reply(200, stored),
        ]);
        let metrics = Metrics::new();
        let health = Health::default();
        let got = keeper.first(&client, &metrics, &health).await;
        api.finish().await;
        assert_eq!(got.unwrap(), held);
        assert_eq!(metrics.certificate_failures.get(), 2);
        assert_eq!(health.starting_wait(), None, "the wait is over");

        let (client, api) = scripted(vec![
            expect(Method::GET, path).reply(403, status(403, "Forbidden", "no Role")),
        ]);
        // (Virtual time: a wait past the refusal would run out this limit at once.)
        let got = tokio::time::timeout(
            Duration::from_secs(60),
            keeper.first(&client, &metrics, &health),
        )
        .await
        .expect("still waiting after the server refused");
        api.finish().await;
        let e = got.unwrap_err();
        assert!(matches!(e, CertError::Kube { .. }), "{e}");
        assert!(e.to_string().contains("read Secret ns/tls"), "{e}");
    }

    fn names() -> Vec<String> {
        vec![
            "gpuledger-operator.gpuledger-system.svc".into(),
            "127.0.0.1".into(),
        ]
    }

    #[test]
    fn renewal_is_due_a_month_before_expiry() {
        let now = Timestamp::UNIX_EPOCH + SignedDuration::from_hours(100_000);
        assert!(!due(now + SignedDuration::from_hours(31 * 24), now));
        assert!(due(now + SignedDuration::from_hours(29 * 24), now));
        assert!(due(now - SignedDuration::from_hours(1), now));
    }

    #[test]
    fn a_renewal_keeps_the_ca_and_the_secret_round_trips() {
        let now = Timestamp::now();
        let first = issue(&names(), None, now).unwrap();
        let renewed = issue(&names(), Some((&first.ca, &first.ca_key)), now).unwrap();
        assert_eq!(renewed.ca, first.ca, "clients keep trusting the same CA");
        assert_ne!(renewed.cert, first.cert);
        assert_eq!(first.not_after, now + VALIDITY);
        let secret = secret_of("tls", "ns", &renewed);
        assert_eq!(
            identity_of(&secret).unwrap().not_after.as_second(),
            renewed.not_after.as_second()
        );
        assert!(LiveCert::new(&renewed).is_ok());
    }

    /// Whether `id`'s serving certificate verifies for `name` against `ca` (a PEM CA).
    fn verifies(id: &Identity, ca: &str, name: &str) -> bool {
        use tokio_rustls::rustls::RootCertStore;
        use tokio_rustls::rustls::client::WebPkiServerVerifier;
        use tokio_rustls::rustls::client::danger::ServerCertVerifier;
        use tokio_rustls::rustls::pki_types::{ServerName, UnixTime};
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
            .unwrap();
        let verifier = WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(default_provider()),
        )
        .build()
        .unwrap();
        let leaf = CertificateDer::from_pem_slice(id.cert.as_bytes()).unwrap();
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(name.to_string()).unwrap(),
                &[],
                UnixTime::now(),
            )
            .is_ok()
    }

    #[test]
    fn a_renewed_certificate_verifies_against_the_ca_clients_already_hold() {
        let now = Timestamp::now();
        let first = issue(&names(), None, now).unwrap();
        let renewed = issue(&names(), Some((&first.ca, &first.ca_key)), now).unwrap();
        assert!(verifies(
            &first,
            &first.ca,
            "gpuledger-operator.gpuledger-system.svc"
        ));
        assert!(verifies(
            &renewed,
            &first.ca,
            "gpuledger-operator.gpuledger-system.svc"
        ));
        assert!(verifies(&renewed, &first.ca, "127.0.0.1"));
        assert!(!verifies(&renewed, &first.ca, "elsewhere.example"));
        let stranger = issue(&names(), None, now).unwrap();
        assert!(
            !verifies(&stranger, &first.ca, "127.0.0.1"),
            "another CA's certificate"
        );
    }

    #[test]
    fn an_incomplete_secret_holds_no_identity() {
        let id = issue(&names(), None, Timestamp::now()).unwrap();
        let mut secret = secret_of("tls", "ns", &id);
        secret.data.as_mut().unwrap().remove("ca.key");
        assert!(identity_of(&secret).is_none());
        assert!(ca_of(&secret).is_none());
    }

    /// Whether `cert` passes as a caller's certificate with `ca`.
    fn accepted_caller(cert: &str, ca: &str) -> bool {
        let leaf = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        callers_of(ca)
            .unwrap()
            .verify_client_cert(&leaf, &[], UnixTime::now())
            .is_ok()
    }

    #[test]
    fn the_schedulers_certificate_is_a_caller_of_the_ca_and_nothing_else_is() {
        let now = Timestamp::now();
        let id = issue(&names(), None, now).unwrap();
        assert!(accepted_caller(&id.client_cert, &id.ca));
        assert!(
            !accepted_caller(&id.cert, &id.ca),
            "the serving certificate is for serving only"
        );
        let stranger = issue(&names(), None, now).unwrap();
        assert!(!accepted_caller(&stranger.client_cert, &id.ca));
        let renewed = issue(&names(), Some((&id.ca, &id.ca_key)), now).unwrap();
        assert!(
            accepted_caller(&renewed.client_cert, &id.ca),
            "a renewal's client certificate chains to the CA the operator already checks"
        );
        assert!(
            accepted_caller(&id.client_cert, &renewed.ca),
            "and the one the scheduler still holds keeps passing until it reads the new one"
        );
    }

    #[test]
    fn a_secret_written_before_client_certificates_is_renewed_under_its_ca() {
        let id = issue(&names(), None, Timestamp::now()).unwrap();
        let mut secret = secret_of("tls", "ns", &id);
        assert_eq!(identity_of(&secret).as_ref(), Some(&id));
        let data = secret.data.as_mut().unwrap();
        data.remove("client.crt");
        data.remove("client.key");
        assert!(identity_of(&secret).is_none(), "so ensure() issues again");
        assert_eq!(ca_of(&secret), Some((id.ca.clone(), id.ca_key.clone())));
    }

    #[test]
    fn an_empty_ca_is_refused_by_name() {
        let err = callers_of("").err().unwrap();
        assert!(err.to_string().contains("no certificate"), "{err}");
    }
}

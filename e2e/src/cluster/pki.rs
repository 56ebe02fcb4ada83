//! The control plane's credentials: a throw-away CA, the API server's serving certificate, the
//! service-account signing key pair and the static admin token. Generated fresh for every run with
//! rcgen (ECDSA P-256), which kube-apiserver accepts for serving and for signing SA tokens.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::cluster::ClusterError;

/// Names the serving certificate is valid for: loopback, plus the in-cluster names of the
/// `kubernetes` Service so that in-cluster style clients verify too.
pub const SERVING_NAMES: [&str; 6] = [
    "localhost",
    "127.0.0.1",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "10.0.0.1",
];

/// User name of the static admin token (group `system:masters`).
pub const ADMIN_USER: &str = "gpuledger-e2e-admin";

/// Files of one run's credentials.
#[derive(Clone, Debug)]
pub struct Pki {
    /// CA certificate (PEM): trust anchor for clients and the client-CA of the API server.
    pub ca_cert: PathBuf,
    /// CA private key (PEM).
    pub ca_key: PathBuf,
    /// API server serving certificate (PEM).
    pub serving_cert: PathBuf,
    /// API server serving key (PEM).
    pub serving_key: PathBuf,
    /// Service-account token signing key (PEM, PKCS#8).
    pub sa_key: PathBuf,
    /// Its public key (PEM), which the API server verifies tokens with.
    pub sa_pub: PathBuf,
    /// Static token file of the API server.
    pub tokens_csv: PathBuf,
    /// The admin bearer token.
    pub admin_token: String,
}

/// Writes a fresh CA, serving certificate, SA key pair and token file into `dir`.
pub fn generate(dir: &Path) -> Result<Pki, ClusterError> {
    std::fs::create_dir_all(dir).map_err(|e| ClusterError::io("create", dir, e))?;
    let pki_err = |what| move |source| ClusterError::Pki { what, source };

    let ca_key = KeyPair::generate().map_err(pki_err("CA key"))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(pki_err("CA"))?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "gpuledger-e2e-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .map_err(pki_err("CA certificate"))?;
    let ca_key_pem = ca_key.serialize_pem();
    let issuer = Issuer::new(ca_params, ca_key);

    let serving_key = KeyPair::generate().map_err(pki_err("serving key"))?;
    let mut serving_params = CertificateParams::new(
        SERVING_NAMES
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
    )
    .map_err(pki_err("serving certificate"))?;
    serving_params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    serving_params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving_cert = serving_params
        .signed_by(&serving_key, &issuer)
        .map_err(pki_err("serving certificate"))?;

    let sa_key = KeyPair::generate().map_err(pki_err("service-account key"))?;
    let admin_token = random_token();

    let pki = Pki {
        ca_cert: dir.join("ca.crt"),
        ca_key: dir.join("ca.key"),
        serving_cert: dir.join("apiserver.crt"),
        serving_key: dir.join("apiserver.key"),
        sa_key: dir.join("sa.key"),
        sa_pub: dir.join("sa.pub"),
        tokens_csv: dir.join("tokens.csv"),
        admin_token,
    };
    write(&pki.ca_cert, &ca_cert.pem())?;
    write(&pki.ca_key, &ca_key_pem)?;
    write(&pki.serving_cert, &serving_cert.pem())?;
    write(&pki.serving_key, &serving_key.serialize_pem())?;
    write(&pki.sa_key, &sa_key.serialize_pem())?;
    write(&pki.sa_pub, &sa_key.public_key_pem())?;
    write(&pki.tokens_csv, &tokens_csv(&pki.admin_token))?;
    Ok(pki)
}

/// The API server's static token file: one admin in `system:masters`. Least-privilege
/// identities are real ServiceAccount tokens (see `client_for_service_account`), never static
/// users, so RBAC is exercised exactly as in a cluster.
pub fn tokens_csv(admin_token: &str) -> String {
    format!("{admin_token},{ADMIN_USER},uid-{ADMIN_USER},\"system:masters\"\n")
}

/// 32 random hex digits: unguessable, and free of the commas the token file would choke on.
fn random_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn write(path: &Path, contents: &str) -> Result<(), ClusterError> {
    std::fs::write(path, contents).map_err(|e| ClusterError::io("write", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_file_as_pem() {
        let dir = tempfile::tempdir().unwrap();
        let pki = generate(dir.path()).unwrap();
        for (path, marker) in [
            (&pki.ca_cert, "BEGIN CERTIFICATE"),
            (&pki.serving_cert, "BEGIN CERTIFICATE"),
            (&pki.serving_key, "PRIVATE KEY"),
            (&pki.sa_key, "PRIVATE KEY"),
            (&pki.sa_pub, "BEGIN PUBLIC KEY"),
        ] {
            let text = std::fs::read_to_string(path).unwrap();
            assert!(text.contains(marker), "{}: {text}", path.display());
        }
        assert_ne!(
            std::fs::read(&pki.ca_cert).unwrap(),
            std::fs::read(&pki.serving_cert).unwrap()
        );
    }

    #[test]
    fn token_file_puts_admin_in_system_masters() {
        let line = tokens_csv("abc");
        assert_eq!(
            line,
            format!("abc,{ADMIN_USER},uid-{ADMIN_USER},\"system:masters\"\n")
        );
    }

    #[test]
    fn tokens_differ_between_runs() {
        let (a, b) = (random_token(), random_token());
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}

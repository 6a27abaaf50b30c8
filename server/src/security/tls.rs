//! TLS material for the server's own connections: reads PEM files into
//! rustls configurations (the MQTT client's, the HTTPS server's) and installs
//! the process-wide rustls crypto provider (ring) once.
//!
//! It opens no socket and performs no handshake; errors name the file and
//! what was expected in it, never a key's content.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} holds no PEM certificate (expected a `-----BEGIN CERTIFICATE-----` block)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no unencrypted PEM private key (expected `-----BEGIN PRIVATE KEY-----`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`; decrypt an encrypted key first)", path.display())]
    NoKey { path: PathBuf },
    #[error("{} is not valid PEM: {reason}", path.display())]
    Pem { path: PathBuf, reason: String },
    #[error("{}: no certificate in it can be a trust anchor ({reason})", path.display())]
    BadCa { path: PathBuf, reason: String },
    #[error("the system trust store has no usable CA certificate ({reason}); name the broker's CA with a CA file")]
    NoSystemRoots { reason: String },
    #[error("{}: the certificate and key cannot be used together: {source}", cert.display())]
    CertAndKey {
        cert: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// Installs ring as the process's rustls crypto provider, once; later
/// calls (and a provider installed by someone else first) are fine. Every
/// rustls user in the process (MQTT, HTTPS, the PostgreSQL driver) takes
/// the process default.
pub fn install_crypto_provider() {
    // Err means a provider is installed already: that one is used.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate of a PEM file (a chain: leaf first).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
// rustls_pki_types::pem::Error is #[non_exhaustive]: a catch-all arm is required.
#[allow(clippy::wildcard_enum_match_arm)]
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoKey {
            path: path.to_path_buf(),
        },
        // The error text names the section kind, never key bytes.
        other => TlsError::Pem {
            path: path.to_path_buf(),
            reason: other.to_string(),
        },
    })
}

/// A certificate and key file pair (mutual TLS, or the HTTPS identity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertKeyFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The trust anchors: every certificate of `ca_file`, or the system's
/// trust store when `None`.
pub fn root_store(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in load_certs(path)? {
                roots.add(cert).map_err(|e| TlsError::BadCa {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let reason = match found.errors.first() {
                    Some(e) => e.to_string(),
                    None => "no certificate found".to_owned(),
                };
                return Err(TlsError::NoSystemRoots { reason });
            }
        }
    }
    Ok(roots)
}

/// A TLS client configuration verifying the peer against `ca_file` (or the
/// system trust store), presenting `client` when given (mutual TLS).
pub fn client_config(
    ca_file: Option<&Path>,
    client: Option<&CertKeyFiles>,
) -> Result<Arc<ClientConfig>, TlsError> {
    install_crypto_provider();
    let builder = ClientConfig::builder().with_root_certificates(root_store(ca_file)?);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some(files) => {
            let certs = load_certs(&files.cert)?;
            let key = load_key(&files.key)?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|source| TlsError::CertAndKey {
                    cert: files.cert.clone(),
                    source,
                })?
        }
    };
    Ok(Arc::new(config))
}

/// A TLS server configuration presenting `files` (HTTP/1.1 only, as the
/// API speaks).
pub fn server_config(files: &CertKeyFiles) -> Result<Arc<ServerConfig>, TlsError> {
    install_crypto_provider();
    let certs = load_certs(&files.cert)?;
    let key = load_key(&files.key)?;
    let mut config = ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|source| TlsError::CertAndKey {
            cert: files.cert.clone(),
            source,
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The MQTT client's TLS settings, loaded: what `Debug` shows is where they
/// came from, never key material.
#[derive(Clone)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    /// `None`: the system trust store.
    pub ca_file: Option<PathBuf>,
    pub client: Option<CertKeyFiles>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client.as_ref().map(|c| &c.cert))
            .finish_non_exhaustive()
    }
}

/// The HTTPS server's TLS settings, loaded.
#[derive(Clone)]
pub struct ServerTls {
    pub config: Arc<ServerConfig>,
    pub files: CertKeyFiles,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.files.cert)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn test_identity(dir: &Path) -> CertKeyFiles {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        CertKeyFiles {
            cert: write(dir, "cert.pem", &cert.pem()),
            key: write(dir, "key.pem", &key.serialize_pem()),
        }
    }

    #[test]
    fn a_certificate_and_key_load_into_client_and_server_configs() {
        let dir = tempfile::tempdir().unwrap();
        let files = test_identity(dir.path());
        let server = server_config(&files).unwrap();
        assert_eq!(server.alpn_protocols, vec![b"http/1.1".to_vec()]);
        client_config(Some(&files.cert), Some(&files)).unwrap();
    }

    #[test]
    fn missing_or_wrong_files_are_errors_naming_the_file_and_what_was_expected() {
        let dir = tempfile::tempdir().unwrap();
        let files = test_identity(dir.path());
        let missing = dir.path().join("nope.pem");
        let err = load_certs(&missing).unwrap_err().to_string();
        assert!(
            err.contains("cannot read") && err.contains("nope.pem"),
            "{err}"
        );

        // A key where a certificate belongs, and the other way round.
        let err = load_certs(&files.key).unwrap_err().to_string();
        assert!(err.contains("no PEM certificate"), "{err}");
        let err = load_key(&files.cert).unwrap_err().to_string();
        assert!(err.contains("no unencrypted PEM private key"), "{err}");
        let err = client_config(Some(&files.key), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("key.pem"), "{err}");

        // A key that does not belong to the certificate.
        let other = rcgen::KeyPair::generate().unwrap();
        let wrong = CertKeyFiles {
            cert: files.cert.clone(),
            key: write(dir.path(), "other.pem", &other.serialize_pem()),
        };
        let err = server_config(&wrong).unwrap_err().to_string();
        assert!(err.contains("cannot be used together"), "{err}");
    }

    #[test]
    fn debug_output_names_files_but_no_key_material() {
        let dir = tempfile::tempdir().unwrap();
        let files = test_identity(dir.path());
        let key_pem = std::fs::read_to_string(&files.key).unwrap();
        let tls = ServerTls {
            config: server_config(&files).unwrap(),
            files: files.clone(),
        };
        let shown = format!("{tls:?}");
        assert!(shown.contains("cert.pem"), "{shown}");
        assert!(!shown.contains("key.pem"), "{shown}");
        let body: String = key_pem.lines().nth(1).unwrap().to_owned();
        assert!(!shown.contains(&body));
    }
}

//! The fleet's TLS client settings for an `mqtts://` broker: what to trust
//! (a CA file or the system's trust store) and, optionally, the client
//! certificate every device presents. Reads the PEM files once; nothing
//! here connects.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::SimError;

/// The fleet's TLS client settings: what to trust (a CA file or the
/// system's trust store) and, optionally, one client certificate every
/// device presents. Loaded once, shared by every connection.
#[derive(Clone)]
pub struct SimTls {
    config: Arc<rustls::ClientConfig>,
    /// Where it came from, for `Debug` (never key material).
    source: String,
}

impl fmt::Debug for SimTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimTls({})", self.source)
    }
}

impl SimTls {
    /// Trusts the CA(s) in `ca_file` (PEM), or the system trust store when
    /// `None`; presents `client` (certificate chain, key; PEM) when given.
    pub fn from_files(
        ca_file: Option<&Path>,
        client: Option<(&Path, &Path)>,
    ) -> Result<Self, SimError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        // Err: a provider is installed already, which is then used.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bad = |path: &Path, reason: String| SimError::Tls {
            path: path.to_path_buf(),
            reason,
        };
        let read = |path: &Path| {
            std::fs::read(path).map_err(|e| bad(path, format!("cannot read it: {e}")))
        };
        let certs = |path: &Path| -> Result<Vec<CertificateDer<'static>>, SimError> {
            let pem = read(path)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(path, e.to_string()))?;
            if certs.is_empty() {
                return Err(bad(path, "no PEM certificate in it".to_owned()));
            }
            Ok(certs)
        };
        let mut roots = rustls::RootCertStore::empty();
        match ca_file {
            Some(path) => {
                for cert in certs(path)? {
                    roots.add(cert).map_err(|e| bad(path, e.to_string()))?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(SimError::Tls {
                        path: PathBuf::from("(system trust store)"),
                        reason: "no usable CA certificate; pass --ca-file".to_owned(),
                    });
                }
            }
        }
        let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certs(cert)?;
                let key_pem = read(key)?;
                let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
                    .map_err(|e| bad(key, format!("no unencrypted PEM private key in it ({e})")))?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    bad(cert, format!("certificate and key do not go together: {e}"))
                })?
            }
        };
        let source = match (ca_file, client) {
            (Some(ca), None) => format!("ca {}", ca.display()),
            (Some(ca), Some((cert, _))) => {
                format!("ca {}, client cert {}", ca.display(), cert.display())
            }
            (None, None) => "system roots".to_owned(),
            (None, Some((cert, _))) => format!("system roots, client cert {}", cert.display()),
        };
        Ok(Self {
            config: Arc::new(config),
            source,
        })
    }

    /// An existing rustls configuration.
    pub fn from_config(config: Arc<rustls::ClientConfig>) -> Self {
        Self {
            config,
            source: "rustls config".to_owned(),
        }
    }

    pub fn config(&self) -> Arc<rustls::ClientConfig> {
        self.config.clone()
    }
}

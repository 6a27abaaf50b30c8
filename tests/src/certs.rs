//! Test certificates made at run time with rcgen: one CA per fixture, server
//! certificates for 127.0.0.1 / localhost / ::1, and client certificates
//! whose common name is the identity a broker takes as user name. Written as
//! PEM files into the fixture's own directory.
//!
//! It owns the files it writes in the directory it is given; it never
//! touches a system trust store or any other file.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    /// The same pair as the server's configuration type.
    pub fn to_server_files(&self) -> idem_server::security::tls::CertKeyFiles {
        idem_server::security::tls::CertKeyFiles {
            cert: self.cert.clone(),
            key: self.key.clone(),
        }
    }
}

/// A certificate authority of one test fixture.
pub struct TestCa {
    dir: PathBuf,
    ca_file: PathBuf,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa")
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/ca.crt`.
    pub fn create(dir: &Path, name: &str) -> Result<Self> {
        let key = KeyPair::generate().context("generating the test CA's key")?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).context("test CA parameters")?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params
            .self_signed(&key)
            .context("self-signing the test CA")?;
        let ca_file = dir.join("ca.crt");
        write(&ca_file, &cert.pem())?;
        Ok(Self {
            dir: dir.to_path_buf(),
            ca_file,
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate (PEM): what clients and servers must trust.
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    /// A server certificate for 127.0.0.1, ::1 and localhost, written to
    /// `dir/{stem}.crt` and `dir/{stem}.key`.
    pub fn issue_server(&self, stem: &str) -> Result<CertFiles> {
        let mut params = CertificateParams::new(vec![
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
            "localhost".to_owned(),
        ])
        .context("server certificate parameters")?;
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params, stem)
    }

    /// A client certificate with common name `common_name` (what Mosquitto's
    /// `use_identity_as_username` takes as the user name), written to
    /// `dir/client-{common_name}.crt` / `.key`.
    pub fn issue_client(&self, common_name: &str) -> Result<CertFiles> {
        let mut params = CertificateParams::new(Vec::<String>::new())
            .context("client certificate parameters")?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let stem: String = common_name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.issue(params, &format!("client-{stem}"))
    }

    /// A rustls client configuration trusting this CA, presenting `client`
    /// when given.
    pub fn client_config(&self, client: Option<&CertFiles>) -> Result<Arc<rustls::ClientConfig>> {
        let files = client.map(CertFiles::to_server_files);
        idem_server::security::tls::client_config(Some(&self.ca_file), files.as_ref())
            .context("building a TLS client configuration for the test CA")
    }

    fn issue(&self, params: CertificateParams, stem: &str) -> Result<CertFiles> {
        let key = KeyPair::generate().context("generating a certificate key")?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .with_context(|| format!("signing the certificate {stem}"))?;
        let files = CertFiles {
            cert: self.dir.join(format!("{stem}.crt")),
            key: self.dir.join(format!("{stem}.key")),
        };
        write(&files.cert, &cert.pem())?;
        write(&files.key, &key.serialize_pem())?;
        Ok(files)
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_load_into_rustls_configs() {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::create(dir.path(), "idem test CA").unwrap();
        let server = ca.issue_server("server").unwrap();
        idem_server::security::tls::server_config(&server.to_server_files()).unwrap();
        let client = ca.issue_client("device/1").unwrap();
        assert!(client.cert.ends_with("client-device_1.crt"));
        ca.client_config(Some(&client)).unwrap();
    }
}

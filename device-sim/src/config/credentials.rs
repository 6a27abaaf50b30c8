//! Secrets of the fleet: [`SecretString`], a value that never prints, and
//! [`Credentials`], the per-device broker passwords read from a
//! `device-id:password` file.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use idem_protocol::DeviceId;

use crate::error::SimError;

/// A value that is never printed: `Debug` and `Display` show `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretString(String);

impl SecretString {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place it is sent (CONNECT, the HTTP header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl FromStr for SecretString {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

/// Per-device broker passwords; the user name is the device id. `Debug`
/// shows how many, never a password.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    passwords: HashMap<DeviceId, SecretString>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials({} devices)", self.passwords.len())
    }
}

impl Credentials {
    pub fn new(passwords: HashMap<DeviceId, String>) -> Self {
        Self {
            passwords: passwords
                .into_iter()
                .map(|(id, pw)| (id, SecretString::new(pw)))
                .collect(),
        }
    }

    /// Reads `id:password` lines (blank lines and `#` comments skipped;
    /// the password is everything after the first `:`).
    pub fn from_file(path: &Path) -> Result<Self, SimError> {
        let bad = |line: usize, reason: String| SimError::Credentials {
            path: path.to_path_buf(),
            line,
            reason,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| bad(0, format!("cannot read it: {e}")))?;
        let mut passwords = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((id, password)) = line.split_once(':') else {
                return Err(bad(n + 1, "expected `device-id:password`".to_owned()));
            };
            let id =
                DeviceId::parse(id).map_err(|e| bad(n + 1, format!("invalid device id: {e}")))?;
            if passwords
                .insert(id.clone(), SecretString::new(password))
                .is_some()
            {
                return Err(bad(n + 1, format!("device {id} appears twice")));
            }
        }
        Ok(Self { passwords })
    }

    pub fn password(&self, id: &DeviceId) -> Option<&SecretString> {
        self.passwords.get(id)
    }

    pub fn len(&self) -> usize {
        self.passwords.len()
    }

    pub fn is_empty(&self) -> bool {
        self.passwords.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BrokerAddr, FleetConfig, SimDevice};
    use idem_protocol::TopicRoot;
    use serde_json::json;

    #[test]
    fn a_credentials_file_maps_device_ids_to_passwords() {
        let dir = std::env::temp_dir().join(format!("idem-sim-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("creds");
        std::fs::write(&path, "# comment\nd1:pw:with:colons\n\nd2:second\r\n").unwrap();
        let creds = Credentials::from_file(&path).unwrap();
        let d1 = DeviceId::parse("d1").unwrap();
        assert_eq!(creds.password(&d1).unwrap().expose(), "pw:with:colons");
        assert_eq!(
            creds
                .password(&DeviceId::parse("d2").unwrap())
                .unwrap()
                .expose(),
            "second"
        );
        assert_eq!(format!("{creds:?}"), "Credentials(2 devices)");

        std::fs::write(&path, "d1\n").unwrap();
        let err = Credentials::from_file(&path).unwrap_err().to_string();
        assert!(
            err.contains("line 1") && err.contains("device-id:password"),
            "{err}"
        );

        let mut cfg = FleetConfig::new(
            BrokerAddr::new("localhost", 1883),
            TopicRoot::default(),
            vec![
                SimDevice::new(d1, json!({})),
                SimDevice::new(DeviceId::parse("d3").unwrap(), json!({})),
            ],
        );
        cfg.credentials = Some(creds);
        std::fs::write(&path, "d1:a\nd2:b\n").unwrap();
        cfg.credentials = Some(Credentials::from_file(&path).unwrap());
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("d3"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

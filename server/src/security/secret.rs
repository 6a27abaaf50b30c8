//! Secrets in configuration and logs: [`Secret`] (a value whose `Debug` and
//! `Display` print `***`), [`SecretUrl`] (a URL that may carry a password,
//! printed with the password replaced), [`redact_url`], and the log writer
//! [`RedactingWriter`] that scrubs known secret values from every log line
//! as a second line of defence (third-party error and trace text).
//!
//! It owns no secret's source (flags, files) and decides nothing about where
//! a secret goes: callers expose a value explicitly, only where it is used.

use std::fmt;
use std::io;
use std::str::FromStr;
use std::sync::{Arc, OnceLock, RwLock};

/// What a secret prints as, everywhere.
pub const REDACTED: &str = "***";

/// Secrets shorter than this are not scrubbed from log text by
/// [`RedactingWriter`] (scrubbing a two-letter word would garble every
/// line); they still never reach a log through our own code.
pub const MIN_SCRUBBED_LEN: usize = 4;

/// A value that must never be printed. `Debug` and `Display` show `***`;
/// [`Secret::expose`] is the one way to the value.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// The value itself: call only where it is handed to its consumer
    /// (the MQTT CONNECT packet, the database driver).
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl<T> fmt::Display for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl FromStr for Secret<String> {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl From<String> for Secret<String> {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret<String> {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

/// A URL that may carry a password (`postgres://user:pw@host/db`, or a
/// `password=` query parameter). `Debug` and `Display` print it with the
/// password replaced by `***` ([`redact_url`]); [`SecretUrl::expose`] is the
/// whole URL, for the driver only.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL with its password: hand it to the driver, never to a log.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL as it may be printed.
    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }

    /// The password this URL carries (in the user info or a `password` /
    /// `sslpassword` query parameter), percent-decoded as a driver would
    /// use it, and as written: either form could end up in some error text.
    pub fn passwords(&self) -> Vec<String> {
        let mut found = Vec::new();
        let parts = UrlParts::split(&self.0);
        if let Some(pw) = parts.password {
            found.push(pw.to_owned());
            found.push(percent_decode(pw));
        }
        for (_, value) in parts.secret_params() {
            found.push(value.to_owned());
            found.push(percent_decode(value));
        }
        found.retain(|s| !s.is_empty());
        found.dedup();
        found
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl FromStr for SecretUrl {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl From<String> for SecretUrl {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for SecretUrl {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

/// Query parameters whose value is a password (libpq's names).
const SECRET_PARAMS: [&str; 2] = ["password", "sslpassword"];

/// The pieces of `scheme://[user[:password]@]host…[?query]` that redaction
/// needs, as slices of the original text.
struct UrlParts<'a> {
    /// Everything up to and including the user name (or `scheme://`).
    before_password: &'a str,
    password: Option<&'a str>,
    /// From the `@` (or the host) to the end.
    after_password: &'a str,
}

impl<'a> UrlParts<'a> {
    fn split(url: &'a str) -> Self {
        let authority_start = url.find("://").map_or(0, |i| i + 3);
        let rest = &url[authority_start..];
        // The user info ends at the last '@' before the query: a password
        // may contain '@' or '/' unencoded, and redaction errs on hiding.
        let authority_len = rest.find(['?', '#']).unwrap_or(rest.len());
        let authority = &rest[..authority_len];
        let Some(at) = authority.rfind('@') else {
            return Self {
                before_password: url,
                password: None,
                after_password: "",
            };
        };
        let userinfo = &authority[..at];
        match userinfo.find(':') {
            Some(colon) => {
                let password_start = authority_start + colon + 1;
                let password_end = authority_start + at;
                Self {
                    before_password: &url[..password_start],
                    password: Some(&url[password_start..password_end]),
                    after_password: &url[password_end..],
                }
            }
            None => Self {
                before_password: url,
                password: None,
                after_password: "",
            },
        }
    }

    /// `(name, value)` of every password-carrying query parameter.
    fn secret_params(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        let whole = if self.after_password.is_empty() {
            self.before_password
        } else {
            self.after_password
        };
        let query = whole.split_once('?').map_or("", |(_, q)| q);
        let query = query.split('#').next().unwrap_or("");
        query.split('&').filter_map(|pair| {
            let (name, value) = pair.split_once('=')?;
            SECRET_PARAMS
                .iter()
                .any(|s| name.eq_ignore_ascii_case(s))
                .then_some((name, value))
        })
    }
}

/// `url` with the password of its user info and the values of `password` /
/// `sslpassword` query parameters replaced by `***`. Text that is not a URL
/// comes back unchanged.
pub fn redact_url(url: &str) -> String {
    let parts = UrlParts::split(url);
    let mut out = match parts.password {
        Some(_) => format!(
            "{}{REDACTED}{}",
            parts.before_password, parts.after_password
        ),
        None => url.to_owned(),
    };
    let values: Vec<&str> = parts.secret_params().map(|(_, v)| v).collect();
    for value in values.into_iter().filter(|v| !v.is_empty()) {
        for name in SECRET_PARAMS {
            out = replace_param_value(&out, name, value);
        }
    }
    out
}

/// Replaces `name=value` by `name=***` (name matched case-insensitively).
fn replace_param_value(text: &str, name: &str, value: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let (head, tail) = rest.split_at(eq);
        let param_start = head.rfind(['?', '&']).map_or(0, |i| i + 1);
        let is_name = head[param_start..].eq_ignore_ascii_case(name);
        let value_part = &tail[1..];
        if is_name && value_part.starts_with(value) {
            out.push_str(head);
            out.push('=');
            out.push_str(REDACTED);
            rest = &value_part[value.len()..];
        } else {
            out.push_str(head);
            out.push('=');
            rest = value_part;
        }
    }
    out.push_str(rest);
    out
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match decoded {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The secret values the running process knows, scrubbed from log lines.
/// One per process: the log subscriber is global too.
#[derive(Debug, Default)]
pub struct SecretValues {
    values: RwLock<Vec<String>>,
}

impl SecretValues {
    /// The process's set (filled by the binary at start-up).
    pub fn global() -> Arc<SecretValues> {
        static GLOBAL: OnceLock<Arc<SecretValues>> = OnceLock::new();
        GLOBAL.get_or_init(Arc::default).clone()
    }

    /// Adds values to scrub; shorter than [`MIN_SCRUBBED_LEN`] are ignored.
    pub fn add<I, S>(&self, values: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut known = self
            .values
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for value in values {
            let value = value.into();
            if value.len() >= MIN_SCRUBBED_LEN && !known.contains(&value) {
                known.push(value);
            }
        }
        // Longest first, so a secret containing another is replaced whole.
        known.sort_by_key(|v| std::cmp::Reverse(v.len()));
    }

    /// `text` with every known secret replaced by `***`.
    pub fn scrub(&self, text: &str) -> String {
        let known = self
            .values
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = text.to_owned();
        for value in known.iter() {
            if out.contains(value.as_str()) {
                out = out.replace(value.as_str(), REDACTED);
            }
        }
        out
    }

    fn is_empty(&self) -> bool {
        self.values
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }
}

/// A log writer (for `tracing_subscriber::fmt().with_writer`) that scrubs
/// known secret values from what it writes. tracing's fmt layer writes one
/// whole event per `write_all`, so a secret is never split across writes.
#[derive(Debug, Clone)]
pub struct RedactingWriter<W> {
    inner: W,
    secrets: Arc<SecretValues>,
}

impl<W> RedactingWriter<W> {
    pub fn new(inner: W, secrets: Arc<SecretValues>) -> Self {
        Self { inner, secrets }
    }
}

impl<W: io::Write> io::Write for RedactingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.secrets.is_empty() {
            return self.inner.write(buf);
        }
        let text = String::from_utf8_lossy(buf);
        self.inner.write_all(self.secrets.scrub(&text).as_bytes())?;
        // The caller's bytes were all handled, even if scrubbing changed
        // their number.
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// `MakeWriter` wrapping another (e.g. `std::io::stderr`) in a
/// [`RedactingWriter`].
#[derive(Debug, Clone)]
pub struct RedactingMakeWriter<M> {
    make: M,
    secrets: Arc<SecretValues>,
}

impl<M> RedactingMakeWriter<M> {
    pub fn new(make: M, secrets: Arc<SecretValues>) -> Self {
        Self { make, secrets }
    }
}

impl<'a, M> tracing_subscriber::fmt::MakeWriter<'a> for RedactingMakeWriter<M>
where
    M: tracing_subscriber::fmt::MakeWriter<'a>,
{
    type Writer = RedactingWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        RedactingWriter::new(self.make.make_writer(), self.secrets.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn a_secret_prints_as_stars_in_debug_and_display() {
        let s = Secret::new("hunter2-long".to_owned());
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(format!("{s}"), "***");
        assert_eq!(s.expose(), "hunter2-long");
        #[derive(Debug)]
        #[allow(dead_code)]
        struct Holder {
            password: Option<Secret<String>>,
        }
        let h = Holder {
            password: Some(s.clone()),
        };
        assert!(!format!("{h:?}").contains("hunter2"));
    }

    #[test]
    fn the_password_of_a_url_is_replaced_and_the_rest_kept() {
        let cases = [
            (
                "postgres://idem:s3cret@db:5432/idem",
                "postgres://idem:***@db:5432/idem",
            ),
            (
                "postgres://idem:p@ss:w@rd@db/idem?sslmode=require",
                "postgres://idem:***@db/idem?sslmode=require",
            ),
            ("postgres://idem@db/idem", "postgres://idem@db/idem"),
            ("postgres://u:pa/ss@db/idem", "postgres://u:***@db/idem"),
            ("postgres://db/idem", "postgres://db/idem"),
            (
                "postgres://idem@db/idem?sslmode=verify-full&password=abc123&x=1",
                "postgres://idem@db/idem?sslmode=verify-full&password=***&x=1",
            ),
            (
                "postgresql://u:pw1@h/d?PASSWORD=pw2&sslpassword=pw3",
                "postgresql://u:***@h/d?PASSWORD=***&sslpassword=***",
            ),
            ("mqtt://user:pw@broker:1883", "mqtt://user:***@broker:1883"),
            ("not a url", "not a url"),
            ("", ""),
        ];
        for (url, redacted) in cases {
            assert_eq!(redact_url(url), redacted, "{url}");
            assert_eq!(SecretUrl::new(url).to_string(), redacted);
            assert_eq!(
                format!("{:?}", SecretUrl::new(url)),
                format!("{redacted:?}")
            );
        }
    }

    #[test]
    fn a_url_lists_its_passwords_raw_and_decoded() {
        let url = SecretUrl::new("postgres://u:p%40ss@h/d?password=q%21x");
        let passwords = url.passwords();
        for pw in ["p%40ss", "p@ss", "q%21x", "q!x"] {
            assert!(passwords.contains(&pw.to_owned()), "{pw} in {passwords:?}");
        }
        assert!(SecretUrl::new("postgres://u@h/d").passwords().is_empty());
    }

    #[test]
    fn the_log_writer_scrubs_every_known_secret() {
        let secrets = Arc::new(SecretValues::default());
        secrets.add(["database-pw-123", "pw", "mqtt-pw-456"]);
        let mut out = Vec::new();
        {
            let mut w = RedactingWriter::new(&mut out, secrets.clone());
            w.write_all(b"connect mqtt-pw-456 to database-pw-123 with pw\n")
                .unwrap();
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "connect *** to *** with pw\n"
        );
    }
}

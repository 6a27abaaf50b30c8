//! Secrets in configuration and logs (`secret`) and TLS material for the
//! server's own connections (`tls`).

pub mod secret;
pub mod tls;

//! The HTTP side: connection handling (`connections`: our own accept loop,
//! TLS, per-peer limits), the API (`api`), Server-Sent Events (`sse`), who
//! may call what (`auth`), the JSON error answer (`error`) and the bounds on
//! operator input (`input`).

pub mod api;
pub mod auth;
pub mod connections;
pub mod error;
pub mod input;
pub mod sse;

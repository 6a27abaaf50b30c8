//! The HTTP side: connection handling (`connections`: our own accept loop,
//! TLS, per-peer limits), the API (`api`), Server-Sent Events (`sse`), who
//! may call what (`auth`), the JSON error answer (`error`), the extractors
//! whose rejections are that answer (`extract`), the bounds on operator
//! input (`input`), the turns of large reads (`large_reads`) and what the
//! handlers and the server's tasks share (`state`).

pub(crate) mod api;
pub mod auth;
pub(crate) mod connections;
pub(crate) mod error;
pub(crate) mod extract;
pub(crate) mod input;
pub(crate) mod large_reads;
pub(crate) mod sse;
pub mod state;

pub use api::routes;
pub use auth::Route;

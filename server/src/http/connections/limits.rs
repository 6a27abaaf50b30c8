//! The limits one server applies to its HTTP connections, and the
//! connection cap fitted under the process's open-file limit (each address's
//! share lowered with it, in proportion).

use std::time::Duration;

pub use crate::config::HttpLimits;

/// Open files kept free for everything that is not an HTTP connection: the
/// database pool, the MQTT connection, the listener, logs, DNS, `/proc`.
pub const FD_RESERVE: u64 = 256;

impl HttpLimits {
    /// These limits with the connection cap lowered to fit the process's
    /// open-file limit (see [`fit_connection_cap`]) and the per-address
    /// share lowered with it, in proportion.
    pub fn fitted_to_open_files(self) -> Self {
        let max_connections = fit_connection_cap(self.max_connections);
        let configured_share = self.max_connections_per_peer;
        let max_connections_per_peer =
            fit_peer_share(configured_share, self.max_connections, max_connections);
        if max_connections_per_peer < configured_share {
            tracing::warn!(
                configured = configured_share,
                lowered_to = max_connections_per_peer,
                "IDEM_HTTP_MAX_CONNECTIONS_PER_PEER / --http-max-connections-per-peer lowered \
                 with the connection cap, in proportion"
            );
        }
        Self {
            max_connections,
            max_connections_per_peer,
            ..self
        }
    }

    /// What refused connections are told to wait: by then the idle
    /// connections open now have been closed by the header timeout.
    pub(super) fn retry_after(&self) -> Duration {
        self.header_timeout
    }
}

/// The per-address share of a connection cap lowered from `configured_cap`
/// to `fitted_cap`: lowered in the same proportion (rounded up), at least 1
/// and never more than the fitted cap.
pub(super) fn fit_peer_share(share: usize, configured_cap: usize, fitted_cap: usize) -> usize {
    let fitted_cap = fitted_cap.max(1);
    let share = if fitted_cap < configured_cap {
        share.saturating_mul(fitted_cap).div_ceil(configured_cap)
    } else {
        share
    };
    share.clamp(1, fitted_cap)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and returns the
/// connection cap that fits under it: `configured`, or less (with a warning)
/// when the soft limit minus [`FD_RESERVE`] is smaller.
pub fn fit_connection_cap(configured: usize) -> usize {
    let soft = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(soft) => soft,
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open-file limit; reading the current one");
            match rlimit::getrlimit(rlimit::Resource::NOFILE) {
                Ok((soft, _hard)) => soft,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the open-file limit; keeping --http-max-connections as configured");
                    return configured;
                }
            }
        }
    };
    let fitted = cap_for_fd_limit(configured, soft);
    if fitted < configured {
        tracing::warn!(
            configured,
            lowered_to = fitted,
            open_file_limit = soft,
            reserve = FD_RESERVE,
            "IDEM_HTTP_MAX_CONNECTIONS / --http-max-connections does not fit the open-file limit; \
             lowered it (raise `ulimit -n` / LimitNOFILE= to allow more)"
        );
    }
    fitted
}

/// The connection cap that leaves [`FD_RESERVE`] descriptors of `soft` free
/// (half of them when the limit is that small), never 0.
pub(super) fn cap_for_fd_limit(configured: usize, soft: u64) -> usize {
    let budget = if soft > 2 * FD_RESERVE {
        soft - FD_RESERVE
    } else {
        soft / 2
    };
    let budget = usize::try_from(budget).unwrap_or(usize::MAX).max(1);
    configured.min(budget)
}

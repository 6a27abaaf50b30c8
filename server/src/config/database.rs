//! The database group (`--help` heading "Database"): where PostgreSQL is
//! and how many connections the server's pool holds.

use super::ConfigError;
use crate::security::secret::SecretUrl;

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Database")]
pub struct DatabaseArgs {
    /// PostgreSQL connection URL (the database must exist; migrations run at
    /// start-up). TLS with `?sslmode=require` or `verify-full` (with
    /// `sslrootcert=/path/ca.pem`). Its password is never printed.
    #[arg(
        long,
        env = "IDEM_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/idem",
        hide_env_values = true
    )]
    pub database_url: SecretUrl,

    /// Most connections in the database pool.
    #[arg(long, env = "IDEM_DB_MAX_CONNECTIONS", default_value_t = 8)]
    pub db_max_connections: u32,
}

/// The database group, validated.
#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    /// A `postgres://` or `postgresql://` URL (prints without its password).
    pub url: SecretUrl,
    /// At least 2.
    pub max_connections: u32,
}

impl DatabaseArgs {
    pub fn validate(&self) -> Result<DatabaseSettings, ConfigError> {
        let url = self.database_url.expose();
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(ConfigError::DatabaseUrl(self.database_url.clone()));
        }
        if self.db_max_connections < 2 {
            return Err(ConfigError::DbConnections(self.db_max_connections));
        }
        Ok(DatabaseSettings {
            url: self.database_url.clone(),
            max_connections: self.db_max_connections,
        })
    }

    /// The password of the database URL, if it has one, for scrubbing logs.
    pub fn secret_values(&self) -> Vec<String> {
        self.database_url.passwords()
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    #[test]
    fn a_pool_of_fewer_than_two_connections_is_refused_naming_the_variable() {
        let mut config = Config::defaults();
        config.database.db_max_connections = 1;
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("IDEM_DB_MAX_CONNECTIONS"), "{err}");
        config.database.db_max_connections = 2;
        assert_eq!(config.validate().unwrap().database.max_connections, 2);
    }
}

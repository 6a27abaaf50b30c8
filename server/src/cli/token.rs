//! `idem-server token create|list|revoke`: operator tokens from the command
//! line, against the server's database (the way to create the first admin
//! token). Prints a new token's secret once; never prints stored hashes.

use anyhow::Context as _;
use clap::Subcommand;

use crate::config::parse_expiry;
use crate::http::auth::{generate_token, Role};
use crate::store::{self, access::NewToken};

#[derive(Debug, Clone, Subcommand)]
pub enum TokenCommand {
    /// Create a token and print its secret (shown only this once).
    Create {
        /// A short name the audit trail shows, e.g. `ci` or `alice`.
        #[arg(long)]
        name: String,
        /// `viewer`, `operator` or `admin`.
        #[arg(long)]
        role: String,
        /// Expire after this long, e.g. `30d`; never when absent.
        #[arg(long)]
        expires_in: Option<String>,
    },
    /// List every token (name, role, created, expiry, revocation).
    List,
    /// Revoke a token at once.
    Revoke {
        /// The token's name.
        name: String,
    },
}

/// Runs one token command against the database at `database_url`.
pub async fn run(database_url: &str, command: TokenCommand) -> anyhow::Result<()> {
    let pool = store::connect(database_url, 2)
        .await
        .context("cannot reach PostgreSQL: start it or set IDEM_DATABASE_URL")?;
    store::migrate(&pool).await.context("applying migrations")?;
    match command {
        TokenCommand::Create {
            name,
            role,
            expires_in,
        } => {
            let role = Role::parse(&role)
                .with_context(|| format!("--role {role:?}: use viewer, operator or admin"))?;
            let expires_at = match expires_in {
                None => None,
                Some(raw) => {
                    let expires_at = parse_expiry(&raw, chrono::Utc::now())
                        .map_err(anyhow::Error::msg)
                        .context("--expires-in")?;
                    Some(expires_at)
                }
            };
            let token = generate_token();
            let row = store::access::create_token(
                &pool,
                &NewToken {
                    name: &name,
                    role: role.as_str(),
                    hash: &token.hash,
                    created_by: Some("idem-server token create"),
                    expires_at,
                },
            )
            .await?
            .with_context(|| format!("a token named {name:?} exists already"))?;
            eprintln!(
                "created token {:?} with role {}{}; store it now, it is shown only once:",
                row.name,
                row.role,
                row.expires_at
                    .map(|at| format!(", expiring {at}"))
                    .unwrap_or_default()
            );
            println!("{}", token.secret);
        }
        TokenCommand::List => {
            println!(
                "{:<24} {:<9} {:<26} {:<26} revoked",
                "name", "role", "created", "expires"
            );
            for row in store::access::list_tokens(&pool).await? {
                let show = |t: Option<chrono::DateTime<chrono::Utc>>| {
                    t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".to_owned())
                };
                println!(
                    "{:<24} {:<9} {:<26} {:<26} {}",
                    row.name,
                    row.role,
                    row.created_at.to_rfc3339(),
                    show(row.expires_at),
                    show(row.revoked_at)
                );
            }
        }
        TokenCommand::Revoke { name } => {
            let row = store::access::revoke_token(&pool, &name)
                .await?
                .with_context(|| format!("no token is named {name:?}"))?;
            eprintln!("revoked token {:?}", row.name);
        }
    }
    Ok(())
}

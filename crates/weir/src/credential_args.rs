//! The credentials every cluster process takes (`weir cluster scheduler|executor`,
//! `weir sql --cluster`): mutual TLS — the cluster's certificate authority, and this process's
//! certificate and key (made with `weir cluster certs`) — and the cluster's shared token
//! (`WEIR_CLUSTER_TOKEN` or `--token-file`, made with `weir cluster token`).

use clap::Args;
use std::path::PathBuf;

use crate::UsageError;

/// `--tls-ca`, `--tls-cert`, `--tls-key` (all three or none) and `--token-file` (or their
/// environment variables).
#[derive(Debug, Clone, Args)]
pub struct CredentialArgs {
    /// The cluster's certificate authority (PEM): only processes holding a certificate it signed
    /// are let in, and only servers holding one are trusted (see weir cluster certs).
    #[arg(long, value_name = "FILE", env = "WEIR_CLUSTER_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM), signed by --tls-ca.
    #[arg(long, value_name = "FILE", env = "WEIR_CLUSTER_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long, value_name = "FILE", env = "WEIR_CLUSTER_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// A file holding the cluster's shared token (see weir cluster token), which every process
    /// of the cluster must give; or set WEIR_CLUSTER_TOKEN. Without TLS it crosses the network
    /// in the clear: use it with TLS, or on a network only you use.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
}

/// Which credentials a process uses.
#[derive(Debug, Clone, Copy, Default)]
pub struct Guarded {
    /// Mutual TLS.
    pub tls: bool,
    /// The shared token.
    pub token: bool,
}

impl Guarded {
    /// Whether strangers are kept out at all.
    pub fn any(self) -> bool {
        self.tls || self.token
    }
}

impl CredentialArgs {
    /// Whether a credential flag was given (a token in the environment is not counted: it may
    /// be set for the shell's cluster runs while a query runs here).
    pub fn given(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some() || self.tls_key.is_some() || self.token_file.is_some()
    }

    /// The token, from --token-file or the environment (the file wins).
    fn token(&self) -> Result<Option<String>, UsageError> {
        if let Some(path) = &self.token_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| UsageError(format!("--token-file {}: {e}", path.display())))?;
            // As ssh does with keys: a secret others can read is no secret.
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(path).map(|m| m.permissions().mode() & 0o777).unwrap_or(0);
                if mode & 0o077 != 0 {
                    return Err(UsageError(format!(
                        "--token-file {}: other users can read it (mode {mode:o}); make it yours alone: chmod 600 {}",
                        path.display(),
                        path.display()
                    )));
                }
            }
            return Ok(Some(text));
        }
        match std::env::var(weir_datafusion_token_variable()) {
            Ok(text) => Ok(Some(text)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(UsageError(format!("{} is not UTF-8 text", weir_datafusion_token_variable())))
            }
        }
    }

    /// Loads the credentials and makes every cluster connection and server of this process use
    /// them; which are on.
    #[cfg(feature = "cluster")]
    pub fn install(&self) -> Result<Guarded, UsageError> {
        use weir_datafusion::guard::{Credentials, Token};
        let tls = match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => {
                let files = weir_datafusion::tls::TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() };
                Some(weir_datafusion::tls::ClusterTls::load(&files).map_err(UsageError)?)
            }
            (None, None, None) => None,
            (ca, cert, key) => {
                let missing: Vec<&str> =
                    [("--tls-ca", ca.is_none()), ("--tls-cert", cert.is_none()), ("--tls-key", key.is_none())]
                        .into_iter()
                        .filter_map(|(flag, absent)| absent.then_some(flag))
                        .collect();
                return Err(UsageError(format!(
                    "--tls-ca, --tls-cert and --tls-key go together: give {} too (make them with weir cluster certs)",
                    missing.join(" and ")
                )));
            }
        };
        let token = match self.token()? {
            Some(text) => Some(Token::new(&text).map_err(|e| {
                let from = match &self.token_file {
                    Some(p) => format!("--token-file {}", p.display()),
                    None => weir_datafusion_token_variable().to_string(),
                };
                UsageError(format!("{from}: {e}"))
            })?),
            None => None,
        };
        let guarded = Guarded { tls: tls.is_some(), token: token.is_some() };
        weir_datafusion::guard::install(Credentials { tls, token }).map_err(UsageError)?;
        Ok(guarded)
    }
}

/// The environment variable that holds the token.
#[cfg(feature = "cluster")]
fn weir_datafusion_token_variable() -> &'static str {
    weir_datafusion::guard::TOKEN_VARIABLE
}

/// The environment variable that holds the token (named here too in a build without the
/// cluster, where `weir sql` still refuses credentials without `--cluster`).
#[cfg(not(feature = "cluster"))]
fn weir_datafusion_token_variable() -> &'static str {
    "WEIR_CLUSTER_TOKEN"
}

//! The mutual-TLS flags every cluster process takes (`weir cluster scheduler|executor`,
//! `weir sql --cluster`): the cluster's certificate authority, and this process's certificate
//! and key. Made with `weir cluster certs`.

use clap::Args;
use std::path::PathBuf;

use crate::UsageError;

/// `--tls-ca`, `--tls-cert`, `--tls-key` (or their environment variables): all three or none.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
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
}

impl TlsArgs {
    /// Whether TLS was asked for.
    pub fn given(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some() || self.tls_key.is_some()
    }

    /// Loads the files and makes every cluster connection and server of this process use them;
    /// whether TLS is on.
    #[cfg(feature = "cluster")]
    pub fn install(&self) -> Result<bool, UsageError> {
        let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) else {
            if self.given() {
                return Err(UsageError(
                    "--tls-ca, --tls-cert and --tls-key go together (make them with weir cluster certs)".into(),
                ));
            }
            return Ok(false);
        };
        let files = weir_datafusion::tls::TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() };
        let tls = weir_datafusion::tls::ClusterTls::load(&files).map_err(UsageError)?;
        weir_datafusion::tls::install(tls).map_err(UsageError)?;
        Ok(true)
    }
}

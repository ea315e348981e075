//! Mutual TLS for a cluster that spans machines: only processes holding a certificate signed by
//! the cluster's own certificate authority can talk to its scheduler and executors.
//!
//! How TLS is put in front of Ballista's servers and into its clients: see [`crate::guard`].
//!
//! Certificates name the cluster ([`CLUSTER_NAME`]), not hosts: holding one is what admits a
//! process, wherever it runs.

use ballista_core::extension::EndpointOverrideFn;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The name every certificate of a cluster carries, and every client checks.
pub const CLUSTER_NAME: &str = "weir-cluster";

/// Where a process's TLS files are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The cluster's certificate authority (PEM).
    pub ca: PathBuf,
    /// This process's certificate (PEM), signed by the authority.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

/// This process's side of the cluster's mutual TLS.
pub struct ClusterTls {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    pub(crate) acceptor: tokio_rustls::TlsAcceptor,
    /// For connections that are not gRPC (the scheduler's quota service, see [`crate::quota`]).
    pub(crate) connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("ClusterTls").finish_non_exhaustive()
    }
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

impl ClusterTls {
    /// Reads and checks the files: the certificate and key must parse, and the authority must
    /// be one rustls accepts for verifying peers.
    pub fn load(files: &TlsFiles) -> Result<Arc<Self>, String> {
        let ca_pem = read("--tls-ca", &files.ca)?;
        let cert_pem = read("--tls-cert", &files.cert)?;
        let key_pem = read("--tls-key", &files.key)?;
        let bad = |flag: &str, path: &Path, e: &dyn std::fmt::Display| format!("{flag} {}: {e}", path.display());
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| bad("--tls-cert", &files.cert, &e))?;
        if certs.is_empty() {
            return Err(format!("--tls-cert {}: no certificate in it", files.cert.display()));
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| bad("--tls-key", &files.key, &e))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&ca_pem) {
            roots.add(ca.map_err(|e| bad("--tls-ca", &files.ca, &e))?).map_err(|e| bad("--tls-ca", &files.ca, &e))?;
        }
        if roots.is_empty() {
            return Err(format!("--tls-ca {}: no certificate in it", files.ca.display()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots.clone()), provider.clone())
                .build()
                .map_err(|e| bad("--tls-ca", &files.ca, &e))?;
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(|e| bad("--tls-cert", &files.cert, &e))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| bad("--tls-cert", &files.cert, &e))?;
        // gRPC is HTTP/2, which TLS clients ask for by ALPN.
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        Ok(Arc::new(Self { ca_pem, cert_pem, key_pem, acceptor, connector }))
    }

    /// A hook for Ballista's clients: the same endpoint, over TLS, presenting this process's
    /// certificate and trusting only the cluster's authority.
    pub fn endpoint_override(self: &Arc<Self>) -> EndpointOverrideFn {
        let me = self.clone();
        Arc::new(move |endpoint: tonic::transport::Endpoint| {
            let uri = endpoint.uri().to_string().replacen("http://", "https://", 1);
            let tls = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&me.ca_pem))
                .identity(tonic::transport::Identity::from_pem(&me.cert_pem, &me.key_pem))
                .domain_name(CLUSTER_NAME);
            // Ballista's own settings (create_grpc_client_endpoint's defaults), on the new URI.
            let seconds = std::time::Duration::from_secs;
            Ok(tonic::transport::Endpoint::from_shared(uri)?
                .connect_timeout(seconds(20))
                .timeout(seconds(20))
                .tcp_nodelay(true)
                .tcp_keepalive(Some(seconds(3600)))
                .http2_keep_alive_interval(seconds(300))
                .keep_alive_timeout(seconds(20))
                .keep_alive_while_idle(true)
                .initial_connection_window_size(64 << 20)
                .initial_stream_window_size(16 << 20)
                .tls_config(tls)?)
        })
    }
}

/// Files written by [`make_certificates`].
pub const CA_CERT: &str = "ca.pem";
/// The authority's private key: kept by whoever makes certificates, never given to a process.
pub const CA_KEY: &str = "ca.key";

/// Makes (or, when `dir` already holds one, reuses) the cluster's authority, and a certificate
/// and key for each name in `names` (`NAME.pem`, `NAME.key`). Keys are written readable by their
/// owner only. Returns the files written.
pub fn make_certificates(dir: &Path, names: &[String]) -> Result<Vec<PathBuf>, String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let write = |name: &str, text: &str, private: bool| -> Result<PathBuf, String> {
        let path = dir.join(name);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut f = options.open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path)
    };
    // Every name is checked before anything is made: a refused name leaves no half-made set.
    for name in names {
        let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !plain || name == "ca" {
            return Err(format!("--name {name}: use letters, digits, '-' and '_' (and not 'ca')"));
        }
        // A process's key is replaced on purpose only: overwritten, the process holding it
        // would stop getting in, and the old certificate would still be accepted.
        for file in [format!("{name}.key"), format!("{name}.pem")] {
            if dir.join(&file).exists() {
                return Err(format!(
                    "--name {name}: {} exists; remove {name}.pem and {name}.key first to make new ones (the old \
                     certificate stays valid until the cluster gets a new authority)",
                    dir.join(&file).display()
                ));
            }
        }
    }
    let e = |e: rcgen::Error| e.to_string();
    let mut written = Vec::new();
    let (ca_cert_path, ca_key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    // The authority's parameters are always the same, so that certificates made later with its
    // saved key chain to the certificate made first.
    let authority = || -> Result<CertificateParams, String> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        params.distinguished_name.push(DnType::CommonName, "weir cluster authority");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Ok(params)
    };
    let ca_key = if ca_cert_path.exists() && ca_key_path.exists() {
        KeyPair::from_pem(&std::fs::read_to_string(&ca_key_path).map_err(|e| e.to_string())?).map_err(e)?
    } else {
        let key = KeyPair::generate().map_err(e)?;
        let cert = authority()?.self_signed(&key).map_err(e)?;
        written.push(write(CA_KEY, &key.serialize_pem(), true)?);
        written.push(write(CA_CERT, &cert.pem(), false)?);
        key
    };
    let issuer = Issuer::new(authority()?, ca_key);
    for name in names {
        let key = KeyPair::generate().map_err(e)?;
        let mut params = CertificateParams::new(vec![CLUSTER_NAME.to_string()]).map_err(e)?;
        params.distinguished_name.push(DnType::CommonName, name.as_str());
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer).map_err(e)?;
        written.push(write(&format!("{name}.key"), &key.serialize_pem(), true)?);
        written.push(write(&format!("{name}.pem"), &cert.pem(), false)?);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_made_here_load_and_keys_are_private() {
        let dir = std::env::temp_dir().join(format!("weir-tls-{}", std::process::id()));
        let files = make_certificates(&dir, &["a".into(), "b".into()]).unwrap();
        assert_eq!(files.len(), 6);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.join("a.key")).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        let load = |name: &str| {
            ClusterTls::load(&TlsFiles {
                ca: dir.join(CA_CERT),
                cert: dir.join(format!("{name}.pem")),
                key: dir.join(format!("{name}.key")),
            })
        };
        assert!(load("a").is_ok() && load("b").is_ok());
        // A second run reuses the authority.
        let more = make_certificates(&dir, &["c".into()]).unwrap();
        assert_eq!(more.len(), 2);
        assert!(load("c").is_ok());
        assert!(make_certificates(&dir, &["../x".into()]).is_err());
        let e = ClusterTls::load(&TlsFiles { ca: dir.join("nope"), cert: dir.join("a.pem"), key: dir.join("a.key") });
        assert!(e.unwrap_err().contains("--tls-ca"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

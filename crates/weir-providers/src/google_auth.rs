//! Google credentials, found the way Google's SDKs find them (Application Default Credentials),
//! for Vertex AI.
//!
//! In order: the JSON file `GOOGLE_APPLICATION_CREDENTIALS` names (a service account's key, or an
//! `authorized_user` file); gcloud's well-known file (`$CLOUDSDK_CONFIG` or
//! `~/.config/gcloud/application_default_credentials.json`, written by `gcloud auth
//! application-default login`); then the metadata server of a GCP machine
//! (`GCE_METADATA_HOST` replaces its address, as in Google's libraries).
//!
//! A service account signs a JWT with its key (RS256, with `ring`) and exchanges it at the
//! file's `token_uri`; an `authorized_user` file exchanges its refresh token at its `token_uri`
//! (Google's by default). Access tokens are cached, shared by every call, refreshed five minutes
//! before they expire, and never logged, written or cached on disk: they live in [`Secret`]s.
//!
//! Why not a crate for all of it: the ones looked at (`gcp_auth`) hard-code the metadata
//! server's address and the refresh endpoint, so neither `GCE_METADATA_HOST` nor an offline test
//! would work; the signing itself is `ring`'s, which the TLS stack already brings in.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;
use tokio::time::Instant;
use weir_core::{ErrorKind, ModelError, RetryHint};

use crate::http::{check_base_url, clip, transport_error, Secret};
use crate::ProviderError;

/// The OAuth scope Vertex AI needs.
pub const SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// Google's token endpoint, for `authorized_user` files that do not name one.
const GOOGLE_TOKEN_URI: &str = "https://oauth2.googleapis.com/token";
/// Refresh this long before a token expires.
const EARLY: Duration = Duration::from_secs(300);

/// Where an access token comes from.
#[derive(Debug, Clone)]
pub enum Credentials {
    /// A service account's key.
    ServiceAccount {
        /// The account's e-mail (the JWT's issuer).
        client_email: String,
        /// Its PKCS #8 private key, DER.
        key: Secret,
        /// The key's id, sent as the JWT's `kid`.
        key_id: Option<String>,
        /// Where the JWT is exchanged.
        token_uri: reqwest::Url,
    },
    /// A user's refresh token (`gcloud auth application-default login`).
    AuthorizedUser {
        /// OAuth client id.
        client_id: String,
        /// OAuth client secret.
        client_secret: Secret,
        /// The refresh token.
        refresh_token: Secret,
        /// Where it is exchanged.
        token_uri: reqwest::Url,
    },
    /// The metadata server of the GCP machine weir runs on.
    Metadata {
        /// `http://host` of the metadata server.
        root: String,
    },
}

/// Where credentials were found, for messages (never their content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `GOOGLE_APPLICATION_CREDENTIALS`.
    EnvFile(PathBuf),
    /// gcloud's well-known file.
    WellKnown(PathBuf),
    /// The metadata server.
    MetadataServer,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::EnvFile(p) => write!(f, "GOOGLE_APPLICATION_CREDENTIALS ({})", p.display()),
            Origin::WellKnown(p) => write!(f, "gcloud's application default credentials ({})", p.display()),
            Origin::MetadataServer => f.write_str("the metadata server"),
        }
    }
}

fn config_error(origin: &Origin, what: &str) -> ProviderError {
    ProviderError::Config(format!("Google credentials from {origin}: {what}"))
}

impl Credentials {
    /// Finds credentials as Application Default Credentials do. `env` reads environment
    /// variables (injected for tests). A named file that is missing or unreadable is an error,
    /// never a silent fall-through to the next source.
    pub fn discover(env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Result<(Self, Origin), ProviderError> {
        let nonempty = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        if let Some(path) = nonempty("GOOGLE_APPLICATION_CREDENTIALS") {
            let origin = Origin::EnvFile(PathBuf::from(&path));
            return Ok((Self::from_file(Path::new(&path), &origin)?, origin));
        }
        let well_known = nonempty("CLOUDSDK_CONFIG")
            .map(PathBuf::from)
            .or_else(|| nonempty("HOME").map(|h| Path::new(&h).join(".config").join("gcloud")))
            .map(|dir| dir.join("application_default_credentials.json"));
        if let Some(path) = well_known.filter(|p| p.is_file()) {
            let origin = Origin::WellKnown(path.clone());
            return Ok((Self::from_file(&path, &origin)?, origin));
        }
        let host = nonempty("GCE_METADATA_HOST").unwrap_or_else(|| "metadata.google.internal".into());
        Ok((
            Credentials::Metadata { root: format!("http://{}", host.trim().trim_end_matches('/')) },
            Origin::MetadataServer,
        ))
    }

    fn from_file(path: &Path, origin: &Origin) -> Result<Self, ProviderError> {
        let text = std::fs::read_to_string(path).map_err(|e| config_error(origin, &format!("cannot read it: {e}")))?;
        Self::from_json(&text, origin)
    }

    /// Reads a credentials file's JSON.
    pub fn from_json(text: &str, origin: &Origin) -> Result<Self, ProviderError> {
        let v: Value = serde_json::from_str(text).map_err(|_| config_error(origin, "not a JSON credentials file"))?;
        let field = |k: &str| v.get(k).and_then(Value::as_str).filter(|s| !s.is_empty());
        // A field that is there but not text is wrong, not missing.
        let need = |k: &str| {
            field(k).ok_or_else(|| match v.get(k) {
                Some(Value::String(_)) => config_error(origin, &format!("\"{k}\" is empty")),
                Some(_) => config_error(origin, &format!("\"{k}\" is not text")),
                None => config_error(origin, &format!("the file has no \"{k}\"")),
            })
        };
        let token_uri = |default: Option<&str>| -> Result<reqwest::Url, ProviderError> {
            let uri = if v.get("token_uri").is_some() {
                need("token_uri")?
            } else {
                default.ok_or_else(|| config_error(origin, "the file has no \"token_uri\""))?
            };
            // Checked as a base URL is, but named as the file's field.
            check_base_url(uri).map_err(|e| {
                let message = e.to_string().replacen(&format!("--base-url {uri}"), &format!("token_uri {uri}"), 1);
                config_error(origin, &message)
            })
        };
        match field("type") {
            Some("service_account") => Ok(Credentials::ServiceAccount {
                client_email: need("client_email")?.to_string(),
                key: {
                    let key = Secret::new(pem_body(need("private_key")?).ok_or_else(|| {
                        config_error(origin, "\"private_key\" is not a PEM private key (-----BEGIN PRIVATE KEY-----)")
                    })?);
                    // Checked now, so an unusable key is a usage error before any record is read.
                    key_pair(&key).map_err(|e| config_error(origin, &format!("\"private_key\": {}", e.message)))?;
                    key
                },
                key_id: field("private_key_id").map(str::to_string),
                token_uri: token_uri(None)?,
            }),
            Some("authorized_user") => Ok(Credentials::AuthorizedUser {
                client_id: need("client_id")?.to_string(),
                client_secret: Secret::new(need("client_secret")?.to_string()),
                refresh_token: Secret::new(need("refresh_token")?.to_string()),
                token_uri: token_uri(Some(GOOGLE_TOKEN_URI))?,
            }),
            Some(other) => Err(config_error(
                origin,
                &format!("credentials of type \"{other}\" are not supported (service_account or authorized_user)"),
            )),
            None => Err(config_error(origin, "the file has no \"type\"")),
        }
    }
}

/// The base64 body of a PEM `PRIVATE KEY` block, kept as text (decoded only to sign).
fn pem_body(pem: &str) -> Option<String> {
    let start = pem.find("-----BEGIN PRIVATE KEY-----")? + "-----BEGIN PRIVATE KEY-----".len();
    let end = pem[start..].find("-----END PRIVATE KEY-----")? + start;
    let body: String = pem[start..end].chars().filter(|c| !c.is_whitespace()).collect();
    (!body.is_empty()).then_some(body)
}

fn b64url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// The RSA key pair of a service account's key.
fn key_pair(key: &Secret) -> Result<ring::signature::RsaKeyPair, ModelError> {
    use base64::Engine;
    let bad = |what: &str| {
        ModelError::new(ErrorKind::Auth, format!("the service account's private key {what}"))
            .with_hint(RetryHint::Never)
    };
    let der = base64::engine::general_purpose::STANDARD.decode(key.expose()).map_err(|_| bad("is not base64"))?;
    ring::signature::RsaKeyPair::from_pkcs8(&der).map_err(|_| bad("is not an RSA PKCS #8 key"))
}

/// Removes from `message` every secret that was sent (and anything shaped like a JWT), so a
/// token endpoint that echoes its request cannot put a credential into a log or a row.
fn scrub(message: &str, sent: &[&str]) -> String {
    // However the echo wrote them (a form body percent-encodes a refresh token's `1//`).
    let secrets: Vec<Secret> = sent.iter().filter(|s| s.len() >= 8).map(|s| Secret::new(s.to_string())).collect();
    let m = crate::http::mask(message, &secrets);
    // A JWT: `eyJ` (base64 of `{"`) and its base64url and dot characters.
    let mut out = String::with_capacity(m.len());
    let mut rest = m.as_str();
    while let Some(i) = rest.find("eyJ") {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' || c == '%'))
            .unwrap_or(tail.len());
        out.push_str("***");
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// How long a failed token fetch is reported to every caller before it is tried again, so
/// that callers waiting together do not each ask the token endpoint.
const FAILED_FETCH_HOLD: Duration = Duration::from_secs(2);

/// A signed JWT asserting `client_email` for `SCOPE` to `token_uri`, valid for an hour.
fn assertion(client_email: &str, key: &Secret, key_id: Option<&str>, token_uri: &str) -> Result<String, ModelError> {
    let bad = |what: &str| {
        ModelError::new(ErrorKind::Auth, format!("the service account's private key {what}"))
            .with_hint(RetryHint::Never)
    };
    let pair = key_pair(key)?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let mut header = serde_json::json!({"alg": "RS256", "typ": "JWT"});
    if let Some(kid) = key_id {
        header["kid"] = kid.into();
    }
    let claims = serde_json::json!({
        "iss": client_email, "scope": SCOPE, "aud": token_uri, "iat": now, "exp": now + 3600,
    });
    let signed = format!("{}.{}", b64url(header.to_string().as_bytes()), b64url(claims.to_string().as_bytes()));
    let mut sig = vec![0; pair.public().modulus_len()];
    pair.sign(&ring::signature::RSA_PKCS1_SHA256, &ring::rand::SystemRandom::new(), signed.as_bytes(), &mut sig)
        .map_err(|_| bad("could not sign"))?;
    Ok(format!("{signed}.{}", b64url(&sig)))
}

/// Access tokens from one set of credentials, cached and shared by every call.
pub struct TokenSource {
    credentials: Credentials,
    client: reqwest::Client,
    cached: Mutex<Cached>,
}

/// The token in hand, or the last failure to get one (shared for a moment).
#[derive(Default)]
struct Cached {
    token: Option<(Secret, Instant)>,
    failed: Option<(ModelError, Instant)>,
}

#[async_trait::async_trait]
impl crate::http::AccessTokens for TokenSource {
    async fn token(&self) -> Result<Secret, ModelError> {
        TokenSource::token(self).await
    }

    async fn reject(&self, rejected: &Secret) {
        TokenSource::reject(self, rejected).await
    }
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSource(***)")
    }
}

impl TokenSource {
    /// Where tokens come from, for messages.
    fn token_uri(&self) -> String {
        match &self.credentials {
            Credentials::ServiceAccount { token_uri, .. } | Credentials::AuthorizedUser { token_uri, .. } => {
                token_uri.to_string()
            }
            Credentials::Metadata { root } => format!("the metadata server at {root}"),
        }
    }

    /// Tokens from `credentials`, fetched with `client`.
    pub fn new(credentials: Credentials, client: reqwest::Client) -> Self {
        Self { credentials, client, cached: Mutex::new(Cached::default()) }
    }

    /// A token valid for at least five more minutes (a quarter of its lifetime, when that is
    /// shorter); fetched when there is none. Callers waiting at the same time share one fetch.
    pub async fn token(&self) -> Result<Secret, ModelError> {
        let mut cached = self.cached.lock().await;
        if let Some((token, renew_at)) = cached.token.as_ref() {
            if Instant::now() < *renew_at {
                return Ok(token.clone());
            }
        }
        if let Some((e, at)) = cached.failed.as_ref() {
            if at.elapsed() < FAILED_FETCH_HOLD {
                return Err(e.clone());
            }
        }
        let (token, lifetime) = match self.fetch().await {
            Ok(t) => t,
            Err(e) => {
                cached.failed = Some((e.clone(), Instant::now()));
                return Err(e);
            }
        };
        cached.failed = None;
        // Renewed five minutes before it expires (a quarter of its life, for short-lived ones).
        let renew_at = Instant::now() + lifetime - EARLY.min(lifetime / 4);
        cached.token = Some((token.clone(), renew_at));
        Ok(token)
    }

    /// Forgets the cached token if it is still `rejected` (the endpoint answered 401 to it), so
    /// the next call fetches a new one.
    pub async fn reject(&self, rejected: &Secret) {
        let mut cached = self.cached.lock().await;
        if cached.token.as_ref().is_some_and(|(t, _)| t.expose() == rejected.expose()) {
            cached.token = None;
        }
    }

    /// Gets a new token. Every failure is an `auth` error (no record can be sent without a
    /// token, so the run's rule for credential failures stops it), retryable when the token
    /// endpoint may recover (unreachable, 5xx, 429), with no secret in its message.
    async fn fetch(&self) -> Result<(Secret, Duration), ModelError> {
        let mut jwt = String::new();
        let sent: Vec<String> = match &self.credentials {
            Credentials::AuthorizedUser { client_secret, refresh_token, .. } => {
                vec![client_secret.expose().to_string(), refresh_token.expose().to_string()]
            }
            _ => Vec::new(),
        };
        let fail = |transient: bool, what: &str, jwt: &str| {
            let mut secrets: Vec<&str> = sent.iter().map(String::as_str).collect();
            secrets.push(jwt);
            let e = ModelError::new(ErrorKind::Auth, clip(&scrub(what, &secrets)));
            if transient {
                e.with_hint(RetryHint::Backoff)
            } else {
                e.with_hint(RetryHint::Never)
            }
        };
        let request = match &self.credentials {
            Credentials::ServiceAccount { client_email, key, key_id, token_uri } => {
                jwt = assertion(client_email, key, key_id.as_deref(), token_uri.as_str())?;
                self.client
                    .post(token_uri.as_str())
                    .form(&[("grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer"), ("assertion", jwt.as_str())])
            }
            Credentials::AuthorizedUser { client_id, client_secret, refresh_token, token_uri } => {
                self.client.post(token_uri.as_str()).form(&[
                    ("grant_type", "refresh_token"),
                    ("client_id", client_id.as_str()),
                    ("client_secret", client_secret.expose()),
                    ("refresh_token", refresh_token.expose()),
                ])
            }
            Credentials::Metadata { root } => self
                .client
                .get(format!("{root}/computeMetadata/v1/instance/service-accounts/default/token"))
                .header("Metadata-Flavor", "Google"),
        };
        let resp = request.send().await.map_err(|e| {
            let e = transport_error(&e);
            let hint = match &self.credentials {
                Credentials::Metadata { .. } => {
                    " (no GOOGLE_APPLICATION_CREDENTIALS and no gcloud credentials file were found, so the metadata \
                     server of a GCP machine was asked; off GCP, set GOOGLE_APPLICATION_CREDENTIALS to a service \
                     account key file or run `gcloud auth application-default login`)"
                }
                _ => "",
            };
            fail(
                true,
                &format!("cannot get a Google access token from {}: {}{hint}", self.token_uri(), e.message),
                &jwt,
            )
        })?;
        let status = resp.status().as_u16();
        let body = resp.bytes().await.map_err(|e| {
            fail(
                true,
                &format!("cannot read the Google token endpoint's answer: {}", transport_error(&e).message),
                &jwt,
            )
        })?;
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status != 200 {
            // The token endpoint's own words (`invalid_grant`, …) say what to fix; they never
            // echo the secret that was sent.
            let what = v
                .get("error_description")
                .or_else(|| v.get("error"))
                .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
            let transient = status >= 500 || status == 429;
            return Err(fail(transient, &format!("the Google token endpoint refused (HTTP {status}): {what}"), &jwt));
        }
        let token = v.get("access_token").and_then(Value::as_str).filter(|t| !t.is_empty()).ok_or_else(|| {
            fail(
                false,
                &format!("the Google token endpoint ({}) answered without an access_token", self.token_uri()),
                &jwt,
            )
        })?;
        // It goes into a header: visible ASCII only.
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(fail(false, "the Google token endpoint's access_token is not a valid header value", &jwt));
        }
        let lifetime = v.get("expires_in").and_then(Value::as_u64).unwrap_or(3600);
        Ok((Secret::new(token.to_string()), Duration::from_secs(lifetime)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrub_removes_what_was_sent_and_anything_like_a_jwt() {
        let m = scrub("refused: assertion=eyJhbGc.eyJpc3M.c2ln&grant=x secret=hunter2hunter2 ok", &["hunter2hunter2"]);
        // A tester's token endpoint echoed the form body: `1//…` written `1%2F%2F…`.
        let form = scrub("client_secret=***&refresh_token=1%2F%2FRefreshTok-0123", &["1//RefreshTok-0123"]);
        assert_eq!(form, "client_secret=***&refresh_token=***");
        assert_eq!(m, "refused: assertion=***&grant=x secret=*** ok");
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn discovery_order_and_clear_errors() {
        let dir = std::env::temp_dir().join(format!("weir-adc-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("gcloud")).unwrap();
        // Nothing set: the metadata server, at the address GCE_METADATA_HOST gives.
        let (c, o) = Credentials::discover(&env(&[("GCE_METADATA_HOST", "127.0.0.1:9")])).unwrap();
        assert_eq!(o, Origin::MetadataServer);
        assert!(matches!(c, Credentials::Metadata { root } if root == "http://127.0.0.1:9"));
        // gcloud's well-known file beats the metadata server.
        let user = r#"{"type":"authorized_user","client_id":"id","client_secret":"cs","refresh_token":"rt-SECRET"}"#;
        let well_known = dir.join("gcloud").join("application_default_credentials.json");
        std::fs::write(&well_known, user).unwrap();
        let cfg = dir.join("gcloud");
        let (c, o) = Credentials::discover(&env(&[("CLOUDSDK_CONFIG", cfg.to_str().unwrap())])).unwrap();
        assert_eq!(o, Origin::WellKnown(well_known.clone()));
        assert!(matches!(&c, Credentials::AuthorizedUser { token_uri, .. } if token_uri.as_str() == GOOGLE_TOKEN_URI));
        assert!(!format!("{c:?}").contains("rt-SECRET"), "secrets do not print");
        // A named file that is missing is an error, not a fall-through.
        let missing = dir.join("nope.json");
        let e = Credentials::discover(&env(&[("GOOGLE_APPLICATION_CREDENTIALS", missing.to_str().unwrap())]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("GOOGLE_APPLICATION_CREDENTIALS") && e.contains("cannot read"), "{e}");
        // Other types and bad fields say what to fix.
        let o = Origin::MetadataServer;
        let e = Credentials::from_json(r#"{"type":"external_account"}"#, &o).unwrap_err().to_string();
        assert!(e.contains("external_account"), "{e}");
        let e = Credentials::from_json(
            r#"{"type":"service_account","client_email":"a@b","private_key":"x","token_uri":"https://t"}"#,
            &o,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("PEM"), "{e}");
        let e = Credentials::from_json(
            r#"{"type":"authorized_user","client_id":"i","client_secret":"s","refresh_token":"r","token_uri":"http://example.com/t"}"#,
            &o,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("https"), "plain http off loopback is refused: {e}");
        std::fs::remove_dir_all(dir).ok();
    }
}

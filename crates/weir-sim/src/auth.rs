//! Google's token endpoints, simulated: the OAuth token endpoint (`POST /token`, a service
//! account's `token_uri` or the refresh of an `authorized_user` file) and the GCE metadata
//! server's token route. They hand out the first of the configured API keys as the access
//! token (or [`AuthConfig::issued_token`](crate::config::AuthConfig)), living
//! `token_lifetime_secs`, so a test can require the token on model routes with `api_keys`, see
//! that a client fetched, used and renewed it, and simulate a revoked token.

use serde_json::{json, Value};

use crate::config::SimConfig;

/// The access token answer.
pub fn access_token(config: &SimConfig) -> Value {
    let token = config
        .auth
        .issued_token
        .clone()
        .or_else(|| config.api_keys.first().cloned())
        .unwrap_or_else(|| "sim-access-token".into());
    json!({"access_token": token, "expires_in": config.auth.token_lifetime_secs, "token_type": "Bearer"})
}

fn invalid(description: &str) -> (u16, Value) {
    (400, json!({"error": "invalid_grant", "error_description": description}))
}

/// Answers a token request (`application/x-www-form-urlencoded`): a JWT-bearer grant (the
/// assertion must be a JWT whose claims name an issuer, an audience and a scope; its signature
/// is not checked) or a refresh-token grant (client id, secret and refresh token present).
pub fn token_grant(config: &SimConfig, body: &[u8]) -> (u16, Value) {
    let form: Vec<(String, String)> = form_urlencoded::parse(body).into_owned().collect();
    let get = |k: &str| form.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty());
    match get("grant_type") {
        Some("urn:ietf:params:oauth:grant-type:jwt-bearer") => {
            let Some(assertion) = get("assertion") else { return invalid("no assertion") };
            let parts: Vec<&str> = assertion.split('.').collect();
            if parts.len() != 3 {
                return invalid("the assertion is not a JWT");
            }
            let claims = decode(parts[1]);
            let header = decode(parts[0]);
            if header.as_ref().and_then(|h| h.get("alg")).and_then(Value::as_str) != Some("RS256") {
                return invalid("the assertion is not signed with RS256");
            }
            let ok = claims.is_some_and(|c| ["iss", "aud", "scope", "exp", "iat"].iter().all(|k| c.get(*k).is_some()));
            if !ok {
                return invalid("the assertion lacks iss, aud, scope, iat or exp");
            }
            (200, access_token(config))
        }
        Some("refresh_token") => match (get("client_id"), get("client_secret"), get("refresh_token")) {
            (Some(_), Some(_), Some(_)) => (200, access_token(config)),
            _ => invalid("client_id, client_secret and refresh_token are required"),
        },
        _ => (400, json!({"error": "unsupported_grant_type"})),
    }
}

fn decode(part: &str) -> Option<Value> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(part).ok()?;
    serde_json::from_slice(&bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_are_checked_for_shape() {
        let c = SimConfig::default();
        let jwt = |h: &str, c: &str| {
            use base64::Engine;
            let e = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
            format!("{}.{}.sig", e(h), e(c))
        };
        let good = jwt(r#"{"alg":"RS256"}"#, r#"{"iss":"a","aud":"t","scope":"s","iat":1,"exp":2}"#);
        let body = format!("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={good}");
        assert_eq!(token_grant(&c, body.as_bytes()).0, 200);
        let unsigned = jwt(r#"{"alg":"none"}"#, r#"{"iss":"a","aud":"t","scope":"s","iat":1,"exp":2}"#);
        let body = format!("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={unsigned}");
        assert_eq!(token_grant(&c, body.as_bytes()).0, 400);
        assert_eq!(token_grant(&c, b"grant_type=refresh_token&client_id=a&client_secret=b").0, 400);
        assert_eq!(token_grant(&c, b"grant_type=password").0, 400);
    }
}

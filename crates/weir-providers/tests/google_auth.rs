//! Google credentials against `weir sim`'s token endpoints: a service account's signed JWT
//! exchanged at its `token_uri`, an `authorized_user` refresh, and the metadata server at
//! `GCE_METADATA_HOST`; tokens cached, shared, and fetched again after a rejection.
//!
//! The service account's RSA key is made by the test (see `support/keys.rs`).

#[path = "support/keys.rs"]
mod keys;

use weir_providers::google_auth::{Credentials, Origin, TokenSource};
use weir_sim::{SimConfig, SimServer};

async fn sim() -> SimServer {
    let config = SimConfig { api_keys: vec!["ya29.sim-token".into()], ..SimConfig::default() };
    SimServer::start(config, ([127, 0, 0, 1], 0).into()).await.unwrap()
}

#[tokio::test]
async fn a_service_account_signs_and_exchanges_at_its_token_uri() {
    let server = sim().await;
    let key = keys::throwaway_rsa_key();
    let file = serde_json::json!({
        "type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": key,
        "client_email": "weir@p.iam.gserviceaccount.com", "token_uri": format!("{}/token", server.url()),
    });
    let creds = Credentials::from_json(&file.to_string(), &Origin::MetadataServer).unwrap();
    let source = TokenSource::new(creds, reqwest::Client::new());
    let (a, b) = tokio::join!(source.token(), source.token());
    assert_eq!(a.unwrap().expose(), "ya29.sim-token");
    assert_eq!(b.unwrap().expose(), "ya29.sim-token");
    assert_eq!(server.stats().tokens_issued, 1, "callers at the same time share one fetch");
    let t = source.token().await.unwrap();
    assert_eq!(server.stats().tokens_issued, 1, "cached");
    source.reject(&t).await;
    source.token().await.unwrap();
    assert_eq!(server.stats().tokens_issued, 2, "a rejected token is fetched again");
    server.shutdown().await;
}

#[tokio::test]
async fn an_authorized_user_refreshes_and_a_refusal_is_an_auth_error_without_the_secret() {
    let server = sim().await;
    let file = |endpoint: &str| {
        serde_json::json!({
            "type": "authorized_user", "client_id": "c", "client_secret": "s3cret-value",
            "refresh_token": "r3fresh-value", "token_uri": format!("{}{endpoint}", server.url()),
        })
        .to_string()
    };
    let source = |endpoint: &str| {
        TokenSource::new(
            Credentials::from_json(&file(endpoint), &Origin::MetadataServer).unwrap(),
            reqwest::Client::new(),
        )
    };
    assert_eq!(source("/token").token().await.unwrap().expose(), "ya29.sim-token");
    let e = source("/not-a-token-endpoint").token().await.unwrap_err();
    assert_eq!(e.kind, weir_core::ErrorKind::Auth, "{e}");
    assert!(e.message.contains("HTTP 404"), "{e}");
    assert!(!e.message.contains("s3cret") && !e.message.contains("r3fresh"), "{e}");
    server.shutdown().await;
}

#[tokio::test]
async fn the_metadata_server_is_found_at_gce_metadata_host() {
    let server = sim().await;
    let host = server.addr().to_string();
    let env = |k: &str| (k == "GCE_METADATA_HOST").then(|| host.clone());
    let (creds, origin) = Credentials::discover(&env).unwrap();
    assert_eq!(origin, Origin::MetadataServer);
    let source = TokenSource::new(creds, reqwest::Client::new());
    assert_eq!(source.token().await.unwrap().expose(), "ya29.sim-token");
    server.shutdown().await;
}

//! A throwaway service-account key, made fresh for each test process, so that no private key
//! lives in the repository.

use std::sync::OnceLock;

/// A new 2048-bit RSA private key, PKCS#8 PEM (the form of a service-account JSON's
/// `private_key`); one per test process.
pub fn throwaway_rsa_key() -> &'static str {
    static KEY: OnceLock<String> = OnceLock::new();
    KEY.get_or_init(|| {
        use rand::SeedableRng;
        use rsa::pkcs8::{EncodePrivateKey, LineEnding};
        let mut seed = [0u8; 32];
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        seed[..16].copy_from_slice(&nanos.to_le_bytes());
        seed[16..20].copy_from_slice(&std::process::id().to_le_bytes());
        let mut rng = rand::rngs::StdRng::from_seed(seed);
        let key = rsa::RsaPrivateKey::new(&mut rng, 2048).expect("an RSA key");
        key.to_pkcs8_pem(LineEnding::LF).expect("PEM").to_string()
    })
}

//! weir's local all-MiniLM-L6-v2 gives the vectors of the reference implementation
//! (sentence-transformers; `fixtures/minilm-reference.json`, made by
//! `scripts/minilm-reference.py`), alone and in padded batches of mixed lengths. Needs the
//! weights (`WEIR_MODELS`, set up by `scripts/setup-peers`); skipped without them unless
//! `WEIR_REQUIRE_PEERS=1`.

use weir_local::{model_dir, LocalEmbedder};

fn models() -> Option<String> {
    match std::env::var("WEIR_MODELS") {
        Ok(v) if !v.is_empty() => Some(v),
        _ if std::env::var("WEIR_REQUIRE_PEERS").as_deref() == Ok("1") => {
            panic!("WEIR_MODELS is not set; run ./scripts/test (it installs the peers)")
        }
        _ => {
            eprintln!("skipped: WEIR_MODELS is not set (./scripts/test sets it)");
            None
        }
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn vectors_match_sentence_transformers_alone_and_in_padded_batches() {
    let Some(root) = models() else { return };
    let env = move |k: &str| (k == "WEIR_MODELS").then(|| root.clone());
    let model = LocalEmbedder::load("all-minilm-l6-v2", &model_dir("all-minilm-l6-v2", &env), 32).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(include_str!("fixtures/minilm-reference.json")).unwrap();
    let items = fixture["items"].as_array().unwrap();
    let texts: Vec<&str> = items.iter().map(|i| i["text"].as_str().unwrap()).collect();
    let reference: Vec<Vec<f32>> = items
        .iter()
        .map(|i| i["vector"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    // All together: padded to the longest (the 256-token one, cut there).
    let together = model.embed(&texts).unwrap();
    // One at a time: no padding.
    for (i, text) in texts.iter().enumerate() {
        let alone = model.embed(&[text]).unwrap().remove(0);
        let (in_batch, tokens) = &together[i];
        assert_eq!(alone.0.len(), 384);
        assert_eq!(alone.1, *tokens, "{text}: real tokens");
        let c = cosine(&alone.0, &reference[i]);
        assert!(c >= 0.999, "{text}: cosine with sentence-transformers {c}");
        let c = cosine(in_batch, &reference[i]);
        assert!(c >= 0.999, "{text} in a padded batch: cosine {c}");
    }
    assert_eq!(together.iter().map(|t| t.1).max(), Some(256), "the long text is cut at 256 tokens");
    // Different texts are told apart.
    assert!(cosine(&together[0].0, &together[1].0) < 0.9);
}

#[test]
fn a_missing_model_says_where_it_looked_and_how_to_get_it() {
    let env = |k: &str| (k == "WEIR_MODELS").then(|| "/nonexistent/models".to_string());
    let e = LocalEmbedder::load("all-minilm-l6-v2", &model_dir("all-minilm-l6-v2", &env), 8).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("/nonexistent/models/all-minilm-l6-v2") && msg.contains("setup-peers"), "{msg}");
    assert!(LocalEmbedder::load("gpt-9", std::path::Path::new("/"), 8).unwrap_err().to_string().contains("unknown"));
}

//! A pool of endpoints for one model, as the user declares it: `--base-url` repeated (replicas
//! that share the model's key), `--location` with several Vertex AI locations, or
//! `--endpoints FILE` (TOML: `[[endpoint]]` tables with a base URL, the environment variable
//! that holds the endpoint's key, project, location, weight and told limits). Keys stay in the
//! environment: a file names variables, never values.
//!
//! Checked before any call: an unknown field, a key variable that is not set, a base URL weir
//! would not call, two entries for the same endpoint — each named by its entry.

use serde::Deserialize;

use weir_core::ThrottleSettings;
use weir_providers::ProviderOptions;

/// One endpoint of a pool: what differs from the run's settings.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointEntry {
    /// A name for the summary and errors (default: its place and base URL or location).
    #[serde(default)]
    pub name: Option<String>,
    /// Its base URL (default: the run's, else the provider's).
    #[serde(default)]
    pub base_url: Option<String>,
    /// The environment variable that holds its key (or, for Vertex AI, the path of its
    /// credentials file) instead of the provider's usual one.
    #[serde(default)]
    pub key_env: Option<String>,
    /// Its Google Cloud project (Vertex AI).
    #[serde(default)]
    pub project: Option<String>,
    /// Its Google Cloud location (Vertex AI).
    #[serde(default)]
    pub location: Option<String>,
    /// Its share of the calls when several endpoints could take one at once (default 1).
    #[serde(default)]
    pub weight: Option<f64>,
    /// Requests it allows per `limit_window` (a told limit, for this endpoint alone).
    #[serde(default)]
    pub rpm: Option<u64>,
    /// Tokens it allows per `limit_window`.
    #[serde(default)]
    pub tpm: Option<u64>,
    /// Where its batch jobs are staged (Vertex AI: `gs://BUCKET/PREFIX`, a bucket in its
    /// region), instead of the run's `--job-bucket`.
    #[serde(default)]
    pub job_bucket: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    endpoint: Vec<EndpointEntry>,
}

impl EndpointEntry {
    /// How the entry is named in messages: its name, else its place in the pool and where it is.
    pub fn label(&self, index: usize) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        // A base URL as messages may show it: never a user, password or query (a key).
        let at = match &self.base_url {
            Some(url) => weir_providers::http::shown_url(url),
            None => self.location.as_deref().or(self.project.as_deref()).unwrap_or("").to_string(),
        };
        if at.is_empty() {
            format!("endpoint {}", index + 1)
        } else {
            format!("endpoint {} ({at})", index + 1)
        }
    }

    /// How a run's job ledger names the endpoint (see [`site_name`]), with the run's settings
    /// where the entry has none.
    pub fn site(&self, run: &ProviderOptions) -> String {
        site_name(&self.provider(run))
    }

    /// The run's provider options with this entry's in place of them.
    pub fn provider(&self, run: &ProviderOptions) -> ProviderOptions {
        ProviderOptions {
            base_url: self.base_url.clone().or_else(|| run.base_url.clone()),
            project: self.project.clone().or_else(|| run.project.clone()),
            location: self.location.clone().or_else(|| run.location.clone()),
            key_var: self.key_env.clone().or_else(|| run.key_var.clone()),
            ..run.clone()
        }
    }

    /// The run's throttle settings with this entry's told limits in place of them.
    pub fn throttle(&self, run: &ThrottleSettings) -> ThrottleSettings {
        let mut t = run.clone();
        if self.rpm.is_some() {
            t.rate.requests = self.rpm;
        }
        if self.tpm.is_some() {
            t.rate.tokens = self.tpm;
        }
        t
    }
}

/// How a run's job ledger names an endpoint, so that a resumed run asks the endpoint that has
/// a job about it: where it is (base URL, project, location, as given) and the name of its
/// key's variable, never a key.
pub fn site_name(options: &ProviderOptions) -> String {
    let url = options.base_url.as_deref().map(|u| u.trim_end_matches('/'));
    [
        ("url", url),
        ("project", options.project.as_deref()),
        ("location", options.location.as_deref()),
        ("key_env", options.key_var.as_deref()),
    ]
    .into_iter()
    .filter_map(|(n, v)| v.map(|v| format!("{n}={v}")))
    .collect::<Vec<_>>()
    .join(" ")
}

/// Reads a pool: `text` is a TOML file's content (`[[endpoint]]` tables), or a JSON list of
/// the same entries (how the Python package passes `endpoints=[...]`). `from` names it in
/// messages.
pub fn parse(text: &str, from: &str) -> Result<Vec<EndpointEntry>, String> {
    // A JSON list opens with `[` and then `{` or `]`; a TOML table header (`[endpoint]`, a
    // single-bracket slip for `[[endpoint]]`) with a name.
    let json = text.trim_start().strip_prefix('[').is_some_and(|r| r.trim_start().starts_with(['{', ']']));
    let entries = if json {
        serde_json::from_str::<Vec<EndpointEntry>>(text).map_err(|e| format!("{from}: {e}"))?
    } else {
        // The line, not the snippet the error would show: a key pasted into the file is not
        // repeated.
        toml::from_str::<File>(text)
            .map_err(|e| {
                format!(
                    "{from}: {}{}",
                    weir_providers::toml_error(text, &e),
                    // `[endpoint]` is one table where a list of them is wanted.
                    if text.lines().any(|l| l.trim() == "[endpoint]") {
                        " (each endpoint is an [[endpoint]] table, with double brackets)"
                    } else {
                        ""
                    }
                )
            })?
            .endpoint
    };
    if entries.is_empty() {
        return Err(format!("{from}: no endpoint listed (give one [[endpoint]] table per endpoint)"));
    }
    Ok(entries)
}

/// What makes an endpoint another: where it is and the key it is called with.
fn where_(x: &EndpointEntry) -> (Option<&str>, Option<&str>, Option<&str>, Option<&str>) {
    (
        x.base_url.as_deref().map(|u| u.trim_end_matches('/')),
        x.project.as_deref(),
        x.location.as_deref(),
        x.key_env.as_deref(),
    )
}

/// Every problem with a pool, naming the entry: weights and limits out of range, a key variable
/// that `env` does not have, a base URL weir would not call, the same endpoint twice.
pub fn check(entries: &[EndpointEntry], env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
    for (i, e) in entries.iter().enumerate() {
        let at = e.label(i);
        if let Some(w) = e.weight {
            if !(w.is_finite() && w > 0.0) {
                return Err(format!("{at}: weight {w} must be a number > 0"));
            }
        }
        if e.rpm == Some(0) || e.tpm == Some(0) {
            return Err(format!("{at}: rpm and tpm must be at least 1"));
        }
        if let Some(var) = &e.key_env {
            // A key pasted in place of its variable's name is not repeated in the message.
            let name = !var.is_empty()
                && !var.starts_with(|c: char| c.is_ascii_digit())
                && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !name || var.len() > 64 {
                return Err(format!(
                    "{at}: key_env must name an environment variable (letters, digits and _), not hold a key"
                ));
            }
            // Repeated only when it reads as a variable's name (upper case, as they are written):
            // a key of letters and digits alone (many Gemini keys) is not.
            let shown = if var.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') {
                format!("{var:?}")
            } else {
                format!("({} characters, not repeated in case it is a key)", var.len())
            };
            match env(var) {
                None => return Err(format!("{at}: key_env {shown} names an environment variable that is not set")),
                Some(v) if v.trim().is_empty() => return Err(format!("{at}: key_env {shown} names an empty variable")),
                Some(_) => {}
            }
        }
        if let Some(url) = &e.base_url {
            weir_providers::http::check_base_url(url).map_err(|err| format!("{at}: {err}"))?;
        }
    }
    for (i, a) in entries.iter().enumerate() {
        for (j, b) in entries.iter().enumerate().skip(i + 1) {
            if where_(a) == where_(b) {
                return Err(format!(
                    "{} and {} are the same endpoint (same base URL, project, location and key): list it once",
                    a.label(i),
                    b.label(j)
                ));
            }
            if a.name.is_some() && a.name == b.name {
                return Err(format!(
                    "{} and {} have the same name: the summary, the page and /metrics tell endpoints apart by it, \
                     give each its own",
                    a.label(i),
                    b.label(j)
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(k: &str) -> Option<String> {
        (k == "KEY_B").then(|| "b-secret".into())
    }

    #[test]
    fn a_pool_file_is_read_and_checked_naming_the_entry() {
        let text = r#"
            [[endpoint]]
            base_url = "http://127.0.0.1:8001/v1"
            rpm = 100

            [[endpoint]]
            name = "replica-b"
            base_url = "http://127.0.0.1:8002/v1"
            key_env = "KEY_B"
            weight = 2
        "#;
        let p = parse(text, "pool.toml").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].rpm, Some(100));
        assert_eq!(p[1].weight, Some(2.0));
        check(&p, &env).unwrap();
        // JSON, as Python passes a list.
        let j = parse(r#"[{"base_url": "http://127.0.0.1:9/v1"}, {"location": "europe-west4"}]"#, "endpoints").unwrap();
        assert_eq!(j[1].location.as_deref(), Some("europe-west4"));

        // A tester's `[endpoint]` was read as JSON ("expected value at line 1 column 2").
        let single = parse("[endpoint]\nbase_url = \"http://127.0.0.1:1/v1\"\n", "pool.toml").unwrap_err();
        assert!(single.contains("[[endpoint]] table, with double brackets"), "{single}");
        let mut twins = p.clone();
        twins[0].name = twins[1].name.clone();
        assert!(check(&twins, &env).unwrap_err().contains("have the same name"));
        let unknown = parse("[[endpoint]]\nbase_url = \"http://127.0.0.1:1/v1\"\napi_key = \"x\"\n", "pool.toml");
        assert!(unknown.unwrap_err().contains("unknown field `api_key`"));
        let mut missing = p.clone();
        missing[1].key_env = Some("KEY_C".into());
        assert_eq!(
            check(&missing, &env).unwrap_err(),
            "replica-b: key_env \"KEY_C\" names an environment variable that is not set"
        );
        let mut twice = p.clone();
        twice[1] = EndpointEntry { base_url: Some("http://127.0.0.1:8001/v1/".into()), ..Default::default() };
        assert!(check(&twice, &env).unwrap_err().contains("endpoint 1 (http://127.0.0.1:8001/v1) and endpoint 2"));
        let mut bad = p;
        bad[0].weight = Some(0.0);
        assert!(check(&bad, &env).unwrap_err().starts_with("endpoint 1 (http://127.0.0.1:8001/v1): weight 0"));
        assert!(parse("", "pool.toml").is_err());
        // A key pasted there (letters and digits only, as many Gemini keys are) is not repeated.
        missing[1].key_env = Some("AIzaSyB3xQ7kLmN9pR2sT4uV6wX8yZ0aBcDeFgH".into());
        let e = check(&missing, &|_| None).unwrap_err();
        assert!(!e.contains("AIza") && e.contains("39 characters"), "{e}");
    }
}

//! The `options` argument: a JSON object with the same generation parameters as `--param`, plus
//! `system` and `fail_on_error`. Unknown keys are errors (a misspelt `temprature` would
//! otherwise be silently ignored and the user would measure the wrong thing).

use serde_json::{Map, Value};
use std::sync::Arc;
use weir_core::GenParams;
use weir_runtime::Call;

/// One row's call options, parsed from its `options` argument.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallOptions {
    /// System instructions and generation parameters (shared by the rows of equal options, so
    /// that they go through one driver).
    pub call: Arc<Call>,
    /// Fail the query on the first row that fails (default: the row gets NULL).
    pub fail_on_error: bool,
}

/// Options that cannot be used, with what to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{function} options {given}: {reason}")]
pub struct OptionsError {
    /// The function whose options these are.
    pub function: String,
    /// The options as written (shortened).
    pub given: String,
    /// What is wrong.
    pub reason: String,
}

impl CallOptions {
    /// Parses `text` (a JSON object) for `function`; `embed` allows `fail_on_error` only, since
    /// an embedding takes the text alone.
    pub fn parse(function: &str, text: &str, embed: bool) -> Result<Self, OptionsError> {
        let err = |reason: String| {
            let mut given: String = text.chars().take(80).collect();
            if given.len() < text.len() {
                given.push('…');
            }
            OptionsError { function: function.to_string(), given, reason }
        };
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let value: Value = serde_json::from_str(text)
            .map_err(|e| err(format!("not JSON ({e}); write e.g. '{{\"temperature\": 0.2}}'")))?;
        let Value::Object(mut object) = value else {
            return Err(err("expected a JSON object, e.g. '{\"temperature\": 0.2}'".into()));
        };
        let mut out = Self::default();
        match object.remove("fail_on_error") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => out.fail_on_error = b,
            Some(_) => return Err(err("fail_on_error must be true or false".into())),
        }
        if embed {
            if let Some(key) = object.keys().next() {
                return Err(err(format!(
                    "'{key}' does not apply to an embedding (it takes the text only); the one option is fail_on_error"
                )));
            }
            return Ok(out);
        }
        let system = match object.remove("system") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(Arc::from(s)),
            Some(_) => return Err(err("system must be a string".into())),
        };
        let mut params = GenParams::default();
        params
            .apply_object(&Map::from_iter(object))
            .map_err(|e| err(format!("{} (options also take system and fail_on_error)", e.reason)))?;
        out.call = Arc::new(Call { system, params: Arc::new(params) });
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_read_and_checked() {
        let o = CallOptions::parse(
            "llm_generate",
            r#"{"temperature":0.2,"system":"Be brief","fail_on_error":true}"#,
            false,
        )
        .unwrap();
        assert_eq!(o.call.params.temperature, Some(0.2));
        assert_eq!(o.call.system.as_deref(), Some("Be brief"));
        assert!(o.fail_on_error);
        assert_eq!(CallOptions::parse("llm_generate", "", false).unwrap(), CallOptions::default());
        let e = CallOptions::parse("llm_generate", r#"{"temprature":0.2}"#, false).unwrap_err();
        assert!(e.to_string().contains("temprature"), "{e}");
        assert!(e.to_string().contains("fail_on_error"), "{e}");
        assert!(CallOptions::parse("llm_generate", "temperature=0.2", false).unwrap_err().reason.contains("not JSON"));
        assert!(CallOptions::parse("llm_generate", "[1]", false).is_err());
        assert!(CallOptions::parse("llm_generate", r#"{"fail_on_error":"yes"}"#, false).is_err());
        let e = CallOptions::parse("llm_embed", r#"{"temperature":0.2}"#, true).unwrap_err();
        assert!(e.reason.contains("does not apply"), "{e}");
        assert!(CallOptions::parse("llm_embed", r#"{"fail_on_error":true}"#, true).unwrap().fail_on_error);
    }
}

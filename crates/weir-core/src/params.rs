//! Generation parameters, provider-neutral. Each provider maps them to its own field names.
//!
//! Users write `--param KEY=VALUE`; a key weir does not know is an error, never silently dropped
//! (Beam drops unknown arguments, and users then benchmark the wrong thing).

use serde::Serialize;
use serde_json::Value;

/// Generation parameters of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GenParams {
    /// Sampling temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling mass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k sampling (Gemini; vLLM and llama.cpp accept it on the OpenAI route too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    /// Most output tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    /// Sampling seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Stop sequences.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Presence penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Frequency penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// A JSON Schema the answer must follow (implies a JSON answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_schema: Option<Value>,
    /// The answer's MIME type: `text/plain` or `application/json`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_mime_type: Option<String>,
}

/// A `--param` that cannot be used, with what to fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--param {spec}: {reason}")]
pub struct ParamError {
    /// The parameter as written.
    pub spec: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The keys `--param` accepts, for error messages and `--help`.
pub const KNOWN_PARAMS: &str = "temperature, top_p, top_k, max_tokens (alias max_output_tokens), seed, stop, \
presence_penalty, frequency_penalty, response_schema, response_mime_type";

impl GenParams {
    /// Applies one `KEY=VALUE`. VALUE is read as JSON when it parses as JSON, else as a string.
    pub fn set(&mut self, spec: &str) -> Result<(), ParamError> {
        let err = |reason: String| ParamError { spec: spec.to_string(), reason };
        let (key, raw) = spec.split_once('=').ok_or_else(|| err("expected KEY=VALUE, e.g. temperature=0.2".into()))?;
        let key = key.trim();
        let value: Value = serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()));
        let num = |v: &Value| v.as_f64().ok_or_else(|| err(format!("{key} takes a number")));
        let uint = |v: &Value| {
            v.as_u64()
                .filter(|n| *n >= 1 && *n <= u32::MAX as u64)
                .map(|n| n as u32)
                .ok_or_else(|| err(format!("{key} takes a positive integer")))
        };
        match key {
            "temperature" => {
                let t = num(&value)?;
                if !(0.0..=2.0).contains(&t) {
                    return Err(err("temperature must be between 0 and 2".into()));
                }
                self.temperature = Some(t);
            }
            "top_p" => {
                let p = num(&value)?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(err("top_p must be between 0 and 1".into()));
                }
                self.top_p = Some(p);
            }
            "top_k" => self.top_k = Some(uint(&value)?),
            "max_tokens" | "max_output_tokens" => self.max_output_tokens = Some(uint(&value)?),
            "seed" => self.seed = Some(value.as_i64().ok_or_else(|| err("seed takes an integer".into()))?),
            "stop" => {
                self.stop = match value {
                    Value::String(s) => vec![s],
                    Value::Array(items) => items
                        .into_iter()
                        .map(|v| v.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| err("stop takes a string or a JSON array of strings".into()))?,
                    _ => return Err(err("stop takes a string or a JSON array of strings".into())),
                }
            }
            "presence_penalty" => self.presence_penalty = Some(num(&value)?),
            "frequency_penalty" => self.frequency_penalty = Some(num(&value)?),
            "response_schema" => {
                let schema = match value {
                    Value::String(s) if s.starts_with('@') => {
                        let text = std::fs::read_to_string(&s[1..])
                            .map_err(|e| err(format!("cannot read {}: {e}", &s[1..])))?;
                        serde_json::from_str(&text).map_err(|e| err(format!("{} is not JSON: {e}", &s[1..])))?
                    }
                    v @ Value::Object(_) => v,
                    _ => return Err(err("response_schema takes a JSON object, or @FILE".into())),
                };
                self.response_schema = Some(schema);
            }
            "response_mime_type" => match value.as_str() {
                Some(m @ ("text/plain" | "application/json")) => self.response_mime_type = Some(m.to_string()),
                _ => return Err(err("response_mime_type is text/plain or application/json".into())),
            },
            other => return Err(err(format!("unknown parameter '{other}'; known: {KNOWN_PARAMS}"))),
        }
        Ok(())
    }

    /// Parses every `KEY=VALUE`.
    pub fn from_specs<'a>(specs: impl IntoIterator<Item = &'a str>) -> Result<Self, ParamError> {
        let mut p = Self::default();
        for s in specs {
            p.set(s)?;
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_params_parse() {
        let p =
            GenParams::from_specs(["temperature=0.2", "max_tokens=64", "stop=[\"\\n\",\"END\"]", "seed=7", "top_k=40"])
                .unwrap();
        assert_eq!(p.temperature, Some(0.2));
        assert_eq!(p.max_output_tokens, Some(64));
        assert_eq!(p.stop, vec!["\n".to_string(), "END".to_string()]);
        assert_eq!(p.seed, Some(7));
        assert_eq!(p.top_k, Some(40));
        let p = GenParams::from_specs(["stop=END", "response_schema={\"type\":\"object\"}"]).unwrap();
        assert_eq!(p.stop, vec!["END".to_string()]);
        assert!(p.response_schema.is_some());
    }

    #[test]
    fn unknown_or_bad_params_are_errors() {
        let e = GenParams::from_specs(["temprature=0.2"]).unwrap_err();
        assert!(e.to_string().contains("unknown parameter 'temprature'"), "{e}");
        assert!(GenParams::from_specs(["temperature=hot"]).is_err());
        assert!(GenParams::from_specs(["max_tokens=0"]).is_err());
        assert!(GenParams::from_specs(["max_tokens"]).is_err());
        assert!(GenParams::from_specs(["temperature=3"]).is_err());
    }
}

//! Generation parameters, provider-neutral. Each provider maps them to its own field names.
//!
//! Users write `--param KEY=VALUE`; a key weir does not know is an error, never silently dropped
//! (Beam drops unknown arguments, and users then benchmark the wrong thing).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Generation parameters of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
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
        let value: Value = serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()));
        self.set_value(key.trim(), value, true).map_err(|e| ParamError { spec: spec.to_string(), ..e })
    }

    /// Applies every key of a JSON object (a record's own parameters). Values are taken as
    /// they are; `@FILE` is not read, since a data row must not make weir read local files.
    pub fn apply_object(&mut self, object: &serde_json::Map<String, Value>) -> Result<(), ParamError> {
        for (key, value) in object {
            self.set_value(key, value.clone(), false)?;
        }
        Ok(())
    }

    /// These parameters with every one that `over` sets replaced by its value (a record's own
    /// parameters over the run's).
    pub fn overlay(&self, over: &GenParams) -> GenParams {
        fn pick<T: Clone>(over: &Option<T>, base: &Option<T>) -> Option<T> {
            over.clone().or_else(|| base.clone())
        }
        GenParams {
            temperature: pick(&over.temperature, &self.temperature),
            top_p: pick(&over.top_p, &self.top_p),
            top_k: pick(&over.top_k, &self.top_k),
            max_output_tokens: pick(&over.max_output_tokens, &self.max_output_tokens),
            seed: pick(&over.seed, &self.seed),
            stop: if over.stop.is_empty() { self.stop.clone() } else { over.stop.clone() },
            presence_penalty: pick(&over.presence_penalty, &self.presence_penalty),
            frequency_penalty: pick(&over.frequency_penalty, &self.frequency_penalty),
            response_schema: pick(&over.response_schema, &self.response_schema),
            response_mime_type: pick(&over.response_mime_type, &self.response_mime_type),
        }
    }

    /// Applies one parameter; `files` allows `response_schema=@FILE`.
    fn set_value(&mut self, key: &str, value: Value, files: bool) -> Result<(), ParamError> {
        let shown = format!("{key}={value}");
        let err = |reason: String| ParamError { spec: shown.clone(), reason };
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
                    Value::String(s) if files && s.starts_with('@') => {
                        let text = std::fs::read_to_string(&s[1..])
                            .map_err(|e| err(format!("cannot read {}: {e}", &s[1..])))?;
                        serde_json::from_str(&text).map_err(|e| err(format!("{} is not JSON: {e}", &s[1..])))?
                    }
                    v @ Value::Object(_) => v,
                    _ if !files => {
                        return Err(err(
                            "response_schema here takes a JSON object (@FILE is read only from --param)".into()
                        ))
                    }
                    _ => return Err(err("response_schema takes a JSON object, or @FILE".into())),
                };
                // Every answer is checked against it: a schema that does not compile is said now.
                crate::schema::OutputSchema::new(&schema).map_err(err)?;
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

    #[test]
    fn a_records_parameters_override_the_runs_and_read_no_files() {
        let run = GenParams::from_specs(["temperature=0.2", "max_tokens=64", "stop=END"]).unwrap();
        let mut own = GenParams::default();
        let obj = serde_json::json!({"temperature": 0.9, "seed": 3});
        own.apply_object(obj.as_object().unwrap()).unwrap();
        let p = run.overlay(&own);
        assert_eq!((p.temperature, p.max_output_tokens, p.seed), (Some(0.9), Some(64), Some(3)));
        assert_eq!(p.stop, vec!["END".to_string()]);
        let file = serde_json::json!({"response_schema": "@/etc/passwd"});
        let e = GenParams::default().apply_object(file.as_object().unwrap()).unwrap_err();
        assert!(e.to_string().contains("JSON object"), "{e}");
        let typo = serde_json::json!({"temprature": 1});
        assert!(GenParams::default().apply_object(typo.as_object().unwrap()).is_err());
    }
}

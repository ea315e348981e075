//! Answers checked against the run's response schema. A provider asked for JSON in a given
//! shape mostly gives it, but not always (a cut answer, a model that ignores the constraint, a
//! server without constrained decoding): every answer is parsed and validated here, and one
//! that fails is an [`ErrorKind::InvalidOutput`] the executor tries again, so what reaches the
//! output matches the schema or is an error row.
//!
//! The schema is JSON Schema; Gemini's OpenAPI subset (`"type": "OBJECT"`, `"nullable": true`)
//! is translated first, so either form a user has works.

use serde_json::Value;

use crate::error::{ErrorKind, ModelError, RetryHint};

/// The longest answer text an invalid-output error quotes.
const QUOTED: usize = 4000;

/// A compiled response schema.
pub struct OutputSchema {
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for OutputSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OutputSchema")
    }
}

impl OutputSchema {
    /// Compiles `schema`; an error says what is wrong with it (a usage error of the run).
    pub fn new(schema: &Value) -> Result<Self, String> {
        let translated = to_json_schema(schema);
        let validator = jsonschema::validator_for(&translated).map_err(|e| format!("the response schema: {e}"))?;
        Ok(Self { validator })
    }

    /// Why `response` is not an answer to keep: its text is not JSON matching the schema. An
    /// embedding has no text to check.
    pub fn invalid(&self, response: &crate::outcome::ModelResponse) -> Option<ModelError> {
        match response.embedding {
            Some(_) => None,
            None => self.check(&response.text).err(),
        }
    }

    /// Whether `text` is JSON that matches the schema; the error quotes what was wrong and
    /// the answer (clipped).
    pub fn check(&self, text: &str) -> Result<(), ModelError> {
        let body = strip_fence(text);
        let why = match serde_json::from_str::<Value>(body) {
            Err(e) => format!("the answer is not JSON ({e})"),
            Ok(v) => match self.validator.iter_errors(&v).next() {
                None => return Ok(()),
                Some(e) => {
                    let at = e.instance_path().to_string();
                    let at = if at.is_empty() { "the answer".to_string() } else { format!("at {at}") };
                    format!("the answer does not match the response schema: {at}: {e}")
                }
            },
        };
        let quoted: String = text.chars().take(QUOTED).collect();
        let more = if quoted.len() < text.len() { " …" } else { "" };
        Err(ModelError::new(ErrorKind::InvalidOutput, format!("{why}; answer: {quoted}{more}"))
            .with_hint(RetryHint::Backoff))
    }
}

/// The JSON inside a Markdown code fence (```json … ```), which some models wrap it in even
/// when asked for JSON; other text as it is.
pub fn strip_fence(text: &str) -> &str {
    let t = text.trim();
    let Some(rest) = t.strip_prefix("```") else { return t };
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    rest.strip_suffix("```").unwrap_or(rest).trim()
}

/// Gemini's OpenAPI-subset schema as JSON Schema: types in lower case, `nullable` as a
/// `"null"` type, OpenAPI-only keys (`propertyOrdering`) dropped. A JSON Schema passes
/// unchanged.
pub fn to_json_schema(schema: &Value) -> Value {
    match schema {
        Value::Object(m) => {
            let mut out = serde_json::Map::new();
            let nullable = m.get("nullable").and_then(Value::as_bool).unwrap_or(false);
            for (k, v) in m {
                match k.as_str() {
                    "nullable" | "propertyOrdering" => {}
                    "type" => {
                        let t = match v {
                            Value::String(s) => Value::String(s.to_ascii_lowercase()),
                            other => other.clone(),
                        };
                        let t = match (nullable, t) {
                            (true, Value::String(s)) => Value::Array(vec![Value::String(s), "null".into()]),
                            (_, t) => t,
                        };
                        out.insert(k.clone(), t);
                    }
                    // Values that are schemas, or maps and lists of schemas.
                    "properties" | "$defs" | "definitions" => {
                        let inner = v
                            .as_object()
                            .map(|o| Value::Object(o.iter().map(|(n, s)| (n.clone(), to_json_schema(s))).collect()))
                            .unwrap_or_else(|| v.clone());
                        out.insert(k.clone(), inner);
                    }
                    "items" | "additionalProperties" | "not" => {
                        out.insert(k.clone(), to_json_schema(v));
                    }
                    "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                        let inner = v
                            .as_array()
                            .map(|a| Value::Array(a.iter().map(to_json_schema).collect()))
                            .unwrap_or_else(|| v.clone());
                        out.insert(k.clone(), inner);
                    }
                    _ => {
                        out.insert(k.clone(), v.clone());
                    }
                }
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> OutputSchema {
        OutputSchema::new(&json!({
            "type": "object",
            "properties": {"label": {"type": "string", "enum": ["shoe", "hat"]}, "score": {"type": "number"}},
            "required": ["label", "score"],
            "additionalProperties": false,
        }))
        .unwrap()
    }

    #[test]
    fn valid_answers_pass_and_others_say_why_with_the_answer() {
        let s = schema();
        assert!(s.check(r#"{"label": "hat", "score": 0.5}"#).is_ok());
        assert!(s.check("```json\n{\"label\": \"hat\", \"score\": 1}\n```").is_ok(), "a fenced answer");
        let e = s.check(r#"{"label": "hat", "sco"#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidOutput);
        assert!(e.kind.is_retryable());
        assert!(e.message.contains("not JSON") && e.message.contains(r#"answer: {"label": "hat", "sco"#), "{e}");
        let e = s.check(r#"{"label": "sock", "score": 1}"#).unwrap_err();
        assert!(e.message.contains("/label"), "{e}");
        let e = s.check(r#"{"label": "hat"}"#).unwrap_err();
        assert!(e.message.contains("score"), "{e}");
        let long = format!("{{\"label\": \"{}\"", "x".repeat(10_000));
        assert!(s.check(&long).unwrap_err().message.len() < 4200, "the quote is clipped");
    }

    #[test]
    fn gemini_openapi_schemas_are_translated() {
        let s = OutputSchema::new(&json!({
            "type": "OBJECT",
            "properties": {
                "name": {"type": "STRING"},
                "tags": {"type": "ARRAY", "items": {"type": "STRING"}},
                "note": {"type": "STRING", "nullable": true},
            },
            "required": ["name", "tags"],
            "propertyOrdering": ["name", "tags", "note"],
        }))
        .unwrap();
        assert!(s.check(r#"{"name": "a", "tags": ["x"], "note": null}"#).is_ok());
        assert!(s.check(r#"{"name": "a", "tags": [1]}"#).is_err());
        assert!(OutputSchema::new(&json!({"type": "no-such-type"})).is_err());
    }
}

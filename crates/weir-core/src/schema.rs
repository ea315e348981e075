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
            None => self.check(&response.text).err().map(|e| cut_short(e, &response.finish_reason)),
        }
    }

    /// Whether `text` is JSON that matches the schema; the error quotes what was wrong and
    /// the answer (clipped).
    pub fn check(&self, text: &str) -> Result<(), ModelError> {
        let body = strip_fence(text);
        let why = match serde_json::from_str::<Value>(body) {
            Err(e) => format!("the answer is not JSON ({e})"),
            Ok(v) => match self.validator.iter_errors(&v).next() {
                None => match unheld_number(&v, &mut String::new()) {
                    None => return Ok(()),
                    Some((at, n)) => {
                        let at = if at.is_empty() { "the answer".to_string() } else { format!("at {at}") };
                        format!("the answer does not fit a typed column: {at}: {n} is past what a 64-bit number holds")
                    }
                },
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

/// A number in `v` that no 64-bit column holds, with its JSON pointer: an integer past i64 (as
/// written, digits only) or a number whose value is infinite as a double (`1e999`). Answers are
/// parsed keeping numbers as written, so such a value would reach a JSONL row whole but a
/// Parquet, Arrow or SQL column as a null: an answer paid for and lost in silence. Refused
/// here, it is an invalid answer like any other, asked for again and, failing that, an error
/// row that quotes it.
fn unheld_number(v: &Value, at: &mut String) -> Option<(String, String)> {
    match v {
        Value::Number(n) => {
            let text = n.to_string();
            let integer = !text.contains(['.', 'e', 'E']);
            let held = if integer { n.is_i64() } else { n.as_f64().is_some_and(f64::is_finite) };
            (!held).then(|| (at.clone(), text))
        }
        Value::Array(items) => items.iter().enumerate().find_map(|(i, x)| {
            let len = at.len();
            at.push_str(&format!("/{i}"));
            let found = unheld_number(x, at);
            at.truncate(len);
            found
        }),
        Value::Object(m) => m.iter().find_map(|(k, x)| {
            let len = at.len();
            at.push('/');
            at.push_str(&k.replace('~', "~0").replace('/', "~1"));
            let found = unheld_number(x, at);
            at.truncate(len);
            found
        }),
        _ => None,
    }
}

/// An invalid answer that the model ended because it reached the output-token limit
/// (`finish_reason` `length`): asked again with the same limit it is most likely cut again, so
/// every retry would be paid for in vain. The error says so and is not retried.
fn cut_short(e: ModelError, finish_reason: &str) -> ModelError {
    if finish_reason != "length" {
        return e;
    }
    ModelError::new(
        e.kind,
        format!(
            "the answer was cut at the output-token limit (finish_reason length), so it was not asked for again; \
             give a larger max_output_tokens. {}",
            e.message
        ),
    )
    .with_hint(RetryHint::Never)
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

    /// A tester's answers: `{"n": 12345678901234567890123}` and `1e999` passed the schema and
    /// became a null and `inf` in a Parquet column, counted as successes.
    #[test]
    fn numbers_no_64_bit_column_holds_are_invalid_answers() {
        let s = OutputSchema::new(&json!({
            "type": "object",
            "properties": {"n": {"type": "integer"}, "xs": {"type": "array", "items": {"type": "number"}}},
        }))
        .unwrap();
        assert!(s.check(r#"{"n": 9223372036854775807, "xs": [1.5, -2e300, 3]}"#).is_ok());
        let e = s.check(r#"{"n": 12345678901234567890123}"#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidOutput);
        assert!(e.message.contains("at /n: 12345678901234567890123 is past"), "{e}");
        assert!(s.check(r#"{"n": -9223372036854775809}"#).is_err());
        let e = s.check(r#"{"xs": [1, 1e999]}"#).unwrap_err();
        assert!(e.message.contains("at /xs/1: 1e"), "{e}");
    }

    /// An answer cut at the output-token limit is not asked for again: the same limit would cut
    /// it again, and each try is paid for.
    #[test]
    fn an_answer_cut_at_the_token_limit_is_not_asked_for_again() {
        let s = schema();
        let answer = |finish: &str| crate::outcome::ModelResponse {
            text: r#"{"label": "hat", "sco"#.into(),
            finish_reason: finish.into(),
            ..Default::default()
        };
        let e = s.invalid(&answer("length")).unwrap();
        assert_eq!((e.kind, e.hint), (ErrorKind::InvalidOutput, RetryHint::Never));
        assert!(e.message.contains("max_output_tokens") && e.message.contains("not JSON"), "{e}");
        let e = s.invalid(&answer("stop")).unwrap();
        assert_eq!(e.hint, RetryHint::Backoff);
        let policy = crate::retry::RetryPolicy::default();
        assert_eq!(policy.decide_invalid(1, &s.invalid(&answer("length")).unwrap()), crate::retry::Decision::GiveUp);
        assert!(matches!(policy.decide_invalid(1, &e), crate::retry::Decision::Retry(_)));
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

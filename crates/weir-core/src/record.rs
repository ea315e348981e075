//! Records: turning an input row into a request, or into an error row that names its line.

use serde_json::{Map, Value};

use crate::error::{ErrorKind, ModelError};
use crate::params::GenParams;

/// A record's id, kept exactly as the input wrote it.
///
/// Ids of different JSON types are different ids: `7` and `"7"` are two records, and a number
/// keeps its digits as written (`12345678901234567890123` is not rounded to a float), so two
/// distinct large ids can never collide.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RecordId {
    /// A string id, or the line number when no id field is given.
    Text(String),
    /// A JSON number, as written.
    Number(String),
}

impl RecordId {
    /// The id from a row's JSON value: a non-empty string or a number.
    pub fn from_value(v: &Value) -> Option<Self> {
        match v {
            Value::String(s) if !s.is_empty() => Some(Self::Text(s.clone())),
            Value::Number(n) => Some(Self::Number(n.to_string())),
            _ => None,
        }
    }

    /// The id as text (a number's digits as written).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Text(s) | Self::Number(s) => s,
        }
    }

    /// Bytes that identify the id and its type, for exact keys.
    pub fn key_bytes(&self) -> Vec<u8> {
        let (tag, s) = match self {
            Self::Text(s) => (b's', s),
            Self::Number(s) => (b'n', s),
        };
        let mut v = Vec::with_capacity(s.len() + 1);
        v.push(tag);
        v.extend_from_slice(s.as_bytes());
        v
    }
}

impl std::fmt::Display for RecordId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for RecordId {
    fn from(s: &str) -> Self {
        Self::Text(s.to_string())
    }
}

impl serde::Serialize for RecordId {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Text(s) => ser.serialize_str(s),
            Self::Number(s) => match s.parse::<serde_json::Number>() {
                Ok(n) => n.serialize(ser),
                Err(_) => ser.serialize_str(s),
            },
        }
    }
}

/// One input row that parsed: its id, the prompt built from it, and its fields for passthrough.
#[derive(Debug, Clone)]
pub struct Record {
    /// Stable id: the `--id-field` value, else the line number.
    pub id: RecordId,
    /// 1-based line number in the input.
    pub line: u64,
    /// The prompt text.
    pub prompt: String,
    /// The record's own system text (`--system-field`), used instead of the run's.
    pub system: Option<std::sync::Arc<str>>,
    /// The record's own generation parameters (`--params-field`), laid over the run's.
    pub params: Option<Box<GenParams>>,
    /// The input object, carried to the output untouched.
    pub input: Map<String, Value>,
    /// What its media fields (`--media-field`) name, in order; read when it is sent.
    pub media: Vec<crate::media::MediaRef>,
    /// The digests of its media parts once read: what keys its answer in the response cache
    /// where the parts are no longer at hand (a batch job's answer, hours later).
    pub media_digests: Vec<[u8; 32]>,
}

impl Record {
    /// A record with the run's system text and parameters.
    pub fn new(id: RecordId, line: u64, prompt: String, input: Map<String, Value>) -> Self {
        Self { id, line, prompt, system: None, params: None, input, media: Vec::new(), media_digests: Vec::new() }
    }
}

/// A prompt template: literal text with `{field}` placeholders; `{{` and `}}` are literal braces.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    source: String,
    pieces: Vec<Piece>,
}

/// A piece of a `{field}` template: literal text, or the name of a field.
#[derive(Debug, Clone, PartialEq)]
pub enum TemplatePiece {
    /// Text as it is (with `{{` and `}}` already made single braces).
    Text(String),
    /// A placeholder's field name (trimmed).
    Field(String),
}
use TemplatePiece as Piece;

/// Splits `text` into literal text and `{field}` placeholders (`{{` and `}}` are literal
/// braces), rejecting unbalanced braces and empty names: the one reading of templates, for
/// prompts and for `http/` models' bodies alike.
pub fn template_pieces(text: &str) -> Result<Vec<TemplatePiece>, String> {
    let mut pieces = Vec::new();
    let mut lit = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                lit.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                lit.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some('{') | None => {
                            return Err(format!("unclosed '{{' in {text:?}; write {{{{ for a literal brace"))
                        }
                        Some(c) => name.push(c),
                    }
                }
                let name = name.trim().to_string();
                if name.is_empty() {
                    return Err(format!("empty field name '{{}}' in {text:?}"));
                }
                if !lit.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut lit)));
                }
                pieces.push(Piece::Field(name));
            }
            '}' => return Err(format!("unmatched '}}' in {text:?}; write }}}} for a literal brace")),
            c => lit.push(c),
        }
    }
    if !lit.is_empty() {
        pieces.push(Piece::Text(lit));
    }
    Ok(pieces)
}

/// A template that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--template: {0}")]
pub struct TemplateError(String);

impl Template {
    /// Parses a template, rejecting unbalanced braces and empty field names.
    pub fn parse(text: &str) -> Result<Self, TemplateError> {
        let pieces = template_pieces(text).map_err(TemplateError)?;
        if !pieces.iter().any(|p| matches!(p, Piece::Field(_))) {
            return Err(TemplateError(format!("{text:?} names no {{field}}, so every prompt would be the same")));
        }
        Ok(Self { source: text.to_string(), pieces })
    }

    /// The fields the template names, in order (a field named twice, twice): a table's
    /// columns can be checked against them before any row is read.
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Field(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// The template as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Fills the template from a row. Strings are inserted as they are, other values as JSON.
    pub fn render(&self, row: &Map<String, Value>) -> Result<String, String> {
        let mut out = String::new();
        for p in &self.pieces {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Field(name) => match row.get(name) {
                    Some(Value::String(s)) => out.push_str(s),
                    Some(Value::Null) | None => {
                        return Err(format!("field '{name}' used by the template is missing or null"))
                    }
                    Some(v) => out.push_str(&v.to_string()),
                },
            }
        }
        Ok(out)
    }
}

/// Where a record's prompt comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// A string field of the row.
    Field(String),
    /// A template over the row's fields.
    Template(Template),
    /// No prompt: the model's request is made from other fields (an `http/` model whose
    /// templates name no `{prompt}`), so a record needs none.
    Unused,
}

/// How rows become records; built once from the command line.
#[derive(Debug, Clone)]
pub struct RecordSpec {
    /// The field holding the id; `None` means the line number is the id.
    pub id_field: Option<String>,
    /// Where the prompt comes from.
    pub prompt: PromptSource,
    /// A string field holding the record's own system text; a missing or null field means the
    /// run's.
    pub system_field: Option<String>,
    /// An object field holding the record's own parameters (`{"temperature": 0.2}`), laid over
    /// the run's; a missing or null field means the run's.
    pub params_field: Option<String>,
    /// Fields naming media sent after the prompt, in order (`--media-field`): a file path or a
    /// URL; a null or empty field adds no part, and a record without the field is invalid input. With a MIME type when one was given
    /// (`FIELD:TYPE`), which the content's does not replace.
    pub media_fields: Vec<(String, Option<String>)>,
}

impl RecordSpec {
    /// Prompts from `prompt`, ids from `id_field` (else line numbers), nothing per record.
    pub fn new(id_field: Option<String>, prompt: PromptSource) -> Self {
        Self { id_field, prompt, system_field: None, params_field: None, media_fields: Vec::new() }
    }
}

fn invalid(
    line: u64,
    id: Option<RecordId>,
    input: Option<Map<String, Value>>,
    raw: Option<String>,
    msg: String,
) -> Box<Failure> {
    Box::new(Failure { id, line, input, raw, error: ModelError::new(ErrorKind::InvalidInput, msg), attempts: 0 })
}

impl RecordSpec {
    /// Parses one input line (without its newline). Bad input becomes an `invalid_input`
    /// failure that names the line and keeps the raw text, so nothing is lost.
    pub fn parse(&self, line: u64, bytes: &[u8]) -> Result<Record, Box<Failure>> {
        let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        let text = match std::str::from_utf8(bytes) {
            Ok(t) => t,
            Err(e) => {
                let raw = String::from_utf8_lossy(bytes).into_owned();
                return Err(invalid(line, None, None, Some(raw), format!("line {line} is not valid UTF-8 ({e})")));
            }
        };
        let value: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                return Err(invalid(
                    line,
                    None,
                    None,
                    Some(text.to_string()),
                    format!("line {line} is not valid JSON: {e}"),
                ))
            }
        };
        let Value::Object(input) = value else {
            return Err(invalid(line, None, None, Some(text.to_string()), format!("line {line} is not a JSON object")));
        };
        let id = match &self.id_field {
            None => RecordId::Text(line.to_string()),
            Some(f) => match input.get(f).and_then(RecordId::from_value) {
                Some(id) => id,
                None => {
                    return Err(invalid(
                        line,
                        None,
                        Some(input),
                        None,
                        format!("line {line}: id field '{f}' is missing, empty or not a string or number"),
                    ))
                }
            },
        };
        let prompt = match &self.prompt {
            PromptSource::Field(f) => match input.get(f) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => {
                    return Err(invalid(
                        line,
                        Some(id),
                        Some(input),
                        None,
                        format!("line {line}: prompt field '{f}' is missing"),
                    ))
                }
                Some(_) => {
                    return Err(invalid(
                        line,
                        Some(id),
                        Some(input),
                        None,
                        format!("line {line}: prompt field '{f}' is not a string"),
                    ))
                }
            },
            PromptSource::Template(t) => match t.render(&input) {
                Ok(p) => p,
                Err(msg) => return Err(invalid(line, Some(id), Some(input), None, format!("line {line}: {msg}"))),
            },
            PromptSource::Unused => String::new(),
        };
        if prompt.trim().is_empty() && !matches!(self.prompt, PromptSource::Unused) {
            return Err(invalid(line, Some(id), Some(input), None, format!("line {line}: the prompt is empty")));
        }
        let system = match self.system_field.as_deref().map(|f| (f, input.get(f))) {
            None | Some((_, None | Some(Value::Null))) => None,
            Some((_, Some(Value::String(s)))) => Some(std::sync::Arc::from(s.as_str())),
            Some((f, Some(_))) => {
                let msg = format!("line {line}: system field '{f}' is not a string");
                return Err(invalid(line, Some(id), Some(input), None, msg));
            }
        };
        let params = match self.params_field.as_deref().map(|f| (f, input.get(f))) {
            None | Some((_, None | Some(Value::Null))) => None,
            Some((f, Some(Value::Object(o)))) => {
                let mut p = GenParams::default();
                if let Err(e) = p.apply_object(o) {
                    let msg =
                        format!("line {line}: params field '{f}': {}", e.to_string().trim_start_matches("--param "));
                    return Err(invalid(line, Some(id), Some(input), None, msg));
                }
                Some(Box::new(p))
            }
            Some((f, Some(_))) => {
                let msg = format!("line {line}: params field '{f}' is not a JSON object of parameters");
                return Err(invalid(line, Some(id), Some(input), None, msg));
            }
        };
        let mut media = Vec::with_capacity(self.media_fields.len());
        let mut wrong = None;
        for (f, mime) in &self.media_fields {
            if !input.contains_key(f) {
                wrong = Some(format!(
                    "line {line}: has no media field '{f}' (--media-field; give it null for a record without this part)"
                ));
                break;
            }
            match crate::media::source_of(input.get(f)) {
                Ok(None) => {}
                Ok(Some(source)) => media.push(crate::media::MediaRef { field: f.clone(), source, mime: mime.clone() }),
                Err(why) => {
                    wrong = Some(format!("line {line}: media field '{f}' {why}"));
                    break;
                }
            }
        }
        // The record's part keeps its source whole; the input its rows echo does not keep a
        // signed URL's signature or a password in a URL (a result or error row, a table's
        // carried column, never holds them).
        let mut input = input;
        for (f, _) in &self.media_fields {
            if let Some(Value::String(s)) = input.get(f) {
                let shown = crate::media::shown(s.trim());
                if shown != s.trim() {
                    input.insert(f.clone(), Value::String(shown));
                }
            }
        }
        if let Some(msg) = wrong {
            return Err(invalid(line, Some(id), Some(input), None, msg));
        }
        Ok(Record { id, line, prompt, system, params, input, media, media_digests: Vec::new() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: Option<&str>) -> RecordSpec {
        RecordSpec::new(id.map(str::to_string), PromptSource::Field("prompt".into()))
    }

    #[test]
    fn rows_become_records() {
        let r = spec(None).parse(3, br#"{"prompt":"hi","x":1}"#).unwrap();
        assert_eq!((r.id.as_str(), r.line, r.prompt.as_str()), ("3", 3, "hi"));
        assert_eq!(r.id, RecordId::Text("3".into()));
        assert_eq!(r.input["x"], 1);
        let r = spec(Some("key")).parse(1, br#"{"prompt":"hi","key":42}"#).unwrap();
        assert_eq!(r.id, RecordId::Number("42".into()));
        let big = spec(Some("key")).parse(1, br#"{"prompt":"hi","key":12345678901234567890123}"#).unwrap();
        assert_eq!(serde_json::to_string(&big.id).unwrap(), "12345678901234567890123");
        let text = spec(Some("key")).parse(1, br#"{"prompt":"hi","key":"42"}"#).unwrap();
        assert_ne!(text.id, r.id, "42 and \"42\" are different ids");
        assert_ne!(text.id.key_bytes(), r.id.key_bytes());
    }

    /// A media URL's part keeps it whole; the input rows echo shows it without its query (a
    /// signed URL's signature) or password, also in the error row of a bad record.
    #[test]
    fn a_signed_media_url_is_not_echoed_whole() {
        let mut s = spec(None);
        s.media_fields = vec![("a".into(), None), ("b".into(), None)];
        let signed = "https://u:pw@h/p.png?X-Goog-Signature=SECRET";
        let line = format!(r#"{{"prompt":"hi","a":"{signed}","b":"photo.jpg"}}"#);
        let r = s.parse(1, line.as_bytes()).unwrap();
        assert_eq!(r.media[0].source, crate::media::MediaSource::Named(signed.into()));
        assert_eq!(r.input["a"], "https://h/p.png");
        assert_eq!(r.input["b"], "photo.jpg", "a path as it was");
        let line = format!(r#"{{"prompt":"hi","a":"{signed}","b":7}}"#);
        let f = s.parse(1, line.as_bytes()).unwrap_err();
        let echoed = serde_json::to_string(&f.input).unwrap();
        assert!(!echoed.contains("SECRET") && !echoed.contains("pw"), "{echoed}");
    }

    #[test]
    fn bad_rows_become_invalid_input_naming_the_line() {
        let s = spec(Some("key"));
        for (bytes, needle) in [
            (&b"{not json"[..], "not valid JSON"),
            (b"[1,2]", "not a JSON object"),
            (b"{\"key\":\"a\"}", "prompt field 'prompt' is missing"),
            (b"{\"key\":\"a\",\"prompt\":5}", "not a string"),
            (b"{\"prompt\":\"x\"}", "id field 'key'"),
            (b"{\"key\":\"a\",\"prompt\":\"\xff\"}", "not valid UTF-8"),
            (b"{\"key\":\"a\",\"prompt\":\"  \"}", "empty"),
        ] {
            let f = s.parse(7, bytes).unwrap_err();
            assert_eq!(f.error.kind, ErrorKind::InvalidInput);
            assert_eq!(f.line, 7);
            assert!(f.error.message.contains("line 7"), "{}", f.error.message);
            assert!(f.error.message.contains(needle), "{} should contain {needle}", f.error.message);
            assert!(f.input.is_some() || f.raw.is_some(), "the row must be kept");
        }
    }

    #[test]
    fn templates() {
        let t = Template::parse("Translate {text} to {lang}. {{literal}}").unwrap();
        let row: Map<String, Value> = serde_json::from_str(r#"{"text":"hello","lang":"French"}"#).unwrap();
        assert_eq!(t.render(&row).unwrap(), "Translate hello to French. {literal}");
        let row: Map<String, Value> = serde_json::from_str(r#"{"text":"hello","lang":3}"#).unwrap();
        assert_eq!(t.render(&row).unwrap(), "Translate hello to 3. {literal}");
        assert!(t.render(&Map::new()).unwrap_err().contains("'text'"));
        assert!(Template::parse("no fields").is_err());
        assert!(Template::parse("bad {field").is_err());
        assert!(Template::parse("bad } brace {f}").is_err());
        assert!(Template::parse("{}").is_err());
    }
}

/// A record that ended in failure; written to the errors file with enough to retry it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The record's id, when it could be read.
    pub id: Option<RecordId>,
    /// 1-based input line.
    pub line: u64,
    /// The input object, when the line parsed.
    pub input: Option<Map<String, Value>>,
    /// The raw line, when it did not parse.
    pub raw: Option<String>,
    /// What went wrong (the last error, after any retries).
    pub error: ModelError,
    /// Calls made (0 for invalid input).
    pub attempts: u32,
}

impl Failure {
    /// A failure of a parsed record.
    pub fn of(record: Record, error: ModelError, attempts: u32) -> Self {
        Self { id: Some(record.id), line: record.line, input: Some(record.input), raw: None, error, attempts }
    }
}

//! The columns of JSON records, inferred in one pass without keeping the records, and the
//! output tables' columns.
//!
//! A JSONL input has no schema, but a Parquet or CSV output needs one. The inference keeps
//! columns in the order they first appear; a column whose values disagree (a number here, text
//! there) becomes text, and values that are not text are written as their JSON.

use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use serde_json::{Map, Value};
use std::sync::Arc;

/// What a column's values have been so far.
#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Null,
    Bool,
    Int,
    Float,
    Text,
    List(Box<Kind>),
    Object(Vec<(String, Kind)>),
    /// Values of kinds that do not merge: written as text.
    Mixed,
}

impl Kind {
    fn of(v: &Value) -> Self {
        match v {
            Value::Null => Self::Null,
            Value::Bool(_) => Self::Bool,
            Value::Number(n) if n.is_i64() || n.is_u64() => Self::Int,
            Value::Number(_) => Self::Float,
            Value::String(_) => Self::Text,
            Value::Array(items) => Self::List(Box::new(items.iter().fold(Self::Null, |k, v| k.merge(Self::of(v))))),
            Value::Object(m) => Self::Object(m.iter().map(|(k, v)| (k.clone(), Self::of(v))).collect()),
        }
    }

    fn merge(self, other: Self) -> Self {
        use Kind::*;
        match (self, other) {
            (Null, k) | (k, Null) => k,
            (Int, Float) | (Float, Int) => Float,
            (List(a), List(b)) => List(Box::new(a.merge(*b))),
            (Object(mut a), Object(b)) => {
                for (name, kind) in b {
                    match a.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, k)) => *k = std::mem::replace(k, Null).merge(kind),
                        None => a.push((name, kind)),
                    }
                }
                Object(a)
            }
            (a, b) if a == b => a,
            _ => Mixed,
        }
    }

    fn data_type(&self) -> DataType {
        match self {
            Kind::Null => DataType::Null,
            Kind::Bool => DataType::Boolean,
            Kind::Int => DataType::Int64,
            Kind::Float => DataType::Float64,
            Kind::Text | Kind::Mixed => DataType::Utf8,
            Kind::List(k) => DataType::List(Arc::new(Field::new("item", k.data_type(), true))),
            // Parquet cannot hold a struct without fields: an object that is always empty is text.
            Kind::Object(fields) if fields.is_empty() => DataType::Utf8,
            Kind::Object(fields) => DataType::Struct(
                fields.iter().map(|(n, k)| Field::new(n, k.data_type(), true)).collect::<Vec<_>>().into(),
            ),
        }
    }
}

/// Columns inferred from JSON objects, added one at a time.
#[derive(Debug, Default)]
pub struct Inference {
    columns: Vec<(String, Kind)>,
    index: std::collections::HashMap<String, usize>,
}

impl Inference {
    /// Takes one record into account.
    pub fn add(&mut self, record: &Map<String, Value>) {
        for (name, v) in record {
            let kind = Kind::of(v);
            match self.index.get(name) {
                Some(&i) => {
                    let slot = &mut self.columns[i].1;
                    *slot = std::mem::replace(slot, Kind::Null).merge(kind);
                }
                None => {
                    self.index.insert(name.clone(), self.columns.len());
                    self.columns.push((name.clone(), kind));
                }
            }
        }
    }

    /// The schema of the records seen, columns in order of first appearance.
    pub fn schema(&self) -> Result<SchemaRef, String> {
        Ok(Arc::new(Schema::new(
            self.columns.iter().map(|(n, k)| Field::new(n, k.data_type(), true)).collect::<Vec<_>>(),
        )))
    }
}

/// True for types a CSV file cannot hold as they are (written there as JSON text).
pub fn is_nested(t: &DataType) -> bool {
    matches!(
        t,
        DataType::List(_)
            | DataType::LargeList(_)
            | DataType::FixedSizeList(..)
            | DataType::Struct(_)
            | DataType::Map(..)
            | DataType::Union(..)
    )
}

/// What a run computes for each record, which decides the result columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Task {
    /// Generated text: a `response` column.
    Generate,
    /// Embedding vectors: `embedding` and `dimensions` columns.
    Embed,
    /// Generated JSON of the run's response schema: a `response` column of the schema's type
    /// ([`arrow_type_of`]; text in a CSV file).
    Shaped(DataType),
}

/// The Arrow type of values of a JSON Schema (or Gemini's OpenAPI form): an object with
/// properties a struct (its fields in the schema's order), an array a list, `string` (and
/// `enum`s of strings) text, `integer` Int64, `number` Float64, `boolean`. What has no one type
/// (`anyOf`, an object without properties, a type list of several) is text, holding its JSON.
pub fn arrow_type_of(schema: &Value) -> DataType {
    let schema = weir_core::schema::to_json_schema(schema);
    type_of(&schema, 0)
}

fn type_of(s: &Value, depth: u32) -> DataType {
    if depth > 16 {
        return DataType::Utf8;
    }
    let kind = match s.get("type") {
        Some(Value::String(t)) => Some(t.as_str()),
        Some(Value::Array(ts)) => {
            let not_null: Vec<&str> = ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect();
            (not_null.len() == 1).then(|| not_null[0])
        }
        _ if s.get("properties").is_some() => Some("object"),
        _ => None,
    };
    match kind {
        Some("object") => match s.get("properties").and_then(Value::as_object).filter(|p| !p.is_empty()) {
            Some(props) => DataType::Struct(
                props.iter().map(|(n, p)| Field::new(n, type_of(p, depth + 1), true)).collect::<Vec<_>>().into(),
            ),
            None => DataType::Utf8,
        },
        Some("array") => {
            let items = s.get("items").map_or(DataType::Utf8, |i| type_of(i, depth + 1));
            DataType::List(Arc::new(Field::new("item", items, true)))
        }
        Some("integer") => DataType::Int64,
        Some("number") => DataType::Float64,
        Some("boolean") => DataType::Boolean,
        _ => DataType::Utf8,
    }
}

/// `v` as a column of type `t` takes it: text where the type is text and the value is not
/// (its JSON), fields and items fitted in turn, a value of another shape left out (null).
pub fn fit(v: &Value, t: &DataType) -> Value {
    match (t, v) {
        (_, Value::Null) => Value::Null,
        (DataType::Utf8, Value::String(_)) => v.clone(),
        (DataType::Utf8, other) => Value::String(other.to_string()),
        (DataType::Struct(fields), Value::Object(m)) => Value::Object(
            fields.iter().filter_map(|f| m.get(f.name()).map(|x| (f.name().clone(), fit(x, f.data_type())))).collect(),
        ),
        (DataType::List(item), Value::Array(items)) => {
            Value::Array(items.iter().map(|x| fit(x, item.data_type())).collect())
        }
        (DataType::Int64, Value::Number(n)) if n.is_i64() => v.clone(),
        // `3.0` is an integer to JSON Schema: kept as 3 (a number past i64 stays null).
        (DataType::Int64, Value::Number(n)) => match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Value::from(f as i64),
            _ => Value::Null,
        },
        (DataType::Float64, Value::Number(_)) | (DataType::Boolean, Value::Bool(_)) => v.clone(),
        _ => Value::Null,
    }
}

/// A column of type `t` (from [`arrow_type_of`]) holding answers to a response schema: each
/// answer's JSON, fitted ([`fit`]); an answer that is missing or is not JSON is null. For a
/// front end that returns the answers themselves as values (SQL's `llm_generate` with a
/// `response_schema`).
pub fn shaped_column<'a>(
    answers: impl IntoIterator<Item = Option<&'a str>>,
    t: &DataType,
) -> Result<arrow_array::ArrayRef, arrow_schema::ArrowError> {
    let field = Arc::new(Field::new("v", t.clone(), true));
    let mut lines = Vec::new();
    let mut n = 0usize;
    for a in answers {
        let v = a
            .and_then(|a| serde_json::from_str::<Value>(weir_core::schema::strip_fence(a)).ok())
            .map_or(Value::Null, |v| fit(&v, t));
        serde_json::to_writer(&mut lines, &serde_json::json!({ "v": v }))
            .map_err(|e| arrow_schema::ArrowError::JsonError(e.to_string()))?;
        lines.push(b'\n');
        n += 1;
    }
    if n == 0 {
        return Ok(arrow_array::new_empty_array(t));
    }
    let schema = Arc::new(arrow_schema::Schema::new(vec![field]));
    let mut decoder = arrow_json::ReaderBuilder::new(schema).with_batch_size(n).build_decoder()?;
    decoder.decode(&lines)?;
    let batch = decoder.flush()?.ok_or_else(|| arrow_schema::ArrowError::JsonError("no rows decoded".into()))?;
    Ok(batch.column(0).clone())
}

/// The bytes a row's value holds for a binary column: a string's UTF-8, or `{"base64": …}`.
fn bytes_of(v: &Value) -> Option<Vec<u8>> {
    use base64::Engine;
    match v {
        Value::String(s) => Some(s.as_bytes().to_vec()),
        Value::Object(o) => base64::engine::general_purpose::STANDARD.decode(o.get("base64")?.as_str()?).ok(),
        _ => None,
    }
}

/// The columns of the results and errors tables: the input columns carried through, then
/// weir's own. weir's column names never take an input column's place: a name an input column
/// already has gets the prefix `weir_` (`model` → `weir_model`).
#[derive(Debug, Clone)]
pub struct OutputColumns {
    /// Input columns carried through, with their types as written.
    pub kept: Vec<Field>,
    /// The results table.
    pub results: SchemaRef,
    /// The errors table.
    pub errors: SchemaRef,
    /// weir's column names after any renaming, by their plain names.
    pub names: std::collections::HashMap<&'static str, String>,
    /// The answers are a response schema's JSON: a string answer (`"type": "string"`) is
    /// written as its text, not as JSON with quotes.
    pub shaped: bool,
}

const RESULT_COLUMNS: &[&str] = &[
    "line",
    "response",
    "embedding",
    "dimensions",
    "finish_reason",
    "prompt_tokens",
    "output_tokens",
    "total_tokens",
    "model",
    "model_version",
    "attempts",
    "latency_ms",
];
const ERROR_COLUMNS: &[&str] = &["line", "kind", "message", "status", "attempts", "retryable", "raw"];

impl OutputColumns {
    /// The output columns for input columns `input` (all of them, or those in `keep`), for
    /// `task`; `text_only` when the output cannot hold nested values (CSV).
    pub fn new(input: &Schema, keep: Option<&[String]>, task: &Task, text_only: bool) -> Result<Self, String> {
        let mut kept: Vec<Field> = Vec::new();
        match keep {
            None => kept.extend(input.fields().iter().map(|f| f.as_ref().clone())),
            Some(names) => {
                for n in names {
                    match input.field_with_name(n) {
                        Ok(_) if kept.iter().any(|k| k.name() == n) => {}
                        Ok(f) => kept.push(f.clone()),
                        Err(_) => {
                            let have: Vec<&str> = input.fields().iter().map(|f| f.name().as_str()).collect();
                            return Err(format!(
                                "--keep-columns: the input has no column '{n}' (it has: {})",
                                have.join(", ")
                            ));
                        }
                    }
                }
            }
        }
        for f in &mut kept {
            *f = f.clone().with_nullable(true);
            // A text output holds bytes as their text or base64 (as the rows carry them).
            if text_only && (is_nested(f.data_type()) || f.data_type() == &DataType::Binary) {
                *f = Field::new(f.name(), DataType::Utf8, true);
            }
        }
        let taken: std::collections::HashSet<&str> = kept.iter().map(|f| f.name().as_str()).collect();
        let mut names = std::collections::HashMap::new();
        for c in RESULT_COLUMNS.iter().chain(ERROR_COLUMNS) {
            let mut name = c.to_string();
            while taken.contains(name.as_str()) {
                name = format!("weir_{name}");
            }
            names.insert(*c, name);
        }
        let n = |c: &str| names[c].clone();
        let mut results: Vec<Field> = kept.clone();
        results.push(Field::new(n("line"), DataType::UInt64, false));
        match task {
            Task::Generate => results.push(Field::new(n("response"), DataType::Utf8, true)),
            Task::Shaped(_) if text_only => results.push(Field::new(n("response"), DataType::Utf8, true)),
            Task::Shaped(t) => results.push(Field::new(n("response"), t.clone(), true)),
            Task::Embed => {
                let vector = if text_only {
                    DataType::Utf8
                } else {
                    DataType::List(Arc::new(Field::new("item", DataType::Float32, true)))
                };
                results.push(Field::new(n("embedding"), vector, true));
                results.push(Field::new(n("dimensions"), DataType::UInt32, true));
            }
        }
        for (c, t, nullable) in [
            ("finish_reason", DataType::Utf8, true),
            ("prompt_tokens", DataType::UInt64, false),
            ("output_tokens", DataType::UInt64, false),
            ("total_tokens", DataType::UInt64, false),
            ("model", DataType::Utf8, false),
            ("model_version", DataType::Utf8, true),
            ("attempts", DataType::UInt32, false),
            ("latency_ms", DataType::UInt64, false),
        ] {
            results.push(Field::new(n(c), t, nullable));
        }
        let mut errors: Vec<Field> = kept.clone();
        for (c, t, nullable) in [
            ("line", DataType::UInt64, false),
            ("kind", DataType::Utf8, false),
            ("message", DataType::Utf8, false),
            ("status", DataType::UInt16, true),
            ("attempts", DataType::UInt32, false),
            ("retryable", DataType::Boolean, false),
            ("raw", DataType::Utf8, true),
        ] {
            errors.push(Field::new(n(c), t, nullable));
        }
        let shaped = matches!(task, Task::Shaped(_));
        Ok(Self { kept, results: Arc::new(Schema::new(results)), errors: Arc::new(Schema::new(errors)), names, shaped })
    }

    /// The name weir's column `plain` has in these tables.
    pub fn name<'a>(&'a self, plain: &'a str) -> &'a str {
        self.names.get(plain).map(String::as_str).unwrap_or(plain)
    }

    /// Puts the kept input columns of `input` into `row`, each as its column's type can take
    /// it: a value a text column cannot take as it is (a number, an object) as its JSON text.
    pub fn carry(&self, input: Option<&Map<String, Value>>, row: &mut Map<String, Value>) {
        let Some(input) = input else { return };
        for f in &self.kept {
            let v = match input.get(f.name()) {
                None | Some(Value::Null) => continue,
                Some(v) => v,
            };
            let v = match (f.data_type(), v) {
                (DataType::Utf8 | DataType::LargeUtf8, Value::String(_)) => v.clone(),
                (DataType::Utf8 | DataType::LargeUtf8, other) => Value::String(other.to_string()),
                // Bytes as the rows carry them (text, or `{"base64": …}`), as the hex the
                // writer's decoder takes for a binary column.
                (DataType::Binary, v) => match bytes_of(v) {
                    Some(b) => Value::String(hex::encode(&b)),
                    None => continue,
                },
                _ => v.clone(),
            };
            row.insert(f.name().clone(), v);
        }
    }

    /// The fields of the results table, for checks.
    pub fn result_fields(&self) -> &Fields {
        self.results.fields()
    }
}

/// Whether a column of type `t` may hold text (strings, bytes that may be UTF-8, or a
/// dictionary of either): what a prompt column must hold.
pub fn holds_text(t: &arrow_schema::DataType) -> bool {
    use arrow_schema::DataType as T;
    match t {
        T::Utf8 | T::LargeUtf8 | T::Utf8View | T::Binary | T::LargeBinary | T::BinaryView => true,
        T::Dictionary(_, values) => holds_text(values),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_schema_gives_typed_columns() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "label": {"type": "string", "enum": ["a", "b"]},
                "score": {"type": "number"},
                "count": {"type": ["integer", "null"]},
                "tags": {"type": "ARRAY", "items": {"type": "STRING"}},
                "any": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            },
        });
        let t = arrow_type_of(&schema);
        let DataType::Struct(fields) = &t else { panic!("{t:?}") };
        let names: Vec<&str> = fields.iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["label", "score", "count", "tags", "any"], "in the schema's order");
        assert_eq!(fields[1].data_type(), &DataType::Float64);
        assert_eq!(fields[2].data_type(), &DataType::Int64);
        assert!(matches!(fields[3].data_type(), DataType::List(i) if i.data_type() == &DataType::Utf8));
        assert_eq!(fields[4].data_type(), &DataType::Utf8);
        let v = serde_json::json!({"label": "a", "score": 1, "count": null, "tags": ["x"], "any": 3, "extra": 1});
        assert_eq!(
            fit(&v, &t),
            serde_json::json!({"label": "a", "score": 1, "count": null, "tags": ["x"], "any": "3"}),
            "text holds what is not text as JSON; fields the schema lacks are left out"
        );
    }
    use serde_json::json;

    #[test]
    fn answers_become_a_column_of_the_schema_type() {
        use arrow_array::Array;
        let t = arrow_type_of(
            &json!({"type": "object", "properties": {"label": {"type": "string"}, "n": {"type": "integer"}}}),
        );
        let c = shaped_column(
            [Some(r#"{"label":"cat","n":2}"#), None, Some("not json"), Some("```json\n{\"n\":3.0}\n```")],
            &t,
        )
        .unwrap();
        assert_eq!(c.len(), 4);
        assert_eq!(c.data_type(), &t);
        let s = c.as_any().downcast_ref::<arrow_array::StructArray>().unwrap();
        assert!(c.is_valid(0) && c.is_null(1) && c.is_null(2) && c.is_valid(3));
        let n = s.column(1).as_any().downcast_ref::<arrow_array::Int64Array>().unwrap();
        assert_eq!((n.value(0), n.value(3)), (2, 3));
    }

    #[test]
    fn infers_in_order_and_merges() {
        let mut inf = Inference::default();
        for v in [
            json!({"id": 1, "x": 1, "tags": ["a"], "m": {"k": 1}}),
            json!({"id": 2, "x": 2.5, "tags": [], "m": {"j": "t"}, "late": null}),
            json!({"id": "three", "x": null}),
        ] {
            inf.add(v.as_object().unwrap());
        }
        let s = inf.schema().unwrap();
        let names: Vec<&str> = s.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["id", "x", "tags", "m", "late"]);
        assert_eq!(s.field(0).data_type(), &DataType::Utf8, "int and text are mixed: text");
        assert_eq!(s.field(1).data_type(), &DataType::Float64);
        assert!(matches!(s.field(2).data_type(), DataType::List(f) if f.data_type() == &DataType::Utf8));
        assert!(matches!(s.field(3).data_type(), DataType::Struct(f) if f.len() == 2));
        assert_eq!(s.field(4).data_type(), &DataType::Null);
    }

    #[test]
    fn weir_columns_step_aside_for_input_columns() {
        let input = Schema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("model", DataType::Utf8, true),
            Field::new("tags", DataType::List(Arc::new(Field::new("item", DataType::Utf8, true))), true),
        ]);
        let c = OutputColumns::new(&input, None, &Task::Generate, false).unwrap();
        assert_eq!(c.name("model"), "weir_model");
        assert_eq!(c.name("response"), "response");
        assert!(c.results.field_with_name("weir_model").is_ok() && c.results.field_with_name("model").is_ok());
        let csv = OutputColumns::new(&input, Some(&["tags".into()]), &Task::Embed, true).unwrap();
        assert_eq!(csv.kept.len(), 1);
        assert_eq!(csv.kept[0].data_type(), &DataType::Utf8, "nested columns are text in CSV");
        assert_eq!(csv.name("model"), "model");
        assert!(OutputColumns::new(&input, Some(&["nope".into()]), &Task::Generate, false).is_err());
        let mut row = Map::new();
        c.carry(Some(json!({"id": 7, "model": null, "tags": ["a"]}).as_object().unwrap()), &mut row);
        assert_eq!(Value::Object(row), json!({"id": "7", "tags": ["a"]}));
    }
}

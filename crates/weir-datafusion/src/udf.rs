//! The four functions as DataFusion async scalar UDFs.

use async_trait::async_trait;
use datafusion::arrow::array::{
    Array, ArrayRef, AsArray, Float32Builder, ListBuilder, StringBuilder, StructArray, UInt32Builder, UInt64Builder,
};
use datafusion::arrow::buffer::NullBuffer;
use datafusion::arrow::compute::cast;
use datafusion::arrow::datatypes::{DataType, Field, Fields};
use datafusion::common::types::{logical_boolean, logical_date, logical_string, NativeType};
use datafusion::common::{exec_err, internal_err, DataFusionError, Result};
use datafusion::logical_expr::async_udf::{AsyncScalarUDF, AsyncScalarUDFImpl};
use datafusion::logical_expr::{
    Coercion, ColumnarValue, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature, TypeSignature,
    TypeSignatureClass, Volatility,
};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use weir_core::{ErrorKind, Outcome};

use crate::options::CallOptions;
use weir_runtime::{Row, RowResult, Runtime};

/// Which of the four functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UdfKind {
    /// `llm_generate`: the text, NULL on failure.
    Generate,
    /// `llm_generate_result`: a struct with the text or the error, attempts and usage.
    GenerateResult,
    /// `llm_embed`: the vector, NULL on failure.
    Embed,
    /// `llm_embed_result`: a struct with the vector or the error, attempts and usage.
    EmbedResult,
}

impl UdfKind {
    /// Every function.
    pub const ALL: [UdfKind; 4] = [UdfKind::Generate, UdfKind::GenerateResult, UdfKind::Embed, UdfKind::EmbedResult];

    /// The SQL name.
    pub fn name(self) -> &'static str {
        match self {
            UdfKind::Generate => "llm_generate",
            UdfKind::GenerateResult => "llm_generate_result",
            UdfKind::Embed => "llm_embed",
            UdfKind::EmbedResult => "llm_embed_result",
        }
    }

    fn embed(self) -> bool {
        matches!(self, UdfKind::Embed | UdfKind::EmbedResult)
    }
}

/// An embedding: a list of 32-bit floats.
fn vector_type() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Float32, true)))
}

/// The fields of a `_result` struct: the answer (`response` text or `embedding`), then what
/// happened.
fn result_fields(embed: bool) -> Fields {
    let answer = if embed {
        vec![Field::new("embedding", vector_type(), true)]
    } else {
        vec![Field::new("response", DataType::Utf8, true), Field::new("finish_reason", DataType::Utf8, true)]
    };
    let rest = [
        Field::new("error_kind", DataType::Utf8, true),
        Field::new("error_message", DataType::Utf8, true),
        Field::new("attempts", DataType::UInt32, false),
        Field::new("prompt_tokens", DataType::UInt64, true),
        Field::new("output_tokens", DataType::UInt64, true),
        Field::new("model", DataType::Utf8, true),
    ];
    Fields::from_iter(answer.into_iter().chain(rest))
}

/// One of weir's functions over the process's [`Runtime`].
#[derive(Debug)]
pub struct LlmUdf {
    kind: UdfKind,
    functions: Arc<Runtime>,
    signature: Signature,
}

impl PartialEq for LlmUdf {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && Arc::ptr_eq(&self.functions, &other.functions)
    }
}

impl Eq for LlmUdf {}

impl Hash for LlmUdf {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.kind.hash(state);
    }
}

impl LlmUdf {
    /// The function `kind` over `functions`.
    pub fn new(kind: UdfKind, functions: Arc<Runtime>) -> Self {
        // Volatile: two calls of the same prompt may answer differently, and a call must never
        // be folded into a constant at planning time (nor made at all then).
        // Text arguments; a number, a date or a time as a prompt is cast to text
        // (`llm_embed(m, id)`).
        let text = || {
            Coercion::new_implicit(
                TypeSignatureClass::Native(logical_string()),
                vec![
                    TypeSignatureClass::Numeric,
                    TypeSignatureClass::Timestamp,
                    TypeSignatureClass::Time,
                    TypeSignatureClass::Native(logical_date()),
                    TypeSignatureClass::Native(logical_boolean()),
                ],
                NativeType::String,
            )
        };
        // After the options, up to MAX_MEDIA media arguments (a path or URL as text, or the
        // bytes), of any type here: their types are checked when the return type is asked.
        let mut forms = vec![
            TypeSignature::Coercible(vec![text(), text()]),
            TypeSignature::Coercible(vec![text(), text(), text()]),
        ];
        forms.extend((1..=MAX_MEDIA).map(|n| TypeSignature::Any(3 + n)));
        let signature = Signature::one_of(forms, Volatility::Volatile);
        Self { kind, functions, signature }
    }

    /// As a DataFusion scalar function.
    pub fn into_udf(self) -> ScalarUDF {
        AsyncScalarUDF::new(Arc::new(self)).into_scalar_udf()
    }
}

/// The most media arguments a call takes (`llm_generate(model, prompt, options, image, …)`).
pub const MAX_MEDIA: usize = 4;

/// The Arrow type of `llm_generate`'s answers when its options are a literal with a
/// `response_schema`: the schema's type ([`weir_tables::arrow_type_of`]); `None` without one.
fn shaped_type(options: Option<&datafusion::common::ScalarValue>) -> Option<DataType> {
    use datafusion::common::ScalarValue;
    let text = match options? {
        ScalarValue::Utf8(Some(t)) | ScalarValue::LargeUtf8(Some(t)) | ScalarValue::Utf8View(Some(t)) => t,
        _ => return None,
    };
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    // Text too (a `"type": "string"` schema): shaped, a string answer loses its JSON quotes.
    Some(weir_tables::arrow_type_of(v.get("response_schema")?))
}

/// A media argument's value at `row`: a path or URL (text) or the bytes; `None` for NULL.
fn media_at(array: &ArrayRef, row: usize) -> Option<weir_core::media::MediaSource> {
    use weir_core::media::MediaSource;
    if array.is_null(row) {
        return None;
    }
    let named = |s: &str| (!s.trim().is_empty()).then(|| MediaSource::Named(s.trim().to_string()));
    let bytes = |b: &[u8]| (!b.is_empty()).then(|| MediaSource::Bytes(bytes::Bytes::copy_from_slice(b)));
    match array.data_type() {
        DataType::Utf8 => named(array.as_string::<i32>().value(row)),
        DataType::LargeUtf8 => named(array.as_string::<i64>().value(row)),
        DataType::Utf8View => named(array.as_string_view().value(row)),
        DataType::Binary => bytes(array.as_binary::<i32>().value(row)),
        DataType::LargeBinary => bytes(array.as_binary::<i64>().value(row)),
        DataType::BinaryView => bytes(array.as_binary_view().value(row)),
        _ => None,
    }
}

/// True for the types a media argument takes.
fn is_media_type(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Null
            | DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    )
}

/// All four functions over `functions`.
pub(crate) fn all(functions: &Arc<Runtime>) -> Vec<ScalarUDF> {
    UdfKind::ALL.into_iter().map(|k| LlmUdf::new(k, functions.clone()).into_udf()).collect()
}

impl ScalarUDFImpl for LlmUdf {
    fn name(&self) -> &str {
        self.kind.name()
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Ok(match self.kind {
            UdfKind::Generate => DataType::Utf8,
            UdfKind::Embed => vector_type(),
            UdfKind::GenerateResult | UdfKind::EmbedResult => DataType::Struct(result_fields(self.kind.embed())),
        })
    }

    fn return_field_from_args(
        &self,
        args: datafusion::logical_expr::ReturnFieldArgs,
    ) -> Result<datafusion::arrow::datatypes::FieldRef> {
        for (i, f) in args.arg_fields.iter().enumerate().skip(3) {
            if self.kind.embed() {
                return datafusion::common::plan_err!(
                    "{}: takes (model, text[, options]); media arguments are for llm_generate",
                    self.name()
                );
            }
            if !is_media_type(f.data_type()) {
                return datafusion::common::plan_err!(
                    "{}: argument {} is media: a path or URL (text) or the bytes (binary), not {}",
                    self.name(),
                    i + 1,
                    f.data_type()
                );
            }
        }
        let shaped = match self.kind {
            UdfKind::Generate => shaped_type(args.scalar_arguments.get(2).copied().flatten()),
            _ => None,
        };
        let t = match shaped {
            Some(t) => t,
            None => self.return_type(&[])?,
        };
        Ok(Arc::new(Field::new(self.name(), t, true)))
    }

    fn invoke_with_args(&self, _args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        internal_err!("{} is asynchronous and is called through its async form", self.name())
    }
}

/// Argument `i` as UTF-8 strings, one per row.
fn strings(args: &ScalarFunctionArgs, i: usize) -> Result<ArrayRef> {
    let array = args.args[i].to_array(args.number_rows)?;
    Ok(cast(&array, &DataType::Utf8)?)
}

#[async_trait]
impl AsyncScalarUDFImpl for LlmUdf {
    async fn invoke_async_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let name = self.name();
        let models = strings(&args, 0)?;
        let prompts = strings(&args, 1)?;
        let options = if args.args.len() > 2 { Some(strings(&args, 2)?) } else { None };
        let (models, prompts) = (models.as_string::<i32>(), prompts.as_string::<i32>());
        let media: Vec<ArrayRef> =
            args.args.iter().skip(3).map(|a| a.to_array(args.number_rows)).collect::<Result<_>>()?;
        // Options are parsed once per distinct text.
        let mut parsed: HashMap<&str, Arc<CallOptions>> = HashMap::new();
        let default = Arc::new(CallOptions::default());
        let mut rows = Vec::with_capacity(args.number_rows);
        let mut fail_on_error = Vec::with_capacity(args.number_rows);
        for i in 0..args.number_rows {
            let opts = match options.as_ref().map(|o| o.as_string::<i32>()).filter(|o| o.is_valid(i)) {
                Some(o) => {
                    let text = o.value(i);
                    match parsed.get(text) {
                        Some(p) => p.clone(),
                        None => {
                            let p = CallOptions::parse(name, text, self.kind.embed())
                                .map_err(|e| DataFusionError::Plan(e.to_string()))?;
                            let p = Arc::new(p);
                            parsed.insert(text, p.clone());
                            p
                        }
                    }
                }
                None => default.clone(),
            };
            let model = models.is_valid(i).then(|| models.value(i).to_string());
            let prompt = prompts.is_valid(i).then(|| prompts.value(i).to_string());
            fail_on_error.push(opts.fail_on_error);
            let media = media
                .iter()
                .enumerate()
                .filter_map(|(k, a)| {
                    let source = media_at(a, i)?;
                    Some(weir_core::media::MediaRef { field: format!("argument {}", k + 4), source, mime: None })
                })
                .collect();
            rows.push(Row { model, prompt, id: None, call: opts.call.clone(), media });
        }
        #[cfg(feature = "cluster")]
        crate::cancel::count_called(
            &args.config_options,
            rows.iter().filter(|r| r.model.is_some() && r.prompt.is_some()).count() as u64,
        );
        let answer = self.functions.answer_or_stop(rows, self.kind.embed());
        #[cfg(feature = "cluster")]
        let answer = async {
            match crate::cancel::token_of(&args.config_options) {
                Some(token) => tokio::select! {
                    r = answer => r,
                    _ = token.cancelled() => Err("the task was cancelled".to_string()),
                },
                None => answer.await,
            }
        };
        let (results, stopped) = answer.await.map_err(|e| DataFusionError::Configuration(format!("{name}: {e}")))?;
        // A model whose calls stopped early (a rejected key, a spent daily quota, an endpoint
        // gone) would leave every later row NULL: the query fails instead, and a COPY keeps
        // the file it would have replaced.
        if let Some(stop) = stopped {
            return exec_err!(
                "{name}: the calls stopped early ({}: {}); the query is stopped rather than \
                 written with NULLs",
                stop.kind,
                stop.message
            );
        }
        // Fewer calls than the rule that stops a run on rejected credentials needs (a query of
        // one or two rows, each refused): their rows were NULLs and the statement exited 1, where
        // a larger one stops (exit 3). Every call refused for its credentials is that stop.
        let mut done = results.iter().filter_map(|r| match r {
            RowResult::Done(o, _) => Some(o.as_ref()),
            _ => None,
        });
        if let Some(Outcome::Failure(first)) = done.next() {
            if first.error.kind == ErrorKind::Auth
                && done.all(|o| matches!(o, Outcome::Failure(f) if f.error.kind == ErrorKind::Auth))
            {
                return exec_err!(
                    "{name}: the calls stopped early ({}: every call was refused for its credentials: {}); the query \
                     is stopped rather than written with NULLs",
                    first.error.kind,
                    first.error.message
                );
            }
        }
        for (i, r) in results.iter().enumerate() {
            if let (true, RowResult::Done(o, _)) = (fail_on_error[i], r) {
                if let Outcome::Failure(f) = o.as_ref() {
                    // DataFusion does not say where in the table a row came from, so the
                    // row is named by the start of its prompt.
                    let prompt: String = prompts.value(i).chars().take(60).collect();
                    let more = if prompts.value(i).chars().nth(60).is_some() { "…" } else { "" };
                    return exec_err!(
                        "{name}: the row with prompt \"{prompt}{more}\" failed after {} attempt(s) ({}: {}); \
                         fail_on_error is set",
                        f.attempts,
                        f.error.kind,
                        f.error.message
                    );
                }
            }
        }
        // Options given as a literal with a response schema (as `return_field_from_args` saw
        // them): the answers are values of its type, text included (a string without quotes).
        let shaped = match args.args.get(2) {
            Some(ColumnarValue::Scalar(v)) => shaped_type(Some(v)).is_some(),
            _ => false,
        };
        let array: ArrayRef = match self.kind {
            // With a response schema, the answers' JSON as a value of its type.
            UdfKind::Generate if shaped => {
                let answers = results.iter().map(|r| match r {
                    RowResult::Done(o, _) => match o.as_ref() {
                        Outcome::Success(s) => Some(s.response.text.as_str()),
                        Outcome::Failure(_) => None,
                    },
                    RowResult::Null => None,
                });
                weir_tables::shaped_column(answers, args.return_field.data_type())?
            }
            UdfKind::Generate => {
                let mut b = StringBuilder::new();
                for r in &results {
                    match r {
                        RowResult::Done(o, _) => match o.as_ref() {
                            Outcome::Success(s) => b.append_value(&s.response.text),
                            Outcome::Failure(_) => b.append_null(),
                        },
                        RowResult::Null => b.append_null(),
                    }
                }
                Arc::new(b.finish())
            }
            UdfKind::Embed => {
                let mut b = ListBuilder::new(Float32Builder::new());
                for r in &results {
                    match embedding(r) {
                        Some(v) => b.append_value(v.iter().map(|x| Some(*x))),
                        None => b.append_null(),
                    }
                }
                Arc::new(b.finish())
            }
            UdfKind::GenerateResult | UdfKind::EmbedResult => Arc::new(result_struct(&results, self.kind.embed())?),
        };
        Ok(ColumnarValue::Array(array))
    }
}

/// The vector of a successful embedding row.
fn embedding(r: &RowResult) -> Option<&[f32]> {
    match r {
        RowResult::Done(o, _) => match o.as_ref() {
            Outcome::Success(s) => s.response.embedding.as_deref(),
            Outcome::Failure(_) => None,
        },
        RowResult::Null => None,
    }
}

/// The `_result` structs of `results` (NULL where the input was NULL).
fn result_struct(results: &[RowResult], embed: bool) -> Result<StructArray> {
    let mut response = StringBuilder::new();
    let mut finish = StringBuilder::new();
    let mut vectors = ListBuilder::new(Float32Builder::new());
    let (mut kind, mut message, mut model) = (StringBuilder::new(), StringBuilder::new(), StringBuilder::new());
    let mut attempts = UInt32Builder::new();
    let (mut prompt_tokens, mut output_tokens) = (UInt64Builder::new(), UInt64Builder::new());
    let mut valid = Vec::with_capacity(results.len());
    for r in results {
        valid.push(!matches!(r, RowResult::Null));
        match r {
            RowResult::Null => {
                response.append_null();
                finish.append_null();
                vectors.append_null();
                kind.append_null();
                message.append_null();
                attempts.append_value(0);
                prompt_tokens.append_null();
                output_tokens.append_null();
                model.append_null();
            }
            RowResult::Done(o, id) => match o.as_ref() {
                Outcome::Success(s) => {
                    response.append_value(&s.response.text);
                    finish.append_value(&s.response.finish_reason);
                    match &s.response.embedding {
                        Some(v) => vectors.append_value(v.iter().map(|x| Some(*x))),
                        None => vectors.append_null(),
                    }
                    kind.append_null();
                    message.append_null();
                    attempts.append_value(s.attempts);
                    prompt_tokens.append_value(s.response.usage.prompt_tokens);
                    output_tokens.append_value(s.response.usage.output_tokens);
                    model.append_value(&*s.model);
                }
                Outcome::Failure(f) => {
                    response.append_null();
                    finish.append_null();
                    vectors.append_null();
                    kind.append_value(f.error.kind.as_str());
                    message.append_value(&f.error.message);
                    attempts.append_value(f.attempts);
                    prompt_tokens.append_null();
                    output_tokens.append_null();
                    model.append_value(&**id);
                }
            },
        }
    }
    let answer: Vec<ArrayRef> = if embed {
        vec![Arc::new(vectors.finish())]
    } else {
        vec![Arc::new(response.finish()), Arc::new(finish.finish())]
    };
    let rest: [ArrayRef; 6] = [
        Arc::new(kind.finish()),
        Arc::new(message.finish()),
        Arc::new(attempts.finish()),
        Arc::new(prompt_tokens.finish()),
        Arc::new(output_tokens.finish()),
        Arc::new(model.finish()),
    ];
    let arrays: Vec<ArrayRef> = answer.into_iter().chain(rest).collect();
    Ok(StructArray::try_new(result_fields(embed), arrays, Some(NullBuffer::from(valid)))?)
}

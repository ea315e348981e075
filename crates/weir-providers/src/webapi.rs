//! `http/<name>`: any JSON-over-HTTP API called once per record, as Beam's `RequestResponseIO`
//! calls one: a translation, moderation or classification service that is not a language
//! model. A small TOML file (`--http-models FILE`, or `WEIR_HTTP_MODELS`) says for each name the
//! method and URL, the headers (values may take environment variables, which are treated as
//! secrets), a body template over the record's fields, where the answer and the usage are in
//! the response (JSON pointers), and which statuses mean "slow down", "try again" or "give up".
//! Everything else — throttle, retries, cache, resume, tables, SQL, Python — is the engine's,
//! as for every other model.
//!
//! ```toml
//! [models.translate]
//! url = "https://translation.example.com/v2/translate"
//! headers = { Authorization = "Bearer ${TRANSLATE_KEY}" }
//! body = { q = "{prompt}", target = "de" }
//! answer = "/data/translations/0/translatedText"
//! ```
//!
//! Keys go in headers (`${VAR}` there reads the environment); the URL is written as is, with
//! placeholders after its host.
//!
//! Templates hold `{name}` placeholders: `{prompt}` (the record's prompt, as `--prompt-field` or
//! `--prompt-template` make it), `{system}`, or any field of the record. In the body, a string
//! that is a placeholder alone takes the field's JSON value (a number stays a number); inside
//! other text it takes the value's text. In the URL the text is percent-encoded. `{{` and `}}`
//! are literal braces.

use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use weir_core::{ErrorKind, ModelError, ModelHandler, ModelRequest, ModelResponse, RetryHint, Usage};

use crate::http::{clip, Reply, Secret};
use crate::ProviderError;

/// The environment variable naming the models file when `--http-models` is not given.
pub const MODELS_VAR: &str = "WEIR_HTTP_MODELS";

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    models: BTreeMap<String, RawModel>,
}

/// One model as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    url: String,
    #[serde(default)]
    method: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: Option<toml::Value>,
    answer: String,
    #[serde(default)]
    prompt_tokens: Option<String>,
    #[serde(default)]
    output_tokens: Option<String>,
    #[serde(default)]
    retry_later: Option<Vec<u16>>,
    #[serde(default)]
    retry: Option<Vec<u16>>,
    #[serde(default)]
    permanent: Option<Vec<u16>>,
}

use weir_core::TemplatePiece as Piece;

/// How a value's text is put into a template: told the placeholder's name and whether it stands
/// after a `?`, and given the text.
type Escape<'a> = dyn Fn((&str, bool), &str) -> Result<String, ModelError> + 'a;

/// A string with `{name}` placeholders (`{{`, `}}`: literal braces), read as prompt templates
/// are ([`weir_core::template_pieces`]).
#[derive(Debug, Clone, PartialEq)]
struct Text(Vec<Piece>);

impl Text {
    fn parse(s: &str, at: &str) -> Result<Self, String> {
        weir_core::template_pieces(s).map(Self).map_err(|e| format!("{at}: {e}"))
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().filter_map(|p| match p {
            Piece::Field(n) => Some(n.as_str()),
            Piece::Text(_) => None,
        })
    }

    /// The text with each placeholder's value as it is.
    fn render(&self, vars: &Vars<'_>) -> Result<String, ModelError> {
        self.render_with(vars, &|_, text| Ok(text.to_string()))
    }

    /// The URL with each placeholder's value percent-encoded. A value that is `.` or `..` in
    /// the path is refused: it would name another path of the API (`/v2/../admin`).
    fn render_url(&self, vars: &Vars<'_>) -> Result<String, ModelError> {
        self.render_with(vars, &|(name, in_query), text| {
            if !in_query && matches!(text, "" | "." | "..") {
                return Err(ModelError::new(
                    ErrorKind::InvalidInput,
                    format!("the record's field '{name}' is '{text}', which cannot stand in the http model's URL path"),
                ));
            }
            Ok(percent_encoding::utf8_percent_encode(text, crate::http::UNRESERVED).to_string())
        })
    }

    /// The text with each placeholder's value's text through `escape`, told the placeholder's
    /// name and whether it stands after a `?`.
    fn render_with(&self, vars: &Vars<'_>, escape: &Escape<'_>) -> Result<String, ModelError> {
        let mut out = String::new();
        let mut in_query = false;
        for p in &self.0 {
            match p {
                Piece::Text(t) => {
                    in_query |= t.contains('?');
                    out.push_str(t)
                }
                // Inside text a null has no text (as in prompt templates); alone in the body it
                // is the JSON null.
                Piece::Field(n) => match vars.get(n)? {
                    Value::Null => {
                        return Err(ModelError::new(
                            ErrorKind::InvalidInput,
                            format!("the record's field '{n}' is null, and the http model's template puts it in text"),
                        ))
                    }
                    v => out.push_str(&escape((n, in_query), &text_of(&v))?),
                },
            }
        }
        Ok(out)
    }

    /// The placeholder's name, when the template is one placeholder and nothing else.
    fn alone(&self) -> Option<&str> {
        match self.0.as_slice() {
            [Piece::Field(n)] => Some(n),
            _ => None,
        }
    }
}

/// A value's text: a string as it is, anything else as JSON.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A JSON body whose strings (and keys) are templates.
#[derive(Debug, Clone)]
enum Body {
    Text(Text),
    Array(Vec<Body>),
    Object(Vec<(Text, Body)>),
    Other(Value),
}

impl Body {
    fn parse(v: &Value, at: &str) -> Result<Self, String> {
        Ok(match v {
            Value::String(s) => Body::Text(Text::parse(s, at)?),
            Value::Array(a) => Body::Array(
                a.iter().enumerate().map(|(i, x)| Body::parse(x, &format!("{at}[{i}]"))).collect::<Result<_, _>>()?,
            ),
            Value::Object(o) => Body::Object(
                o.iter()
                    .map(|(k, x)| Ok((Text::parse(k, at)?, Body::parse(x, &format!("{at}.{k}"))?)))
                    .collect::<Result<_, String>>()?,
            ),
            other => Body::Other(other.clone()),
        })
    }

    fn names<'a>(&'a self, out: &mut BTreeSet<&'a str>) {
        match self {
            Body::Text(t) => out.extend(t.names()),
            Body::Array(a) => a.iter().for_each(|b| b.names(out)),
            Body::Object(o) => o.iter().for_each(|(k, b)| {
                out.extend(k.names());
                b.names(out)
            }),
            Body::Other(_) => {}
        }
    }

    fn render(&self, vars: &Vars<'_>) -> Result<Value, ModelError> {
        Ok(match self {
            Body::Text(t) => match t.alone() {
                Some(name) => vars.get(name)?,
                None => Value::String(t.render(vars)?),
            },
            Body::Array(a) => Value::Array(a.iter().map(|b| b.render(vars)).collect::<Result<_, _>>()?),
            Body::Object(o) => {
                let mut m = Map::new();
                for (k, b) in o {
                    let key = k.render(vars)?;
                    // A key from a field may not replace one the file writes (or another's).
                    if m.insert(key.clone(), b.render(vars)?).is_some() {
                        return Err(ModelError::new(
                            ErrorKind::InvalidInput,
                            format!(
                                "the http model's body would have the key '{}' twice (a key comes from the record)",
                                clip(&key)
                            ),
                        ));
                    }
                }
                Value::Object(m)
            }
            Body::Other(v) => v.clone(),
        })
    }
}

/// What placeholders name, for one request.
struct Vars<'a> {
    request: &'a ModelRequest,
}

impl Vars<'_> {
    fn get(&self, name: &str) -> Result<Value, ModelError> {
        match name {
            "prompt" => Ok(Value::String(self.request.prompt.clone())),
            "system" => Ok(Value::String(self.request.system.as_deref().unwrap_or("").to_string())),
            field => self.request.fields.as_ref().and_then(|f| f.get(field)).cloned().ok_or_else(|| {
                ModelError::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "the record has no field '{field}', which the http model's template names (weir sql and \
                         Python give templates {{prompt}} and {{system}} only)"
                    ),
                )
            }),
        }
    }
}

/// How an answer's status is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Slow down: a rate limit (waits as `Retry-After` says; the throttle learns from it).
    Later,
    /// Try again after a back-off.
    Retry,
    /// Give up on the record.
    Permanent,
}

/// One `http/<name>` model, checked.
#[derive(Debug)]
struct Spec {
    method: reqwest::Method,
    url: Text,
    /// The URL up to its first placeholder or query, and a digest of the request's shape: the
    /// cache's and the quota's name of the endpoint.
    endpoint: String,
    headers: Vec<(reqwest::header::HeaderName, String)>,
    secrets: Vec<Secret>,
    body: Option<Body>,
    answer: String,
    prompt_tokens: Option<String>,
    output_tokens: Option<String>,
    classes: BTreeMap<u16, Class>,
    fields: Vec<String>,
    /// Whether the url or body names `{system}`.
    takes_system: bool,
    /// The model's name in the file, for messages.
    name: String,
}

fn pointer(p: &str, at: &str) -> Result<String, String> {
    // `~` escapes only `~0` (a ~) and `~1` (a /) in a JSON pointer; anything else finds nothing.
    let bad_escape = p.match_indices('~').any(|(i, _)| !matches!(p.as_bytes().get(i + 1), Some(b'0' | b'1')));
    if bad_escape {
        Err(format!("{at}: '{p}' has a '~' that is not ~0 (a ~) or ~1 (a /), the only escapes of a JSON pointer"))
    } else if p.is_empty() || p.starts_with('/') {
        Ok(p.to_string())
    } else {
        Err(format!(
            "{at}: '{p}' is not a JSON pointer (it starts with '/', e.g. /data/0/text; \"\" is the whole answer)"
        ))
    }
}

/// `${VAR}` in `value` replaced by the variable's value (each a secret); `$$` is a `$`.
fn expand(
    value: &str,
    at: &str,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<(String, Vec<Secret>), String> {
    let mut out = String::new();
    let mut secrets = Vec::new();
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push('$');
            rest = r;
        } else if let Some(r) = after.strip_prefix('{') {
            let end = r.find('}').ok_or_else(|| format!("{at}: '${{' is not closed by '}}'"))?;
            let var = &r[..end];
            let v = env(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("{at}: the environment variable {var} is not set (or empty)"))?;
            // Whitespace around it is a key file's newline; inside, only spaces and printable
            // ASCII go in a header as written (a non-ASCII letter was sent as Latin-1).
            if let Some((i, _)) = crate::unprintable(&v, true) {
                return Err(format!(
                    "{at}: the environment variable {var} holds a control or non-ASCII character at character {i} of \
                     {}; check how it was set",
                    v.chars().count()
                ));
            }
            out.push_str(&v);
            secrets.push(Secret::new(v));
            rest = &r[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok((out, secrets))
}

/// Headers the HTTP client sets itself, from the URL and the body.
const FRAMING_HEADERS: [&str; 9] =
    ["host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te", "trailer", "expect"];

/// Whether a header (its lowercase name) carries a credential: its `${VAR}` values are secrets.
fn is_credential(name: &str) -> bool {
    matches!(name, "authorization" | "proxy-authorization" | "cookie")
        || ["key", "token", "secret", "auth", "signature", "password", "credential", "session"]
            .iter()
            .any(|w| name.contains(w))
}

/// The model's description for the cache and a run's identity: the digest of how it is written,
/// then each setting its non-credential headers read from the environment (they shape the
/// answers too: a model version, a tenant) as `;header=digest`, so that a run refused after
/// one changed says which.
fn described(shape: String, settings: &[(String, String)]) -> String {
    let mut out = shape;
    for (header, value) in settings {
        out.push_str(&format!(";{header}={}", digest_of(&Value::String(value.clone()))));
    }
    out
}

/// The values of `raw`'s non-credential headers that read `${VAR}`s, read from `env` (those
/// that cannot be read are left out: connecting says why).
fn settings_of(raw: &RawModel, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Vec<(String, String)> {
    raw.headers
        .iter()
        .filter(|(k, v)| v.contains("${") && !is_credential(&k.to_ascii_lowercase()))
        .filter_map(|(k, v)| expand(v, k, env).ok().map(|(value, _)| (k.clone(), value)))
        .collect()
}

/// A short digest of `v`'s JSON text.
fn digest_of(v: &Value) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, v.to_string().as_bytes());
    hex::encode(&digest.as_ref()[..6])
}

impl RawModel {
    /// A digest of everything that shapes a request and reads its answer as written (headers
    /// with their variables' names, never their values): a models file changed between runs (a
    /// target language, another pointer) is another source of answers, for the response cache
    /// and for resuming a run.
    fn shape(&self) -> String {
        let shape = serde_json::json!([
            self.method.as_deref().unwrap_or("POST").to_ascii_uppercase(),
            self.url,
            self.headers,
            self.body.as_ref().map(|b| serde_json::to_value(b).unwrap_or_default()),
            self.answer,
            self.prompt_tokens,
            self.output_tokens,
        ]);
        digest_of(&shape)
    }
}

impl Spec {
    fn check(name: &str, raw: RawModel, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Result<Self, String> {
        let at = |what: &str| format!("models.{name}.{what}");
        let method = match raw.method.as_deref().map(str::to_ascii_uppercase).as_deref() {
            None | Some("POST") => reqwest::Method::POST,
            Some("GET") => reqwest::Method::GET,
            Some("PUT") => reqwest::Method::PUT,
            Some(other) => return Err(format!("{}: '{other}' is not GET, POST or PUT", at("method"))),
        };
        // A value written into the URL's query (`?key=…`, as some APIs take keys; or a
        // setting such as `api-version=…`) is masked as a header's written key is: in this
        // file's errors, and wherever a server echoes the URL.
        let written_query: Vec<Secret> = match raw.url.split('#').next().unwrap_or("").split_once('?') {
            Some((_, query)) => query
                .split('&')
                .filter_map(|pair| pair.split_once('=').map(|(_, v)| v))
                .filter(|v| v.len() >= 8 && !v.contains('{'))
                .map(|v| Secret::new(v.to_string()))
                .collect(),
            None => Vec::new(),
        };
        let url = Text::parse(&raw.url, &at("url")).map_err(|e| crate::http::mask(&e, &written_query))?;
        // Where the calls go, written out before any placeholder or query: https, or plain
        // http to this machine only (a field may not choose the host).
        let endpoint = raw.url.split(['?', '#', '{']).next().unwrap_or("").to_string();
        let whole = endpoint.len() == raw.url.split(['?', '#']).next().unwrap_or("").len();
        if !whole && !endpoint.split_once("://").is_some_and(|(_, rest)| rest.contains('/')) {
            return Err(format!("{}: the scheme and host must be written out, not come from a field", at("url")));
        }
        crate::http::check_base_url(&endpoint).map_err(|e| {
            let e = e.to_string().replacen("--base-url ", "", 1);
            let e = e.replace("use the API key variables", "put a key in a header, as ${VAR}");
            format!("{}: {e}", at("url"))
        })?;
        // `${VAR}` reads the environment in headers only: in the URL or body it would be taken
        // for the record's field VAR, missing from every record.
        let body_text = raw.body.as_ref().map(|b| serde_json::to_string(b).unwrap_or_default()).unwrap_or_default();
        // (`${{x}}` is a literal `${x}`: braces doubled are literal.)
        let reads_env = |t: &str| t.match_indices("${").any(|(i, _)| !t[i + 2..].starts_with('{'));
        if reads_env(&raw.url) || reads_env(&body_text) {
            return Err(format!(
                "models.{name}: ${{VAR}} reads the environment in headers only (keys go in a header); the url and \
                 body take {{field}} placeholders from the record"
            ));
        }
        // The endpoint names the answers' source for the response cache, with the digest of the
        // model as written (see `shape`).
        let shape = raw.shape();
        let mut headers = Vec::new();
        let mut secrets = Vec::new();
        let settings = settings_of(&raw, env);
        for (k, v) in &raw.headers {
            let header = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| format!("{}: '{k}' is not a header name", at("headers")))?;
            // Framing and routing are the HTTP client's: a Content-Length of its own cut the
            // body (and desynchronised the connection), a Host sent the call elsewhere.
            if FRAMING_HEADERS.contains(&header.as_str()) {
                return Err(format!(
                    "{}: {k} is set by weir's HTTP client from the url and body, not in headers",
                    at("headers")
                ));
            }
            // Header values are not templates: a `{field}` there would be sent as written.
            let without_vars: String = v
                .split("${")
                .enumerate()
                .map(|(i, part)| if i == 0 { part } else { part.split_once('}').map_or(part, |(_, rest)| rest) })
                .collect();
            if weir_core::template_pieces(&without_vars).is_ok_and(|p| {
                p.iter().any(
                    |p| matches!(p, Piece::Field(n) if n.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c))),
                )
            }) {
                return Err(format!(
                    "{}: header values take no {{field}} placeholders (a record's field goes in the url or body); \
                     ${{VAR}} reads the environment",
                    at(&format!("headers.{k}"))
                ));
            }
            let (value, s) = expand(v, &at(&format!("headers.{k}")), env)?;
            // A variable in a header that carries a credential is a secret (masked wherever a
            // server echoes it, kept out of the run's identity); in any other header it is a
            // setting, which shapes the answers: part of the model's description.
            // A credential written into the file itself (no `${VAR}`) is masked as well: the
            // words of such a header long enough to be a key (not its scheme, `Bearer`).
            let s = if is_credential(header.as_str()) {
                let written = without_vars.split_whitespace().filter(|w| w.len() >= 8);
                s.into_iter().chain(written.map(|w| Secret::new(w.to_string()))).collect()
            } else {
                Vec::new()
            };
            reqwest::header::HeaderValue::from_str(&value)
                .map_err(|_| format!("{}: not a header value (a control character?)", at(&format!("headers.{k}"))))?;
            headers.push((header, value));
            secrets.extend(s);
        }
        secrets.extend(written_query);
        let endpoint = format!("{endpoint}#{}", described(shape, &settings));
        let body = match raw.body {
            None => None,
            // A table is the JSON body; a string holds the JSON text.
            Some(toml::Value::String(s)) => {
                let v: Value = serde_json::from_str(&s).map_err(|e| format!("{}: not JSON: {e}", at("body")))?;
                Some(Body::parse(&v, &at("body"))?)
            }
            Some(t) => {
                let v = serde_json::to_value(t).map_err(|e| format!("{}: {e}", at("body")))?;
                Some(Body::parse(&v, &at("body"))?)
            }
        };
        if body.is_some() && method == reqwest::Method::GET {
            return Err(format!("{}: a GET request has no body; put the fields in the URL", at("body")));
        }
        // The defaults of lists not given, then the lists given, which override them.
        let lists = [
            (raw.retry_later, Class::Later, vec![429]),
            (raw.retry, Class::Retry, [408, 500, 502, 503, 504].to_vec()),
            (raw.permanent, Class::Permanent, vec![]),
        ];
        let mut classes = BTreeMap::new();
        for (list, class, default) in &lists {
            if list.is_none() {
                classes.extend(default.iter().map(|s| (*s, *class)));
            }
        }
        let mut given = BTreeMap::new();
        for (list, class, _) in &lists {
            for s in list.iter().flatten().copied() {
                if (300..=399).contains(&s) {
                    return Err(format!(
                        "models.{name}: {s} is a redirect, which weir never follows (it could carry the key to \
                         another host) and which stops the run: it goes in no list"
                    ));
                }
                if !(400..=599).contains(&s) {
                    return Err(format!("models.{name}: {s} is not an error status (400-599)"));
                }
                if given.insert(s, *class).is_some_and(|c| c != *class) {
                    return Err(format!("models.{name}: status {s} is in two of retry_later, retry and permanent"));
                }
                classes.insert(s, *class);
            }
        }
        let mut names = BTreeSet::new();
        names.extend(url.names());
        if let Some(b) = &body {
            b.names(&mut names);
        }
        let takes_system = names.contains("system");
        let fields = names.into_iter().filter(|n| !matches!(*n, "prompt" | "system")).map(str::to_string).collect();
        Ok(Self {
            method,
            url,
            endpoint,
            headers,
            secrets,
            body,
            answer: pointer(&raw.answer, &at("answer"))?,
            prompt_tokens: raw.prompt_tokens.as_deref().map(|p| pointer(p, &at("prompt_tokens"))).transpose()?,
            output_tokens: raw.output_tokens.as_deref().map(|p| pointer(p, &at("output_tokens"))).transpose()?,
            classes,
            fields,
            takes_system,
            name: name.to_string(),
        })
    }
}

/// The models file (`path`, else [`MODELS_VAR`]) as written; None when there is none or it
/// cannot be read (connecting says why).
fn read_file(path: Option<&str>, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Option<RawFile> {
    let path = path.map(str::to_string).or_else(|| env(MODELS_VAR))?;
    std::fs::read_to_string(&path).ok().and_then(|t| toml::from_str::<RawFile>(&t).ok())
}

/// The environment variables the models file (`path`, else [`MODELS_VAR`]) reads in its
/// headers: a front end that hands the providers a snapshot of the environment takes these too.
/// None when there is no file or it cannot be read (connecting says why).
pub fn variables(path: Option<&str>, env: &(dyn Fn(&str) -> Option<String> + Sync)) -> Vec<String> {
    let Some(file) = read_file(path, env) else { return Vec::new() };
    let mut names = BTreeSet::new();
    for value in file.models.values().flat_map(|m| m.headers.values()) {
        for part in value.split("${").skip(1) {
            if let Some((name, _)) = part.split_once('}') {
                names.insert(name.to_string());
            }
        }
    }
    names.into_iter().collect()
}

/// The placeholders model `name`'s URL and body name (`prompt`, `system`, record fields), when
/// the models file (`path`, else [`MODELS_VAR`]) describes it well enough to tell: a front end
/// checks with them that its prompt and system flags are used at all.
pub fn placeholders(
    name: &str,
    path: Option<&str>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Option<BTreeSet<String>> {
    let raw = read_file(path, env)?.models.remove(name)?;
    let spec = Spec::check(name, raw, &|_| Some("x".to_string())).ok()?;
    let mut names: BTreeSet<String> = spec.url.names().map(str::to_string).collect();
    if let Some(b) = &spec.body {
        let mut in_body = BTreeSet::new();
        b.names(&mut in_body);
        names.extend(in_body.into_iter().map(str::to_string));
    }
    Some(names)
}

/// Each model of the models file (`path`, else [`MODELS_VAR`]) as `name#digest` of how it is
/// written (names given: those; none: every model), for a run's identity: a run resumed after
/// its model's body or pointers were edited would mix the old answers with the new ones.
pub fn shapes(
    names: Option<&[&str]>,
    path: Option<&str>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Vec<String> {
    let Some(file) = read_file(path, env) else { return Vec::new() };
    file.models
        .iter()
        .filter(|(n, _)| names.is_none_or(|names| names.contains(&n.as_str())))
        .map(|(n, m)| format!("{n}#{}", described(m.shape(), &settings_of(m, env))))
        .collect()
}

/// The model `name` from the models file (`path`, else [`MODELS_VAR`]), with its header
/// variables read from `env`.
pub fn connect(
    name: &str,
    path: Option<&str>,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> Result<HttpModel, ProviderError> {
    let path =
        path.map(str::to_string).or_else(|| env(MODELS_VAR).filter(|p| !p.trim().is_empty())).ok_or_else(|| {
            ProviderError::Config(format!(
                "--model http/{name}: say where http models are described with --http-models FILE (or {MODELS_VAR})"
            ))
        })?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ProviderError::Config(format!("--http-models {path}: cannot read it: {e}")))?;
    let file: RawFile = toml::from_str(&text)
        .map_err(|e| ProviderError::Config(format!("--http-models {path}: {}", crate::toml_error(&text, &e))))?;
    let known: Vec<String> = file.models.keys().cloned().collect();
    let mut models = file.models;
    let raw = models.remove(name).ok_or_else(|| {
        ProviderError::Config(format!(
            "--model http/{name}: {path} has no [models.{name}] (it has: {})",
            if known.is_empty() { "none".to_string() } else { known.join(", ") }
        ))
    })?;
    let spec = Spec::check(name, raw, env).map_err(|e| ProviderError::Config(format!("--http-models {path}: {e}")))?;
    let client = crate::http::client()?;
    Ok(HttpModel {
        missed: Default::default(),
        client,
        model_id: format!("http/{name}"),
        quota: spec.secrets.iter().map(|s| s.expose().to_string()).collect::<Vec<_>>().join("\n"),
        spec,
    })
}

/// A client of one `http/<name>` model.
#[derive(Debug)]
pub struct HttpModel {
    client: reqwest::Client,
    model_id: String,
    /// The secrets the calls carry, joined: what tells this quota from another key's.
    quota: String,
    spec: Spec,
    /// Answers with nothing at `answer` since the run started, while none has had something
    /// there (`u32::MAX` once one has): see [`MISSED_FROM_THE_START`].
    missed: std::sync::atomic::AtomicU32,
}

/// Answers in a row, from the start of a run, with nothing at `answer` that stop the run: the
/// pointer is most likely wrong (a typo in the models file), and every record would otherwise
/// be paid for `--max-retries` + 1 times before failing (a tester's 20 records: 180 calls,
/// every one answered 2xx). Once an answer has had something there, a miss is that answer's
/// (`malformed_response`, tried again).
const MISSED_FROM_THE_START: u32 = 3;

impl HttpModel {
    /// The request for `request`: its URL and body.
    fn build(&self, request: &ModelRequest) -> Result<(String, Option<bytes::Bytes>), ModelError> {
        // System text this model has no place for (a record `--model-field` routed here, in a
        // run given --system or --system-field): the record's error, not text dropped in silence.
        if request.system.as_deref().is_some_and(|s| !s.is_empty()) && !self.spec.takes_system {
            return Err(ModelError::new(
                ErrorKind::InvalidInput,
                format!(
                    "--system and --system-field do not apply to http/{}: its url and body name no {{system}}",
                    self.spec.name
                ),
            ));
        }
        let vars = Vars { request };
        let url = self.spec.url.render_url(&vars)?;
        let body = match &self.spec.body {
            Some(b) => Some(bytes::Bytes::from(serde_json::to_vec(&b.render(&vars)?).unwrap_or_default())),
            None => None,
        };
        Ok((url, body))
    }

    /// Masks every secret the calls carry in `e`'s message.
    fn redacted(&self, mut e: ModelError) -> ModelError {
        e.message = self.masked(&e.message);
        e
    }

    /// `text` with every secret the calls carry masked, in any form an API may echo it (an
    /// echo service answers with the request's headers).
    fn masked(&self, text: &str) -> String {
        crate::http::mask(text, &self.spec.secrets)
    }

    /// An answer other than 2xx, taken as the model's file says.
    fn classify(&self, reply: &Reply) -> ModelError {
        let status = reply.status;
        // A JSON body is masked string by string (an escaped key inside a string that is
        // itself JSON is found there), then as text; masked before it is cut, so that no part
        // of a secret is left at the cut.
        let text = match serde_json::from_slice::<Value>(&reply.body) {
            Ok(mut v) => {
                crate::http::mask_value(&mut v, &self.spec.secrets);
                v.to_string()
            }
            Err(_) => String::from_utf8_lossy(&reply.body).into_owned(),
        };
        let text = self.masked(&text);
        let message = clip(&format!("HTTP {status}: {}", text.trim()));
        let e = crate::http::status_error(status, &reply.headers, message.clone());
        match self.spec.classes.get(&status) {
            Some(Class::Later) => ModelError {
                kind: ErrorKind::RateLimited,
                hint: RetryHint::Later(crate::http::retry_after(&reply.headers)),
                ..e
            },
            // After the wait a `Retry-After` asks for, if the answer gives one (a 503 often does).
            Some(Class::Retry) => ModelError {
                kind: ErrorKind::Server,
                hint: match crate::http::retry_after(&reply.headers) {
                    Some(d) => RetryHint::Later(Some(d)),
                    None => RetryHint::Backoff,
                },
                ..e
            },
            Some(Class::Permanent) => ModelError { kind: ErrorKind::BadRequest, hint: RetryHint::Never, ..e },
            // Not listed: a redirect and a rejected key stop the run, as for every provider.
            None if (300..400).contains(&status) || matches!(status, 401 | 403) => e,
            // A URL the records fill in names a record's resource: not found is that record's.
            // A fixed URL not found (or not taking the method) fails every record alike: the
            // run stops, and its records are tried again once the url is put right.
            None if matches!(status, 404 | 405) && self.spec.url.names().next().is_none() => ModelError::new(
                ErrorKind::Endpoint,
                format!(
                    "{message} (the url of models.{} was not found or takes no {})",
                    self.spec.name, self.spec.method
                ),
            )
            .with_hint(RetryHint::StopRun)
            .with_status(status),
            // Any other status is the record's error, as the file's lists leave it: retried only
            // when listed. A 5xx keeps its kind (`server`), so `--retry-errors` runs it again.
            None if status >= 500 => ModelError { kind: ErrorKind::Server, hint: RetryHint::Never, ..e },
            None => ModelError::new(ErrorKind::BadRequest, message).with_status(status),
        }
    }

    fn parse(&self, body: &[u8]) -> Result<ModelResponse, ModelError> {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| ModelError::new(ErrorKind::MalformedResponse, format!("the answer is not JSON: {e}")))?;
        use std::sync::atomic::Ordering::Relaxed;
        let answer = v.pointer(&self.spec.answer).filter(|a| !a.is_null()).cloned().ok_or_else(|| {
            let mut v = v.clone();
            crate::http::mask_value(&mut v, &self.spec.secrets);
            let said =
                clip(&format!("the answer has nothing at {}: {}", self.spec.answer, self.masked(&v.to_string())));
            let missed = self.missed.fetch_update(Relaxed, Relaxed, |n| (n != u32::MAX).then(|| n + 1));
            match missed {
                Ok(n) if n + 1 >= MISSED_FROM_THE_START => ModelError::new(
                    ErrorKind::Endpoint,
                    format!(
                        "{said} (the first {} answers of the run all had nothing at models.{}'s answer pointer: \
                         put it right in the models file; the records are tried again by the next run)",
                        n + 1,
                        self.spec.name
                    ),
                )
                .with_hint(RetryHint::StopRun),
                _ => ModelError::new(ErrorKind::MalformedResponse, said),
            }
        })?;
        self.missed.store(u32::MAX, Relaxed);
        // An answer that is an object is masked string by string, then as the text written.
        let mut answer = answer;
        crate::http::mask_value(&mut answer, &self.spec.secrets);
        let count = |p: &Option<String>| p.as_deref().and_then(|p| v.pointer(p)).and_then(Value::as_u64).unwrap_or(0);
        let (prompt_tokens, output_tokens) = (count(&self.spec.prompt_tokens), count(&self.spec.output_tokens));
        Ok(ModelResponse {
            text: self.masked(&text_of(&answer)),
            finish_reason: "stop".into(),
            usage: Usage { prompt_tokens, output_tokens, total_tokens: prompt_tokens + output_tokens },
            model_version: None,
            limits: None,
            embedding: None,
        })
    }
}

#[async_trait::async_trait]
impl ModelHandler for HttpModel {
    async fn generate(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let (url, body) = self.build(request)?;
        let build = || {
            let mut req = self.client.request(self.spec.method.clone(), &url);
            for (k, v) in &self.spec.headers {
                req = req.header(k, v);
            }
            match &body {
                Some(b) if self.spec.headers.iter().any(|(k, _)| k == reqwest::header::CONTENT_TYPE) => {
                    req.body(b.clone())
                }
                Some(b) => req.header(reqwest::header::CONTENT_TYPE, "application/json").body(b.clone()),
                None => req,
            }
        };
        let resp = build().send().await.map_err(|e| self.redacted(crate::http::transport_error(&e)))?;
        let reply = crate::http::read_answer(resp).await.map_err(|e| self.redacted(e))?;
        if !(200..300).contains(&reply.status) {
            return Err(self.redacted(self.classify(&reply)));
        }
        self.parse(&reply.body).map_err(|e| self.redacted(e))
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn endpoint(&self) -> &str {
        &self.spec.endpoint
    }

    fn record_fields(&self) -> &[String] {
        &self.spec.fields
    }

    fn quota_credential(&self) -> Option<&str> {
        (!self.quota.is_empty()).then_some(self.quota.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn model(toml_text: &str, env: &[(&str, &str)]) -> Result<HttpModel, String> {
        let raw: RawFile = toml::from_str(toml_text).map_err(|e| e.to_string())?;
        let (name, raw) = raw.models.into_iter().next().unwrap();
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let get = move |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let spec = Spec::check(&name, raw, &get)?;
        Ok(HttpModel {
            client: reqwest::Client::new(),
            model_id: format!("http/{name}"),
            quota: String::new(),
            spec,
            missed: Default::default(),
        })
    }

    fn request(prompt: &str, fields: Value) -> ModelRequest {
        ModelRequest {
            prompt: prompt.into(),
            system: None,
            params: Default::default(),
            media: Vec::new().into(),
            fields: fields.as_object().cloned().map(Arc::new),
        }
    }

    #[test]
    fn bodies_and_urls_are_rendered_from_the_record() {
        let m = model(
            r#"[models.t]
url = "http://127.0.0.1:9/v2/{lang}/translate?q={prompt}"
headers = { Authorization = "Bearer ${KEY}", X-Fixed = "a$$b" }
body = { q = "{prompt}", n = "{n}", tags = ["{lang}", "x {n} y"], "{lang}" = 1, braces = "{{lit}}" }
answer = "/data/0/text"
"#,
            &[("KEY", "s3cret")],
        )
        .unwrap();
        assert_eq!(m.record_fields(), ["lang", "n"]);
        assert!(m.endpoint().starts_with("http://127.0.0.1:9/v2/#"), "{}", m.endpoint());
        // Another body is another source of answers (the cache keeps them apart).
        let other = model(
            "[models.t]\nurl = \"http://127.0.0.1:9/v2/{lang}/translate?q={prompt}\"\nanswer = \"/data/0/text\"\n",
            &[],
        )
        .unwrap();
        assert_ne!(m.endpoint(), other.endpoint());
        let (url, body) = m.build(&request("a b&c", serde_json::json!({"lang": "de/at", "n": 7}))).unwrap();
        assert_eq!(url, "http://127.0.0.1:9/v2/de%2Fat/translate?q=a%20b%26c");
        // Unreserved characters stay as they are (servers that route on the raw path).
        let (url, _) = m.build(&request("a-b.c_d~e", serde_json::json!({"lang": "pt_BR", "n": 1}))).unwrap();
        assert_eq!(url, "http://127.0.0.1:9/v2/pt_BR/translate?q=a-b.c_d~e");
        // A dot segment from a field would name another path of the API; in the query it is text.
        for dots in ["", ".", ".."] {
            let e = m.build(&request("p", serde_json::json!({"lang": dots, "n": 1}))).unwrap_err();
            assert!(e.kind == ErrorKind::InvalidInput && e.message.contains("URL path"), "{e}");
        }
        assert!(m.build(&request("..", serde_json::json!({"lang": "de", "n": 1}))).unwrap().0.ends_with("q=.."));
        // A key from a field may not replace a key the file writes.
        let e = m.build(&request("p", serde_json::json!({"lang": "q", "n": 1}))).unwrap_err();
        assert!(e.kind == ErrorKind::InvalidInput && e.message.contains("'q' twice"), "{e}");
        let body: Value = serde_json::from_slice(&body.unwrap()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"q": "a b&c", "n": 7, "tags": ["de/at", "x 7 y"], "de/at": 1, "braces": "{lit}"})
        );
        assert_eq!(m.spec.headers[0].1, "Bearer s3cret");
        assert_eq!(m.spec.headers[1].1, "a$b");
        let null = m.build(&request("p", serde_json::json!({"lang": null, "n": 1}))).unwrap_err();
        assert!(null.kind == ErrorKind::InvalidInput && null.message.contains("'lang' is null"), "{null}");
        let missing = m.build(&request("p", serde_json::json!({"lang": "de"}))).unwrap_err();
        assert_eq!(missing.kind, ErrorKind::InvalidInput);
        assert!(missing.message.contains("'n'"), "{missing}");
    }

    #[test]
    fn bad_models_are_refused_saying_what_to_fix() {
        let base = "url = \"https://api.example.com/x\"\nanswer = \"/a\"\n";
        for (extra, says) in [
            ("method = \"DELETE\"", "is not GET, POST or PUT"),
            ("headers = { A = \"${NOPE}\" }", "NOPE is not set"),
            ("body = \"{not json\"", "not JSON"),
            ("body = { q = \"{unclosed\" }", "unclosed '{'"),
            ("retry = [429]\nretry_later = [429]", "two of"),
            ("retry = [200]", "not an error status"),
            ("colour = 1", "unknown field"),
            ("body = { q = \"${KEY}\" }", "headers only"),
            ("body = { q = \"$${KEY}\" }", "headers only"),
            ("headers = { X-Lang = \"{lang}\" }", "no {field} placeholders"),
            ("prompt_tokens = \"/a~2b\"", "~0"),
            ("headers = { Content-Length = \"5\" }", "set by weir's HTTP client"),
            ("headers = { host = \"evil.example.com\" }", "set by weir's HTTP client"),
        ] {
            let e = model(&format!("[models.m]\n{base}{extra}\n"), &[]).err().unwrap();
            assert!(e.contains(says), "{extra}: {e}");
        }
        let e = model("[models.m]\nurl = \"http://example.com/x\"\nanswer = \"/a\"\n", &[]).err().unwrap();
        assert!(e.contains("https") && !e.contains("--base-url"), "{e}");
        let e = model("[models.m]\nurl = \"https://x.com/{q}?k=${KEY}\"\nanswer = \"/a\"\n", &[]).err().unwrap();
        assert!(e.contains("headers only"), "{e}");
        // `${{x}}` in a body is the literal text `${x}`.
        let lit = model("[models.m]\nurl = \"https://x.com/\"\nbody = { q = \"${{amount}}\" }\nanswer = \"/a\"\n", &[])
            .unwrap();
        let body: Value =
            serde_json::from_slice(&lit.build(&request("p", serde_json::json!({}))).unwrap().1.unwrap()).unwrap();
        assert_eq!(body, serde_json::json!({"q": "${amount}"}));
        // Braces that are no placeholder (JSON in a header) are sent as written.
        assert!(model(
            "[models.m]\nurl = \"https://x.com/\"\nheaders = { X-J = '{\"a\": 1}' }\nanswer = \"/a\"\n",
            &[]
        )
        .is_ok());
        let e = model("[models.m]\nurl = \"https://x.com/\"\nanswer = \"a\"\n", &[]).err().unwrap();
        assert!(e.contains("JSON pointer"), "{e}");
        for url in ["{host}/x", "https://{host}/x", "https://api.{domain}.com/x"] {
            let e = model(&format!("[models.m]\nurl = \"{url}\"\nanswer = \"/a\"\n"), &[]).err().unwrap();
            assert!(e.contains("written out"), "{url}: {e}");
        }
    }

    #[test]
    fn answers_usage_and_statuses_are_read_as_the_file_says() {
        let m = model(
            "[models.m]\nurl = \"https://x.com/\"\nanswer = \"/out\"\nprompt_tokens = \"/u/in\"\noutput_tokens = \"/u/out\"\nretry_later = [429, 503]\npermanent = [500]\n",
            &[],
        )
        .unwrap();
        let r = m.parse(br#"{"out": "hallo", "u": {"in": 3, "out": 2}}"#).unwrap();
        assert_eq!((r.text.as_str(), r.usage.prompt_tokens, r.usage.output_tokens), ("hallo", 3, 2));
        let r = m.parse(br#"{"out": {"label": "ok", "score": 0.5}}"#).unwrap();
        assert_eq!(r.text, r#"{"label":"ok","score":0.5}"#);
        assert_eq!(m.parse(br#"{"other": 1}"#).unwrap_err().kind, ErrorKind::MalformedResponse);
        let reply = |status: u16| Reply { status, headers: Default::default(), body: bytes::Bytes::from_static(b"{}") };
        assert_eq!(m.classify(&reply(503)).kind, ErrorKind::RateLimited);
        assert_eq!(m.classify(&reply(500)).kind, ErrorKind::BadRequest);
        assert_eq!(m.classify(&reply(502)).kind, ErrorKind::Server);
        assert_eq!(m.classify(&reply(401)).kind, ErrorKind::Auth);
        assert_eq!(m.classify(&reply(422)).kind, ErrorKind::BadRequest);
        // Statuses in no list: an outside tester saw 409, 425, 501 and 529 retried, and 429
        // waited out after `retry_later` left it out. Only the listed are tried again.
        let class = |m: &HttpModel, status| {
            let e = m.classify(&reply(status));
            (e.kind, e.hint)
        };
        let m2 = model("[models.m]\nurl = \"https://x.com/a\"\nanswer = \"/out\"\nretry_later = [420]\n", &[]).unwrap();
        for status in [409, 425, 429, 418] {
            assert_eq!(class(&m2, status), (ErrorKind::BadRequest, RetryHint::Never), "{status}");
        }
        for status in [501, 529] {
            assert_eq!(class(&m2, status), (ErrorKind::Server, RetryHint::Never), "{status}");
        }
        assert_eq!(class(&m2, 503).1, RetryHint::Backoff);
        // A status in `retry` waits as its `Retry-After` asks, when it gives one.
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::RETRY_AFTER, "7".parse().unwrap());
        let e = m2.classify(&Reply { status: 503, headers, body: bytes::Bytes::from_static(b"{}") });
        assert_eq!((e.kind, e.hint), (ErrorKind::Server, RetryHint::Later(Some(std::time::Duration::from_secs(7)))));
        assert!(matches!(class(&m2, 420), (ErrorKind::RateLimited, RetryHint::Later(_))));
        // A fixed url not found stops the run, its records tried again by the next; a url a
        // record fills in names that record's resource.
        assert_eq!(class(&m2, 404), (ErrorKind::Endpoint, RetryHint::StopRun));
        assert!(m2.classify(&reply(404)).message.contains("the url of models.m"));
        assert_eq!(class(&m2, 302), (ErrorKind::Endpoint, RetryHint::StopRun));
        let per_record = model("[models.m]\nurl = \"https://x.com/items/{id}\"\nanswer = \"/out\"\n", &[]).unwrap();
        assert_eq!(class(&per_record, 404), (ErrorKind::BadRequest, RetryHint::Never));
        // A redirect goes in no list.
        let e = model("[models.m]\nurl = \"https://x.com/\"\nanswer = \"/out\"\nretry = [302]\n", &[]).unwrap_err();
        assert!(e.contains("redirect"), "{e}");
    }

    /// A wrong `answer` pointer: a tester's 20 records were paid for 9 times each (180 calls,
    /// every one answered) before failing. The first three answers of a run with nothing there
    /// stop it; once one has had something there, a miss is that answer's and tried again.
    #[test]
    fn an_answer_pointer_that_finds_nothing_from_the_start_stops_the_run() {
        let text = "[models.m]\nurl = \"https://x.com/a\"\nanswer = \"/choices/0/msg\"\n";
        let kinds = |m: &HttpModel| {
            (0..3)
                .map(|_| m.parse(br#"{"choices": [{"message": "hi"}]}"#).unwrap_err())
                .map(|e| (e.kind, e.hint))
                .collect::<Vec<_>>()
        };
        let wrong = model(text, &[]).unwrap();
        let seen = kinds(&wrong);
        assert_eq!(seen[..2], [(ErrorKind::MalformedResponse, RetryHint::Backoff); 2]);
        assert_eq!(seen[2], (ErrorKind::Endpoint, RetryHint::StopRun));
        let e = wrong.parse(b"{}").unwrap_err();
        assert!(e.message.contains("models.m's answer pointer"), "{e}");
        let found = model(text, &[]).unwrap();
        assert!(found.parse(br#"{"choices": [{"msg": "hi"}]}"#).is_ok());
        assert!(kinds(&found).into_iter().all(|k| k == (ErrorKind::MalformedResponse, RetryHint::Backoff)));
    }

    /// A variable in a header that carries no credential is a setting: not masked, and part of
    /// the model's description (another value is another source of answers).
    #[test]
    fn settings_from_the_environment_shape_the_model() {
        let text = "[models.m]\nurl = \"https://x.com/\"\nheaders = { X-Api-Key = \"${K}\", X-Model-Version = \"${V}\" }\nanswer = \"/a\"\n";
        let v1 = model(text, &[("K", "secret-key-1"), ("V", "fine")]).unwrap();
        let v2 = model(text, &[("K", "secret-key-1"), ("V", "v2")]).unwrap();
        let other_key = model(text, &[("K", "secret-key-2"), ("V", "fine")]).unwrap();
        assert_ne!(v1.endpoint(), v2.endpoint());
        assert!(v1.endpoint().contains(";X-Model-Version="), "says which setting: {}", v1.endpoint());
        assert_eq!(v1.endpoint(), other_key.endpoint(), "a key is not the model's description");
        assert_eq!(v1.masked("fine and secret-key-1"), "fine and ***");
        // A key written into the file is masked too (an outside tester's answers kept it).
        let literal = "[models.m]\nurl = \"https://x.com/\"\nheaders = { Authorization = \"Bearer LiteralSecret_5566\" }\nanswer = \"/a\"\n";
        let m = model(literal, &[]).unwrap();
        assert_eq!(m.masked("Bearer LiteralSecret_5566 as sent"), "Bearer *** as sent");
        let raw: RawFile = toml::from_str(text).unwrap();
        let env = |k: &str| Some(if k == "V" { "v2" } else { "k" }.to_string());
        assert_ne!(described(raw.models["m"].shape(), &settings_of(&raw.models["m"], &env)), raw.models["m"].shape());
        // A null at the answer's pointer is no answer.
        assert_eq!(v1.parse(br#"{"a": null}"#).unwrap_err().kind, ErrorKind::MalformedResponse);
    }

    /// `s` with the hex digits of its `%XX` escapes in lower case.
    fn lower_hex(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        let mut left = 0;
        for c in s.chars() {
            if c == '%' {
                left = 2;
                out.push(c);
            } else if left > 0 {
                left -= 1;
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    /// A key an API echoes, as sent or escaped in JSON (`\"`, `\/`) or percent-encoded, is
    /// masked in error messages and in answers.
    #[test]
    fn echoed_secrets_are_masked_in_every_form() {
        let key = r#"k3y/with"quote+plus<a>&\b"#;
        let m = model(
            "[models.m]\nurl = \"https://x.com/\"\nheaders = { X-Key = \"${K}\" }\nanswer = \"/echo\"\n",
            &[("K", key)],
        )
        .unwrap();
        let bodies = [
            serde_json::json!({"echo": key}).to_string(),
            serde_json::json!({"echo": key}).to_string().replace('/', "\\/"),
            format!("{{\"echo\": \"{}\"}}", url::form_urlencoded::byte_serialize(key.as_bytes()).collect::<String>()),
        ];
        let quoted = |lower: bool| {
            const PATH: &percent_encoding::AsciiSet = &crate::http::UNRESERVED.remove(b'/');
            let q = percent_encoding::utf8_percent_encode(key, PATH).to_string();
            let q = if lower { lower_hex(&q) } else { q };
            format!("{{\"echo\": \"{q}\"}}")
        };
        let upper_u = serde_json::json!({"echo": key}).to_string().replace('<', "\\u003C");
        let go = serde_json::json!({"echo": key})
            .to_string()
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('&', "\\u0026");
        for body in bodies.into_iter().chain([go, quoted(false), quoted(true), upper_u]) {
            let r = m.parse(body.as_bytes()).unwrap();
            assert!(!r.text.contains("k3y"), "{}", r.text);
            let reply = Reply { status: 401, headers: Default::default(), body: bytes::Bytes::from(body.clone()) };
            let e = m.redacted(m.classify(&reply));
            assert!(!e.message.contains("k3y") && e.message.contains("***"), "{}", e.message);
        }
    }

    /// A key written into the URL's query was quoted unmasked when a server echoed the URL in
    /// an error (a tester's `?key=LITERALSECRET-…`); a placeholder's value is the record's.
    #[test]
    fn a_value_written_into_the_url_query_is_masked_in_echoes() {
        let m = model(
            "[models.m]\nurl = \"https://x.com/a?key=LITERALSECRET-zzz999&q={prompt}&v=1\"\nanswer = \"/echo\"\n",
            &[],
        )
        .unwrap();
        let body = r#"{"error": "bad path /a?key=LITERALSECRET-zzz999&q=hi&v=1"}"#;
        let reply = Reply { status: 400, headers: Default::default(), body: bytes::Bytes::from(body) };
        let e = m.redacted(m.classify(&reply));
        assert!(!e.message.contains("LITERALSECRET") && e.message.contains("key=***&q=hi&v=1"), "{}", e.message);
        // Nor in the file's own error about that URL.
        let Err(e) =
            model("[models.m]\nurl = \"https://x.com/a?key=LITERALSECRET-zzz999&v={prompt\"\nanswer = \"/a\"\n", &[])
        else {
            panic!("an unclosed placeholder accepted")
        };
        assert!(e.contains("unclosed") && !e.contains("LITERALSECRET"), "{e}");
    }

    /// A parse error quoted the line, and a key written on it (a tester's
    /// `Authorization = "Bearer LITERALSECRET…" oops`): now the line's number only.
    #[test]
    fn a_file_that_does_not_parse_is_named_by_line_without_quoting_it() {
        let dir = std::env::temp_dir().join(format!("weir-http-models-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let none = |_: &str| None;
        for (text, line) in [
            ("[models.a]\nurl = \"http://127.0.0.1:9/a\"\nheaders = { Authorization = \"Bearer LITERALSECRET-1\" oops }\n", 3),
            ("[models.a]\nurl = \"http://127.0.0.1:9/a\"\nanswer = \"/x\"\nbogus = \"LITERALSECRET-2\"\n", 4),
        ] {
            let file = dir.join("m.toml");
            std::fs::write(&file, text).unwrap();
            let Err(e) = connect("a", Some(file.to_str().unwrap()), &none) else { panic!("accepted") };
            let e = e.to_string();
            assert!(!e.contains("LITERALSECRET") && e.contains(&format!("line {line}:")), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A `${VAR}` key with a non-ASCII letter inside was sent as Latin-1 (and echoed unmasked);
    /// one with a key file's newline at its end was refused as "not a header value".
    #[test]
    fn a_header_variable_is_trimmed_and_must_be_printable_ascii() {
        let file =
            "[models.m]\nurl = \"https://x.com/\"\nheaders = { Authorization = \"Bearer ${K}\" }\nanswer = \"/a\"\n";
        assert!(model(file, &[("K", "sk-abc123\n")]).is_ok());
        for bad in ["sk-ab\u{e9}c123", "sk-ab\u{200b}c123", "sk-ab\u{1}c123"] {
            let Err(e) = model(file, &[("K", bad)]) else { panic!("{bad:?} accepted") };
            assert!(
                e.contains("K holds a control or non-ASCII character at character 6") && !e.contains("sk-ab"),
                "{e}"
            );
        }
    }
}

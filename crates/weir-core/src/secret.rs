//! Credentials, and masking them wherever a server echoed them: in error messages, in
//! answers, in any text weir writes. Here, in weir-core, so that every crate that holds a
//! credential (providers, object stores) masks the same way.

/// A credential. Its `Debug` never shows the value, so it cannot leak into logs or errors.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// Wraps a credential.
    pub fn new(value: String) -> Self {
        Self(value)
    }

    /// `text` with this secret masked wherever a server echoed it, however escaped (see
    /// [`mask`]).
    pub fn masked_in(&self, text: &str) -> String {
        mask(text, std::slice::from_ref(self))
    }

    /// The value, for a request header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// `text` with each of `secrets` replaced by `***` wherever a server echoed it, however each
/// of its characters was written: as itself, percent-encoded (either case of hex; any set of
/// characters left as they are, as every URL and form encoder leaves a different set; a space
/// as `+`), escaped for JSON or JavaScript (`\uXXXX` in either case, surrogate pairs, `\/`,
/// `\"`, `\xXX`) or for HTML (`&amp;`, `&#60;`, `&#x3c;`). Decoding each character where it
/// stands, rather than listing the encoders' forms of the whole value, finds the mixtures
/// those encoders write (JavaScript's `encodeURIComponent` keeps `*`, PHP's `urlencode`
/// escapes it; Go keeps `~`, Java escapes it). A value under 4 characters is not masked: it
/// cannot be told from other text.
pub fn mask(text: &str, secrets: &[Secret]) -> String {
    let keys: Vec<Vec<char>> =
        secrets.iter().map(|s| s.expose().chars().collect::<Vec<char>>()).filter(|k| k.len() >= 4).collect();
    if keys.is_empty() {
        return text.to_string();
    }
    // The bytes an echo can start with: a key's first character as itself, or an escape.
    let mut starts: Vec<u8> = b"%+\\&".to_vec();
    starts.extend(keys.iter().map(|k| k[0].to_string().as_bytes()[0]));
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let found = if starts.contains(&text.as_bytes()[i]) {
            keys.iter().filter_map(|k| echo_at(text, i, k)).max()
        } else {
            None
        };
        match found {
            Some(end) => {
                out.push_str("***");
                i = end;
            }
            None => {
                let c = text[i..].chars().next().expect("i is a char boundary within text");
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    out
}

/// Where an echo of `key` that starts at byte `i` of `text` ends (the longest), if one does.
fn echo_at(text: &str, i: usize, key: &[char]) -> Option<usize> {
    // The ends reachable after each character of the key: escapes make a few at most.
    let mut ends = vec![i];
    for &c in key {
        let mut next = Vec::new();
        for &at in &ends {
            char_echo_ends(text.as_bytes(), at, c, &mut next);
        }
        next.sort_unstable();
        next.dedup();
        if next.is_empty() {
            return None;
        }
        ends = next;
    }
    ends.pop()
}

/// Pushes to `ends` where each way of writing `c` that starts at byte `at` of `text` ends.
fn char_echo_ends(text: &[u8], at: usize, c: char, ends: &mut Vec<usize>) {
    let rest = &text[at.min(text.len())..];
    let mut utf8 = [0u8; 4];
    let bytes = c.encode_utf8(&mut utf8).as_bytes();
    if rest.starts_with(bytes) {
        ends.push(at + bytes.len());
    }
    match rest.first() {
        Some(b'%') => {
            // JavaScript's `escape()`: `%XX` for a Latin-1 character, `%uXXXX` past it (a
            // surrogate pair past the BMP).
            let code = c as u32;
            if (0x80..0x100).contains(&code) && hex(rest.get(1..3)) == Some(code) {
                ends.push(at + 3);
            }
            let unit = |s: &[u8]| s.starts_with(b"%u").then(|| hex(s.get(2..6))).flatten();
            match surrogates(code) {
                None if unit(rest) == Some(code) => ends.push(at + 6),
                Some((hi, lo)) if unit(rest) == Some(hi) && unit(&rest[6.min(rest.len())..]) == Some(lo) => {
                    ends.push(at + 12)
                }
                _ => {}
            }
            // Each byte as `%XX`.
            let n = bytes.len();
            if rest.len() >= 3 * n
                && (0..n).all(|k| rest[3 * k] == b'%' && hex(rest.get(3 * k + 1..3 * k + 3)) == Some(bytes[k].into()))
            {
                ends.push(at + 3 * n);
            }
        }
        Some(b'+') if c == ' ' => ends.push(at + 1),
        Some(b'\\') => {
            // An escape escaped again (JSON in a JSON string: `\\/`, `\\u0041`) is the same
            // escape behind more backslashes; a backslash itself is two or four of them then.
            let run = rest.iter().take_while(|&&b| b == b'\\').count();
            if c == '\\' {
                for n in [2, 4] {
                    if run >= n {
                        ends.push(at + n);
                    }
                }
            }
            let (at, rest) = (at + run - 1, &rest[run - 1..]);
            let code = c as u32;
            // `\u{2f}` (JavaScript since ES2015, Rust) and `\U0001F600` (Python, C).
            if rest.get(1) == Some(&b'u') && rest.get(2) == Some(&b'{') {
                if let Some(len) = rest[3..].iter().take(7).position(|&b| b == b'}') {
                    if hex(rest.get(3..3 + len)) == Some(code) {
                        ends.push(at + 4 + len);
                    }
                }
            }
            if rest.get(1) == Some(&b'U') && hex(rest.get(2..10)) == Some(code) {
                ends.push(at + 10);
            }
            let simple = match c {
                '/' => Some(b'/'),
                '"' => Some(b'"'),
                '\\' => Some(b'\\'),
                '\'' => Some(b'\''),
                '\n' => Some(b'n'),
                '\t' => Some(b't'),
                '\r' => Some(b'r'),
                _ => None,
            };
            if simple.is_some_and(|e| rest.get(1) == Some(&e)) {
                ends.push(at + 2);
            }
            let unit = |s: &[u8]| (s.get(1) == Some(&b'u')).then(|| hex(s.get(2..6))).flatten();
            if code < 0x10000 {
                if unit(rest) == Some(code) {
                    ends.push(at + 6);
                }
            } else {
                // The second half behind as many backslashes as the first (escaped again or not).
                let (hi, lo) = surrogates(code).expect("past the BMP");
                let second = rest.get(6..).map_or(0, |r| r.iter().take_while(|&&b| b == b'\\').count());
                if unit(rest) == Some(hi) && second >= 1 && unit(&rest[6 + second - 1..]) == Some(lo) {
                    ends.push(at + 6 + second - 1 + 6);
                }
            }
            if rest.get(1) == Some(&b'x') && hex(rest.get(2..4)) == Some(code) {
                ends.push(at + 4);
            }
        }
        Some(b'&') => {
            for name in html_names(c) {
                let len = name.len() + 2;
                if rest.len() >= len && rest[len - 1] == b';' && rest[1..len - 1].eq_ignore_ascii_case(name.as_bytes())
                {
                    ends.push(at + len);
                }
            }
            // `&#NN;` or `&#xHH;`, with any leading zeros.
            if rest.get(1) == Some(&b'#') {
                let (digits, radix) = if matches!(rest.get(2), Some(b'x' | b'X')) { (3, 16) } else { (2, 10) };
                // Its digits, and the `;` after them, which HTML lets a browser do without.
                let tail = &rest[digits.min(rest.len())..];
                let len = tail
                    .iter()
                    .take(10)
                    .take_while(|b| if radix == 16 { b.is_ascii_hexdigit() } else { b.is_ascii_digit() })
                    .count();
                let n = std::str::from_utf8(&tail[..len]).ok().and_then(|d| u32::from_str_radix(d, radix).ok());
                if len > 0 && n == Some(c as u32) {
                    let semi = usize::from(tail.get(len) == Some(&b';'));
                    ends.push(at + digits + len + semi);
                }
            }
        }
        _ => {}
    }
}

/// The UTF-16 surrogate pair that writes `code`, if it is past the BMP.
fn surrogates(code: u32) -> Option<(u32, u32)> {
    let v = code.checked_sub(0x10000)?;
    Some((0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF)))
}

/// HTML's names for an ASCII character (`&sol;` for `/`, as PHP's `htmlentities` writes them
/// with `ENT_HTML5`); `&lt;` and the other three are also matched in capitals, as HTML allows.
fn html_names(c: char) -> &'static [&'static str] {
    match c {
        '&' => &["amp"],
        '<' => &["lt"],
        '>' => &["gt"],
        '"' => &["quot"],
        '\'' => &["apos"],
        '/' => &["sol"],
        '+' => &["plus"],
        '=' => &["equals"],
        '(' => &["lpar"],
        ')' => &["rpar"],
        '!' => &["excl"],
        '#' => &["num"],
        '$' => &["dollar"],
        '%' => &["percnt"],
        '*' => &["ast", "midast"],
        ',' => &["comma"],
        '.' => &["period"],
        ':' => &["colon"],
        ';' => &["semi"],
        '?' => &["quest"],
        '@' => &["commat"],
        '[' => &["lsqb", "lbrack"],
        ']' => &["rsqb", "rbrack"],
        '\\' => &["bsol"],
        '^' => &["hat"],
        '_' => &["lowbar"],
        '`' => &["grave"],
        '{' => &["lcub", "lbrace"],
        '}' => &["rcub", "rbrace"],
        '|' => &["verbar", "vert"],
        '~' => &["tilde"],
        ' ' => &["nbsp"],
        _ => &[],
    }
}

/// `body`, an answer's bytes, with `secret` masked wherever the server echoed it (see
/// [`mask`]): a gateway or an echo model that repeats the request's headers in a successful
/// answer would otherwise put the key in result rows and the response cache. Bytes that are not
/// UTF-8 are kept as they are (no key is written in them that `mask` could find).
pub fn masked_body<'a>(body: &'a [u8], secret: Option<&Secret>) -> std::borrow::Cow<'a, [u8]> {
    use std::borrow::Cow;
    match (secret, std::str::from_utf8(body)) {
        (Some(s), Ok(text)) => match s.masked_in(text) {
            m if m.len() == text.len() && m == text => Cow::Borrowed(body),
            m => Cow::Owned(m.into_bytes()),
        },
        _ => Cow::Borrowed(body),
    }
}

/// `v` with each of `secrets` masked in every string it holds (and every key), however
/// escaped (see [`mask`]): masked where each string is itself, not in the JSON text, whose
/// escaping of a string inside a string (`\\\/`) would hide an echo.
pub fn mask_value(v: &mut serde_json::Value, secrets: &[Secret]) {
    use serde_json::Value;
    match v {
        Value::String(s) => *s = mask(s, secrets),
        Value::Array(items) => items.iter_mut().for_each(|i| mask_value(i, secrets)),
        Value::Object(map) => {
            let fields = std::mem::take(map);
            for (k, mut item) in fields {
                mask_value(&mut item, secrets);
                map.insert(mask(&k, secrets), item);
            }
        }
        _ => {}
    }
}

/// The number `digits` write in hex (either case): none when there are none (the text ended
/// first) or one is not a hex digit.
fn hex(digits: Option<&[u8]>) -> Option<u32> {
    let d = digits.filter(|d| !d.is_empty() && d.iter().all(u8::is_ascii_hexdigit))?;
    u32::from_str_radix(std::str::from_utf8(d).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However an encoder wrote the key, it is masked: an outside tester's forms, each of
    /// which leaked before (`quote_plus` keeps `~`, PHP's `urlencode` escapes `*`,
    /// JavaScript's `encodeURIComponent` keeps `!'()*`, `\u` escapes in a text body), with
    /// HTML's, and partial escapes of either case mixed within one echo.
    #[test]
    fn a_key_is_masked_however_it_was_escaped() {
        let cases: &[(&str, &str)] = &[
            ("a b~c", "k=a+b~c end"),
            ("key with space*", "k=key+with+space%2A end"),
            ("key with space*", "k=key%20with%20space* end"),
            ("ab!c(d)e*f'g~h i", "k=ab!c(d)e*f'g~h%20i end"),
            ("abcdeJ123", r"Error: your key \u0061\u0062\u0063\u0064\u0065\u004A\u0031\u0032\u0033 end"),
            ("abcdef123", r"Error: your key \u0061\u0062c\x64ef1%323 end"),
            ("sk-\u{1F600}-xyz", r"key sk-\ud83d\ude00-xyz end"),
            ("sk-\u{1F600}-xyz", "key sk-%F0%9F%98%80-xyz end"),
            ("a<b>&c\"d'e", "key a&lt;b&gt;&amp;c&quot;d&#39;e end"),
            ("a<b>&c\"d'e", "key a&#x3C;b&#62;&#0038;c\\\"d\\'e end"),
            ("a/b/c/d", r"key a\/b%2fc%2Fd end"),
            ("plain-key-1", "key plain-key-1 end"),
            // A second tester's: `\/` escaped again (JSON in a JSON string), `\u{2f}`, Python's
            // `\U`, `escape()`'s `%u`, HTML5's names (any case), a key with a backslash.
            ("abc/def+gh=", r"key abc\\/def+gh= end"),
            ("abc/def+gh=", r"key abc\\\/def\\x2bgh\\u003d end"),
            ("abc/def+gh=", r"key abc\u{2f}def\u{2B}gh\U0000003d end"),
            ("sk-\u{e9}\u{1F600}x", r"key sk-%u00E9\U0001F600x end"),
            ("abc/def+gh=", "key abc&sol;def&PLUS;gh&equals; end"),
            ("ab\\cd\\ef", r"key ab\\cd\\\\ef end"),
            // A third tester's: `escape()`'s `%E9` and `%uD83D%uDE00`, a pair escaped again,
            // `\u005c` escaped again, numeric references without their `;`.
            ("abcd\u{e9}fgh1234", "key abcd%E9fgh1234 end"),
            ("abcDEF12\u{1F600}xyz789", r"key abcDEF12%uD83D%ude00xyz789 end"),
            ("abcDEF12\u{1F600}xyz789", r"key abcDEF12\\ud83d\\ude00xyz789 end"),
            ("Q7\\zZ\"p/+", r#"key Q7\\u005czZ\\\"p/+ end"#),
            ("abc/def+gh=", "key abc&#47def&#43gh&#x3d end"),
        ];
        for (key, echo) in cases {
            let masked = mask(echo, &[Secret::new(key.to_string())]);
            assert!(masked.ends_with("*** end") && !masked.contains(key), "{key:?} in {echo:?}: {masked:?}");
        }
        // Around it, text is kept as it was, escapes and all; a key under 4 characters is not
        // masked; a near miss is not masked.
        let k = [Secret::new("s3cr3t".into())];
        assert_eq!(mask("x %41 s3cr3t \\u0041 s3cr3", &k), "x %41 *** \\u0041 s3cr3");
        assert_eq!(mask("key abc", &[Secret::new("abc".into())]), "key abc");
        // In JSON, each string is masked as itself: an escaped key in a string inside a string,
        // and in an object's key.
        let mut v: serde_json::Value =
            serde_json::from_str(r#"{"error": {"message": "k={\"key\": \"abc\\/def+gh=\"}"}, "abc/def+gh=": 1}"#)
                .unwrap();
        mask_value(&mut v, &[Secret::new("abc/def+gh=".into())]);
        assert!(!v.to_string().contains("abc"), "{v}");
    }

    #[test]
    fn secrets_do_not_print() {
        let s = Secret::new("sk-very-secret".into());
        assert!(!format!("{s:?}").contains("very"));
    }
}

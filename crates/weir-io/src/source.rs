//! Reading JSONL input line by line, from a file or stdin, in constant memory.

use futures::Stream;
use std::io;
use std::path::{Path, PathBuf};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// Where input comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputPath {
    /// Standard input (`-`).
    Stdin,
    /// A local file.
    File(PathBuf),
}

impl InputPath {
    /// `-` is stdin; anything else a file.
    pub fn parse(s: &str) -> Self {
        if s == "-" {
            Self::Stdin
        } else {
            Self::File(PathBuf::from(s))
        }
    }
}

/// One input line, without its line ending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawLine {
    /// 1-based line number.
    pub line: u64,
    /// The bytes of the line (not yet checked to be UTF-8).
    pub bytes: Vec<u8>,
    /// Why the record could not be read, when it could not (a CSV line with the wrong number of
    /// fields, an unreadable Parquet row group): it becomes an error row with this message,
    /// keeping `bytes` as its raw text.
    pub malformed: Option<String>,
    /// The file the line is in and the number of lines before that file, when the input is
    /// many files and `line` counts through all of them: messages name the file and its own
    /// line (`data/b.jsonl line 2`), while `line` keeps the input's order for resuming.
    pub origin: Option<(std::sync::Arc<str>, u64)>,
}

impl RawLine {
    /// `message`, which names this line as `line N`, naming its file and its line there
    /// instead, when the input is many files.
    pub fn located(&self, message: String) -> String {
        match &self.origin {
            Some((file, before)) => {
                message.replacen(&format!("line {}", self.line), &format!("{file} line {}", self.line - before), 1)
            }
            None => message,
        }
    }
}

const BUFFER: usize = 256 * 1024;
const BOM: &[u8] = b"\xef\xbb\xbf";

/// Opens the input for reading.
pub async fn open(input: &InputPath) -> io::Result<Box<dyn AsyncRead + Send + Unpin>> {
    Ok(match input {
        InputPath::Stdin => Box::new(tokio::io::stdin()),
        InputPath::File(p) => Box::new(tokio::fs::File::open(p).await?),
    })
}

/// Line `n` as read (with its line ending), or `None` when it is blank: blank lines are not
/// records, but they are counted, so a line number always points at the file.
fn record_line(n: u64, mut bytes: Vec<u8>) -> Option<RawLine> {
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
    }
    if bytes.last() == Some(&b'\r') {
        bytes.pop();
    }
    // A UTF-8 byte-order mark (as some editors and Excel write) is not data.
    if n == 1 && bytes.starts_with(BOM) {
        bytes.drain(..BOM.len());
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    Some(RawLine { line: n, bytes, malformed: None, origin: None })
}

/// Why a file that starts with `head` (its first bytes, a few KiB) is not JSON Lines, when it
/// plainly is not: compressed, a Parquet file, or a JSON array written over many lines. Each
/// would become error rows that say nothing of why (a gzip file's two records became one row
/// "not valid UTF-8"; a pretty-printed array's two records became eight).
pub fn not_jsonl(head: &[u8]) -> Option<&'static str> {
    if let Some(why) = not_text(head) {
        return Some(why);
    }
    let text = head.strip_prefix(BOM).unwrap_or(head);
    let mut filled = text.split(|b| *b == b'\n').map(|l| l.trim_ascii()).filter(|l| !l.is_empty());
    let first = filled.next()?;
    let json = |l: &[u8]| serde_json::from_slice::<serde::de::IgnoredAny>(l).is_ok();
    // A line that opens an array and does not close it, and a next line that is no JSON value
    // either (`{`, or `{…},`): the array goes on over the lines below. (A first line that is
    // only broken, above whole objects, is one error row as any other.)
    let opens_array = first.starts_with(b"[") && !json(first) && !filled.next().is_some_and(json);
    opens_array.then_some(
        "is a JSON array written over many lines, not JSON Lines (one object per line); convert it: \
         jq -c '.[]' FILE > FILE.jsonl",
    )
}

/// Why a file that starts with `head` is not text at all (JSON Lines or CSV), when its first
/// bytes say what it is instead: compressed, an archive, a Parquet file.
pub fn not_text(head: &[u8]) -> Option<&'static str> {
    const MAGIC: &[(&[u8], &str)] = &[
        (
            b"\x1f\x8b",
            "is gzip-compressed; decompress it first (gunzip -k), or stream it: zcat FILE | weir run --input - …",
        ),
        (
            b"\x28\xb5\x2f\xfd",
            "is zstd-compressed; decompress it first (zstd -d), or stream it: zstdcat FILE | weir run --input - …",
        ),
        (
            b"BZh",
            "is bzip2-compressed; decompress it first (bunzip2 -k), or stream it: bzcat FILE | weir run --input - …",
        ),
        (
            b"\xfd7zXZ\x00",
            "is xz-compressed; decompress it first (unxz -k), or stream it: xzcat FILE | weir run --input - …",
        ),
        (b"PK\x03\x04", "is a zip archive; extract the JSONL, CSV or Parquet file from it first"),
        (b"PAR1", "is a Parquet file; name it *.parquet, or pass --input-format parquet"),
    ];
    MAGIC.iter().find(|(magic, _)| head.starts_with(magic)).map(|(_, why)| *why)
}

/// The longest line read as a record. A longer one (a file with no line ends, `/dev/zero`)
/// would be held whole, and the process run out of memory; it becomes an error row instead,
/// keeping its first [`KEPT_OF_LONG`] bytes.
pub const MAX_LINE: usize = 64 << 20;

/// The bytes of a line longer than [`MAX_LINE`] kept in its error row, to find it by.
pub const KEPT_OF_LONG: usize = 1024;

/// Reads past the rest of a line (through its `\n`, or to the end), holding none of it; the
/// number of bytes passed, without the `\n`.
async fn skip_line<R: tokio::io::AsyncBufRead + Unpin>(reader: &mut R) -> io::Result<u64> {
    let mut passed = 0u64;
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(passed);
        }
        let (used, end) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        reader.consume(used);
        if end {
            return Ok(passed + used as u64 - 1);
        }
        passed += used as u64;
    }
}

/// The lines of a reader as a stream. Blank lines are not records and are skipped; line
/// numbers still count them, so a line number always points at the file. A line longer than
/// [`MAX_LINE`] is a malformed record.
pub fn lines(reader: Box<dyn AsyncRead + Send + Unpin>) -> impl Stream<Item = io::Result<RawLine>> + Send {
    use tokio::io::AsyncReadExt;
    let reader = BufReader::with_capacity(BUFFER, reader);
    futures::stream::unfold((reader, 0u64, false), |(mut reader, mut n, done)| async move {
        if done {
            return None;
        }
        loop {
            let mut bytes = Vec::new();
            match (&mut reader).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut bytes).await {
                Ok(0) => return None,
                Ok(_) if bytes.len() > MAX_LINE && bytes.last() != Some(&b'\n') => {
                    n += 1;
                    let rest = match skip_line(&mut reader).await {
                        Ok(rest) => rest,
                        Err(e) => return Some((Err(e), (reader, n, true))),
                    };
                    bytes.truncate(KEPT_OF_LONG);
                    let malformed = format!(
                        "line {n} is {} bytes long, over weir's limit of {} MiB for one record; its first {} \
                         bytes are kept here",
                        MAX_LINE as u64 + 1 + rest,
                        MAX_LINE >> 20,
                        KEPT_OF_LONG
                    );
                    return Some((
                        Ok(RawLine { line: n, bytes, malformed: Some(malformed), origin: None }),
                        (reader, n, false),
                    ));
                }
                Ok(_) => {
                    n += 1;
                    match record_line(n, bytes) {
                        Some(line) => return Some((Ok(line), (reader, n, false))),
                        None => continue,
                    }
                }
                Err(e) => return Some((Err(e), (reader, n, true))),
            }
        }
    })
}

/// What identifies a followed file across runs, or `None` while it has no whole first line
/// yet: where it is, which file that is (device and inode: a file put in its place is another
/// input), and a digest of its first line (a file truncated and written anew starts
/// differently). A file that only grows keeps all three.
pub fn followed_identity(path: &Path) -> io::Result<Option<String>> {
    use sha2::{Digest, Sha256};
    use std::io::{BufRead, Read};
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    let mut first = Vec::new();
    std::io::BufReader::new(file).take(64 << 20).read_until(b'\n', &mut first)?;
    if first.last() != Some(&b'\n') {
        return Ok(None);
    }
    let digest = Sha256::digest(&first);
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok(Some(format!("{} (followed; file {}:{}, first line {hex})", abs.display(), meta.dev(), meta.ino())))
}

/// How often a followed file is looked at for more lines when there were none.
pub const FOLLOW_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// The lines of a file that keeps growing (`tail -f`): at its end it waits for more, every
/// `poll`, and never ends. A last line without its newline is still being written and is
/// not read until the newline comes. The file must only grow: one that shrinks (truncated) or
/// whose path now names another file (rotated) ends the stream with an error, since lines
/// already read — and the line numbers that make records resumable — would no longer mean
/// what they meant.
pub fn follow(path: PathBuf, poll: std::time::Duration) -> impl Stream<Item = io::Result<RawLine>> + Send {
    struct Followed {
        path: PathBuf,
        reader: Option<BufReader<tokio::fs::File>>,
        /// The file's identity (device, inode), to notice a rotation.
        id: (u64, u64),
        /// Bytes read up to the end of the last whole line.
        offset: u64,
        /// A last line read without its newline, yet.
        partial: Vec<u8>,
        n: u64,
        failed: bool,
        /// The file's length when its content was last checked: lines ending beyond it are
        /// new, and the file is checked again before they are taken.
        verified: u64,
        /// The start of the first line and the end of the last line read, as read: a file
        /// truncated and written again within one poll can be longer than before, and only
        /// its content tells it from one that grew.
        first: Vec<u8>,
        last: Vec<u8>,
    }
    /// The end of `line`, at most this long, is what is compared.
    const KEPT: usize = 4096;
    /// Errs if the bytes where the first and the last line read were are not them any more.
    fn unchanged(st: &Followed) -> io::Result<u64> {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::open(&st.path)?;
        let len = file.metadata()?.len();
        let at = |pos: u64, want: &[u8]| -> io::Result<bool> {
            let mut got = vec![0u8; want.len()];
            match file.read_exact_at(&mut got, pos) {
                Ok(()) => Ok(got == want),
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
                Err(e) => Err(e),
            }
        };
        if st.n > 0 && !(at(0, &st.first)? && at(st.offset - st.last.len() as u64, &st.last)?) {
            let msg = format!(
                "{} was truncated and written again while it was followed (after line {}); weir follows one file \
                 that only grows. Start a new run for the new data (another --output, or --fresh)",
                st.path.display(),
                st.n
            );
            return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
        }
        Ok(len)
    }
    async fn identity(path: &Path) -> io::Result<((u64, u64), u64)> {
        use std::os::unix::fs::MetadataExt;
        let m = tokio::fs::metadata(path).await?;
        Ok(((m.dev(), m.ino()), m.len()))
    }
    let state = Followed {
        path,
        reader: None,
        id: (0, 0),
        offset: 0,
        partial: Vec::new(),
        n: 0,
        failed: false,
        verified: 0,
        first: Vec::new(),
        last: Vec::new(),
    };
    futures::stream::unfold(state, move |mut st| async move {
        if st.failed {
            return None;
        }
        let fail = |mut st: Followed, e: io::Error| {
            st.failed = true;
            Some((Err(e), st))
        };
        if st.reader.is_none() {
            let file = match tokio::fs::File::open(&st.path).await {
                Ok(f) => f,
                Err(e) => return fail(st, e),
            };
            match identity(&st.path).await {
                Ok((id, len)) => (st.id, st.verified) = (id, len),
                Err(e) => return fail(st, e),
            }
            st.reader = Some(BufReader::with_capacity(BUFFER, file));
        }
        loop {
            let reader = st.reader.as_mut().expect("opened above");
            let before = st.partial.len();
            match reader.read_until(b'\n', &mut st.partial).await {
                Err(e) => return fail(st, e),
                Ok(_) if st.partial.last() == Some(&b'\n') => {
                    let end = st.offset + st.partial.len() as u64;
                    if end > st.verified {
                        match unchanged(&st) {
                            Ok(len) => st.verified = len,
                            Err(e) => return fail(st, e),
                        }
                    }
                    st.offset = end;
                    st.n += 1;
                    if st.n == 1 {
                        st.first = st.partial[..st.partial.len().min(KEPT)].to_vec();
                    }
                    st.last = st.partial[st.partial.len().saturating_sub(KEPT)..].to_vec();
                    match record_line(st.n, std::mem::take(&mut st.partial)) {
                        Some(line) => return Some((Ok(line), st)),
                        None => continue,
                    }
                }
                Ok(read) => {
                    // At the end (perhaps inside a line): wait for more, unless the file
                    // shrank or was replaced.
                    debug_assert_eq!(st.partial.len(), before + read);
                    match identity(&st.path).await {
                        Ok((id, len)) if id == st.id && len >= st.offset + st.partial.len() as u64 => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            let msg = format!(
                                "{} was deleted while it was followed (after line {}); the rows so far are kept",
                                st.path.display(),
                                st.n
                            );
                            return fail(st, io::Error::new(io::ErrorKind::NotFound, msg));
                        }
                        Ok((id, _)) => {
                            let what = if id == st.id { "shrank (truncated?)" } else { "was replaced (rotated?)" };
                            let msg = format!(
                                "{} {what} while it was followed after line {}; weir follows one file that only \
                                 grows. Start a new run for the new data (another --output, or --fresh)",
                                st.path.display(),
                                st.n
                            );
                            return fail(st, io::Error::new(io::ErrorKind::InvalidData, msg));
                        }
                        Err(e) => return fail(st, e),
                    }
                    tokio::time::sleep(poll).await;
                }
            }
        }
    })
}

/// Counts the records (non-blank lines) of a file, for the progress bar's total.
pub fn count_records(path: &Path) -> io::Result<u64> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; BUFFER];
    let mut count = 0u64;
    let mut line_has_content = false;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        for &b in &buf[..n] {
            if b == b'\n' {
                if line_has_content {
                    count += 1;
                }
                line_has_content = false;
            } else if !b.is_ascii_whitespace() {
                line_has_content = true;
            }
        }
    }
    if line_has_content {
        count += 1;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn lines_skip_blanks_and_keep_numbers() {
        let data: &'static [u8] = b"\xef\xbb\xbf{\"a\":1}\r\n\n  \n{\"a\":2}\n{\"a\":3}";
        let got: Vec<RawLine> = lines(Box::new(data)).map(|l| l.unwrap()).collect().await;
        assert_eq!(got.len(), 3);
        assert_eq!((got[0].line, got[0].bytes.as_slice()), (1, &b"{\"a\":1}"[..]));
        assert_eq!(got[1].line, 4);
        assert_eq!((got[2].line, got[2].bytes.as_slice()), (5, &b"{\"a\":3}"[..]));
    }

    #[test]
    fn files_that_are_not_json_lines_are_told_apart() {
        assert!(not_jsonl(b"\x1f\x8b\x08\x08").unwrap().contains("gzip"));
        assert!(not_jsonl(b"PAR1\x15\x04").unwrap().contains("Parquet"));
        assert!(not_jsonl(b"[\n  {\n    \"prompt\": \"a\"\n").unwrap().contains("JSON array"));
        assert!(not_jsonl(b"\xef\xbb\xbf\n  [{\"prompt\": \"a\"},\n").unwrap().contains("JSON array"));
        for fine in [
            &b"{\"prompt\": \"a\"}\n"[..],
            b"[\"a\", 1]\n{\"prompt\": 1}\n",
            b"[broken\n{\"prompt\": 1}\n",
            b"",
            b"\n\n",
            b"not json",
        ] {
            assert_eq!(not_jsonl(fine), None, "{:?}", String::from_utf8_lossy(fine));
        }
    }

    #[tokio::test]
    async fn a_line_over_the_limit_is_one_malformed_record_and_the_next_is_read() {
        // A tester's `--input /dev/zero` grew to 880 MB and aborted; a 50 MB line took 467 MB.
        let mut data = b"{\"a\":1}\n".to_vec();
        data.resize(data.len() + MAX_LINE + 5000, b'x');
        data.extend_from_slice(b"\n{\"a\":3}\n");
        let got: Vec<RawLine> = lines(Box::new(std::io::Cursor::new(data))).map(|l| l.unwrap()).collect().await;
        assert_eq!(got.len(), 3);
        assert_eq!((got[0].line, got[0].malformed.is_none()), (1, true));
        let long = &got[1];
        assert_eq!((long.line, long.bytes.len()), (2, KEPT_OF_LONG));
        let why = long.malformed.as_deref().unwrap();
        assert!(why.contains(&format!("line 2 is {} bytes long", MAX_LINE + 5000)), "{why}");
        assert_eq!((got[2].line, got[2].bytes.as_slice(), got[2].malformed.is_none()), (3, &b"{\"a\":3}"[..], true));
    }

    #[tokio::test]
    async fn a_followed_file_gives_whole_lines_as_they_are_written_and_notices_a_truncation() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("weir-io-follow-{}", std::process::id()));
        std::fs::write(&path, b"{\"a\":1}\n\n").unwrap();
        let mut lines = Box::pin(follow(path.clone(), std::time::Duration::from_millis(5)));
        let first: RawLine = tokio::time::timeout(std::time::Duration::from_secs(5), lines.next())
            .await
            .expect("in time")
            .unwrap()
            .unwrap();
        assert_eq!((first.line, first.bytes.as_slice()), (1, &b"{\"a\":1}"[..]));
        // Nothing more yet: the stream waits rather than ends.
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), lines.next()).await.is_err());
        // A line written in two pieces is read once, whole.
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"a\":").unwrap();
        f.flush().unwrap();
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), lines.next()).await.is_err());
        f.write_all(b"2}\n").unwrap();
        let second = tokio::time::timeout(std::time::Duration::from_secs(5), lines.next())
            .await
            .expect("in time")
            .unwrap()
            .unwrap();
        assert_eq!((second.line, second.bytes.as_slice()), (3, &b"{\"a\":2}"[..]));
        // Truncated: an error that says so, then the end.
        f.set_len(0).unwrap();
        let err = tokio::time::timeout(std::time::Duration::from_secs(5), lines.next())
            .await
            .expect("in time")
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("shrank"), "{err}");
        assert!(tokio::time::timeout(std::time::Duration::from_secs(5), lines.next())
            .await
            .expect("in time")
            .is_none());
        std::fs::remove_file(&path).unwrap();
    }

    /// Issue #29, item 11: truncated and written again, longer, between two looks (copytruncate,
    /// or `> file` and quick appends): an error, not lines taken from the old offset.
    #[tokio::test]
    async fn a_followed_file_rewritten_longer_within_one_poll_is_an_error() {
        let path = std::env::temp_dir().join(format!("weir-io-follow-rewrite-{}", std::process::id()));
        let old: String = (0..3).map(|i| format!("{{\"old\":{i}}}\n")).collect();
        std::fs::write(&path, &old).unwrap();
        let mut lines = Box::pin(follow(path.clone(), std::time::Duration::from_millis(200)));
        for n in 1..=3 {
            let l = lines.next().await.unwrap().unwrap();
            assert_eq!(l.line, n);
        }
        // Within one poll: the file is replaced in place by more, other lines.
        let new: String = (0..20).map(|i| format!("{{\"new\":{i}}}\n")).collect();
        std::fs::write(&path, &new).unwrap();
        let err = tokio::time::timeout(std::time::Duration::from_secs(5), lines.next())
            .await
            .expect("in time")
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("truncated and written again"), "{err}");
        // Appends alone are taken as before.
        std::fs::write(&path, &old).unwrap();
        let mut lines = Box::pin(follow(path.clone(), std::time::Duration::from_millis(5)));
        for _ in 0..3 {
            lines.next().await.unwrap().unwrap();
        }
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        std::io::Write::write_all(&mut f, b"{\"more\":1}\n").unwrap();
        let l = lines.next().await.unwrap().unwrap();
        assert_eq!((l.line, l.bytes.as_slice()), (4, &b"{\"more\":1}"[..]));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn counts_records() {
        let dir = std::env::temp_dir().join(format!("weir-io-count-{}", std::process::id()));
        std::fs::write(&dir, b"a\n\nb\n  \nc").unwrap();
        assert_eq!(count_records(&dir).unwrap(), 3);
        std::fs::remove_file(&dir).unwrap();
    }
}

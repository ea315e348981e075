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

/// The lines of a reader as a stream. Blank lines are not records and are skipped; line
/// numbers still count them, so a line number always points at the file.
pub fn lines(reader: Box<dyn AsyncRead + Send + Unpin>) -> impl Stream<Item = io::Result<RawLine>> + Send {
    let reader = BufReader::with_capacity(BUFFER, reader);
    futures::stream::unfold((reader, 0u64, false), |(mut reader, mut n, done)| async move {
        if done {
            return None;
        }
        loop {
            let mut bytes = Vec::new();
            match reader.read_until(b'\n', &mut bytes).await {
                Ok(0) => return None,
                Ok(_) => {
                    n += 1;
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
                        continue;
                    }
                    return Some((Ok(RawLine { line: n, bytes, malformed: None }), (reader, n, false)));
                }
                Err(e) => return Some((Err(e), (reader, n, true))),
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
    fn counts_records() {
        let dir = std::env::temp_dir().join(format!("weir-io-count-{}", std::process::id()));
        std::fs::write(&dir, b"a\n\nb\n  \nc").unwrap();
        assert_eq!(count_records(&dir).unwrap(), 3);
        std::fs::remove_file(&dir).unwrap();
    }
}

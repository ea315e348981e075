//! The three table formats and how a name says which one it is.

use std::fmt;
use std::str::FromStr;

/// A table format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// One JSON object per line.
    Jsonl,
    /// Comma-separated values with a header row.
    Csv,
    /// Apache Parquet.
    Parquet,
}

impl Format {
    /// The format a file name's extension says (`.jsonl`, `.json`, `.ndjson`, `.csv`,
    /// `.parquet`, `.pq`), if it says one.
    pub fn from_name(name: &str) -> Option<Self> {
        let name = name.trim_end_matches('/');
        let ext = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase())?;
        match ext.as_str() {
            "jsonl" | "json" | "ndjson" => Some(Self::Jsonl),
            "csv" => Some(Self::Csv),
            "parquet" | "pq" => Some(Self::Parquet),
            _ => None,
        }
    }

    /// The extension weir gives the files it writes in this format.
    pub fn extension(self) -> &'static str {
        match self {
            Self::Jsonl => "jsonl",
            Self::Csv => "csv",
            Self::Parquet => "parquet",
        }
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "jsonl" | "json" | "ndjson" => Ok(Self::Jsonl),
            "csv" => Ok(Self::Csv),
            "parquet" => Ok(Self::Parquet),
            other => Err(format!("unknown format '{other}': use jsonl, csv or parquet")),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.extension())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_formats() {
        assert_eq!(Format::from_name("s3://b/x.PARQUET"), Some(Format::Parquet));
        assert_eq!(Format::from_name("a/b.csv"), Some(Format::Csv));
        assert_eq!(Format::from_name("out.jsonl/"), Some(Format::Jsonl));
        assert_eq!(Format::from_name("results"), None);
        assert_eq!("Parquet".parse::<Format>(), Ok(Format::Parquet));
        assert!("xml".parse::<Format>().is_err());
    }
}

//! Telling files apart by what they are, not how they are spelled.
//!
//! `p.jsonl`, `./p.jsonl`, `../dir/p.jsonl` and a symlink to it are one file. Comparing path
//! strings misses that, and a run whose `--output` names its `--input` by another spelling would
//! truncate the input before reading it. So files are compared by identity: an existing file by
//! its device and inode; a file that does not exist yet by the canonical path of its nearest
//! existing ancestor joined with the rest (a file that does not exist cannot be any existing one,
//! and two spellings of a future file resolve to the same canonical path).

use std::io;
use std::path::{Component, Path, PathBuf};

/// What a path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileId {
    /// An existing file: device and inode.
    Inode(u64, u64),
    /// A file not yet created: its canonical path.
    Future(PathBuf),
}

/// The identity of the file `path` names (following symlinks).
pub fn file_id(path: &Path) -> io::Result<FileId> {
    match std::fs::metadata(path) {
        Ok(m) => inode(path, &m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(FileId::Future(future_path(path)?)),
        Err(e) => Err(e),
    }
}

#[cfg(unix)]
fn inode(_path: &Path, m: &std::fs::Metadata) -> io::Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    Ok(FileId::Inode(m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn inode(path: &Path, _m: &std::fs::Metadata) -> io::Result<FileId> {
    // Without inodes, the canonical path identifies an existing file.
    Ok(FileId::Future(std::fs::canonicalize(path)?))
}

/// The canonical spelling of a path that does not exist (yet): the nearest existing ancestor,
/// canonicalized, with the remaining components applied lexically.
fn future_path(path: &Path) -> io::Result<PathBuf> {
    let abs = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir()?.join(path) };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(canonical) = std::fs::canonicalize(existing) {
            let mut out = canonical;
            for c in rest.iter().rev() {
                match c {
                    Component::ParentDir => {
                        out.pop();
                    }
                    Component::CurDir => {}
                    other => out.push(other.as_os_str()),
                }
            }
            return Ok(out);
        }
        match (existing.parent(), existing.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                existing = parent;
            }
            _ => return Ok(abs),
        }
    }
}

/// The directory a file is in: its parent, or `.` for a bare file name.
pub fn parent_dir(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// True when `path` names something other than a regular file (a FIFO, a terminal,
/// `/dev/stdin`, a process substitution): reading it consumes it, so it can be read only once.
pub fn is_stream(path: &Path) -> bool {
    std::fs::metadata(path).map(|m| !m.file_type().is_file()).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_of_one_file_are_one_file() {
        let d = std::env::temp_dir().join(format!("weir-paths-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let f = d.join("p.jsonl");
        std::fs::write(&f, b"x\n").unwrap();
        let id = file_id(&f).unwrap();
        assert_eq!(file_id(&d.join("sub/../p.jsonl")).unwrap(), id);
        assert_eq!(file_id(&d.join("./p.jsonl")).unwrap(), id);
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&f, d.join("link.jsonl")).unwrap();
            assert_eq!(file_id(&d.join("link.jsonl")).unwrap(), id);
        }
        // Files not yet created: two spellings agree, different names differ.
        let a = file_id(&d.join("new/x.jsonl")).unwrap();
        assert_eq!(a, file_id(&d.join("sub/../new/./x.jsonl")).unwrap());
        assert_ne!(a, file_id(&d.join("new/y.jsonl")).unwrap());
        assert!(!is_stream(&f));
        std::fs::remove_dir_all(&d).unwrap();
    }
}

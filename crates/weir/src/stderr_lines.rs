//! `eprintln!` and `eprint!` that never panic, in place of std's (a crate root declares this
//! module first, with `#[macro_use]`, so that every module after it uses these).

/// A line to stderr that never panics. std's `eprintln!` panics when stderr is a pipe whose
/// reader went away (`weir run … 2>&1 | head -3`): the run ended there, exit 101, its answered
/// records unwritten and the rest without an `aborted` row. What was to be said is lost; the
/// run goes on as with stderr open.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Text to stderr that never panics (see `eprintln!` above).
#[allow(unused_macros)]
macro_rules! eprint {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}

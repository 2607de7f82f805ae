//! Loading one plugin shared library through abi_stable, and turning its errors into short [`LoadError`]s.
//! Uses `lib_header_from_path(..).init_root_module()` on a canonical path, never `load_from_file`
//! (which caches the first module it ever loaded). Never unloads a library (abi_stable leaks them).

use crate::error::LoadError;
use kvgate_abi::abi_stable::library::{lib_header_from_path, LibHeader, LibraryError};
use kvgate_abi::module::first_release;
use kvgate_abi::PluginModRef;
use std::path::{Path, PathBuf};

/// At most this many `Error:` lines of a layout mismatch are kept in [`LoadError::AbiInstability`].
pub const MAX_ABI_ERROR_LINES: usize = 6;

/// Canonicalise `path` (resolving a relative path against the current directory, so a bare file name
/// is never looked up in the loader's search path).
pub fn canonical_plugin_path(path: &Path) -> Result<PathBuf, LoadError> {
    std::fs::canonicalize(path).map_err(|e| LoadError::NotFound { path: path.to_path_buf(), message: e.to_string() })
}

/// Open the library at the canonical `path` and check its root module's layout.
/// The ABI version is checked by the caller.
pub fn load_root_module(path: &Path) -> Result<PluginModRef, LoadError> {
    let header = lib_header_from_path(path).map_err(|e| library_error(path, e))?;
    match header.init_root_module::<PluginModRef>() {
        Ok(module) => Ok(module),
        // abi_stable refuses a module with fewer fields than ours: a plugin built before a field was
        // appended. One with exactly the first release's fields is read with the appended ones absent.
        Err(e @ LibraryError::AbiInstability(_)) => first_release_module(header).ok_or_else(|| library_error(path, e)),
        Err(e) => Err(library_error(path, e)),
    }
}

/// The library's module read as ours when it has exactly the fields of ABI v1's first release, each
/// checked against it (`kvgate_abi::module::first_release`); `None` otherwise (its version was
/// already checked, and the full check's report is the reason to give).
fn first_release_module(header: &LibHeader) -> Option<PluginModRef> {
    header.check_layout::<first_release::PluginModRef>().ok()?.into_current()
}

/// Map an abi_stable error to a [`LoadError`], keeping messages to a few lines.
pub fn library_error(path: &Path, error: LibraryError) -> LoadError {
    let path = path.to_path_buf();
    match error {
        LibraryError::OpenError { err, .. } => LoadError::OpenFailed { path, message: err.to_string() },
        LibraryError::GetSymbolError { symbol, .. } => LoadError::NotAPlugin {
            path,
            message: format!("no abi_stable root module (symbol {:?} missing)", String::from_utf8_lossy(&symbol)),
        },
        LibraryError::AbiInstability(report) => {
            LoadError::AbiInstability { path, summary: abi_error_summary(&report.to_string()) }
        }
        LibraryError::InvalidAbiHeader(header) => LoadError::AbiInstability {
            path,
            summary: format!("Error: abi_stable header {header:?} is incompatible with the host's"),
        },
        LibraryError::InvalidCAbi { .. } => LoadError::AbiInstability {
            path,
            summary: "Error: the library was built by a compiler with another C ABI".to_string(),
        },
        // abi_stable's own text puts the two versions on lines of their own, which one line would drop.
        LibraryError::IncompatibleVersionNumber { expected_version, actual_version, .. } => LoadError::LibraryVersionMismatch {
            path,
            message: format!(
                "built against kvgate-abi {actual_version}, which this host (kvgate-abi {expected_version}) does not load: \
                 only plugins of its own minor series do (core/abi/ABI.md)"
            ),
        },
        e @ LibraryError::ParseVersionError(_) => LoadError::LibraryVersionMismatch { path, message: first_line(&e.to_string()) },
        LibraryError::RootModule { err, .. } => {
            LoadError::RootModuleFailed { path, message: first_line(&err.to_string()) }
        }
        LibraryError::Many(errors) => match errors.into_iter().next() {
            Some(first) => library_error(&path, first),
            None => LoadError::RootModuleFailed { path, message: "unspecified abi_stable error".to_string() },
        },
    }
}

/// Keep only the `Error:` lines of abi_stable's (often hundreds of lines long) layout report, each with
/// the first line of its `Expected:` and `Found:` values, at most [`MAX_ABI_ERROR_LINES`] of them,
/// with a count of the rest.
// CONFORMANCE: HYGIENE-2 (a short, clear message)
pub fn abi_error_summary(report: &str) -> String {
    let lines: Vec<&str> = report.lines().map(str::trim).collect();
    let mut errors = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if !line.starts_with("Error:") {
            continue;
        }
        let mut detail = Vec::new();
        for (j, next) in lines.iter().enumerate().skip(i + 1).take(6) {
            if next.starts_with("Error:") {
                break;
            }
            if let Some(label) = next.strip_suffix(':').filter(|l| *l == "Expected" || *l == "Found") {
                let value = lines.get(j + 1).copied().unwrap_or("");
                detail.push(format!("{} {}", label.to_lowercase(), shorten(value, 100)));
            }
        }
        errors.push(if detail.is_empty() { line.to_string() } else { format!("{line} ({})", detail.join(", ")) });
    }
    if errors.is_empty() {
        return first_line(report);
    }
    let total = errors.len();
    errors.truncate(MAX_ABI_ERROR_LINES);
    if total > MAX_ABI_ERROR_LINES {
        errors.push(format!("({} more Error: lines)", total - MAX_ABI_ERROR_LINES));
    }
    errors.join("\n")
}

fn shorten(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_keeps_error_lines_with_expected_and_found() {
        let report = "Compared <this>:\n    --- Type Layout ---\n    type:X\n\nError:mismatched package\nExpected:\n    kvgate-abi\nFound:\n    other\n\n";
        assert_eq!(abi_error_summary(report), "Error:mismatched package (expected kvgate-abi, found other)");
    }

    #[test]
    fn summary_is_capped_with_a_count_of_the_rest() {
        let report: String = (0..20).map(|i| format!("noise\nError:problem {i}\n")).collect();
        let summary = abi_error_summary(&report);
        let lines: Vec<&str> = summary.lines().collect();
        assert_eq!(lines.len(), MAX_ABI_ERROR_LINES + 1, "{summary}");
        assert_eq!(lines[0], "Error:problem 0");
        assert_eq!(lines[MAX_ABI_ERROR_LINES], format!("({} more Error: lines)", 20 - MAX_ABI_ERROR_LINES));
    }

    #[test]
    fn summary_without_error_lines_is_the_first_line() {
        assert_eq!(abi_error_summary("\n  something odd\nmore"), "something odd");
    }
}

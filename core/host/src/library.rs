//! Loading one plugin shared library through abi_stable, and turning its errors into short [`LoadError`]s.
//! Uses `lib_header_from_path(..).init_root_module()` on a canonical path, never `load_from_file`
//! (which caches the first module it ever loaded). Never unloads a library (abi_stable leaks them).

use crate::error::LoadError;
use kvgate_abi::abi_stable::library::{lib_header_from_path, LibraryError};
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
    header.init_root_module::<PluginModRef>().map_err(|e| library_error(path, e))
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
        e @ (LibraryError::ParseVersionError(_) | LibraryError::IncompatibleVersionNumber { .. }) => {
            LoadError::LibraryVersionMismatch { path, message: first_line(&e.to_string()) }
        }
        LibraryError::RootModule { err, .. } => LoadError::RootModuleFailed { path, message: first_line(&err.to_string()) },
        LibraryError::Many(errors) => match errors.into_iter().next() {
            Some(first) => library_error(&path, first),
            None => LoadError::RootModuleFailed { path, message: "unspecified abi_stable error".to_string() },
        },
    }
}

/// Keep only the `Error:` lines of abi_stable's (often hundreds of lines long) layout report,
/// at most [`MAX_ABI_ERROR_LINES`] of them, with a count of the rest.
pub fn abi_error_summary(report: &str) -> String {
    let errors: Vec<&str> =
        report.lines().map(str::trim).filter(|line| line.starts_with("Error:")).collect();
    if errors.is_empty() {
        return first_line(report);
    }
    let mut kept: Vec<String> = errors.iter().take(MAX_ABI_ERROR_LINES).map(|l| l.to_string()).collect();
    if errors.len() > MAX_ABI_ERROR_LINES {
        kept.push(format!("({} more Error: lines)", errors.len() - MAX_ABI_ERROR_LINES));
    }
    kept.join("\n")
}

fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("").to_string()
}

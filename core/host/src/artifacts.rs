//! Finding plugin libraries that cargo built next to the running executable (tests, harness, benches).
//! Looks only in the current profile's target directory (`target/<profile>/`, wherever
//! `CARGO_TARGET_DIR` put it); never builds anything and never searches the loader path.

use std::path::PathBuf;

/// The file name cargo gives a cdylib with this lib name on this platform (`libkvgate_shm.so`).
pub fn cdylib_file_name(lib_name: &str) -> String {
    format!("{}{lib_name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

/// Where the cdylib `lib_name` of the `package` crate was built for the profile of the running
/// executable. A test binary lives in `target/<profile>/deps/`, a binary in `target/<profile>/`; the
/// cdylib is in `target/<profile>/`. The error says which command builds it.
pub fn built_cdylib_path(package: &str, lib_name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the running executable: {e}"))?;
    let file = cdylib_file_name(lib_name);
    let mut searched = Vec::new();
    let exe_dir = exe.parent().ok_or("the running executable has no directory")?;
    // A test binary in `<profile>/deps/`: the uplifted copy in `<profile>/` first, then `deps/` itself.
    let dirs: Vec<&std::path::Path> = match exe_dir.parent() {
        Some(profile_dir) if exe_dir.ends_with("deps") => vec![profile_dir, exe_dir],
        _ => vec![exe_dir],
    };
    for dir in dirs {
        let candidate = dir.join(&file);
        if candidate.is_file() {
            return Ok(candidate);
        }
        searched.push(dir.display().to_string());
    }
    let release = if exe.ancestors().any(|d| d.file_name().is_some_and(|n| n == "release")) { " --release" } else { "" };
    Err(format!(
        "{file} not found in {}; build it with `cargo build{release} -p {package}` \
         (with the same CARGO_TARGET_DIR), or run `cargo test --workspace{release}`, which builds every plugin",
        searched.join(" or ")
    ))
}

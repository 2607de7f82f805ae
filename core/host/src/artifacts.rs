//! Finding plugin libraries and binaries that cargo built next to the running executable (tests,
//! harness, benches), and building one there when it is missing (`cargo test` builds test harnesses,
//! not cdylibs, and only the binaries of the package under test).
//! Looks only in the current profile's target directory (`target/<profile>/`, wherever
//! `CARGO_TARGET_DIR` put it); never searches the loader path.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// The file name cargo gives a cdylib with this lib name on this platform (`libkvgate_shm.so`).
pub fn cdylib_file_name(lib_name: &str) -> String {
    format!("{}{lib_name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

/// Where the cdylib `lib_name` of the `package` crate was built for the profile of the running
/// executable. A test binary lives in `target/<profile>/deps/`, a binary in `target/<profile>/`; the
/// cdylib is in `target/<profile>/`. The error says which command builds it.
pub fn built_cdylib_path(package: &str, lib_name: &str) -> Result<PathBuf, String> {
    built_file_path(package, &cdylib_file_name(lib_name))
}

/// Where the binary `bin_name` of the `package` crate was built for the profile of the running
/// executable (`target/<profile>/<bin_name>`).
pub fn built_binary_path(package: &str, bin_name: &str) -> Result<PathBuf, String> {
    built_file_path(package, &format!("{bin_name}{}", std::env::consts::EXE_SUFFIX))
}

fn built_file_path(package: &str, file: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the running executable: {e}"))?;
    let mut searched = Vec::new();
    let exe_dir = exe.parent().ok_or("the running executable has no directory")?;
    // A test binary in `<profile>/deps/`: the uplifted copy in `<profile>/` first, then `deps/` itself.
    let dirs: Vec<&std::path::Path> = match exe_dir.parent() {
        Some(profile_dir) if exe_dir.ends_with("deps") => vec![profile_dir, exe_dir],
        _ => vec![exe_dir],
    };
    for dir in dirs {
        let candidate = dir.join(file);
        if candidate.is_file() {
            return Ok(candidate);
        }
        searched.push(dir.display().to_string());
    }
    let release =
        if exe.ancestors().any(|d| d.file_name().is_some_and(|n| n == "release")) { " --release" } else { "" };
    Err(format!(
        "{file} not found in {}; build it with `cargo build{release} -p {package}` \
         (with the same CARGO_TARGET_DIR), or run `cargo test --workspace{release}`, which builds every plugin",
        searched.join(" or ")
    ))
}

/// `target/<profile>` of an executable that cargo built (in it, or in its `deps/`).
fn profile_dir_of(exe: &Path) -> Result<PathBuf, String> {
    let exe_dir = exe.parent().ok_or("the running executable has no directory")?;
    Ok(match exe_dir.parent() {
        Some(profile_dir) if exe_dir.ends_with("deps") => profile_dir.to_path_buf(),
        _ => exe_dir.to_path_buf(),
    })
}

/// Packages this process already built (each is built at most once per process), behind the lock
/// that serialises builds (several tests may ask for the same library at once).
static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The library, freshly built: runs `cargo build -p <package> --profile <profile of this executable>`
/// once per process, with this executable's target directory, from `workspace_dir` (any directory
/// inside the workspace), so a library older than its sources is never used (`cargo test` builds
/// test harnesses, not cdylibs). A no-op build takes a fraction of a second. Uses `$CARGO` when cargo
/// set it; when no cargo can be started, falls back to an already built library.
pub fn built_or_build_cdylib(package: &str, lib_name: &str, workspace_dir: &Path) -> Result<PathBuf, String> {
    built_or_build(package, &cdylib_file_name(lib_name), workspace_dir)
}

/// The binary `bin_name` of `package`, freshly built, as [`built_or_build_cdylib`] does for a
/// library: the end-to-end tests of a library crate run the `kvgate` binary, which another package
/// (gateway/cli) builds, so `CARGO_BIN_EXE_kvgate` does not reach them.
pub fn built_or_build_binary(package: &str, bin_name: &str, workspace_dir: &Path) -> Result<PathBuf, String> {
    built_or_build(package, &format!("{bin_name}{}", std::env::consts::EXE_SUFFIX), workspace_dir)
}

fn built_or_build(package: &str, file: &str, workspace_dir: &Path) -> Result<PathBuf, String> {
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if built.iter().any(|p| p == package) {
        return built_file_path(package, file);
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the running executable: {e}"))?;
    let profile_dir = profile_dir_of(&exe)?;
    let target_dir = profile_dir.parent().ok_or("the profile directory has no parent")?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => return Err(format!("cannot tell the cargo profile of {}", exe.display())),
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = match Command::new(&cargo)
        .args(["build", "--quiet", "-p", package, "--profile", profile])
        .env("CARGO_TARGET_DIR", target_dir)
        .current_dir(workspace_dir)
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            return built_file_path(package, file)
                .map_err(|missing| format!("cannot run {cargo:?} to build {package} ({e}), and {missing}"))
        }
    };
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
        return Err(format!(
            "`cargo build -p {package} --profile {profile}` failed ({}):\n{}",
            output.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    built.push(package.to_string());
    built_file_path(package, file)
}

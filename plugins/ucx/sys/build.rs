//! Finds the system UCX through pkg-config and generates raw bindings for the UCP API.
//! Enums are newtypes (an unexpected value from C is never undefined behaviour).

fn main() {
    let ucx = pkg_config::Config::new()
        .atleast_version("1.12")
        .probe("ucx")
        .expect("UCX >= 1.12 not found through pkg-config: install libucx-dev (Debian) or set PKG_CONFIG_PATH");
    println!("cargo:rerun-if-changed=wrapper.h");
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*|ucs_status_string")
        .allowlist_type("ucp_.*|ucs_.*")
        .allowlist_var("UCP_.*|UCS_.*")
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .bitfield_enum(
            "ucp_feature|.*_field|.*_flags(_t)?|ucp_op_attr_t|ucp_am_cb_flags|ucp_send_am_flags|ucp_am_recv_attr_t",
        )
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect("bindgen failed on ucp/api/ucp.h");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings.write_to_file(out).expect("writing bindings.rs");
}

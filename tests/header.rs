//! `include/kvxfer.h` must be exactly what the pinned cbindgen generates from the
//! current source, with the version macros of Cargo.toml. Regenerate with `make header`
//! (which runs this test with KVXFER_BLESS=1).

use std::path::Path;

fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config =
        cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml is readable");
    let version = env!("CARGO_PKG_VERSION");
    config.after_includes = Some(format!(
        "\n#define KVXFER_VERSION \"{version}\"\n\
         #define KVXFER_VERSION_MAJOR {}\n\
         #define KVXFER_VERSION_MINOR {}\n\
         #define KVXFER_VERSION_PATCH {}\n\n\
         #if defined(__GNUC__) || defined(__clang__)\n\
         #define KVXFER_MUST_USE __attribute__((warn_unused_result))\n\
         #else\n\
         #define KVXFER_MUST_USE\n\
         #endif",
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_PATCH"),
    ));
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_crate(root)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

#[test]
fn committed_header_matches_the_source() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvxfer.h");
    let fresh = generate();
    if std::env::var_os("KVXFER_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write include/kvxfer.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/kvxfer.h is stale: run `make header` and commit the result"
    );
}

#[test]
fn header_version_macros_match_cargo() {
    let h = generate();
    assert!(h.contains(&format!(
        "#define KVXFER_VERSION \"{}\"",
        env!("CARGO_PKG_VERSION")
    )));
    // SAFETY: kvxfer_version returns a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr(kvxfer::ffi::status::kvxfer_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

//! Sets the shared library's versioned SONAME: `libkvxfer.so.<major>` from 1.0 on, and
//! `libkvxfer.so.0.<minor>` before 1.0 (where each minor release may break the ABI).

fn main() {
    let major: u32 = env!("CARGO_PKG_VERSION_MAJOR").parse().unwrap_or(0);
    let minor: u32 = env!("CARGO_PKG_VERSION_MINOR").parse().unwrap_or(0);
    let soname = if major == 0 {
        format!("libkvxfer.so.0.{minor}")
    } else {
        format!("libkvxfer.so.{major}")
    };
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    }
    println!("cargo:rustc-env=KVXFER_SONAME={soname}");
    println!("cargo:rerun-if-changed=build.rs");
}

//! `include/kvxfer.h` must be exactly what the pinned cbindgen generates from the
//! current source, with the version macros of Cargo.toml. Regenerate with `make header`
//! (which runs this test with KVXFER_BLESS=1).

use std::path::Path;

use kvxfer::ffi::types::{KVXFER_METRICS_CAUSES, KVXFER_ROOM_STATES};

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
         #endif\n\n\
         /* Entries of kvxfer_metrics.rooms_by_state: one per kvxfer_room_state value. */\n\
         #define KVXFER_ROOM_STATES {KVXFER_ROOM_STATES}\n\n\
         /* Entries of kvxfer_metrics.rooms_failed_by_cause, indexed by kvxfer_failure_cause\n \
         * value, with room for causes added later (index 0 and unused values stay 0). */\n\
         #define KVXFER_METRICS_CAUSES {KVXFER_METRICS_CAUSES}",
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

/// `kvxfer_config_set`'s documentation is the C user's list of keys: one item per key of
/// `kvxfer::config::KEYS`, in its order, each naming the key's default and the values it
/// takes.
#[test]
fn the_header_documents_every_config_key_with_its_default_and_values() {
    use kvxfer::config::{Accepts, KEYS};
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvxfer.h"))
            .unwrap();
    let decl = header
        .find("kvxfer_status kvxfer_config_set(")
        .expect("kvxfer_config_set is declared");
    let doc = &header[header[..decl].rfind("/**").unwrap()..decl];
    // The doc's list items, each with its continuation lines.
    let mut items: Vec<String> = Vec::new();
    for line in doc.lines().map(|l| l.trim_start().trim_start_matches('*')) {
        if let Some(item) = line.strip_prefix(" - ") {
            items.push(item.to_string());
        } else if let (Some(last), Some(more)) = (items.last_mut(), line.strip_prefix("   ")) {
            last.push(' ');
            last.push_str(more);
        }
    }
    let names: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
    let documented: Vec<&str> = items
        .iter()
        .map(|i| i.split('`').nth(1).unwrap_or(""))
        .collect();
    assert_eq!(documented, names, "the keys listed on kvxfer_config_set");
    for (k, item) in KEYS.iter().zip(&items) {
        let mut wants = Vec::new();
        match k.default {
            Some("") => wants.push("default empty".to_string()),
            Some(d) => wants.push(format!("default `{d}`")),
            None => {}
        }
        match k.accepts {
            Accepts::Int { min, max } => wants.push(format!("{min}..{max}")),
            Accepts::OneOf(words) => wants.extend(words.iter().map(|w| format!("`{w}`"))),
            Accepts::Text => {}
        }
        for want in wants {
            assert!(
                item.contains(&want),
                "kvxfer_config_set's item for `{}` lacks {want}: {item}",
                k.name
            );
        }
    }
}

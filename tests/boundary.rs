//! Every exported function must run its body inside the panic boundary, and every
//! function the header declares must be exported from `src/ffi/`.

use std::path::Path;

/// (file, function name, whether its body starts with a boundary macro) of every
/// `#[no_mangle]` function: the exports (an `extern "C"` callback a unit test defines is
/// not one).
fn exports() -> Vec<(String, String, bool)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ffi");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let src = std::fs::read_to_string(&path).unwrap();
        for export in src.split("#[no_mangle]").skip(1) {
            let Some(i) = export.find("extern \"C\" fn ") else {
                continue;
            };
            let after = &export[i + "extern \"C\" fn ".len()..];
            let name: String = after
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // The body starts at the first '{' after the signature's closing ')'.
            let body = after
                .find('{')
                .map(|b| after[b + 1..].trim_start())
                .unwrap_or("");
            let guarded = body.starts_with("ffi_status!(") || body.starts_with("ffi_value!(");
            out.push((
                path.file_name().unwrap().to_string_lossy().into_owned(),
                name,
                guarded,
            ));
        }
    }
    out
}

#[test]
fn every_export_runs_inside_the_panic_boundary() {
    let exports = exports();
    assert!(exports.len() >= 20, "found only {} exports", exports.len());
    let bare: Vec<_> = exports.iter().filter(|e| !e.2).collect();
    assert!(
        bare.is_empty(),
        "exports without ffi_status!/ffi_value!: {bare:?}"
    );
}

#[test]
fn every_header_function_is_a_guarded_export() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvxfer.h"))
            .unwrap();
    let exports = exports();
    let mut declared = 0;
    for line in header.lines() {
        let t = line.trim_end();
        if !t.ends_with(");") || t.starts_with("typedef") || t.starts_with(' ') {
            continue;
        }
        let Some(open) = t.find('(') else { continue };
        let name = t[..open].split_whitespace().last().unwrap_or("");
        let name = name.trim_start_matches('*');
        declared += 1;
        assert!(
            exports.iter().any(|e| e.1 == name && e.2),
            "{name} is declared in the header but is not a guarded export in src/ffi/"
        );
    }
    assert_eq!(declared, exports.len(), "header and src/ffi/ disagree");
}

#[test]
fn the_header_declares_only_kvxfer_names() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvxfer.h"))
            .unwrap();
    for line in header.lines() {
        let t = line.trim();
        let name = if t.ends_with('{') || t.contains("//") {
            None
        } else if let Some(r) = t.strip_prefix("} ") {
            r.trim_end_matches(';').split_whitespace().last()
        } else if let Some(r) = t.strip_prefix("#define ") {
            r.split_whitespace().next()
        } else if let Some(r) = t.strip_prefix("typedef ") {
            match r.find("(*") {
                Some(i) => r[i + 2..].split(')').next(),
                None => r.trim_end_matches(';').split_whitespace().last(),
            }
        } else if let Some(r) = t.strip_prefix("enum ") {
            r.split_whitespace().next()
        } else {
            None
        };
        let Some(name) = name else { continue };
        let name = name.trim_start_matches('*').split('(').next().unwrap();
        assert!(
            name.starts_with("kvxfer_") || name.starts_with("KVXFER_"),
            "the header declares '{name}' without the kvxfer prefix: {line}"
        );
    }
}

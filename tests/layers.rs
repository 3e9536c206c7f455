//! The layers of the library as docs/ARCHITECTURE.md draws them, checked in the source:
//! who may change a room's state, who may name whom, and how large an engine file may
//! grow. Like tests/boundary.rs for the panic boundary, these fail as soon as a change
//! crosses a line, whatever else it does right.

use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, with its text.
fn files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path, text));
            }
        }
    }
    assert!(!out.is_empty(), "no source under {}", dir.display());
    out
}

/// The lines of `text` that are code (not comments), with their numbers.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
}

/// "Who may change a room's state" has two answers: `room/` (the rule and the
/// compare-and-swap) and `engine/lifecycle.rs` (when each event fires). No other engine
/// file calls `advance`, `fail` or `fail_in` on a room.
#[test]
fn only_the_lifecycle_changes_a_room_s_state() {
    let mut found = Vec::new();
    for (path, text) in files(&src().join("engine")) {
        if path.ends_with("lifecycle.rs") {
            continue;
        }
        for (n, line) in code_lines(&text) {
            for call in [".advance(", ".fail(", ".fail_in("] {
                if line.contains(call) {
                    found.push(format!("{}:{n}: {}", path.display(), line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "state changes outside lifecycle.rs:\n{}",
        found.join("\n")
    );
    let lifecycle = std::fs::read_to_string(src().join("engine/lifecycle.rs")).unwrap();
    assert!(lifecycle.contains(".advance(") && lifecycle.contains(".fail("));
}

/// The lower layers never name the engine: control, transport, proto, room and the node
/// are below it, and the engine talks down to them (control reaches the engine only
/// through its `Events` trait).
#[test]
fn no_lower_layer_names_the_engine() {
    let mut found = Vec::new();
    for dir in ["control", "transport", "proto", "room"] {
        for (path, text) in files(&src().join(dir)) {
            for (n, line) in code_lines(&text) {
                if line.contains("crate::engine") || line.contains("super::super::engine") {
                    found.push(format!("{}:{n}: {}", path.display(), line.trim()));
                }
            }
        }
    }
    for file in ["node.rs", "metrics.rs"] {
        let text = std::fs::read_to_string(src().join(file)).unwrap();
        for (n, line) in code_lines(&text) {
            if line.contains("crate::engine") {
                found.push(format!("src/{file}:{n}: {}", line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a lower layer names the engine:\n{}",
        found.join("\n")
    );
}

/// Transport and proto do not name the control layer either: a transport moves bytes,
/// the control layer decides what they mean.
#[test]
fn transport_and_proto_do_not_name_the_control_layer() {
    let mut found = Vec::new();
    for dir in ["transport", "proto", "room"] {
        for (path, text) in files(&src().join(dir)) {
            for (n, line) in code_lines(&text) {
                if line.contains("crate::control") {
                    found.push(format!("{}:{n}: {}", path.display(), line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// An engine file holds one idea: none grows past about 600 lines.
#[test]
fn no_engine_file_is_larger_than_600_lines() {
    let big: Vec<String> = files(&src().join("engine"))
        .into_iter()
        .filter(|(_, text)| text.lines().count() > 600)
        .map(|(path, text)| format!("{}: {} lines", path.display(), text.lines().count()))
        .collect();
    assert!(big.is_empty(), "{}", big.join("\n"));
}

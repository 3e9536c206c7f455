//! The library's room state machine, compiled from the library's own source file, for
//! the loom model in `tests/loom_room.rs`. Nothing here is a copy: `state` is
//! `src/room/state.rs` itself, so the model checks the very `transition` and
//! `StateWord::apply` that the engine runs.

#[path = "../../src/room/state.rs"]
pub mod state;

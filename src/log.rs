//! Per-engine logging: a sink (a callback) and a minimum level. The library installs no
//! global logger; without a sink, messages go to stderr.

use std::fmt;
use std::sync::Arc;

/// Severity, most severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Something failed.
    Error = 1,
    /// Something is wrong but handled (a room failed, a peer was lost).
    Warn = 2,
    /// Lifecycle events.
    Info = 3,
    /// Per-room detail.
    Debug = 4,
    /// Per-chunk detail.
    Trace = 5,
}

impl Level {
    /// Parses a level name.
    pub fn parse(s: &str) -> Option<Level> {
        Some(match s {
            "error" => Level::Error,
            "warn" => Level::Warn,
            "info" => Level::Info,
            "debug" => Level::Debug,
            "trace" => Level::Trace,
            _ => return None,
        })
    }

    /// The level for a raw value.
    pub fn from_u32(v: u32) -> Option<Level> {
        Some(match v {
            1 => Level::Error,
            2 => Level::Warn,
            3 => Level::Info,
            4 => Level::Debug,
            5 => Level::Trace,
            _ => return None,
        })
    }

    /// The level's name.
    pub fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        }
    }
}

/// A log sink: called from any library thread with a level and one line of text.
pub type Sink = Arc<dyn Fn(Level, &str) + Send + Sync>;

/// An engine's logger.
#[derive(Clone)]
pub struct Logger {
    min: Level,
    sink: Option<Sink>,
}

impl fmt::Debug for Logger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logger")
            .field("min", &self.min)
            .field("sink", &self.sink.is_some())
            .finish()
    }
}

impl Logger {
    /// A logger passing messages at `min` or more severe to `sink` (stderr if `None`).
    pub fn new(min: Level, sink: Option<Sink>) -> Self {
        Logger { min, sink }
    }

    /// Whether a message at `level` would be passed on.
    pub fn enabled(&self, level: Level) -> bool {
        level <= self.min
    }

    /// Passes `args` on at `level` if enabled.
    pub fn log(&self, level: Level, args: fmt::Arguments<'_>) {
        if !self.enabled(level) {
            return;
        }
        let line = args.to_string();
        match &self.sink {
            Some(sink) => sink(level, &line),
            None => eprintln!("kvxfer {}: {}", level.name(), line),
        }
    }
}

/// `log!(logger, Warn, "room {} failed: {}", id, why)`
#[macro_export]
#[doc(hidden)]
macro_rules! log {
    ($logger:expr, $level:ident, $($fmt:tt)+) => {{
        let l = &$logger;
        if l.enabled($crate::log::Level::$level) {
            l.log($crate::log::Level::$level, format_args!($($fmt)+));
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    #[test]
    fn only_messages_at_or_above_the_minimum_reach_the_sink() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let logger = Logger::new(
            Level::Info,
            Some(Arc::new(move |l, m: &str| {
                s.lock().push((l, m.to_string()))
            })),
        );
        crate::log!(logger, Debug, "hidden {}", 1);
        crate::log!(logger, Warn, "shown {}", 2);
        crate::log!(logger, Info, "shown {}", 3);
        let seen = seen.lock();
        assert_eq!(
            *seen,
            vec![
                (Level::Warn, "shown 2".to_string()),
                (Level::Info, "shown 3".to_string())
            ]
        );
    }
}

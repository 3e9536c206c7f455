//! Test engines: their config, their registered buffers, what they log, and the
//! cluster key files they read.

use std::sync::{Arc, Mutex};

use kvxfer::log::{Level, Logger, Sink};
use kvxfer::{BufferDesc, Config, Engine};

use super::memory::Region;
use super::wait::wait_until;

/// The transport the integration tests run over: `tcp`, unless KVXFER_TEST_TRANSPORT
/// says otherwise (`make test-rdma` runs the suites with `rdma` inside a soft-RoCE guest).
pub fn test_transport() -> String {
    std::env::var("KVXFER_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

/// The `same_host` setting of the integration tests' engines: `off` (the suites test
/// the TCP path, and the fake engines on raw sockets speak only it), unless
/// KVXFER_TEST_SAME_HOST says otherwise (`make test` runs the transfer suites again
/// with `require`).
pub fn test_same_host() -> String {
    std::env::var("KVXFER_TEST_SAME_HOST").unwrap_or_else(|_| "off".into())
}

/// The `integrity` setting of the integrity tests' engines and fake engines: `verify`
/// (the default of the library), unless KVXFER_TEST_INTEGRITY says otherwise.
pub fn test_integrity() -> String {
    std::env::var("KVXFER_TEST_INTEGRITY").unwrap_or_else(|_| "verify".into())
}

/// The config of an engine of `role` over the test transport and same-host setting,
/// then `extra` in order: a later key wins, so `("transport", "tcp")` pins TCP.
pub fn config(role: &str, extra: &[(&str, &str)]) -> Config {
    let mut c = Config::default();
    c.set("role", role).unwrap();
    c.set("transport", &test_transport()).unwrap();
    c.set("same_host", &test_same_host()).unwrap();
    c.set("integrity", &test_integrity()).unwrap();
    for (k, v) in extra {
        c.set(k, v).unwrap();
    }
    c
}

/// A logger of errors only, to stderr.
pub fn quiet() -> Logger {
    Logger::new(Level::Error, None)
}

/// A started engine of `role` with `extra` config keys (see [`config`]), logging to
/// `log`, with no buffers registered yet.
pub fn start(role: &str, extra: &[(&str, &str)], log: Logger) -> Engine {
    Engine::new(config(role, extra), log).unwrap()
}

/// An engine of `role` with `extra` config keys, logging only errors, its KV buffers
/// registered over `mem`.
pub fn engine(role: &str, mem: &[Region], extra: &[(&str, &str)]) -> Engine {
    let e = start(role, extra, quiet());
    e.register_kv(descs(mem)).unwrap();
    e
}

/// `mem` as buffers to register, one per region, of its pages.
pub fn descs(mem: &[Region]) -> Vec<BufferDesc> {
    mem.iter().map(Region::desc).collect()
}

/// Everything an engine logged, kept by the sink of [`Log::logger`].
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<(Level, String)>>>);

impl Log {
    /// A logger of `level` and above into this log.
    pub fn logger(&self, level: Level) -> Logger {
        let lines = self.0.clone();
        let sink: Sink =
            Arc::new(move |level, line: &str| lines.lock().unwrap().push((level, line.into())));
        Logger::new(level, Some(sink))
    }

    /// The lines logged at `level` that contain `part`.
    pub fn lines(&self, level: Level, part: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, s)| *l == level && s.contains(part))
            .map(|(_, s)| s.clone())
            .collect()
    }

    /// The first line, at any level, that contains every one of `parts`; waits for it.
    pub fn wait_for(&self, parts: &[&str]) -> String {
        let find = || {
            self.0
                .lock()
                .unwrap()
                .iter()
                .find(|(_, s)| parts.iter().all(|p| s.contains(p)))
                .map(|(_, s)| s.clone())
        };
        wait_until(&format!("a log line with {parts:?}"), || find().is_some());
        find().unwrap()
    }
}

/// A cluster key file that only its owner can read, deleted on drop.
pub struct KeyFile {
    pub path: String,
}

impl KeyFile {
    /// A key file named after this process and `name`, holding `bytes`.
    pub fn new(name: &str, bytes: &[u8]) -> KeyFile {
        use std::os::unix::fs::PermissionsExt;
        let path = std::env::temp_dir()
            .join(format!("kvxfer-test-{}-{name}.key", std::process::id()))
            .to_str()
            .unwrap()
            .to_string();
        std::fs::write(&path, bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        KeyFile { path }
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

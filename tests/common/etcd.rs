//! A real etcd for the discovery tests (Debian's `etcd-server`): started on free ports
//! of an address of this host, with a data directory of its own, stopped (and its
//! directory removed) on drop; and read or written with etcd's own client (`etcdctl`).
//! Plus the prefill child process of the discovery tests, whose engine registers.

use std::io::{BufRead, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvxfer::RoomPeers;

use super::child::{plan, BUFS, ITEM, PAGES};
use super::engine::engine;
use super::memory::source;
use super::wait::wait_until_within;

/// A running etcd (or a stopped one that can start again on the same ports).
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    host: String,
    client_port: u16,
    peer_port: u16,
}

/// Whether the etcd binaries are here; if not, says so (the test then skips).
pub fn available() -> bool {
    let ok = [("etcd", "--version"), ("etcdctl", "version")]
        .iter()
        .all(|(b, arg)| {
            Command::new(b)
                .arg(arg)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
    if !ok {
        eprintln!(
            "SKIPPED: etcd or etcdctl not found (Debian: apt-get install etcd-server \
             etcd-client; `make deps` installs them)"
        );
    }
    ok
}

fn free_port(host: &str) -> u16 {
    TcpListener::bind((host, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// An etcd on loopback.
    pub fn start() -> Etcd {
        Self::start_on("127.0.0.1")
    }

    /// An etcd listening on loopback and on `host` (another address of this host).
    pub fn start_on(host: &str) -> Etcd {
        let dir = std::env::temp_dir().join(format!(
            "kvxfer-etcd-{}-{}",
            std::process::id(),
            free_port(host)
        ));
        let mut e = Etcd {
            child: None,
            dir,
            host: host.to_string(),
            client_port: free_port(host),
            peer_port: free_port(host),
        };
        e.run();
        e
    }

    fn run(&mut self) {
        let (h, c, p) = (&self.host, self.client_port, self.peer_port);
        let child = Command::new("etcd")
            .args([
                "--name",
                "kvxfer-test",
                "--data-dir",
                self.dir.to_str().unwrap(),
                "--listen-client-urls",
                &if h == "127.0.0.1" {
                    format!("http://{h}:{c}")
                } else {
                    format!("http://127.0.0.1:{c},http://{h}:{c}")
                },
                "--advertise-client-urls",
                &format!("http://{h}:{c}"),
                "--listen-peer-urls",
                &format!("http://{h}:{p}"),
                "--initial-advertise-peer-urls",
                &format!("http://{h}:{p}"),
                "--initial-cluster",
                &format!("kvxfer-test=http://{h}:{p}"),
                "--log-level",
                "error",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        wait_until_within("etcd to answer", Duration::from_secs(20), || {
            self.ctl(&["endpoint", "health"]).is_ok()
        });
    }

    /// `etcd://host:port`, for the `discovery` key.
    pub fn url(&self) -> String {
        format!("etcd://{}:{}", self.host, self.client_port)
    }

    /// `etcd://127.0.0.1:port`: the same etcd through loopback.
    pub fn local_url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// Stops etcd at once (SIGKILL: its clients see their connections close).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports; with `wipe`, without its data (a rebuilt
    /// cluster: every entry and lease is gone).
    pub fn restart(&mut self, wipe: bool) {
        self.stop();
        if wipe {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        self.run();
    }

    /// Runs `etcdctl` on this etcd: its output, or its error output.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!(
                "--endpoints=http://{}:{}",
                self.host, self.client_port
            ))
            .arg("--command-timeout=2s")
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<String> {
        let out = self.ctl(&["get", key, "--print-value-only"]).unwrap();
        let v = out.strip_suffix('\n').unwrap_or(&out);
        (!v.is_empty()).then(|| v.to_string())
    }

    /// Puts `key` = `value` with etcd's own client (no lease).
    pub fn put(&self, key: &str, value: &str) {
        self.ctl(&["put", key, value]).unwrap();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The discovery tests' child process, if KVXFER_DISCOVERY_CHILD is set: an engine with
/// the config keys of that variable (`key=value` pairs separated by `;`), a prefill
/// engine over the child's source pattern ([`source`]) unless `role=decode` is among
/// them. It says `ADDR host:port`, and `REGISTERED` once it has put its entry into
/// etcd; then it serves from stdin `room R` (prefill: room R of [`plan`], for one decode
/// engine), `from R INSTANCE` (decode: room R pulling from that instance, with page R as
/// its destination) and `quit`.
pub fn discovery_child_main() {
    let Ok(keys) = std::env::var("KVXFER_DISCOVERY_CHILD") else {
        return;
    };
    let extra: Vec<(&str, &str)> = keys
        .split(';')
        .filter(|kv| !kv.is_empty())
        .map(|kv| kv.split_once('=').expect("key=value"))
        .collect();
    let role = if extra.contains(&("role", "decode")) {
        "decode"
    } else {
        "prefill"
    };
    let mem = match role {
        "decode" => super::memory::poisoned(BUFS, PAGES, ITEM),
        _ => source(BUFS, PAGES, ITEM),
    };
    let p = engine(role, &mem, &extra);
    println!("ADDR {}", p.address());
    std::io::stdout().flush().unwrap();
    wait_until_within(
        "the entry to be registered",
        Duration::from_secs(20),
        || p.metrics().registry_registrations > 0,
    );
    println!("REGISTERED");
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let mut w = line.split_whitespace();
        match (w.next(), w.next().and_then(|x| x.parse::<u64>().ok())) {
            (Some("room"), Some(r)) => {
                p.room_create(r, RoomPeers::Decoders(1)).unwrap();
                let (src, chunks) = plan(r);
                let per = src.len().div_ceil(chunks);
                let parts: Vec<&[u32]> = src.chunks(per).collect();
                for (i, part) in parts.iter().enumerate() {
                    p.enqueue_chunk(r, part, i + 1 == parts.len(), None)
                        .unwrap();
                }
            }
            (Some("from"), Some(r)) => {
                p.room_create_from(r, w.next().expect("an instance"))
                    .unwrap();
                p.room_set_destination(r, &[r as u32], None).unwrap();
            }
            (Some("quit"), _) => return,
            _ => panic!("bad command {line}"),
        }
    }
}

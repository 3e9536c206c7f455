//! The same-host path: two engines on one host move KV without the network. The decode
//! engine copies each run straight from the prefill process's registered memory into
//! its own pages with cross-memory attach (`process_vm_readv`, many runs per call), so
//! every byte is copied once, by the kernel, and never crosses a socket.
//!
//! Why the decode engine copies (it pulls), not the prefill (pushing with
//! `process_vm_writev`): nothing can revoke another process's cross-memory access, so a
//! prefill that was stopped in the middle of a push could resume after the decode side
//! gave the pages back and write into them. Pulling, the decode engine's own threads are
//! the only ones that write into its pages: a room drains as over TCP, once no copy of
//! its own is in progress, whatever the prefill process does (it may be stopped or
//! killed: a copy from a stopped process completes, one from a dead one fails).
//!
//! The prefill's source pages are read by the decode process. A prefill batch ends, and
//! the room's io count drops, only once the decode engine answered that batch's `Copy`
//! with `Copied` ([`super::copy_link`]: several batches in flight per link, each ended
//! by its answer), so `kvxfer_room_drained` on the prefill means no copy of the room is
//! in progress. If the decode process stops answering, the prefill gives the link up
//! after its stall (`heartbeat_interval_ms x heartbeat_misses`), ending the batches that
//! wait on it with the error; a decode
//! process that was stopped between its check of the room and its next read call (at
//! most [`MAX_COPY_BYTES`]) may still make that one call when it resumes, whose bytes
//! land only in its own failed room's pages.
//!
//! Pairing (on the control connection, after `Transport`, TCP only): the decode engine
//! offers the path with its identity ([`HostInfo`]: boot id, PID and network
//! namespaces, pid, uid); the prefill answers with its own and a probe, 16 random bytes
//! in its memory; the decode engine decides ([`check`]): another boot id or network
//! namespace is another host; on the same host it reads the probe with
//! `process_vm_readv`, which proves both the permission (same user, Yama
//! `ptrace_scope`, `CAP_SYS_PTRACE`, the prefill's dumpable flag) and that the pid is
//! the prefill's process; it says the path it chose (and why not the fast one) in
//! `PathChoice`, which the prefill applies and echoes before any data connection opens.

use std::io::{self, Write};
use std::net::TcpStream;
use std::os::unix::fs::MetadataExt;

use super::tcp::recv::{Admit, DataStream, FrameSink, Grant};
use crate::cuda::ipc::{CopyError, DtoD, Imports};
use crate::proto::{self, DataHeader, HostInfo, Kind, Limits, Message, SameHostSetting};

/// The most bytes one `process_vm_readv` call copies: a room that ends stops being
/// copied within one call of this size.
pub const MAX_COPY_BYTES: usize = 8 << 20;
/// The most runs one `process_vm_readv` call copies (within `IOV_MAX`, 1024 on Linux).
const MAX_COPY_RUNS: usize = 1024;

/// This process's identity for a pairing, with `setting` and, on a prefill engine,
/// `probe` (its address and bytes).
pub fn local(setting: SameHostSetting, probe: Option<&[u8; 16]>, device_memory: bool) -> HostInfo {
    let ns = |name: &str| {
        std::fs::metadata(format!("/proc/self/ns/{name}"))
            .map(|m| m.ino())
            .unwrap_or(0)
    };
    HostInfo {
        setting,
        device_memory,
        boot_id: boot_id().unwrap_or([0; 16]),
        pid_ns: ns("pid"),
        net_ns: ns("net"),
        pid: std::process::id(),
        // SAFETY: getuid has no preconditions and cannot fail.
        uid: unsafe { libc::getuid() },
        probe_addr: probe.map_or(0, |p| p.as_ptr() as u64),
        probe: probe.copied().unwrap_or([0; 16]),
    }
}

/// The kernel's boot id (a UUID, new at every boot), as 16 bytes.
fn boot_id() -> Option<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// Why a pairing does not take the same-host path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotSameHost {
    /// The engines are on different hosts (or network namespaces): TCP is the path, and
    /// nothing is wrong.
    Elsewhere(String),
    /// They share the host, or one of them refuses the path, and it cannot be used: a
    /// fallback to TCP worth a warning, or with `same_host=require` a refusal.
    Refused(String),
}

impl NotSameHost {
    pub fn why(&self) -> &str {
        match self {
            NotSameHost::Elsewhere(w) | NotSameHost::Refused(w) => w,
        }
    }
}

/// Decode side: whether this process (`ours`) can copy from the prefill process that
/// answered with `theirs`, reading its probe to prove it.
pub fn check(ours: &HostInfo, theirs: &HostInfo) -> Result<(), NotSameHost> {
    if theirs.setting == SameHostSetting::Off {
        return Err(NotSameHost::Refused(
            "the prefill engine has same_host=off".into(),
        ));
    }
    if ours.boot_id == [0; 16] || theirs.boot_id != ours.boot_id {
        return Err(NotSameHost::Elsewhere("another host".into()));
    }
    if theirs.net_ns != ours.net_ns {
        return Err(NotSameHost::Elsewhere(
            "another network namespace (taken as another host)".into(),
        ));
    }
    if theirs.pid_ns != ours.pid_ns {
        return Err(NotSameHost::Refused(
            "same host, but the prefill process is in another PID namespace".into(),
        ));
    }
    let mut got = [0u8; 16];
    let read = read_from(theirs.pid, &mut [&mut got[..]], &[(theirs.probe_addr, 16)]);
    match read {
        Ok(16) if got == theirs.probe => Ok(()),
        Ok(16) => Err(NotSameHost::Refused(format!(
            "process {} is not the prefill engine (its probe differs)",
            theirs.pid
        ))),
        Ok(n) => Err(NotSameHost::Refused(format!(
            "reading the probe of process {} copied {n} of 16 bytes",
            theirs.pid
        ))),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Err(NotSameHost::Refused(format!(
            "ptrace denied: {}",
            denial(ours, theirs)
        ))),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(NotSameHost::Refused(format!(
            "process {} is not visible from here",
            theirs.pid
        ))),
        Err(e) => Err(NotSameHost::Refused(format!(
            "reading the probe of process {} failed: {e}",
            theirs.pid
        ))),
    }
}

/// What may explain an `EPERM` on reading the prefill process.
fn denial(ours: &HostInfo, theirs: &HostInfo) -> String {
    let mut why = Vec::new();
    if ours.uid != theirs.uid {
        why.push(format!(
            "the prefill runs as uid {}, this process as uid {}",
            theirs.uid, ours.uid
        ));
    }
    if let Ok(scope) = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        let scope = scope.trim();
        if scope != "0" {
            why.push(format!("ptrace_scope={scope}"));
        }
    }
    if why.is_empty() {
        why.push(
            "the prefill process is not dumpable (PR_SET_DUMPABLE 0) or this one lacks \
             CAP_SYS_PTRACE"
                .into(),
        );
    }
    why.join(", ")
}

/// Copies the remote ranges `remote` (address, length) of process `pid` into `local`,
/// in order, with one `process_vm_readv` call; returns the bytes copied.
fn read_from(pid: u32, local: &mut [&mut [u8]], remote: &[(u64, usize)]) -> io::Result<usize> {
    let local: Vec<libc::iovec> = local
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    let remote: Vec<libc::iovec> = remote
        .iter()
        .map(|&(addr, len)| libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        })
        .collect();
    // SAFETY: every local iovec is a live `&mut [u8]` we hold for the call, so the
    // kernel writes only into memory we own exclusively; the remote iovecs are read in
    // the other process, which the kernel checks (a bad address is EFAULT, not ours).
    let n = unsafe {
        libc::process_vm_readv(
            pid as libc::pid_t,
            local.as_ptr(),
            local.len() as libc::c_ulong,
            remote.as_ptr(),
            remote.len() as libc::c_ulong,
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Decode side: serves a same-host data connection from prefill process `pid` until it
/// ends: each `Copy` is admitted by `sink` as a data frame of those runs would be, copied
/// into the granted pages and answered; `Done` goes to `sink`. Returns why it ended.
///
/// A small batch comes inline as a TCP data frame (`copy_link::INLINE_MAX_BYTES`) and is
/// read into the granted pages as over TCP.
///
/// The answers go out together once every message already read is served (the prefill
/// keeps several copies in flight, so several often arrive in one read): one write, and
/// one wakeup of the prefill's reader, for all of them.
///
/// On the CUDA IPC path (`ipc`: the pairing's import table) runs into device pages are
/// copied device to device from the prefill's exported memory ([`crate::cuda::ipc`]);
/// runs into host pages (aux rows) as on the same-host path.
pub fn serve<S: FrameSink>(
    s: TcpStream,
    sink: &S,
    pid: u32,
    limits: &Limits,
    ipc: Option<&Imports>,
) -> String {
    let mut w = match s.try_clone() {
        Ok(w) => w,
        Err(e) => return format!("data connection: {e}"),
    };
    let mut r = DataStream::new(s);
    let mut answers = Vec::with_capacity(256);
    let mut dtod = None;
    let mut rings = crate::cuda::copy::Rings::default();
    loop {
        if !r.has_buffered() && !answers.is_empty() {
            if let Err(e) = w.write_all(&answers) {
                return format!("answering copies failed: {e}");
            }
            answers.clear();
        }
        let hdr = match super::tcp::recv::next_frame(&mut r, sink, limits) {
            Ok(h) => h,
            Err(why) => return why,
        };
        if matches!(hdr.kind, Kind::Data | Kind::DataRuns) {
            // A small batch, sent inline (`copy_link::INLINE_MAX_BYTES`).
            let served = super::tcp::recv::data_frame(&mut r, sink, &hdr, limits, &mut rings);
            if let Err(why) = served {
                sink.protocol_error();
                return why;
            }
            continue;
        }
        let served = match proto::read_control(&mut r, &hdr, limits) {
            Ok(Message::Copy { runs }) => {
                copy(sink, pid, &runs, ipc, &mut dtod).and_then(|whole| {
                    let (h, _) = runs[0];
                    Message::Copied {
                        room: h.room,
                        generation: h.generation,
                        whole,
                    }
                    .encode(&mut answers)
                    .map_err(|e| e.to_string())
                })
            }
            Ok(Message::Done {
                room,
                generation,
                pages_sent,
                aux_sent,
            }) => {
                sink.done(room, generation, pages_sent, aux_sent);
                Ok(())
            }
            Ok(m) => Err(format!(
                "unexpected {} frame on a same-host data connection",
                m.kind().name()
            )),
            Err(e) => Err(e.to_string()),
        };
        if let Err(why) = served {
            sink.protocol_error();
            return why;
        }
    }
}

/// Copies the runs of one `Copy` from process `pid` into the pages `sink` grants them,
/// [`MAX_COPY_RUNS`] runs and [`MAX_COPY_BYTES`] at most per call, each call under the
/// room's io count and only while the room is live. Whether every run was copied whole
/// (false: the room ended, or cannot take them); an error ends the connection.
///
/// Runs into device pages (the grant says which) are copied through `ipc` with the
/// connection's copier (`dtod`, made on first use): every source is translated through
/// the import table first, and a source outside what the prefill exported ends the
/// connection before anything of that call is copied.
fn copy<S: FrameSink>(
    sink: &S,
    pid: u32,
    runs: &[(DataHeader, u64)],
    ipc: Option<&Imports>,
    dtod: &mut Option<DtoD>,
) -> Result<bool, String> {
    let headers: Vec<DataHeader> = runs.iter().map(|(h, _)| *h).collect();
    let grant = match sink.admit(&headers) {
        Admit::Write(g) => g,
        Admit::Discard => return Ok(false),
        Admit::Refuse(why) => return Err(why),
    };
    let device: Vec<Option<(u32, usize)>> = (0..runs.len()).map(|j| grant.device(j)).collect();
    let ipc = match (ipc, device.iter().any(Option::is_some)) {
        (Some(t), true) => Some(t),
        (None, true) => {
            return Err("runs into device pages on a same-host connection without CUDA IPC".into())
        }
        (_, false) => None,
    };
    let mut complete = vec![false; runs.len()];
    let mut i = 0;
    while i < runs.len() {
        let Some(_io) = grant.enter() else { break };
        let (mut end, mut bytes) = (i, 0usize);
        while end < runs.len()
            && end - i < MAX_COPY_RUNS
            && (end == i || bytes + runs[end].0.byte_len as usize <= MAX_COPY_BYTES)
        {
            bytes += runs[end].0.byte_len as usize;
            end += 1;
        }
        let host: Vec<usize> = (i..end).filter(|&j| device[j].is_none()).collect();
        if let Some(t) = ipc {
            let on_device: Vec<(u64, u64, u64)> = (i..end)
                .filter_map(|j| {
                    device[j].map(|(_, dst)| (dst as u64, runs[j].1, runs[j].0.byte_len as u64))
                })
                .collect();
            if !on_device.is_empty() {
                let copier = match dtod {
                    Some(c) => c,
                    None => dtod.insert(DtoD::new(t.device()).map_err(|e| e.to_string())?),
                };
                copier.copy(t, &on_device).map_err(|e| match e {
                    CopyError::Outside(why) => format!("prefill process {pid}: {why}"),
                    CopyError::Driver(why) => format!("copying through CUDA IPC failed: {why}"),
                })?;
            }
        }
        if !host.is_empty() {
            let mut local: Vec<&mut [u8]> = host.iter().map(|&j| grant.pages(j)).collect();
            let remote: Vec<(u64, usize)> = host
                .iter()
                .map(|&j| (runs[j].1, runs[j].0.byte_len as usize))
                .collect();
            let want: usize = remote.iter().map(|r| r.1).sum();
            let n = read_from(pid, &mut local, &remote)
                .map_err(|e| format!("copying from prefill process {pid} failed: {e}"))?;
            if n != want {
                return Err(format!(
                    "copying from prefill process {pid} stopped after {n} of {want} bytes"
                ));
            }
        }
        complete[i..end].fill(true);
        i = end;
    }
    let whole = complete.iter().all(|&c| c);
    grant.finish(&complete);
    Ok(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_its_own_probe() {
        let probe = [7u8; 16];
        let ours = local(SameHostSetting::Auto, None, false);
        let theirs = local(SameHostSetting::Auto, Some(&probe), false);
        assert_eq!(check(&ours, &theirs), Ok(()));
    }

    #[test]
    fn another_boot_id_or_network_namespace_is_another_host() {
        let probe = [7u8; 16];
        let ours = local(SameHostSetting::Auto, None, false);
        let mut theirs = local(SameHostSetting::Auto, Some(&probe), false);
        theirs.boot_id[0] ^= 1;
        assert!(matches!(
            check(&ours, &theirs),
            Err(NotSameHost::Elsewhere(_))
        ));
        let mut theirs = local(SameHostSetting::Auto, Some(&probe), false);
        theirs.net_ns += 1;
        assert!(matches!(
            check(&ours, &theirs),
            Err(NotSameHost::Elsewhere(_))
        ));
    }

    #[test]
    fn a_probe_that_differs_or_a_peer_that_is_off_is_refused_with_the_reason() {
        let probe = [7u8; 16];
        let ours = local(SameHostSetting::Auto, None, false);
        let mut theirs = local(SameHostSetting::Auto, Some(&probe), false);
        theirs.probe[3] ^= 1;
        let e = check(&ours, &theirs).unwrap_err();
        assert!(e.why().contains("probe differs"), "{e:?}");
        let mut theirs = local(SameHostSetting::Off, Some(&probe), false);
        theirs.probe = probe;
        let e = check(&ours, &theirs).unwrap_err();
        assert!(e.why().contains("same_host=off"), "{e:?}");
    }

    #[test]
    fn a_process_that_does_not_exist_is_not_visible() {
        let probe = [7u8; 16];
        let ours = local(SameHostSetting::Auto, None, false);
        let mut theirs = local(SameHostSetting::Auto, Some(&probe), false);
        theirs.pid = i32::MAX as u32;
        let e = check(&ours, &theirs).unwrap_err();
        assert!(e.why().contains("not visible"), "{e:?}");
    }
}

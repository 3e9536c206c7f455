//! The few operating-system facilities the benchmark needs beyond std: the system-wide
//! monotonic clock (comparable between the two processes on one host), CPU time and
//! context switches of the process and of one thread, how busy the host's CPUs were,
//! and page-aligned memory shared with an engine, on small or huge pages.
//!
//! Linux only, through the `libc` crate.

use std::ptr::NonNull;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime writes only into it.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime({clock}) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on this host (it is what
/// `std::time::Instant` reads on Linux, but as a number another process can compare).
pub fn mono_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CPU time of the calling thread, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// What the kernel accounts to a process (every thread, ended ones included) or to one
/// thread: CPU time, user and system, in microseconds, and context switches, voluntary
/// (the thread blocked: a sleep, a read with nothing to read, a lock) and involuntary
/// (preempted). From `getrusage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub user_us: u64,
    pub sys_us: u64,
    pub voluntary: u64,
    pub involuntary: u64,
}

impl Usage {
    fn get(who: libc::c_int) -> Usage {
        // SAFETY: an all-zero rusage is a valid value of this plain C struct.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is a valid, writable rusage; getrusage writes only into it.
        let rc = unsafe { libc::getrusage(who, &mut u) };
        assert_eq!(rc, 0, "getrusage({who}) failed");
        let us = |t: &libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        Usage {
            user_us: us(&u.ru_utime),
            sys_us: us(&u.ru_stime),
            voluntary: u.ru_nvcsw as u64,
            involuntary: u.ru_nivcsw as u64,
        }
    }

    /// Now, for this process.
    pub fn now() -> Usage {
        Usage::get(libc::RUSAGE_SELF)
    }

    /// Now, for the calling thread.
    pub fn thread() -> Usage {
        Usage::get(libc::RUSAGE_THREAD)
    }

    /// What was used since `earlier`.
    pub fn since(self, earlier: Usage) -> Usage {
        Usage {
            user_us: self.user_us.saturating_sub(earlier.user_us),
            sys_us: self.sys_us.saturating_sub(earlier.sys_us),
            voluntary: self.voluntary.saturating_sub(earlier.voluntary),
            involuntary: self.involuntary.saturating_sub(earlier.involuntary),
        }
    }

    /// User plus system, in seconds.
    pub fn secs(self) -> f64 {
        (self.user_us + self.sys_us) as f64 / 1e6
    }

    /// System time, in seconds.
    pub fn sys_secs(self) -> f64 {
        self.sys_us as f64 / 1e6
    }
}

impl std::ops::Add for Usage {
    type Output = Usage;
    fn add(self, o: Usage) -> Usage {
        Usage {
            user_us: self.user_us + o.user_us,
            sys_us: self.sys_us + o.sys_us,
            voluntary: self.voluntary + o.voluntary,
            involuntary: self.involuntary + o.involuntary,
        }
    }
}

impl std::iter::Sum for Usage {
    fn sum<I: Iterator<Item = Usage>>(it: I) -> Usage {
        it.fold(Usage::default(), |a, b| a + b)
    }
}

/// How busy this host's CPUs were between two reads of `/proc/stat`: CPU seconds of
/// every process and of the kernel's own work (interrupts, softirqs and the threads that
/// run them, `ksoftirqd`), per wall second. A process's `getrusage` misses the kernel's
/// threads: over loopback, much of a TCP stream's receive processing runs in
/// `ksoftirqd`, so the stream's processes look less busy than the host is.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostBusy {
    /// CPU seconds busy, every CPU added up.
    pub busy_s: f64,
    /// Wall seconds between the reads; 0 when the host does not say.
    pub wall_s: f64,
}

impl HostBusy {
    /// CPUs busy per wall second (the reads' CPU ticks are 1/`USER_HZ` s, 10 ms on
    /// most hosts), or `None` when `/proc/stat` could not be read.
    pub fn cores(self) -> Option<f64> {
        (self.wall_s > 0.0).then(|| self.busy_s / self.wall_s)
    }
}

impl std::ops::Add for HostBusy {
    type Output = HostBusy;
    fn add(self, o: HostBusy) -> HostBusy {
        HostBusy {
            busy_s: self.busy_s + o.busy_s,
            wall_s: self.wall_s + o.wall_s,
        }
    }
}

impl std::iter::Sum for HostBusy {
    fn sum<I: Iterator<Item = HostBusy>>(it: I) -> HostBusy {
        it.fold(HostBusy::default(), |a, b| a + b)
    }
}

/// A first read of the host's CPU time, for [`HostMark::since`].
#[derive(Debug, Clone, Copy)]
pub struct HostMark {
    busy_ticks: Option<u64>,
    at: std::time::Instant,
}

impl HostMark {
    pub fn now() -> HostMark {
        HostMark {
            busy_ticks: std::fs::read_to_string("/proc/stat")
                .ok()
                .and_then(|t| busy_ticks(&t)),
            at: std::time::Instant::now(),
        }
    }

    /// The host's busy CPU time since this mark (nothing when either read failed).
    pub fn since(self) -> HostBusy {
        let now = HostMark::now();
        let (Some(a), Some(b)) = (self.busy_ticks, now.busy_ticks) else {
            return HostBusy::default();
        };
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if hz <= 0 {
            return HostBusy::default();
        }
        HostBusy {
            busy_s: b.saturating_sub(a) as f64 / hz as f64,
            wall_s: now.at.duration_since(self.at).as_secs_f64(),
        }
    }
}

/// Busy ticks of every CPU from the text of `/proc/stat`: the first line's user, nice,
/// system, irq and softirq (guest time is within user); idle, iowait and steal (time
/// the hypervisor gave to others) are not busy.
fn busy_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().next()?;
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.map(|x| x.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let at = |i: usize| v.get(i).copied();
    Some(at(0)? + at(1)? + at(2)? + at(5)? + at(6)?)
}

/// Which pages back the benchmark's memory (`--pool-pages`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pages {
    /// 4 KiB pages (transparent huge pages refused with `MADV_NOHUGEPAGE`).
    #[value(name = "4k")]
    #[serde(rename = "4k")]
    Small,
    /// 2 MiB transparent huge pages where the kernel has them (`MADV_HUGEPAGE` on a
    /// 2 MiB-aligned mapping, before the first touch).
    Huge,
}

impl Pages {
    pub fn name(self) -> &'static str {
        match self {
            Pages::Small => "4k",
            Pages::Huge => "huge",
        }
    }
}

const HUGE: usize = 2 << 20;

/// A page-aligned, zeroed block of memory that an engine may read or write through its
/// address while the benchmark holds it (registered memory). Every access from the
/// benchmark goes through the methods below, whose callers promise that the engine is
/// not writing the same bytes at that moment (the page belongs to no live room).
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes mapped at `ptr` (`len` rounded up to the page size used).
    mapped: usize,
}

// SAFETY: a Region is plain memory; which thread touches which bytes when is governed by
// the room protocol (see the type's documentation), not by the owner.
unsafe impl Send for Region {}
// SAFETY: as above; shared references only hand out slices under the same contract.
unsafe impl Sync for Region {}

const ALIGN: usize = 4096;

fn mmap_anon(len: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert!(
        p != libc::MAP_FAILED,
        "mmap of {len} bytes failed: {}",
        std::io::Error::last_os_error()
    );
    p as *mut u8
}

impl Region {
    /// `len` zeroed bytes (`len` > 0) on `pages`, every page touched so that page faults
    /// are not measured later.
    pub fn new(len: usize, pages: Pages) -> Region {
        assert!(len > 0);
        let (ptr, mapped) = match pages {
            Pages::Small => {
                let mapped = len.next_multiple_of(ALIGN);
                let p = mmap_anon(mapped);
                // SAFETY: advice on our own fresh mapping. A kernel without THP refuses
                // it, which leaves small pages: what was asked.
                unsafe { libc::madvise(p.cast(), mapped, libc::MADV_NOHUGEPAGE) };
                (p, mapped)
            }
            Pages::Huge => {
                // Over-map by one huge page, keep the 2 MiB-aligned part, unmap the rest.
                let mapped = len.next_multiple_of(HUGE);
                let raw = mmap_anon(mapped + HUGE);
                let head = (raw as usize).next_multiple_of(HUGE) - raw as usize;
                // SAFETY: both ranges lie inside the mapping just made and are not used.
                unsafe {
                    if head > 0 {
                        libc::munmap(raw.cast(), head);
                    }
                    if HUGE - head > 0 {
                        libc::munmap(raw.add(head + mapped).cast(), HUGE - head);
                    }
                }
                // SAFETY: inside the mapping (`head` < HUGE).
                let p = unsafe { raw.add(head) };
                // SAFETY: advice on our own mapping, before its first touch. Refused
                // (no THP in this kernel) it leaves small pages; `huge_bytes` tells.
                unsafe { libc::madvise(p.cast(), mapped, libc::MADV_HUGEPAGE) };
                (p, mapped)
            }
        };
        let r = Region {
            ptr: NonNull::new(ptr).expect("mmap returned a non-null address"),
            len,
            mapped,
        };
        r.touch();
        r
    }

    fn touch(&self) {
        for off in (0..self.len).step_by(ALIGN) {
            // SAFETY: `off` < len, inside the mapping; nobody else holds it yet.
            unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
        }
    }

    /// The first byte's address, for `BufferDesc::base`.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes mapped for it (`len` rounded up to its page size).
    pub fn mapped(&self) -> usize {
        self.mapped
    }

    fn check(&self, off: usize, n_words: usize) {
        assert!(off % 8 == 0, "unaligned word offset {off}");
        assert!(
            off.checked_add(n_words * 8).is_some_and(|e| e <= self.len),
            "words {off}+{n_words}x8 outside a region of {} bytes",
            self.len
        );
    }

    /// The `n_words` u64 words starting at byte `off`.
    ///
    /// # Safety
    /// No engine may be writing these bytes while the slice lives.
    pub unsafe fn words(&self, off: usize, n_words: usize) -> &[u64] {
        self.check(off, n_words);
        // SAFETY: in bounds and 8-aligned (checked; the base is page-aligned); the caller
        // promises no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off) as *const u64, n_words) }
    }

    /// Mutable `n_words` u64 words starting at byte `off`.
    ///
    /// # Safety
    /// Nobody else (engine or benchmark thread) may access these bytes while the slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn words_mut(&self, off: usize, n_words: usize) -> &mut [u64] {
        self.check(off, n_words);
        // SAFETY: in bounds and aligned (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off) as *mut u64, n_words) }
    }

    /// All bytes, mutable.
    ///
    /// # Safety
    /// As [`Region::words_mut`], for the whole region.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: the whole allocation; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no slice of it outlives the
        // region (they borrow it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
    }
}

/// Bytes of this process's memory in transparent huge pages (`AnonHugePages` of
/// `/proc/self/smaps_rollup`), or `None` where the kernel does not say.
pub fn huge_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = text.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Sleeps until CLOCK_MONOTONIC reads `deadline_ns` (at once if it has passed): an
/// absolute deadline, so that an overshoot does not add up over successive sleeps.
pub fn sleep_until_ns(deadline_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    loop {
        // SAFETY: `ts` is a valid timespec; with TIMER_ABSTIME the remainder pointer may
        // be null.
        let rc = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        // Interrupted by a signal: sleep again to the same deadline.
        if rc != libc::EINTR {
            return;
        }
    }
}

/// Sets the calling thread's timer slack (how late the kernel may end its sleeps, to
/// merge wakeups; 50 µs by default) to 1 ns, for a sleep that should end on time. The
/// slack belongs to this thread alone.
pub fn precise_sleeps() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

/// Puts the calling thread under `SCHED_IDLE`: it runs only on a core that no other
/// thread wants. For the checkers, so that checking never takes a core from the engines.
/// Whether the kernel took it (it leaves the thread as it was otherwise).
pub fn sched_idle() -> bool {
    set_idle(0, true)
}

/// The calling thread's kernel id, for [`set_idle`] from another thread.
pub fn thread_id() -> i32 {
    // SAFETY: gettid takes no argument and cannot fail.
    unsafe { libc::gettid() }
}

/// Puts thread `tid` of this process (0: the calling thread) under `SCHED_IDLE`, or
/// back under the default policy (`idle` false). Whether the kernel took it (it leaves
/// the thread as it was otherwise).
pub fn set_idle(tid: i32, idle: bool) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: the kernel only reads `param`; a tid that is gone is an error (ESRCH).
    unsafe { libc::sched_setscheduler(tid, policy, &param) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sched_idle_changes_the_calling_thread_only() {
        // SAFETY: queries of the calling thread's policy.
        let policy = || unsafe { libc::sched_getscheduler(0) };
        let before = policy();
        let inside = std::thread::spawn(move || (sched_idle(), policy()))
            .join()
            .unwrap();
        assert_eq!(inside, (true, libc::SCHED_IDLE));
        assert_eq!(policy(), before);
    }

    /// The loop boosts a checker that went idle, and puts it back, by its id.
    #[test]
    fn another_thread_of_the_process_is_put_under_sched_idle_and_back_by_its_id() {
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            assert!(sched_idle());
            tid_tx.send(thread_id()).unwrap();
            for () in go_rx {
                // SAFETY: a query of the calling thread's policy.
                seen_tx
                    .send(unsafe { libc::sched_getscheduler(0) })
                    .unwrap();
            }
        });
        let tid = tid_rx.recv().unwrap();
        assert_ne!(tid, thread_id());
        let policy = || {
            go_tx.send(()).unwrap();
            seen_rx.recv().unwrap()
        };
        assert_eq!(policy(), libc::SCHED_IDLE);
        assert!(set_idle(tid, false));
        assert_eq!(policy(), libc::SCHED_OTHER);
        assert!(set_idle(tid, true));
        assert_eq!(policy(), libc::SCHED_IDLE);
        drop(go_tx);
        t.join().unwrap();
    }

    #[test]
    fn usage_counts_a_threads_sleeps_as_voluntary_switches_and_its_work_as_cpu() {
        let (sleeps, spin) = std::thread::spawn(|| {
            let u0 = Usage::thread();
            for _ in 0..20 {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            let sleeps = Usage::thread().since(u0);
            let u1 = Usage::thread();
            let t = std::time::Instant::now();
            let mut x = 0u64;
            while t.elapsed() < std::time::Duration::from_millis(30) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            (sleeps, Usage::thread().since(u1))
        })
        .join()
        .unwrap();
        assert!(sleeps.voluntary >= 20, "{sleeps:?}");
        assert!(spin.user_us + spin.sys_us > 0, "{spin:?}");
        // The process account includes the thread's, ended threads too.
        let all = Usage::now();
        assert!(all.voluntary >= sleeps.voluntary, "{all:?}");
        let sum: Usage = [sleeps, spin].into_iter().sum();
        assert_eq!(sum.voluntary, sleeps.voluntary + spin.voluntary);
        assert_eq!(sum.since(spin), sleeps);
    }

    #[test]
    fn host_busy_counts_user_nice_system_irq_and_softirq_ticks() {
        let stat = "cpu  100 20 300 4000 50 6 70 800 9 0\ncpu0 1 2 3 4 5 6 7 8 9 0\nintr 1 2\n";
        assert_eq!(busy_ticks(stat), Some(100 + 20 + 300 + 6 + 70));
        assert_eq!(busy_ticks("cpu0 1 2 3 4 5 6 7\n"), None);
        assert_eq!(busy_ticks("cpu  1 2 x 4 5 6 7\n"), None);
        assert_eq!(busy_ticks("cpu  1 2 3 4 5\n"), None);
    }

    #[test]
    fn a_thread_that_spins_shows_in_the_host_s_busy_cpus() {
        let mark = HostMark::now();
        let cpu0 = thread_cpu_ns();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let spun = (thread_cpu_ns() - cpu0) as f64 / 1e9;
        let busy = mark.since();
        let cores = busy.cores().expect("Linux has /proc/stat");
        // The host was busy at least while this thread ran (less a few 10 ms ticks of
        // rounding at each end); the rest of the host may add to it, never take from it.
        assert!(
            busy.busy_s >= spun - 0.04,
            "{busy:?}, the thread ran {spun} s"
        );
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(cores <= cpus + 0.2, "{busy:?}");
        let two: HostBusy = [busy, busy].into_iter().sum();
        assert_eq!(two.cores(), busy.cores());
        assert_eq!(HostBusy::default().cores(), None);
    }
}

"""One side of a peer engine's run: NIXL or Mooncake TE, target (the decode side, which
owns the destination buffer, hands out destination slots and checks what landed) or
initiator (the prefill side, which writes each request from its source buffer).

The two sides talk over a socket pair the runner (peers.py) hands them (--ctl-fd), in
text lines, like kvxfer-bench's two processes:

    target    -> initiator  hello ...             the target's address and buffer
    initiator -> target     ready                 its buffer is filled and registered
    target    -> initiator  go IDX SLOT           request IDX goes to destination SLOT
    initiator -> target     done IDX T_ENQ        (Mooncake) request IDX completed;
                                                  NIXL says the same with its own
                                                  notification, sent after the data
    target    -> initiator  end                   the phase is over
    initiator -> target     stats USER SYS VCSW IVCSW   its CPU and context switches
    target    -> initiator  quit

The scheduler loops poll like kvxfer-bench's: everything that can move moves, and a loop
that found nothing to do sleeps --poll-us. The target prints one JSON line per phase on
stdout. Both sides leave with os._exit: the NIXL wheel crashes in a bundled libnl at
normal interpreter exit.
"""

import argparse
import collections
import concurrent.futures
import ctypes
import json
import os
import resource
import socket
import sys
import time
import traceback

import numpy as np

import kvwork

SEED = 1


class Ctl:
    """Lines over a socket, with a non-blocking read."""

    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.buf = b""

    def send(self, line: str):
        self.sock.sendall(line.encode() + b"\n")

    def _split(self) -> list[str]:
        *lines, self.buf = self.buf.split(b"\n")
        return [l.decode() for l in lines]

    def poll(self) -> list[str]:
        self.sock.setblocking(False)
        try:
            while True:
                b = self.sock.recv(65536)
                if not b:
                    raise EOFError("the other side closed the control channel")
                self.buf += b
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        return self._split()

    def recv(self, timeout: float = 120.0) -> str:
        self.sock.settimeout(timeout)
        try:
            while b"\n" not in self.buf:
                b = self.sock.recv(65536)
                if not b:
                    raise EOFError("the other side closed the control channel")
                self.buf += b
        finally:
            self.sock.settimeout(None)
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_nvcsw, r.ru_nivcsw


def since(a, b):
    return tuple(y - x for x, y in zip(a, b))


# --- the engines -------------------------------------------------------------------

# NIXL's UCX backend parameter ucx_error_handling_mode (--nixl-err-mode); None keeps the
# backend's default (peer). UCX's shared-memory transports (posix, sysv, cma) have no peer
# failure handler, so with the default UCX refuses them for the endpoints ("no active
# messages transport ... no peer failure handler") and same-host runs need "none".
NIXL_ERR_MODE = None


def nixl_agent_for(name: str, prog_thread: bool):
    from nixl_cu12 import nixl_agent, nixl_agent_config

    if NIXL_ERR_MODE is None:
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=["UCX"]))
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=[]))
    params = agent.get_plugin_params("UCX")
    params["ucx_error_handling_mode"] = NIXL_ERR_MODE
    agent.create_backend("UCX", params)
    return agent


class NixlTarget:
    def __init__(self, pool: kvwork.Pool):
        # The progress thread receives while the scheduler loop sleeps or checks.
        self.agent = nixl_agent_for(f"target-{os.getpid()}", prog_thread=True)
        self.agent.register_memory([(pool.region.addr, pool.region.len, 0, "")], "DRAM")

    def hello(self, pool) -> str:
        return f"hello {self.agent.get_agent_metadata().hex()} {pool.region.addr}"

    def landed(self, ctl_lines) -> list[tuple[int, int]]:
        out = []
        for msgs in self.agent.get_new_notifs().values():
            for m in msgs:
                idx, t_enq = m.decode().split()
                out.append((int(idx), int(t_enq)))
        return out


class NixlInitiator:
    def __init__(self, pool: kvwork.Pool, hello: list[str], dst_pages: int, page_bytes: int, perm, concurrency: int):
        # No progress thread: the scheduler loop progresses the worker by polling
        # check_xfer_state (a progress thread busy-polls a core).
        self.agent = nixl_agent_for(f"initiator-{os.getpid()}", prog_thread=False)
        self.agent.register_memory([(pool.region.addr, pool.region.len, 0, "")], "DRAM")
        meta, dst_base = bytes.fromhex(hello[0]), int(hello[1])
        self.remote = self.agent.add_remote_agent(meta)
        n_src = pool.slots * pool.slot_pages

        def dlist(base, n):
            a = np.zeros((n, 3), dtype=np.uint64)
            a[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(page_bytes)
            a[:, 1] = page_bytes
            return a

        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", dlist(pool.region.addr, n_src), "DRAM")
        self.far = self.agent.prep_xfer_dlist(self.remote, dlist(dst_base, dst_pages), "DRAM")
        self.slot_pages = pool.slot_pages
        self.perm = np.asarray(perm, dtype=np.int32)
        self.seq = np.arange(pool.slot_pages, dtype=np.int32)

    def post(self, idx, sslot, dslot, t_enq):
        h = self.agent.make_prepped_xfer(
            "WRITE",
            self.local,
            self.seq + sslot * self.slot_pages,
            self.far,
            self.perm + dslot * self.slot_pages,
            f"{idx} {t_enq}".encode(),
        )
        st = self.agent.transfer(h)
        if st == "ERR":
            raise RuntimeError(f"NIXL transfer of request {idx} failed to post")
        return h

    def poll(self, h) -> bool:
        st = self.agent.check_xfer_state(h)
        if st == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if st == "DONE":
            self.agent.release_xfer_handle(h)
            return True
        return False

    def completed(self, ctl, idx, t_enq):
        pass  # the target learns it from NIXL's notification


class MooncakeTarget:
    def __init__(self, pool: kvwork.Pool):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize failed")
        if self.engine.register_memory(pool.region.addr, pool.region.len) != 0:
            raise RuntimeError("Mooncake register_memory failed")

    def hello(self, pool) -> str:
        return f"hello 127.0.0.1:{self.engine.get_rpc_port()} {pool.region.addr}"

    def landed(self, ctl_lines) -> list[tuple[int, int]]:
        out = []
        for l in ctl_lines:
            f = l.split()
            if f[0] != "done":
                raise RuntimeError(f"initiator said '{l}'")
            out.append((int(f[1]), int(f[2])))
        return out


class MooncakeInitiator:
    def __init__(self, pool: kvwork.Pool, hello: list[str], dst_pages: int, page_bytes: int, perm, concurrency: int):
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake TransferEngine.initialize failed")
        if self.engine.register_memory(pool.region.addr, pool.region.len) != 0:
            raise RuntimeError("Mooncake register_memory failed")
        self.session, dst_base = hello[0], int(hello[1])
        self.pool = pool
        self.dst = [
            [dst_base + (d * pool.slot_pages + int(p)) * page_bytes for p in perm]
            for d in range(dst_pages // pool.slot_pages)
        ]
        self.lens = [page_bytes] * pool.slot_pages
        self.pool_threads = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency)

    def post(self, idx, sslot, dslot, t_enq):
        # batch_transfer_sync_write on one of `concurrency` threads (it drops the GIL),
        # as SGLang's Mooncake connector does. Not batch_transfer_async_write with
        # transfer_check_status: in this wheel that reports a 128-entry batch complete
        # while most of its pages have not landed (the check here catches it).
        src = self.pool.page_addrs(sslot)
        return self.pool_threads.submit(
            self.engine.batch_transfer_sync_write, self.session, src, self.dst[dslot], self.lens
        )

    def poll(self, fut) -> bool:
        if not fut.done():
            return False
        rc = fut.result()
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync_write failed ({rc})")
        return True

    def completed(self, ctl, idx, t_enq):
        ctl.send(f"done {idx} {t_enq}")


ENGINES = {"nixl": (NixlTarget, NixlInitiator), "mooncake": (MooncakeTarget, MooncakeInitiator)}


# --- the target (decode side) --------------------------------------------------------


def target_phase(a, eng, pool, ctl, start, count, self_check=False):
    """Announces `count` requests (indices from `start`), at most --concurrency in flight,
    and checks each one that lands. Returns the phase's figures."""
    free = list(range(pool.slots))[::-1]
    live = {}  # idx -> (slot, t_announced)
    landed = collections.deque()
    announced = 0
    ok = failed = checked = 0
    errors = []
    lat_e2e = []
    u0 = usage()
    t0 = time.monotonic_ns()
    t_last = t0
    while ok + failed < count:
        progress = False
        lines = ctl.poll()
        for idx, t_enq in eng.landed(lines):
            slot, _ = live.pop(idx)
            landed.append((idx, slot))
            lat_e2e.append(time.monotonic_ns() - t_enq)
            progress = True
        while len(live) < a.concurrency and announced < count and free:
            slot = free.pop()
            idx = start + announced
            live[idx] = (slot, time.monotonic_ns())
            ctl.send(f"go {idx} {slot}")
            announced += 1
            progress = True
        if landed:
            idx, slot = landed.popleft()
            room = kvwork.room_id(SEED, idx)
            if self_check:
                self_check_verify(pool, slot, room)
            c, err = pool.verify(slot, room)
            if err is None:
                ok += 1
                checked += c
            else:
                failed += 1
                errors.append(err)
            free.append(slot)
            t_last = time.monotonic_ns()
            progress = True
        if not progress:
            time.sleep(a.poll_us / 1e6)
    u = since(u0, usage())
    ctl.send("end")
    f = ctl.recv().split()
    if f[0] != "stats":
        raise RuntimeError(f"initiator said '{' '.join(f)}' at the end of a phase")
    iu = [float(x) for x in f[1:]]
    secs = max(t_last - t0, 1) / 1e9
    nbytes = ok * pool.slot_pages * pool.page_bytes
    lat = sorted(lat_e2e)

    def pct(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] / 1e6 if lat else None

    return {
        "rooms": count,
        "rooms_ok": ok,
        "rooms_failed_verify": failed,
        "errors": errors[:4],
        "bytes": nbytes,
        "bytes_checked": checked,
        "seconds": secs,
        "gbps": nbytes / secs / 1e9,
        "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "n": len(lat)},
        "cpu_s": {"target": u[0] + u[1], "target_sys": u[1], "initiator": iu[0] + iu[1], "initiator_sys": iu[1]},
        "ctx_switches": {
            "target_voluntary": u[2],
            "target_involuntary": u[3],
            "initiator_voluntary": iu[2],
            "initiator_involuntary": iu[3],
        },
        "cores_busy": (u[0] + u[1] + iu[0] + iu[1]) / secs,
    }


def self_check_verify(pool, slot, room):
    """Proves the check is live in this process: a changed stamp and a changed body word
    of a fully checked page must both fail it (the page is put back after each)."""
    c, err = pool.verify(slot, room)
    if err is not None:
        return  # the real check reports it
    rows = pool.rows(slot)
    s = pool.stamps(room)
    full = np.nonzero((kvwork.mix_np(s) & np.uint64(15)) == 0)[0]
    if c == 0 or full.size == 0:
        raise RuntimeError("self-check: the warm-up request has no fully checked page")
    for row, word in ((rows[0], 0), (rows[full[0]], pool.words.shape[1] // 2)):
        keep = int(pool.words[row, word])
        pool.words[row, word] = np.uint64(keep ^ 1)
        _, e = pool.verify(slot, room)
        pool.words[row, word] = np.uint64(keep)
        if e is None:
            raise RuntimeError(f"self-check: a changed word {word} of a page was not caught")


def run_target(a):
    slots = a.concurrency + 2
    perm = kvwork.shuffled_perm(SEED, a.slot_pages)
    pool = kvwork.Pool(a.page_bytes, a.slot_pages, slots, perm)
    eng = ENGINES[a.engine][0](pool)
    ctl = Ctl(a.ctl_fd)
    ctl.send(eng.hello(pool) + f" {slots * a.slot_pages}")
    line = ctl.recv(timeout=300)
    if line != "ready":
        raise RuntimeError(f"initiator said '{line}'")
    # One untimed request first: it opens the engines' connections.
    warm = target_phase(a, eng, pool, ctl, 0, 1, self_check=True)
    if warm["rooms_ok"] != 1:
        raise RuntimeError(f"the warm-up request did not check: {warm['errors']}")
    for phase in range(a.phases):
        if a.marks:
            # For a profiler (profile.py): it attaches, then says go on stdin.
            print("pair.py: mark ready", file=sys.stderr, flush=True)
            sys.stdin.readline()
            print("pair.py: mark start", file=sys.stderr, flush=True)
        r = target_phase(a, eng, pool, ctl, 1 + phase * a.rooms, a.rooms)
        if a.marks:
            print("pair.py: mark end", file=sys.stderr, flush=True)
        r.update(engine=a.engine, page_bytes=a.page_bytes, slot_pages=a.slot_pages, concurrency=a.concurrency)
        print(json.dumps(r), flush=True)
    ctl.send("quit")


# --- the initiator (prefill side) -----------------------------------------------------


def run_initiator(a):
    slots = a.concurrency + 2
    pool = kvwork.Pool(a.page_bytes, a.slot_pages, slots, None)
    pool.fill_bodies()
    ctl = Ctl(a.ctl_fd)
    hello = ctl.recv(timeout=300).split()
    if hello[0] != "hello":
        raise RuntimeError(f"target said '{' '.join(hello)}'")
    perm = kvwork.shuffled_perm(SEED, a.slot_pages)
    eng = ENGINES[a.engine][1](pool, hello[1:3], int(hello[3]), a.page_bytes, perm, a.concurrency)
    ctl.send("ready")
    free = list(range(slots))[::-1]
    pending = collections.deque()
    inflight = []  # (handle, idx, sslot, t_enq)
    u0 = usage()
    while True:
        progress = False
        ended = quit_ = False
        for l in ctl.poll():
            f = l.split()
            if f[0] == "go":
                pending.append((int(f[1]), int(f[2])))
            elif f[0] == "end":
                ended = True
            elif f[0] == "quit":
                quit_ = True
            else:
                raise RuntimeError(f"target said '{l}'")
            progress = True
        if quit_:
            return
        while pending and free:
            idx, dslot = pending.popleft()
            sslot = free.pop()
            pool.stamp(sslot, kvwork.room_id(SEED, idx))
            t_enq = time.monotonic_ns()
            inflight.append((eng.post(idx, sslot, dslot, t_enq), idx, sslot, t_enq))
            progress = True
        i = 0
        while i < len(inflight):
            h, idx, sslot, t_enq = inflight[i]
            if eng.poll(h):
                inflight.pop(i)
                free.append(sslot)
                eng.completed(ctl, idx, t_enq)
                progress = True
                continue
            i += 1
        if ended:
            # The target ends a phase once every request checked, so none is in flight.
            u = since(u0, usage())
            ctl.send("stats " + " ".join(str(x) for x in u))
            u0 = usage()
        if not progress:
            time.sleep(a.poll_us / 1e6)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True)
    ap.add_argument("--role", choices=["target", "initiator"], required=True)
    ap.add_argument("--ctl-fd", type=int, required=True)
    ap.add_argument("--page-bytes", type=int, required=True)
    ap.add_argument("--slot-pages", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rooms", type=int, default=32, help="requests per timed phase")
    ap.add_argument("--phases", type=int, default=1)
    ap.add_argument("--poll-us", type=float, default=100)
    ap.add_argument("--marks", action="store_true", help="target: say on stderr when a phase starts and ends")
    ap.add_argument("--nixl-err-mode", choices=["peer", "none"],
                    help="NIXL: the UCX backend's ucx_error_handling_mode [the backend's default, peer]")
    a = ap.parse_args()
    global NIXL_ERR_MODE
    NIXL_ERR_MODE = a.nixl_err_mode
    code = 0
    try:
        (run_target if a.role == "target" else run_initiator)(a)
    except Exception:
        traceback.print_exc()
        print(f"pair.py {a.engine} {a.role}: failed", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # C stdio too (UCX's log with UCX_LOG_FILE, which os._exit would drop).
    ctypes.CDLL(None).fflush(None)
    os._exit(code)


if __name__ == "__main__":
    main()

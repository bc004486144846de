"""Executors run job payloads and report each result back to the orchestrator's thread.

`SerialExecutor` runs in-process (fast tests, debugging). `RayExecutor` runs jobs as calls on Ray
actors that declare the stage's CPUs/GPUs and keep the models they loaded resident, so a worker
holding a teacher evaluates many conversions without reloading it. Neither touches the DB.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

Done = Callable[[dict[str, Any], dict[str, Any] | None, str | None, float], None]
# (job key, done, total, description, metrics): metrics are records a running job reports early
# (validation CE during distillation); the orchestrator writes them at once, the final record replaces them
Progress = Callable[[str, float, float, str, list | None], None]
Claim = Callable[[dict[str, Any]], bool]  # take the job just before it starts; False: someone else has it
Shape = tuple[float, float, tuple[tuple[str, float], ...]]  # (cpus, gpus, sorted Ray custom resources)


class JobLog:
    """A job's log file that never fails the job: when it cannot be opened or written (a full disk, a
    folder that cannot be made) its text goes on in memory, `error` says why, and the job runs on."""

    encoding = "utf-8"

    def __init__(self, path: str | None) -> None:
        self.path, self.error, self.file = path, None, None
        self.memory = io.StringIO()
        try:
            if path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            self.file = open(path or os.devnull, "a")  # noqa: SIM115  (closed in close())
        except OSError as e:
            self._lost(e)

    def _lost(self, e: OSError) -> None:
        self.error = self.error or f"cannot write the log {self.path}: {e}"
        f, self.file = self.file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def write(self, text: str) -> int:
        if self.file is not None:
            try:
                return self.file.write(text)
            except OSError as e:
                self._lost(e)
        return self.memory.write(text)

    def flush(self) -> None:
        if self.file is not None:
            try:
                self.file.flush()
            except OSError as e:
                self._lost(e)

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str):  # anything else a library asks of sys.stdout (encoding, buffer, ...)
        if name in ("file", "memory"):
            raise AttributeError(name)
        return getattr(self.file if self.file is not None else self.memory, name)

    def fileno(self) -> int:
        if self.file is None:
            raise io.UnsupportedOperation("the job's log is kept in memory")
        return self.file.fileno()

    def close(self) -> None:
        self.flush()
        if self.file is not None:
            try:
                self.file.close()
            except OSError as e:
                self._lost(e)
            self.file = None


LM_EVAL_STAGES = frozenset({"evaluate"})  # the stages whose jobs run lm-eval's simple_evaluate


def _no_git_probe() -> None:
    """lm-eval stores `git describe` of the working directory in its results: meaningless for a job (moesweep
    records its own code version per job), and outside a git checkout git prints `fatal: not a git
    repository` straight to the terminal, past the job's log. The job's environment, not its code, so no key
    changes."""
    try:
        import lm_eval.evaluator as evaluator
    except ImportError:
        return
    evaluator.get_git_commit_hash = lambda: None


def run_payload(
    payload: dict[str, Any], cache: dict, progress: Progress | None, where: dict[str, Any] | None = None
) -> tuple[dict | None, str | None]:
    """Run one job with its output going to its log file; returns (result, error text). Never raises an
    Exception: a job that cannot write its log still runs, and its error (with why the log is missing)
    comes back to the orchestrator, which records it."""
    cb = (
        (lambda d, t, desc="", metrics=None: progress(payload["key"], d, t, desc, metrics))
        if progress
        else None
    )
    log = JobLog(payload.get("log_path"))
    result, err = None, None
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                from workers.run.jobs import run_job

                if payload.get("stage") in LM_EVAL_STAGES:
                    _no_git_probe()
                t0 = time.perf_counter()
                result = run_job(payload, cache, cb)
                result.setdefault("compute_s", time.perf_counter() - t0)
            except Exception:  # a failing job is a result for the orchestrator, not a crash
                err = traceback.format_exc()
                log.write(err)
    finally:
        log.close()
    if err is not None and log.error:
        err += f"\n(its log is incomplete: {log.error})"
    if result is not None:  # where it ran, beside the library versions (jobs.versions_json)
        result["versions"] = {**result.get("versions", {}), "host": socket.gethostname(), **(where or {})}
    return result, err


def fresh_cache(cache: dict, epoch: int, payload: dict[str, Any]) -> int:
    """A payload's `cache_epoch` grows when the orchestrator recomputed an artifact in place (same path,
    new content): what a worker loaded before (a resident teacher, calibration statistics) is dropped."""
    new = payload.get("cache_epoch", 0)
    if new != epoch:
        cache.clear()
    return new


def payload_shape(payload: dict[str, Any]) -> Shape:
    """The resources a job holds while it runs: jobs of one shape share a pool of actors."""
    return (
        payload.get("cpus", 1),
        payload.get("gpus", 0),
        tuple(sorted((payload.get("custom") or {}).items())),
    )


def _amounts(shape: Shape) -> dict[str, float]:
    """A shape as Ray names its resources: {"CPU": .., "GPU": .., custom name: ..}."""
    return {"CPU": shape[0], "GPU": shape[1], **dict(shape[2])}


class SerialExecutor:
    name = "serial"

    def __init__(self) -> None:
        self.cache: dict = {}
        self.epoch = 0

    def run(
        self,
        payloads: list[dict[str, Any]],
        on_done: Done,
        progress: Progress | None = None,
        poll: Callable[[], None] | None = None,
        claim: Claim | None = None,
    ) -> None:
        for p in payloads:
            if claim is not None and not claim(p):
                continue
            self.epoch = fresh_cache(self.cache, self.epoch, p)
            t0 = time.perf_counter()
            result, err = run_payload(p, self.cache, progress)
            on_done(p, result, err, time.perf_counter() - t0)

    def close(self) -> None:
        self.cache.clear()


class ClusterError(RuntimeError):
    """The Ray cluster of --address / RAY_ADDRESS cannot be joined; the message is one line."""


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def unreachable(address: str, timeout: float = 10.0) -> str | None:
    """Why no Ray cluster can answer at `address`, or None: something listens there, or it is a form Ray
    resolves itself (auto, local, another scheme). HOST:PORT is the head's GCS, ray://HOST:PORT a Ray Client
    server; a refused or timed-out connection would otherwise leave ray.init retrying for minutes."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if address in ("auto", "local") or "://" in target or not sep or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as e:
        return f"nothing answers at {host}:{port} ({e.strerror or e})"


class RayExecutor:
    """Jobs as Ray actor calls; one actor pool per (cpus, gpus, custom resources) shape, reused across stages."""

    name = "ray"

    def __init__(
        self, address: str | None = None, num_cpus: int | None = None, max_concurrent: int | None = None
    ) -> None:
        self.address, self.num_cpus, self.max_concurrent = address, num_cpus, max_concurrent
        self.ray: Any = (
            None  # Ray starts with the first job: a resumed sweep with nothing to run never starts it
        )
        self.hub: Any = None
        self.pools: dict[Shape, list[Any]] = {}
        self.holds: dict[Any, str] = {}  # actor -> the resident model its last job loaded
        self.starting: dict[Any, Any] = {}  # actor -> its readiness ref, until it has started

    def _start(self) -> None:
        import ray

        self.ray = ray
        if not ray.is_initialized():
            kw: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if self.address:
                try:
                    ray.init(address=self.address, **kw)
                except (ConnectionError, RuntimeError, ValueError) as e:  # Ray's, after its own retries
                    raise ClusterError(
                        f"cannot join the Ray cluster at {self.address}: {_first_line(e)}"
                    ) from None
            else:
                with _dies_with_this_process():
                    ray.init(num_cpus=self.num_cpus or os.cpu_count() or 1, **kw)
        self.hub = _progress_hub(ray).remote()

    def connect(self) -> None:
        """Start (or join) Ray now rather than with the first job: a cluster given by address is joined
        before anything else happens, so one that cannot be is a ClusterError up front."""
        if self.ray is None:
            self._start()

    def _pool(self, shape: Shape, wanted: int) -> list[Any]:
        cpus, gpus, custom = shape
        pool = self.pools.setdefault(shape, [])
        total = self.ray.cluster_resources()
        fit = int(total.get("CPU", 1) // cpus) if cpus else wanted
        for name, need in (("GPU", gpus), *custom):
            if need:
                fit = min(fit, int(total.get(name, 0) // need))
        if fit < 1:
            extra = "".join(f", {v:g} {k}" for k, v in custom)
            have = "".join(f", {total.get(k, 0):g} {k}" for k, _ in custom)
            raise RuntimeError(
                f"no node can hold a job needing {cpus} CPUs and {gpus} GPUs{extra} "
                f"(cluster: {total.get('CPU', 0)} CPUs, {total.get('GPU', 0)} GPUs{have})"
            )
        n = max(1, min(wanted, fit, self.max_concurrent or wanted))
        self._make_room(shape, max(n, len(pool)), total)
        while len(pool) < n:
            pool.append(self._actor(shape))
        return pool[:n]

    def _actor(self, shape: Shape) -> Any:
        cpus, gpus, custom = shape
        actor = (
            _worker_actor(self.ray)
            .options(num_cpus=cpus, num_gpus=gpus, resources=dict(custom) or None)
            .remote(self.hub, cpus)
        )
        self.starting[actor] = actor.__ray_ready__.remote()
        return actor

    def run(
        self,
        payloads: list[dict[str, Any]],
        on_done: Done,
        progress: Progress | None = None,
        poll: Callable[[], None] | None = None,
        claim: Claim | None = None,
    ) -> None:
        if not payloads:
            return
        if self.ray is None:
            self._start()
        # jobs that want the same resident model go to the same actor, in order
        payloads = sorted(payloads, key=lambda p: (p.get("resident") or "", p["key"]))
        shape = payload_shape(payloads[0])
        pool = self._pool(shape, wanted=len(payloads))
        queue = list(payloads)
        inflight: dict[Any, tuple[dict, Any, float]] = {}
        idle = list(pool)
        try:
            while queue or inflight:
                while queue and (actor := self._first_started(idle, shape)) is not None:
                    p = self._next_job(actor, queue)
                    if claim is not None and not claim(p):
                        continue
                    idle.remove(actor)
                    if p.get("resident"):
                        self.holds[actor] = p["resident"]
                    inflight[actor.run.remote(p)] = (p, actor, time.perf_counter())
                refs = list(inflight) or [self.starting[a] for a in idle if a in self.starting]
                ready, _ = self.ray.wait(refs, num_returns=1, timeout=0.5) if refs else ([], [])
                self._drain_progress(progress)
                if poll:
                    poll()
                for ref in ready:
                    if ref not in inflight:  # an actor has started: it takes a job in the next round
                        continue
                    p, actor, t0 = inflight.pop(ref)
                    try:
                        result, err = self.ray.get(ref)
                    except Exception:  # the actor died (OOM, segfault): the job failed
                        result, err = None, traceback.format_exc()
                        self._replace(actor, shape)
                        actor = None
                    if actor is not None:
                        idle.append(actor)
                    else:
                        idle.append(self.pools[shape][-1])
                    on_done(p, result, err, time.perf_counter() - t0)
        except BaseException:
            for ref in inflight:
                self.ray.cancel(ref, force=True)
            raise

    def _first_started(self, idle: list[Any], shape: Shape) -> Any:
        """The first idle actor that has started (None: none yet). A job is claimed only once an actor
        can run it: a job claimed for an actor that cannot be placed (another launch on the cluster holds
        what it needs) would stay `running` while that launch waits for it, and neither would go on."""
        for actor in list(idle):
            ref = self.starting.get(actor)
            if ref is None:
                return actor
            if not self.ray.wait([ref], timeout=0)[0]:
                continue
            del self.starting[actor]
            try:
                self.ray.get(ref)
                return actor
            except Exception:  # it died while starting: a fresh one takes its place
                idle.remove(actor)
                self._replace(actor, shape)
                idle.append(self.pools[shape][-1])
        return None

    def _next_job(self, actor: Any, queue: list[dict[str, Any]]) -> dict[str, Any]:
        """The first queued job that wants the model this actor already holds, else the first one.

        An actor keeps one resident model (workers.run.runtime.resident_teacher); switching it reloads the
        model and drops the tensors cached for it, so an actor stays with its model while jobs want it."""
        held = self.holds.get(actor)
        i = next((i for i, p in enumerate(queue) if held is not None and p.get("resident") == held), 0)
        return queue.pop(i)

    def _make_room(self, shape: Shape, n: int, total: dict[str, float]) -> None:
        """Actors hold their resources for as long as they live: when the pools of other shapes hold
        what `n` actors of this shape need, end those pools (else this pool's actors never start)."""
        others = [s for s in self.pools if s != shape and self.pools[s]]
        held: dict[str, float] = {}
        for s in [*others, shape]:
            count = n if s == shape else len(self.pools[s])
            for name, amount in _amounts(s).items():
                held[name] = held.get(name, 0) + amount * count
        if all(v <= total.get(name, 0) + 1e-9 for name, v in held.items()):
            return
        for s in others:
            for a in self.pools.pop(s):
                self.holds.pop(a, None)
                self.starting.pop(a, None)
                self.ray.kill(a)

    def _replace(self, actor: Any, shape: Shape) -> None:
        self.holds.pop(actor, None)
        self.starting.pop(actor, None)
        pool = self.pools[shape]
        if actor in pool:
            pool.remove(actor)
        pool.append(self._actor(shape))

    def _drain_progress(self, progress: Progress | None) -> None:
        if progress is None:
            return
        for key, done, total, desc, metrics in self.ray.get(self.hub.drain.remote()):
            progress(key, done, total, desc, metrics)

    def close(self) -> None:
        for pool in self.pools.values():
            for a in pool:
                self.ray.kill(a)
        self.pools.clear()
        self.holds.clear()
        self.starting.clear()


# ---- a local Ray ends with the process that started it ------------------------------------------
# Ray ties its head processes (gcs_server, raylet, ...) to the driver with PR_SET_PDEATHSIG, but not what the
# raylet starts: when the driver is SIGKILLed, its workers, idle prestarted workers and the dashboard and
# runtime-env agents live on until they notice (1.5 to 60 s here, benchmarks/README.md). The watchdog waits
# in a session of its own for the driver to end (the end of a pipe that only the driver holds) and then
# SIGKILLs what that Ray started. It knows them two ways, as either alone misses some: while the driver
# lives it notes, every second, the driver's descendants and every process that carries the launch's token
# in its environment (a process that renames itself, as Ray's agents do, may overwrite the environment that
# /proc shows); once the driver is gone it kills those still alive (same pid and start time), every process
# still showing the token, and their descendants, until none is left.
LOCAL_RAY_ENV = "MOESWEEP_LOCAL_RAY"

_WATCHDOG = r"""# moesweep: the local Ray watchdog
import os, select, signal, sys, time
token, driver, me = sys.argv[1].encode(), int(sys.argv[2]), os.getpid()


def table():
    t = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                t[int(d)] = (int(fields[1]), fields[19])
            except (OSError, IndexError, ValueError):
                pass
    return t


def marked(pids):
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if token in f.read().split(b"\0"):
                    found.add(pid)
        except OSError:
            pass
    return found


def family(t, roots):
    kids = {}
    for pid, (ppid, _) in t.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [r for r in roots if r in t]
    while todo:
        pid = todo.pop()
        if pid not in out and pid != me:
            out.add(pid)
            todo += kids.get(pid, [])
    return out


known, checked = {}, set()
while True:
    ready = select.select([sys.stdin], [], [], 1.0)[0]
    if ready and not os.read(sys.stdin.fileno(), 4096):
        break  # EOF: the driver ended, however it ended
    t = table()
    new = {p for p in t if (p, t[p][1]) not in checked}
    checked = {(p, t[p][1]) for p in t}
    roots = {driver} | {p for p, st in known.items() if t.get(p, (0, None))[1] == st} | marked(new - {me})
    known = {p: t[p][1] for p in family(t, roots) if p != driver}

deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    t = table()
    alive = {p for p, st in known.items() if t.get(p, (0, None))[1] == st}
    targets = family(t, alive | marked(set(t) - {me}))
    if not targets:
        break
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.2)
"""


@contextlib.contextmanager
def _dies_with_this_process():
    """Around `ray.init` of a local Ray (never a cluster's `--address`): every process that this Ray starts
    inherits `MOESWEEP_LOCAL_RAY=<token>` (set only while the head starts; the raylet passes its environment
    on to the workers and agents it starts later) and a watchdog kills them, and this process's other
    descendants, once this process has ended (SIGKILL included). Linux only (it reads /proc); elsewhere
    Ray's own clean-up is all there is."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc") or os.environ.get("RAY_ADDRESS"):
        yield  # (with RAY_ADDRESS set, ray.init joins that cluster: nothing here is ours to end)
        return
    token = f"{LOCAL_RAY_ENV}={os.getpid()}-{uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k != LOCAL_RAY_ENV}
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, token, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )  # a kill of the launch's process group spares it
    _WATCHDOGS.append(watchdog)  # its pipe stays open for as long as this process lives
    before = os.environ.get(LOCAL_RAY_ENV)
    os.environ[LOCAL_RAY_ENV] = token.split("=", 1)[1]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOCAL_RAY_ENV, None)
        else:
            os.environ[LOCAL_RAY_ENV] = before


_WATCHDOGS: list[subprocess.Popen] = []
_ACTOR = None
_HUB = None


def _worker_actor(ray):
    global _ACTOR
    if _ACTOR is None:

        @ray.remote
        class JobWorker:
            def __init__(self, hub, cpus: float) -> None:
                import ray as _ray
                import torch

                torch.set_num_threads(max(1, int(cpus)))
                self.hub = hub
                self.cache: dict = {}
                self.epoch = 0
                ctx = _ray.get_runtime_context()  # where its jobs run, recorded with each result
                self.where = {"ray_node": ctx.get_node_id(), "ray_resources": ctx.get_assigned_resources()}

            def run(self, payload: dict[str, Any]):
                self.epoch = fresh_cache(self.cache, self.epoch, payload)

                def report(
                    key: str, done: float, total: float, desc: str = "", metrics: list | None = None
                ) -> None:
                    self.hub.put.remote(key, done, total, desc, metrics)

                return run_payload(payload, self.cache, report, self.where)

        _ACTOR = JobWorker
    return _ACTOR


def _progress_hub(ray):
    """A tiny actor that collects progress reports from workers for the driver's bars."""
    global _HUB
    if _HUB is None:

        @ray.remote(num_cpus=0)
        class ProgressHub:
            def __init__(self) -> None:
                self.latest: dict[str, tuple] = {}
                self.metrics: dict[str, list] = {}

            def put(
                self, key: str, done: float, total: float, desc: str, metrics: list | None = None
            ) -> None:
                self.latest[key] = (key, done, total, desc)
                if metrics:
                    self.metrics.setdefault(key, []).extend(metrics)

            def drain(self) -> list[tuple]:
                keys = list(self.latest) + [k for k in self.metrics if k not in self.latest]
                out = [(*self.latest.get(k, (k, 0, 0, ""))[:4], self.metrics.get(k)) for k in keys]
                self.latest, self.metrics = {}, {}
                return out

        _HUB = ProgressHub
    return _HUB

"""A PostgreSQL server for the tests: the one MOESWEEP_TEST_PG_URL names, or a throwaway cluster.

Without MOESWEEP_TEST_PG_URL the tests start their own server from the PostgreSQL server programs
(Debian/Ubuntu: `apt-get install postgresql`, found in /usr/lib/postgresql/*/bin; elsewhere initdb and
pg_ctl on PATH; or the folder MOESWEEP_TEST_PG_BINDIR names): a cluster in a fresh temporary folder,
listening on a unix socket in that folder only (no TCP port), trust authentication, stopped and deleted
when the test session ends (a detached watchdog does it should the test process be killed). As root,
the server runs as the user `postgres` (or `nobody`), since PostgreSQL refuses to run as root.

Each test or test module asks for its own database (`PgServer.create_database`), so tests never see each other's
rows; with MOESWEEP_TEST_PG_URL the user must therefore be allowed to CREATE DATABASE, and the databases
(moesweep_test_*) are dropped at the end.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from sqlalchemy.engine import URL, make_url

ENV_URL = "MOESWEEP_TEST_PG_URL"
ENV_BINDIR = "MOESWEEP_TEST_PG_BINDIR"
PROGRAMS = ("initdb", "pg_ctl", "postgres")
HOW = (
    f"install the PostgreSQL server (Debian/Ubuntu: apt-get install postgresql; .ci/run does) so the "
    f"tests start a throwaway one, or set {ENV_URL}=postgresql+psycopg://USER@HOST/DB (a user who may "
    "CREATE DATABASE)"
)


class NoPostgres(Exception):
    """No server to test against, and why (one line for pytest.fail)."""


def _version(bindir: str) -> tuple[int, ...]:
    m = re.search(r"/postgresql/([\d.]+)/bin$", bindir)
    return tuple(int(p) for p in m.group(1).split(".") if p) if m else ()


def find_bindir() -> Path:
    """The folder of initdb, pg_ctl and postgres: $MOESWEEP_TEST_PG_BINDIR, else Debian's newest
    /usr/lib/postgresql/*/bin, else the folder of pg_ctl on PATH."""

    def complete(d: str | os.PathLike) -> bool:
        return all(os.access(Path(d) / p, os.X_OK) for p in PROGRAMS)

    if os.environ.get(ENV_BINDIR):
        d = Path(os.environ[ENV_BINDIR])
        if not complete(d):
            raise NoPostgres(f"{ENV_BINDIR}={d} does not hold {', '.join(PROGRAMS)}: {HOW}")
        return d
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True):
        if complete(d):
            return Path(d)
    on_path = shutil.which("pg_ctl")
    if on_path and complete(Path(on_path).resolve().parent):
        return Path(on_path).resolve().parent
    raise NoPostgres(
        f"the PostgreSQL tests found no server: {ENV_URL} is not set and no PostgreSQL server "
        f"programs ({', '.join(PROGRAMS)}) are installed; {HOW}"
    )


def _server_user() -> pwd.struct_passwd | None:
    """Who runs the server: None (this user) unless we are root, whom PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise NoPostgres(
        "running as root, and there is no user postgres or nobody to run the PostgreSQL "
        f"server as (it refuses root): create one, or set {ENV_URL}"
    )


class PgServer:
    """A running PostgreSQL server: `create_database()` gives the URL of a new, empty database."""

    def __init__(self, admin_url: str, owned: bool) -> None:
        self.admin_url = admin_url  # a database to connect to for CREATE/DROP DATABASE
        self.owned = owned  # True: our throwaway cluster (deleted whole at the end)
        self.created: list[str] = []
        self._names = itertools.count(1)

    def _admin(self, sql: str) -> None:
        import psycopg

        u = make_url(self.admin_url)
        with psycopg.connect(**_connect_args(u), autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self, label: str = "db") -> str:
        name = f"moesweep_test_{os.getpid()}_{next(self._names)}_{re.sub(r'[^a-z0-9_]', '_', label.lower())}"
        name = name[:63]
        try:
            self._admin(f'CREATE DATABASE "{name}"')
        except Exception as e:
            raise NoPostgres(
                f"cannot create a test database on {make_url(self.admin_url).render_as_string()}: "
                f"{' '.join(str(e).split())} (the user must be allowed to CREATE DATABASE)"
            ) from None
        self.created.append(name)
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def drop_databases(self) -> None:
        for name in self.created:
            with contextlib.suppress(Exception):
                self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.created.clear()


def _connect_args(u: URL) -> dict:
    """psycopg.connect() keywords for a postgresql+psycopg:// URL (host may be a socket folder)."""
    args = {k: v for k, v in dict(u.query).items()}
    for key, value in (
        ("host", u.host),
        ("port", u.port),
        ("user", u.username),
        ("password", u.password),
        ("dbname", u.database),
    ):
        if value is not None:
            args.setdefault(key, value)
    return args


def external_server() -> PgServer | None:
    url = os.environ.get(ENV_URL)
    if not url:
        return None
    u = make_url(url)
    if u.get_backend_name() != "postgresql":
        raise NoPostgres(f"{ENV_URL}={u.render_as_string()} is not a postgresql+psycopg:// URL")
    return PgServer(u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False), owned=False)


@contextlib.contextmanager
def throwaway_server():
    """Start a fresh cluster in a temporary folder; yield its PgServer; stop it and delete the folder."""
    bindir = find_bindir()
    user = _server_user()
    # not under pytest's basetemp (/tmp/pytest-of-root is 0700, where the postgres user cannot go), and
    # short: the server's socket path, FOLDER/.s.PGSQL.5432, must fit in 107 bytes
    base = tempfile.gettempdir()
    if (user is not None or len(base) > 60) and os.path.isdir("/tmp"):
        base = "/tmp"
    top = Path(tempfile.mkdtemp(prefix="moesweep-pg-", dir=base))
    data, log = top / "data", top / "server.log"
    as_user = {}
    if user is not None:
        os.chown(top, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")

    def run(*args: str, timeout: float = 120) -> None:
        try:
            r = subprocess.run(
                [str(bindir / args[0]), *args[1:]],
                capture_output=True,
                text=True,
                env=env,
                cwd=top,
                timeout=timeout,
                **as_user,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NoPostgres(f"{args[0]} failed: {e}") from None
        if r.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise NoPostgres(
                f"{' '.join(args[:2])} failed (exit {r.returncode}): "
                f"{' '.join((r.stderr + r.stdout + tail).split())[-1500:]}"
            )

    started = False
    try:
        run(
            "initdb",
            "-D",
            str(data),
            "-U",
            "moesweep",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        options = " ".join(
            [
                "-c listen_addresses=''",  # no TCP at all: the unix socket below is the only way in
                f"-c unix_socket_directories='{top}'",
                "-c port=5432",  # only names the socket file, .s.PGSQL.5432 in our folder
                "-c max_connections=200",  # tests open many short-lived engines
                "-c shared_buffers=16MB",
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off",  # a throwaway cluster
            ]
        )
        run("pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start")
        started = True
        _watchdog(data, top)
        admin = URL.create(
            "postgresql+psycopg",
            username="moesweep",
            database="postgres",
            query={"host": str(top), "port": "5432"},
        )
        yield PgServer(admin.render_as_string(hide_password=False), owned=True)
    finally:
        if started:
            with contextlib.suppress(NoPostgres):
                run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "-t", "60", "stop")
        shutil.rmtree(top, ignore_errors=True)


WATCHDOG = """
while kill -0 "$1" 2>/dev/null; do sleep 2; done
[ -f "$2/postmaster.pid" ] && kill -QUIT "$(head -n 1 "$2/postmaster.pid")" 2>/dev/null && sleep 2
rm -rf "$3"
"""


def _watchdog(data: Path, top: Path) -> None:
    """Should this process die without its clean-up (SIGKILL, SIGTERM), a detached shell stops the server
    (SIGQUIT: immediate shutdown) and deletes its folder."""
    subprocess.Popen(
        ["sh", "-c", WATCHDOG, "moesweep-pg-watchdog", str(os.getpid()), str(data), str(top)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

"""Tests run offline, on CPU, with one torch thread (tiny models, 2-core machines)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# torch.compile's kernels (inductor on the CPU) go to a cache of this run's own: a cache shared with runs under
# another ATEN_CPU_CAPABILITY hands out kernels built for another instruction set (seen: a segfault)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="moesweep-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: threads cost more than they give

import contextlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def pg_database():
    """`pg_database(label)` -> the URL of a new, empty PostgreSQL database (postgresql+psycopg://).

    The server is the one MOESWEEP_TEST_PG_URL names, else a throwaway cluster started for this session
    from the installed PostgreSQL server programs (tests/throwaway_pg.py). With neither, a test that asks
    for a database fails (it does not skip) and says what to install."""
    from throwaway_pg import NoPostgres, external_server, throwaway_server

    with contextlib.ExitStack() as stack:
        problem = None
        server = None
        try:
            server = external_server() or stack.enter_context(throwaway_server())
        except NoPostgres as e:
            problem = str(e)

        def make(label: str = "db") -> str:
            if server is None:
                pytest.fail(problem, pytrace=False)
            try:
                return server.create_database(label)
            except NoPostgres as e:
                pytest.fail(str(e), pytrace=False)

        yield make
        if server is not None and not server.owned:
            server.drop_databases()


@pytest.fixture(autouse=True)
def _ctrl_c_as_python_sets_it():
    """Every test starts with Ctrl-C handled as Python sets it up: SIGINT's handler Python's own (also at the OS
    level, where a library's C code may have left it ignored) and SIGINT not blocked in the main thread; the
    launches these tests start in subprocesses inherit that."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the long variants (fuzzing with 1000+ examples, 500-step consistency)")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: single-process tests of pure functions (seconds); "
                                       "`pytest -m quick tests` for a fast loop")

"""Benchmarks are `bench_*.py` files (kept out of the test suite); each may add rows to a
table printed at the end of the run."""
import pytest

_TABLES: dict[str, list[str]] = {}


def pytest_collect_file(parent, file_path):
    named = file_path.suffix == ".py" and file_path.name.startswith("bench_")
    if named and not parent.session.isinitpath(file_path):  # files named on the command line are collected anyway
        return pytest.Module.from_parent(parent, path=file_path)


@pytest.fixture(scope="module")
def table(request):
    """`table(header, row)`: a row for the table named after the module's docstring title."""
    title = (request.module.__doc__ or request.module.__name__).strip().splitlines()[0]

    def add(header: str, row: str) -> None:
        _TABLES.setdefault(title, [header]).append(row)
    return add


def pytest_terminal_summary(terminalreporter):
    for title, rows in _TABLES.items():
        terminalreporter.write_sep("-", title)
        for row in rows:
            terminalreporter.write_line(row)

"""Shared test set-up: deterministic seeds, GPU tests skipped without CUDA,
``--update-golden`` (rewrite the golden files of tests/golden/ instead of comparing),
``check_output``, which holds printed output against an expected output, and ``umask_027``,
which checks that written files honour the umask; SIGINT handled by Python even when a shell
started the suite in the background (which ignores it)."""
import doctest
import os
import random
import signal

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite the golden traces under tests/golden/ from this checkout instead of comparing")


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")


def _check_output(got: str, want: str, where: str) -> None:
    """Fail unless ``got`` is ``want``, where ``...`` in ``want`` matches any text, across lines too
    (doctest's ELLIPSIS): expected outputs write ``...`` over figures measured on the wall clock,
    which differ from run to run, and over lines a document leaves out."""
    flags = doctest.ELLIPSIS | doctest.REPORT_UDIFF
    checker = doctest.OutputChecker()
    if not checker.check_output(want, got, flags):
        diff = checker.output_difference(doctest.Example("", want), got, flags)
        pytest.fail(f"{where}: the output differs from the expected output\n{diff}", pytrace=False)


@pytest.fixture
def check_output():
    """``check_output(got, want, where)``: see :func:`_check_output`."""
    return _check_output


@pytest.fixture
def umask_027():
    """Run the test under umask 027 (the group may read, others get nothing); yields ``check(root)``,
    which asserts that every file and folder below ``root`` has the mode a plain ``open`` or
    ``mkdir`` gives under it (0640, 0750): nothing megaloom writes is more open or more closed."""
    def check(root) -> None:
        paths = sorted(root.rglob("*"))
        assert paths, f"nothing was written below {root}"
        bad = [f"{p.relative_to(root)}: {p.stat().st_mode & 0o777:o}" for p in paths
               if p.stat().st_mode & 0o777 != (0o750 if p.is_dir() else 0o640)]
        assert not bad, f"modes that ignore the umask 027: {bad}"

    old = os.umask(0o027)
    try:
        yield check
    finally:
        os.umask(old)


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # started in the background by a shell without job control, which ignores SIGINT: give the
    # suite Python's own handler, as under a terminal, so Ctrl-C handling can be tested
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Shared test set-up: deterministic seeds, GPU tests skipped without CUDA,
``--update-golden`` (rewrite the golden files of tests/golden/ instead of comparing), and
``check_output``, which holds printed output against an expected output."""
import doctest
import random

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

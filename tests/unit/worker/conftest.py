"""Fixtures for the worker's model tests: a built model repository, shared by the session.

`model_repo/` (from `make models`) is reused when it holds exactly the current
recipes. Otherwise the digits classifier is built in full (a few seconds) and
tinylm with a short training run: the paged-vs-dense and executor tests need
the real architecture, not a well-trained model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.worker.repository.loader import LoadedModel, load_model
from tools.build_models import DigitsRecipe, TinyLMRecipe, build_digits, build_tinylm, is_up_to_date

REPO_MODEL_ROOT = Path(__file__).resolve().parents[3] / "model_repo"
QUICK_TINYLM = dataclasses.replace(TinyLMRecipe(), num_steps=40, batch_size=8, train_seq_len=128, num_eval_windows=4)


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if is_up_to_date(REPO_MODEL_ROOT, DigitsRecipe()) and is_up_to_date(REPO_MODEL_ROOT, TinyLMRecipe()):
        return REPO_MODEL_ROOT
    root = tmp_path_factory.mktemp("model_repo")
    build_digits(root, log=_quiet)
    build_tinylm(root, QUICK_TINYLM, log=_quiet)
    return root


@pytest.fixture(scope="session")
def digits(model_root: Path) -> LoadedModel:
    return load_model(model_root, "digits", "1")


@pytest.fixture(scope="session")
def tinylm(model_root: Path) -> LoadedModel:
    return load_model(model_root, "tinylm", "1")

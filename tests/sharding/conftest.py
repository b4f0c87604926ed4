"""Fixtures shared by the sharding tests."""

import pytest

from deepinfer.model import init_params, load_config, write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny-v4.1-short checkpoint in the official format (random weights), written once per module."""
    directory = tmp_path_factory.mktemp("tiny")
    config = load_config("tiny-v4.1-short", dtype="float32")
    write_checkpoint(init_params(config, seed=7), config, str(directory))
    return str(directory)

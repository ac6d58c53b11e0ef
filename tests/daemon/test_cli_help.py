"""`kvd serve --help` shows each option's default from Config, written nowhere else (no daemon)."""
from __future__ import annotations

import pytest

from kvd.cli import build_parser
from kvd.daemon.config import FIELD_NAMES, config_default, load_config, shown_default

SERVE = build_parser().commands["serve"]
OPTIONS = {action.dest: action for action in SERVE._actions if action.dest in FIELD_NAMES}


def test_every_config_field_has_a_flag():
    assert set(FIELD_NAMES) - set(OPTIONS) == set()


@pytest.mark.parametrize("name", sorted(n for n in OPTIONS if shown_default(n) is not None))
def test_help_shows_the_config_default_once(name):
    text = OPTIONS[name].help
    assert text.endswith(f"(default: {shown_default(name)})"), text
    assert text.count("default:") == 1, f"a default written by hand beside Config's: {text!r}"
    # what the help says is what a bare daemon runs with: read back, it is Config's value
    assert getattr(load_config({name: shown_default(name)}, env={}), name) == config_default(name)


def test_what_is_not_one_value_is_said_in_words():
    """Defaults computed at start, empty or derived: the help says what happens instead."""
    for name in ("node_id", "socket", "registry", "advertise", "curve_cert"):
        assert shown_default(name) is None and "default:" in OPTIONS[name].help, name


def test_sizes_and_durations_are_shown_in_units():
    assert shown_default("pool_size") == "1GiB" and shown_default("block_size") == "64KiB"
    assert shown_default("default_ttl") == "600s" and shown_default("window") == "8"
    assert shown_default("pool_prefault") is None and shown_default("curve_allow") is None


def test_the_parser_leaves_every_option_unset():
    """The parser's defaults stay None, so the env and the config file can still set a value."""
    args = SERVE.parse_args([])
    assert all(getattr(args, name) is None for name in OPTIONS), vars(args)

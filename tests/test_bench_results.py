"""Which benchmark runs may write the results file the README quotes: only those with every flag at its default."""

import argparse

from benchmarks.common import with_defaults


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1025,4097")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p


def test_a_run_with_every_default_is_the_full_run_even_when_the_defaults_are_spelled_out():
    p = parser()
    assert with_defaults(p, p.parse_args([]))
    assert with_defaults(p, p.parse_args(["--repeats", "3", "--sizes", "1025,4097"]))


def test_any_other_flag_makes_a_partial_run_not_only_another_choice_of_rows():
    p = parser()
    assert not with_defaults(p, p.parse_args(["--repeats", "1"]))  # a quick run must not overwrite the full one
    assert not with_defaults(p, p.parse_args(["--sizes", "1025"]))


def test_flags_that_choose_another_results_file_are_left_out_when_named():
    p = parser()
    args = p.parse_args(["--device", "cuda"])
    assert not with_defaults(p, args)
    assert with_defaults(p, args, apart_from=["device"])
    assert not with_defaults(p, p.parse_args(["--device", "cuda", "--repeats", "9"]), apart_from=["device"])

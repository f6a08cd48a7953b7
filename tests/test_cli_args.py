"""The command line's arguments: every numeric option checked for its range in the parser (one
line, exit 2, before any work), a batch the memory cannot hold refused before anything is
allocated, and `tune` on a model whose batch is fixed saying what it ran."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from fusion import FusionError
from fusion.cli import main, tune
from fusion.cli.main import build_parser
from fusion.feeds import model_inputs
from fusion.modelfile import save_model
from fusion.models import conv_stack

# Every numeric option of every command, a value out of its range, and the smallest it takes.
NUMERIC = {
    "run": {"--threads": ("0", "1"), "--seed": ("-1", "0")},
    "tune": {"--threads": ("-3", "1"), "--batch": ("0", "1")},
    "verify": {"--rtol": ("-0.1", "0"), "--atol": ("nan", "0"), "--seed": ("-1", "0")},
    "demo": {"--threads": ("0", "1")},
    "bench": {
        "--threads": ("-3", "1"),
        "--rounds": ("0", "1"),
        "--repeat": ("0", "1"),
        "--budget": ("-1", "0"),
        "--gap": ("-5", "0"),
        "--batch": ("0", "1"),
        "--seed": ("-1", "0"),
    },
}
CASES = [(c, opt, *values) for c, opts in NUMERIC.items() for opt, values in opts.items()]


def takes_a_model(command: str) -> list[str]:
    return [] if command == "demo" else ["missing.onnx"]  # never read: the parser refuses first


def refused(capsys, argv) -> str:
    """The one line a refused command printed (exit 2, nothing on stdout)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("fusion: error: "), err
    return err


@pytest.mark.parametrize(("command", "option", "bad", "least"), CASES)
def test_a_numeric_option_out_of_range_is_one_line_before_any_work(
    capsys, command, option, bad, least
):
    err = refused(capsys, [command, *takes_a_model(command), option, bad])
    assert f"argument {option}: " in err and bad in err, err
    assert "missing.onnx" not in err  # refused by the parser, before the model is looked at
    args = build_parser().parse_args([command, *takes_a_model(command), option, least])
    assert getattr(args, option[2:]) in (int(least), [int(least)])  # the least value is taken


@pytest.mark.parametrize("bad", ["abc", "2.5", "inf"])
def test_a_number_that_is_not_one_is_one_line(capsys, bad):
    err = refused(capsys, ["bench", "missing.onnx", "--rounds", bad])
    assert f"argument --rounds: expected an integer of at least 1, got '{bad}'" in err, err


def test_a_usage_error_is_one_line_too(capsys):
    assert "the following arguments are required: model" in refused(capsys, ["bench"])
    assert "invalid choice: 'benhc'" in refused(capsys, ["benhc"])


def test_bench_with_zero_rounds_prints_no_header(capsys, tmp_path):
    """The reported case: the header printed, then a StatisticsError traceback."""
    err = refused(capsys, ["bench", tmp_path / "m.onnx", "--rounds", "0", "--same-process"])
    assert "argument --rounds: must be at least 1, got 0" in err


# ---- a batch the memory cannot hold ----------------------------------------------------------
@pytest.fixture
def free_batch(tmp_path):
    """Two small convs on an input [N, 8, 10, 10]: at N = 10^9 it is 2.9 TiB of float32."""
    path = tmp_path / "free.onnx"
    save_model(conv_stack(blocks=2, channels=8, size=10, batch="N"), path)
    return path


QUICK_BENCH = ["--same-process", "--rounds", "1", "--budget", "0", "--threads", "1"]
QUICK_BENCH += ["--no-memory", "--no-compile", "--no-nodes"]


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_a_batch_the_memory_cannot_hold_is_refused_before_it_is_allocated(
    capsys, free_batch, command
):
    """The reported case: a MemoryError traceback (exit 1) once the kernels were built."""
    more = QUICK_BENCH if command == "bench" else []
    err = refused(capsys, [command, free_batch, "--batch", "1000000000", *more])
    assert "more than the " in err and " of memory available" in err, err
    assert "input 'input', float32 [1000000000, 8, 10, 10], is 2.91 TiB" in err, err


def test_random_inputs_beyond_the_memory_are_refused_by_the_library_too(free_batch):
    model = onnx.load(free_batch)
    with pytest.raises(FusionError, match="of memory available"):
        model_inputs(model, None, 0, {"N": 10**9})
    assert model_inputs(model, None, 0, None, batch=3)[0]["input"].shape == (3, 8, 10, 10)


def test_a_memory_error_in_a_command_is_one_line(capsys, free_batch, monkeypatch):
    def exhausted(*args, **kwargs):
        raise MemoryError("Unable to allocate 2.91 TiB for an array")

    monkeypatch.setattr(tune, "prepared_session", exhausted)
    err = refused(capsys, ["tune", free_batch])
    assert err == "fusion: error: out of memory (Unable to allocate 2.91 TiB for an array)\n"
    with pytest.raises(MemoryError):
        main(["tune", str(free_batch), "--debug"])


# ---- a model whose batch is fixed ------------------------------------------------------------
def fixed_batch(tmp_path, batch: int) -> Path:
    path = tmp_path / f"fixed{batch}.onnx"
    save_model(conv_stack(blocks=2, channels=8, size=10, batch=batch), path)
    return path


def test_tune_says_the_batch_it_ran_and_warns_of_the_batches_it_ignored(capsys, tmp_path):
    """The reported case: "batch 8: ..." for a run at the model's fixed batch 1."""
    path = fixed_batch(tmp_path, 1)
    assert main(["tune", str(path), "--batch", "1", "8", "16", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("batch")] == ["batch 1"]
    assert err == (
        "fusion: warning: the model's batch is fixed at 1 (input 'input' is [1, 8, 10, 10]): "
        "--batch 8 16 ignored\n"
    )


def test_tune_on_a_fixed_batch_without_batch_given_warns_of_nothing(capsys, tmp_path):
    assert main(["tune", str(fixed_batch(tmp_path, 2)), "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("batch 2: ") and err == ""


def test_tune_sizes_a_first_axis_that_has_no_name(capsys, tmp_path):
    """A first axis declared neither by size nor by name is free: --batch sizes it."""
    model = conv_stack(blocks=2, channels=8, size=10, batch="N")
    model.graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_param")
    path = tmp_path / "unnamed.onnx"
    save_model(model, path)
    assert model_inputs(model, None, 0, None, batch=3)[0]["input"].shape == (3, 8, 10, 10)
    assert main(["tune", str(path), "--batch", "3", "3", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("batch")] == ["batch 3"]
    assert err == ""


def test_bench_warns_of_a_batch_the_model_cannot_take(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["bench", str(fixed_batch(tmp_path, 1)), "--batch", "8", *QUICK_BENCH]) == 0
    out, err = capsys.readouterr()
    assert "batch 1: time per run" in " ".join(out.split()), out  # the title, maybe on 2 lines
    assert err == (
        "fusion: warning: the model's batch is fixed at 1 (input 'input' is [1, 8, 10, 10]): "
        "--batch 8 ignored\n"
    )

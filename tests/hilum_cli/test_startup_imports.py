"""What a ``hilum`` command imports at start-up (issue #12: the simulator is charged its whole process).

Each check runs a fresh interpreter, so modules an earlier test imported cannot hide or fake a result.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hilum_cli import main as hilum

ROOT = Path(__file__).resolve().parents[2]

# what a simulation never needs: the cluster's HTTP server and client, gRPC, protobuf, the etcd client,
# Prometheus, the Hugging Face tokenizers and torch
CLUSTER_ONLY = (
    "aiohttp",
    "grpc",
    "google.protobuf",
    "etcd3aio",
    "prometheus_client",
    "transformers",
    "tokenizers",
    "torch",
    "hilum_proto",
    "hilum_cli.up",
    "hilum_cli.bench",
)


def _imported_after(code: str, watched: tuple[str, ...]) -> list[str]:
    """The modules of ``watched`` in ``sys.modules`` after a fresh interpreter ran ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {list(watched)!r} if m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_a_simulation_run_imports_nothing_of_the_live_cluster() -> None:
    run = (
        "import contextlib, io\n"
        "from hilum_cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['sim', '--max-requests', '20', '--policy', 'hilum,round-robin']) == 0\n"
        "assert 'round-robin' in out.getvalue()\n"
    )
    assert _imported_after(run, (*CLUSTER_ONLY, "sim.runner", "sim.report")) == ["sim.report", "sim.runner"]


def test_a_simulation_starts_no_blas_threads() -> None:
    """``hilum sim`` runs in one thread: numpy's OpenBLAS starts none of its own (they spin idle after start-up)."""
    run = (
        "import contextlib, io, os\n"
        "from hilum_cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['sim', '--max-requests', '5', '--policy', 'round-robin']) == 0\n"
        "import numpy\n"
        "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]  # the setting, and the process's threads: the main one alone
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    bare = subprocess.run(
        [sys.executable, "-c", "import numpy, os; print(len(os.listdir('/proc/self/task')))"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    assert int(bare.stdout) > 1 or (os.cpu_count() or 1) == 1  # numpy alone starts OpenBLAS threads


def test_hilum_help_imports_no_sub_command() -> None:
    run = (
        "from hilum_cli.main import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0\n"
    )
    watched = (*CLUSTER_ONLY, "sim.cli", "topology.cli", "pydantic", "numpy", "networkx", "rich")
    assert _imported_after(run, watched) == []


@pytest.mark.parametrize(
    ("code", "absent"),
    [
        ("import gateway.core", ("aiohttp", "prometheus_client", "grpc", "gateway.app")),  # the simulator's use
        ("import global_coord.wiring", ("etcd3aio", "grpc", "global_coord.coordinator")),
        ("import topology.spec", ("networkx", "topology.load", "pydantic")),
        ("import hilum_config", (*CLUSTER_ONLY, "networkx")),
    ],
)
def test_a_pure_part_imports_no_service(code: str, absent: tuple[str, ...]) -> None:
    assert _imported_after(code, absent) == []


def _help(argv: list[str], full: bool) -> str:
    """What ``hilum ARGV --help`` prints with every sub-command registered in full (as before lazy
    registration) or as :func:`main` registers them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        if full:
            hilum.build_parser().parse_args([*argv, "--help"])
        else:
            hilum.main([*argv, "--help"])
    return out.getvalue()


@pytest.mark.parametrize(
    "argv", [[], ["sim"], ["sim", "sweep"], ["sim", "size"], ["topology"], ["topology", "path"], ["up"], ["bench"]]
)
def test_help_is_the_same_whatever_is_registered(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    text = _help(argv, full=False)
    assert text.startswith(f"usage: hilum {' '.join(argv)}".rstrip())
    assert text == _help(argv, full=True)


@pytest.mark.parametrize("argv", [["sim"], ["sim", "sweep"], ["sim", "size"], ["topology", "show"], ["up"], ["bench"]])
def test_help_shows_the_module_docstrings_without_their_rest_markup(argv: list[str]) -> None:
    text = _help(argv, full=False)
    assert "``" not in text and ":mod:`" not in text and ":func:`" not in text and ":class:`" not in text, text
    if argv == ["up"]:  # its ``hilum up`` and :mod:`hilum_cli.supervisor`, shown as the README writes commands
        assert "`hilum up`: a whole hilum cluster" in text and "(`hilum_cli.supervisor`)" in text


def test_top_level_help_lists_every_sub_command_with_its_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = _help([], full=False)
    for command in hilum.SUBCOMMANDS:
        assert f"    {command.name:<10}{command.summary}" in text, command.name


def test_build_parser_refuses_an_unknown_sub_command() -> None:
    with pytest.raises(ValueError, match="unknown hilum sub-command simulate; choose from topology, sim, up, bench"):
        hilum.build_parser(full=("simulate",))


@pytest.mark.parametrize("prog", ["hilum", "hilumctl"])
def test_version_prints_the_installed_version_and_reads_it_only_when_asked(prog: str) -> None:
    """``--version`` prints the installed distribution's version (pyproject.toml's) and Python's, exit 0; the
    version (``importlib.metadata``, 17 ms of imports) is read only then, not at every start."""
    import importlib.metadata

    module = "hilum_cli.main" if prog == "hilum" else "hilum_cli.ctl"
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main(['--version']))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    python = ".".join(str(part) for part in sys.version_info[:3])
    assert (out.returncode, out.stdout, out.stderr) == (
        0,
        f"{prog} {importlib.metadata.version('hilum')} (Python {python})\n",
        "",
    )
    help_run = (
        f"from {module} import main\ntry:\n    main(['--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
    )
    assert _imported_after(help_run, ("importlib.metadata",)) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["simm"],
            "hilum: error: argument COMMAND: invalid choice: 'simm' (choose from 'topology', 'sim', 'up', 'bench'); "
            "did you mean 'sim'?",
        ),
        (
            ["topology", "shw", "1x8-a100"],
            "hilum topology: error: argument SUBCOMMAND: invalid choice: 'shw' (choose from 'show', 'path'); did you "
            "mean 'show'?",
        ),
        (["sim", "Size"], "did you mean 'size'?"),
        (["xyzzy"], "invalid choice: 'xyzzy' (choose from 'topology', 'sim', 'up', 'bench')"),
    ],
)
def test_an_invalid_sub_command_is_answered_with_the_closest(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        hilum.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and ("did you mean" in message or "did you mean" not in err), err


def test_hilumctl_names_the_closest_command(capsys: pytest.CaptureFixture[str]) -> None:
    from hilum_cli import ctl

    with pytest.raises(SystemExit) as exited:
        ctl.main(["stauts"])
    assert exited.value.code == 2
    assert "invalid choice: 'stauts'" in (err := capsys.readouterr().err) and "did you mean 'status'?" in err, err

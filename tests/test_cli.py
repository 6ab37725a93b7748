import pytest

from hilum_cli.main import main


def test_hilum_without_command_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_an_interrupt_a_command_does_not_handle_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hilum_cli.bench

    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM in hilum sim

    monkeypatch.setattr(hilum_cli.bench, "run_bench", interrupted)
    assert main(["bench", "--url", "http://127.0.0.1:1"]) == 130
    assert capsys.readouterr().err == "hilum bench: interrupted\n"  # it was a KeyboardInterrupt traceback


def test_ctrl_c_while_hilum_up_loads_ends_it_even_when_inherited_ignored(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script's ``hilum up &`` inherits SIGINT ignored; one sent while its modules load was lost (the cluster came
    up all the same). Here the SIGINT arrives while the parser is built, before hilum up's own handlers."""
    import os
    import signal

    import hilum_cli.main

    build = hilum_cli.main.build_parser

    def loading(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGINT)
        return build(*args, **kwargs)  # type: ignore[arg-type]

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        monkeypatch.setattr(hilum_cli.main, "build_parser", loading)
        # a usage error (status 2) had the signal been lost; nothing would start either way
        assert main(["up", "--coordinators", "0"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err == "hilum up: interrupted\n"


@pytest.mark.parametrize(
    ("argv", "prog", "extra"),
    [
        (["up", "--port", "0", "--bogus"], "hilum up", "--bogus"),
        (["topology", "show", "1x8-a100", "2x8-a100"], "hilum topology show", "2x8-a100"),
        (["bench", "--url", "http://127.0.0.1:1", "--bogus"], "hilum bench", "--bogus"),
    ],
)
def test_an_option_no_parser_takes_is_named_by_its_sub_command(
    argv: list[str], prog: str, extra: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse reported it at the top level (``usage: hilum [-h] ...``, ``hilum: error: ...``)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ") and err.endswith(f"{prog}: error: unrecognized arguments: {extra}\n"), err


def test_hilumctl_names_the_command_an_unknown_option_followed(capsys: pytest.CaptureFixture[str]) -> None:
    from hilum_cli.ctl import main as ctl_main

    with pytest.raises(SystemExit) as exited:
        ctl_main(["--coordinator", "127.0.0.1:1", "status", "--bogus"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith("hilumctl status: error: unrecognized arguments: --bogus\n")

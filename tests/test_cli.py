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

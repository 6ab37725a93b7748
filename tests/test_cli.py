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

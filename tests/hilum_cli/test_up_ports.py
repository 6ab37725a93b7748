"""``hilum up`` refuses clearly, before starting anything, when a port is taken or etcd does not answer."""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from up_harness import TOPOLOGY

import hilum_cli.up as up_module
from hilum_cli.up import UpConfig, UpError, UpUsageError, plan_ports, run_up
from topology.load import parse_topology


def _topology() -> object:
    return parse_topology(yaml.safe_load(TOPOLOGY), "test")


def test_port_zero_picks_distinct_free_ports_for_every_process() -> None:
    plan = plan_ports(_topology(), "127.0.0.1", 0, 0, 0, etcd_embedded=True)  # type: ignore[arg-type]
    assert set(plan.instances) == {"a0", "a1", "b0", "b1"} and set(plan.domains) == {"dom-a", "dom-b"}
    ports = [p for _, p in plan.named()]
    assert len(ports) == 3 + 1 + 2 + 4 + 1 and len(set(ports)) == len(ports) and all(ports)


@pytest.mark.parametrize("host", ["nosuch.invalid", "192.0.2.1"])
def test_a_host_this_machine_cannot_listen_on_is_named_not_called_a_taken_port(host: str) -> None:
    with pytest.raises(UpError) as err:
        plan_ports(_topology(), host, 18300, 0, 17070, etcd_embedded=True)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"--host {host}: cannot listen there (") and "in use" not in str(err.value)


_IPV6 = (
    " is an IPv6 address; hilum up runs its cluster on an IPv4 address or a host name (default 127.0.0.1). A process "
    "started on its own listens there: --listen [::1]:PORT"
)
_NOT_A_HOST = (
    ": a host name or an IPv4 address alone, not HOST:PORT or a URL (the gateway's port is --port, the others' "
    "--grpc-base-port and --etcd-port)"
)


@pytest.mark.parametrize(
    ("host", "why"),
    [("::1", _IPV6), ("[::1]", _IPV6), ("127.0.0.1:8000", _NOT_A_HOST), ("localhost:8000", _NOT_A_HOST),
     ("http://127.0.0.1", _NOT_A_HOST), ("", None), (" ", None),
     ("[127.0.0.1]", ": brackets enclose an IPv6 address before a port; give the host alone: --host 127.0.0.1"),
     ("::ffff:127.0.0.1", ": an IPv4-mapped IPv6 address; give the IPv4 address: --host 127.0.0.1"),
     ("local host", None)],
)  # fmt: skip
def test_a_host_that_is_not_one_to_listen_on_alone_is_refused_saying_what_it_is(host: str, why: str | None) -> None:
    with pytest.raises(UpUsageError) as err:
        plan_ports(_topology(), host, 18300, 0, 17070, etcd_embedded=True)  # type: ignore[arg-type]
    if why is not None:
        assert str(err.value) == f"--host {host}{why}"
    elif host.strip():
        assert str(err.value) == f"--host {host!r}: a host name or an IPv4 address has no spaces"
    else:
        assert (
            str(err.value) == "--host: empty; give a host name or an IPv4 address of this machine (default 127.0.0.1)"
        )


def test_etcd_binds_an_address_a_host_name_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    # etcd refuses a listen URL naming a host other than localhost ("expected IP in URL for binding"), and said so
    # only at a log level hilum up did not keep: `hilum up --host NAME` failed with an empty etcd log
    monkeypatch.setattr(up_module.socket, "gethostbyname", {"node-a.example": "10.1.2.3"}.__getitem__)
    assert up_module.etcd_bind_host("node-a.example") == "10.1.2.3"
    assert [up_module.etcd_bind_host(h) for h in ("127.0.0.1", "0.0.0.0", "localhost")] == [
        "127.0.0.1", "0.0.0.0", "localhost"
    ]  # fmt: skip


def test_an_ephemeral_port_handed_out_twice_is_not_planned_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The OS may give a just-closed ephemeral port again (it did under load: the coordinator and a token sink
    # got the same one); the plan asks again rather than refuse its own choice.
    real = up_module._free_port
    given: list[int] = []

    def repeating(host: str) -> int:
        port = given[0] if len(given) in (3, 7) else real(host)  # the first port again, twice
        given.append(port)
        return port

    monkeypatch.setattr(up_module, "_free_port", repeating)
    plan = plan_ports(_topology(), "127.0.0.1", 0, 0, 0, etcd_embedded=True, gateways=2)  # type: ignore[arg-type]
    ports = [p for _, p in plan.named()]
    assert given.count(given[0]) == 3 and len(set(ports)) == len(ports) and given[0] in ports


def test_a_taken_gateway_port_is_a_clear_error_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UpError, match=rf"port {port} \(gateway HTTP\) on 127.0.0.1 is already in use: .*--port"):
            plan_ports(_topology(), "127.0.0.1", port, 0, 0, etcd_embedded=True)  # type: ignore[arg-type]
        topo = tmp_path / "t.yaml"
        topo.write_text(TOPOLOGY)
        err = io.StringIO()
        cfg = UpConfig(topology=str(topo), port=port, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
        assert run_up(cfg, out=io.StringIO(), err=err) == 1
        assert f"hilum up: error: port {port} (gateway HTTP)" in err.getvalue()
        assert not (tmp_path / "run").exists()  # nothing was started, not even a run directory made


def test_a_taken_grpc_port_names_the_process_and_the_option() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        # the base is the coordinator's port; the domain schedulers and llumlets follow it
        with pytest.raises(UpError, match=rf"port {port} \(coordinator coord-0\) .* --grpc-base-port"):
            plan_ports(_topology(), "127.0.0.1", 0, 0, port, etcd_embedded=True)  # type: ignore[arg-type]


def test_an_unreachable_etcd_is_one_line_at_once_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = holder.getsockname()[1]
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        err = io.StringIO()
        cfg = UpConfig(etcd=f"127.0.0.1:{port}", port=0, grpc_base_port=0)
        t0 = time.monotonic()
        assert run_up(cfg, out=io.StringIO(), err=err) == 1
        assert time.monotonic() - t0 < 10
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hilum up: error: etcd at 127.0.0.1:{port} does not answer (")
    assert lines[0].endswith("start it or correct --etcd (without --etcd, hilum up runs an embedded etcd)")
    assert list(tmp_path.iterdir()) == []  # no hilum-up-* directory


def test_two_coordinators_get_ports_after_the_base() -> None:
    plan = plan_ports(_topology(), "127.0.0.1", 0, 0, 17070, etcd_embedded=True, coordinators=2)  # type: ignore[arg-type]
    assert plan.coordinators == {"coord-0": 17070, "coord-1": 17071}
    assert (plan.domains["dom-a"], plan.instances["a0"], plan.sinks["gateway"]) == (17072, 17074, 17078)


def test_a_bad_configuration_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "hilum.yaml"
    bad.write_text("policy:\n  no_such_key: 1\n")
    err = io.StringIO()
    cfg = UpConfig(config=str(bad), port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith(f"hilum up: error: --config {bad}: policy")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("config", "env", "said"),
    [
        (None, "bad", "hilum up: error: $HILUM_CONFIG {bad}: policy.no_such_key: unknown key"),  # as the user named it
        ("bad", "", "hilum up: error: --config {bad}: policy.no_such_key: unknown key"),
        ("", "bad", "hilum up: error: --config is empty: give a configuration file, or leave it out"),
    ],
)
def test_a_configuration_file_is_named_as_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str | None, env: str, said: str
) -> None:
    bad = tmp_path / "hilum.yaml"
    bad.write_text("policy:\n  no_such_key: 1\n")
    monkeypatch.setenv("HILUM_CONFIG", str(bad) if env else "")
    err = io.StringIO()
    given = str(bad) if config else config  # "" is an empty --config, refused (it was read as no file)
    cfg = UpConfig(config=given, port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith(said.format(bad=bad)), err.getvalue()
    assert not (tmp_path / "run").exists()


def test_a_topology_from_a_pipe_is_refused_before_anything_starts(tmp_path: Path) -> None:
    fifo = tmp_path / "topology.fifo"  # --topology <(...): hilum up copies the file for its processes to read
    os.mkfifo(fifo)
    err = io.StringIO()
    cfg = UpConfig(topology=str(fifo), port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith(f"hilum up: error: --topology {fifo}: not a regular file (a pipe?); hilum up ")
    assert not (tmp_path / "run").exists()


def test_an_invalid_topology_is_named_once_then_every_error_of_it(tmp_path: Path) -> None:
    """It read "--topology F: F: models: ...": the file named twice on the first line, once on the others."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: []\n")
    err = io.StringIO()
    cfg = UpConfig(topology=str(bad), port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "run"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().splitlines() == [
        f"hilum up: error: invalid topology (--topology {bad})",
        f"{bad}: models: must list at least one entry",
        f"{bad}: gpu_types: missing required key",
        f"{bad}: domains: missing required key",
    ]
    assert not (tmp_path / "run").exists()


def _up_vllm(tmp_path: Path, *options: str, **kw: object) -> tuple[int, str]:
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPOLOGY)
    err = io.StringIO()
    cfg = UpConfig(
        topology=str(topo),
        engine="vllm",
        engine_options=options,
        port=0,
        etcd_port=0,
        grpc_base_port=0,
        run_dir=str(tmp_path / "run"),
        **kw,  # type: ignore[arg-type]
    )
    return run_up(cfg, out=io.StringIO(), err=err), err.getvalue()


def test_engine_options_for_the_sim_engine_are_refused_before_anything_starts(tmp_path: Path) -> None:
    err = io.StringIO()
    cfg = UpConfig(engine_options=("nosuch=1",), port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "r"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("hilum up: error: --engine-option nosuch: the sim engine takes no option")
    assert not (tmp_path / "r").exists()


def test_engine_vllm_without_a_checkpoint_says_which_option(tmp_path: Path) -> None:
    status, err = _up_vllm(tmp_path)
    assert status == 2
    assert err.startswith("hilum up: error: --engine vllm needs the checkpoint every llumlet loads: --engine-option")
    assert not (tmp_path / "run").exists()


def test_engine_vllm_refuses_a_python_without_vllm_naming_it_and_the_venv(tmp_path: Path) -> None:
    import sys

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this python has vLLM: the refusal needs one without it")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    status, err = _up_vllm(tmp_path, f"model={checkpoint}", llumlet_python=sys.executable)
    assert status == 1
    assert f"--engine vllm: the llumlets' python ({sys.executable}) cannot run vLLM: " in err
    assert "No module named 'vllm'" in err and "make .venv-vllm/.installed" in err and "--llumlet-python" in err
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_engine_vllm_with_a_model_name_needs_a_tokenizer_directory(tmp_path: Path) -> None:
    status, err = _up_vllm(tmp_path, "model=meta-llama/Llama-3.1-8B-Instruct")
    assert status == 2
    assert "--engine-option model=meta-llama/Llama-3.1-8B-Instruct: not a directory here" in err
    assert "pass --tokenizer DIR" in err


@pytest.mark.parametrize(
    ("kw", "config", "message"),
    [
        ({"time_scale": -1.0}, "", "hilum up: error: --time-scale: must be a finite number > 0, got -1"),
        ({"time_scale": 0.0}, "", "hilum up: error: --time-scale: must be a finite number > 0, got 0"),  # as a llumlet
        (
            {"llumlet_python": "/nonexistent/python"},
            "",
            "--llumlet-python /nonexistent/python: no such executable file",
        ),
        ({"llumlet_python": "false"}, "", "--llumlet-python false: cannot import hilum's llumlet (exit status 1)"),
        (
            {"engine": "torch", "engine_options": ("foo=1",)},
            "",
            "--engine-option foo: the torch engine has no such option (known: eos_token_id, threads, device, "
            "model.<LlamaConfig field>)",
        ),
        ({"min_step_s": float("nan")}, "", "hilum up: error: --min-step-s: must be a finite number >= 0, got nan"),
        (
            {"start_timeout_s": float("inf")},
            "",
            "hilum up: error: --start-timeout: must be a finite number of seconds > 0, got inf",
        ),
        (
            {},
            "autoscale:\n  enabled: true\n",
            "autoscale.command is empty: the autoscaler has no way to start or stop an instance",
        ),
    ],
)
def test_values_a_child_would_refuse_are_refused_before_anything_starts(
    tmp_path: Path, kw: dict[str, object], config: str, message: str
) -> None:
    if config:
        (tmp_path / "hilum.yaml").write_text(config)
        kw = {**kw, "config": str(tmp_path / "hilum.yaml")}
    err = io.StringIO()
    cfg = UpConfig(port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "r"), **kw)  # type: ignore[arg-type]
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert message in err.getvalue()
    assert not (tmp_path / "r").exists()  # nothing started, not even the run directory


def test_a_run_dir_that_cannot_be_made_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    err = io.StringIO()
    cfg = UpConfig(port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "file" / "r"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2  # it was a traceback
    assert err.getvalue().endswith(f"--run-dir {tmp_path}/file/r: cannot write there (Not a directory)\n")
    err = io.StringIO()
    cfg = replace(cfg, run_dir="/proc")  # there, but nothing can be written in it: a traceback after the check
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().endswith("--run-dir /proc: cannot write there (No such file or directory)\n")
    err = io.StringIO()
    cfg = replace(cfg, run_dir=str(tmp_path / "file"))  # a file: "File exists" said nothing of what was wrong
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().endswith(
        f"--run-dir {tmp_path}/file: cannot write there (it exists and is not a directory)\n"
    )


def test_a_bad_api_key_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {name: a, key_sha256: nothex}\n  - {name: b, key: k, prio: 1}\n")
    err = io.StringIO()
    cfg = UpConfig(api_keys=str(keys), port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "r"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue() == (  # every problem, each line naming the option (the second lacked it)
        f"hilum up: error: --api-keys {keys}: keys[0] (a): key_sha256 must be 64 hexadecimal digits (sha256sum of "
        "the key)\n"
        f"--api-keys {keys}: keys[1] (b): prio: unknown key; expected one of: name, key, key_sha256, priority, "
        "max_priority\n"
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"port": 99999}, "--port: the gateway HTTP would get port 99999, outside 1..65535"),
        ({"port": -1}, "--port: the gateway HTTP would get port -1, outside 1..65535"),
        ({"etcd_port": 65535}, "--etcd-port: the etcd peer would get port 65536, outside 1..65535"),
        ({"grpc_base_port": 65530}, "--grpc-base-port: the llumlet b1 would get port 65536, outside 1..65535"),
    ],
)
def test_a_port_outside_the_range_is_a_usage_error(tmp_path: Path, kw: dict[str, int], message: str) -> None:
    err = io.StringIO()
    cfg = UpConfig(**{"port": 0, "etcd_port": 0, "grpc_base_port": 0, "run_dir": str(tmp_path / "r"), **kw})  # type: ignore[arg-type]
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith(f"hilum up: error: {message}: choose ports within it")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("etcd", "message"),
    [
        ("nohost", "--etcd: 'nohost' is not HOST:PORT (port 1-65535)"),
        ("127.0.0.1:2379,", "--etcd: entry 2 of '127.0.0.1:2379,' is empty: drop the extra comma"),
    ],
)
def test_a_malformed_etcd_address_is_a_usage_error(tmp_path: Path, etcd: str, message: str) -> None:
    err = io.StringIO()
    cfg = UpConfig(etcd=etcd, port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "r"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith(f"hilum up: error: {message}")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("seed", ["-1", "2.5"])
def test_a_seed_that_is_not_a_whole_number_from_0_is_refused_before_anything_starts(
    seed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seed -1`` started the cluster, whose processes drew what ``--seed 1`` draws (random.Random drops the
    sign); ``hilum sim`` and ``hilum bench`` refuse it."""
    from hilum_cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["up", "--seed", seed])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"hilum up: error: argument --seed: expected a whole number >= 0, got '{seed}'"
    )


def test_a_time_scale_for_an_engine_that_is_not_paced_is_refused(tmp_path: Path) -> None:
    """``--time-scale`` paces the sim engine; ``--engine torch --time-scale 0.5`` was accepted and ignored."""
    err = io.StringIO()
    cfg = UpConfig(engine="torch", time_scale=0.5, port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "r"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue() == (
        "hilum up: error: --time-scale paces the sim engine only: --engine torch's steps take the time they compute\n"
    )
    assert not (tmp_path / "r").exists()


class _ReaderGone(io.StringIO):
    """stderr whose reader leaves after ``lines`` lines (``hilum up 2>&1 | head -2``): later writes raise."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= text.count("\n")
        return super().write(text)


def _processes_under(folder: Path) -> list[str]:
    """Command lines of the live processes that name ``folder`` (etcd's data directory is in the run directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if str(folder) in argv:
            found.append(argv)
    return found


def test_a_closed_stderr_mid_start_stops_everything_and_removes_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start stops at the first line that cannot be written, and the stop still happens in full (it stopped at
    its own first line, leaving the temporary run directory)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    err = _ReaderGone(lines=2)  # "run directory ...", "starting etcd ...": then etcd's "ready" line fails
    with pytest.raises(BrokenPipeError):  # the entry point's wrapper ends quietly on it
        run_up(UpConfig(port=0, etcd_port=0, grpc_base_port=0), out=io.StringIO(), err=err)
    said = err.getvalue().splitlines()
    assert said[0].startswith(f"hilum up: run directory {tmp_path}/hilum-up-")
    assert said[1].startswith("hilum up: starting etcd on 127.0.0.1:")
    assert len(said) == 2
    assert list(tmp_path.iterdir()) == []  # no hilum-up-* directory
    assert _processes_under(tmp_path) == []  # etcd stopped


class _CtrlCAt(io.StringIO):
    """stderr that sends this process SIGINT (Ctrl-C) once a line containing ``words`` is written."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def write(self, text: str) -> int:
        n = super().write(text)
        if self.words in text:
            os.kill(os.getpid(), signal.SIGINT)
        return n


def test_ctrl_c_during_the_start_stops_everything_and_exits_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script must not read an interrupted start as success (it exited 0, as after stopping a cluster that was
    up)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    err = _CtrlCAt("starting the coordinator")
    assert run_up(UpConfig(port=0, etcd_port=0, grpc_base_port=0), out=io.StringIO(), err=err) == 130
    said = [line.removeprefix("hilum up: ") for line in err.getvalue().splitlines()]
    assert said[-3:] == [
        "stopping before the cluster was up ...",
        "stopped; no process left",
        f"removed the run directory {next(line for line in said if line.startswith('run directory '))[14:]}",
    ]
    assert list(tmp_path.iterdir()) == []
    assert _processes_under(tmp_path) == []


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        ("--api-keys", "--api-keys is empty: give an API key file, or leave the flag out for gateways open to every"),
        ("--etcd", "--etcd is empty: give HOST:PORT, or leave the flag out for an embedded etcd"),
        ("--run-dir", "--run-dir is empty: give a folder, or leave the flag out for a temporary one"),
        ("--tokenizer", "--tokenizer is empty: give a tokenizer directory, or leave the flag out for each model's own"),
        ("--llumlet-python", "--llumlet-python is empty: give a python, or leave the flag out for this one"),
    ],
)
def test_an_empty_path_option_is_refused_not_read_as_left_out(
    flag: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script's ``--api-keys "$KEYS"`` with the variable unset started gateways open to every caller."""
    from hilum_cli.main import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["up", "--port", "0", "--etcd-port", "0", "--grpc-base-port", "0", flag, " "]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hilum up: error: {said}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []  # nothing started


_TP4_7B = """name: tp4
models:
  - {name: llama-2-7b, num_layers: 32, num_attention_heads: 32, num_kv_heads: 32, head_dim: 128,
     hidden_size: 4096, dtype: bfloat16, num_params: 7241732096, max_context_tokens: 4096}
gpu_types:
  - {name: a100-80gb, memory_gib: 80, hbm_gbyte_per_s: 2039, nvlink_gbyte_per_s: 600}
domains:
  - id: n0
    kind: node
    gpu_type: a100-80gb
    nodes: [{id: n0, num_gpus: 8, nic_gbit_per_s: 100}]
    instances:
      - {id: n0-i0, gpus: [0], tensor_parallel_size: 1, model: llama-2-7b}
      - {id: n0-i1, gpus: [4, 5, 6, 7], tensor_parallel_size: 4, model: llama-2-7b}
"""


def test_an_instance_the_sim_engine_cannot_time_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Its llumlet refused to start once etcd, the coordinator and every other llumlet had (exit 1, the run directory
    kept): Llama-2-7B is measured at TP1 and TP2 only."""
    topology = tmp_path / "tp4.yaml"
    topology.write_text(_TP4_7B)
    err = io.StringIO()
    cfg = UpConfig(topology=str(topology), port=0, etcd_port=0, grpc_base_port=0, run_dir=str(tmp_path / "r"))
    assert run_up(cfg, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith(
        f"hilum up: error: --engine sim: topology {topology}: instance n0-i1: no step-time model for llama-2-7b at "
        "TP4 on a100-80gb: none is measured for it on a100"
    )
    assert not (tmp_path / "r").exists()

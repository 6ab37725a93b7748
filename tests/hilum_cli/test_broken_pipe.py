"""``hilum`` and ``hilumctl`` piped into a reader that has gone (``| head -1``) end quietly: status 0, stderr empty.

Each command runs as its own process (the installed entry points), since what is checked is what the
interpreter prints on its way out. Two kinds of closed pipe:

* a pipe whose read end is closed before the command starts: every write fails, whatever its size, so the
  check never depends on what fits in the pipe's buffer;
* ``COMMAND | head -1`` in bash, the user's case, with more output (about 360 KB) than the pipe and ``head``
  hold before ``head`` exits. One large write that the reader leaves midway returns a short count rather than
  raising (CPython), so a rich table written in one piece may end that way; any later write raises.

Both rich tables (rich catches the error itself and raises ``SystemExit(1)``) and plain ``print`` (``--json``)
are covered; without the entry points' wrapper (``hilum_cli.broken_pipe``) the first exits 1 with no message
and the second prints a BrokenPipeError traceback. ``hilumctl`` has no command that prints without a
coordinator (``--help`` aside, which argparse already ends quietly), so its checks run against an in-process
gRPC coordinator that answers ``GetTopology`` only.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from hilum_cli.broken_pipe import BROKEN_PIPE_STATUS, quiet_on_broken_pipe
from hilum_proto.v1 import coordinator_pb2 as pb
from hilum_proto.v1 import coordinator_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HILUM, HILUMCTL = str(BIN / "hilum"), str(BIN / "hilumctl")


def _into_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with its stdout a pipe whose reader has already gone; stderr captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)


def _into_head(command: str) -> subprocess.CompletedProcess[str]:
    """Run ``COMMAND | head -1`` in bash; exits with COMMAND's status (``PIPESTATUS[0]``)."""
    script = f"{command} | head -1; exit ${{PIPESTATUS[0]}}"
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("extra", [["--instances"], ["--json"]], ids=["rich-table", "json-print"])
def test_hilum_topology_show_into_a_closed_pipe_ends_quietly(extra: list[str]) -> None:
    done = _into_closed_pipe([HILUM, "topology", "show", "64x8-h100", *extra])
    assert (done.returncode, done.stderr) == (BROKEN_PIPE_STATUS, "")


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["tables", "json"])
def test_hilum_sim_writes_its_results_before_printing_into_a_closed_pipe(extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _into_closed_pipe([HILUM, "sim", "--max-requests", "30", "--policy", "hilum", "--out", str(out), *extra])
    assert done.returncode == BROKEN_PIPE_STATUS
    assert sorted(p.name for p in out.iterdir()) == ["kv_usage_hilum.png", "results.json", "ttft_cdf.png"]
    sized = tmp_path / "sized"
    argv = [HILUM, "sim", "size", "--target-p99-ttft-ms", "5000", "--max-requests", "30", "--policy", "hilum"]
    done = _into_closed_pipe([*argv, "--out", str(sized), *extra])
    assert done.returncode == BROKEN_PIPE_STATUS
    assert [p.name for p in sized.iterdir()] == ["sizing.json"]


def test_hilum_usage_errors_still_print_and_exit_2() -> None:
    """A closed stdout changes nothing for a message on stderr."""
    done = _into_closed_pipe([HILUM, "topology", "show"])
    assert done.returncode == 2
    assert "hilum topology show: error: the following arguments are required: FILE|NAME" in done.stderr


class _Coordinator(pb_grpc.CoordinatorServicer):
    """Answers GetTopology with ``n_domains`` domains of 8 one-GPU instances each."""

    def __init__(self, n_domains: int) -> None:
        self.reply = pb.TopologyReply(
            loaded=True,
            name="big",
            source="/etc/hilum/big.yaml",
            domains=[
                pb.TopologyDomain(
                    domain_id=f"node-{d}",
                    kind="node",
                    gpu_type="A100-80GB",
                    instances=[
                        pb.TopologyInstance(
                            instance_id=f"node-{d}-i{g}",
                            node_id=f"node-{d}",
                            gpus=[g],
                            tensor_parallel_size=1,
                            model="llama-2-7b",
                            gpu_type="A100-80GB",
                            kv_capacity_blocks=7609,
                        )
                        for g in range(8)
                    ],
                )
                for d in range(n_domains)
            ],
        )

    def GetTopology(self, request: pb.GetTopologyRequest, context: Any) -> pb.TopologyReply:
        return self.reply


@pytest.fixture(scope="module")
def coordinator() -> Iterator[str]:
    """The address of a coordinator answering GetTopology with 4000 instances (about 360 KB of table)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_CoordinatorServicer_to_server(_Coordinator(500), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["rich-table", "json-print"])
def test_hilumctl_topology_into_a_closed_pipe_ends_quietly(coordinator: str, extra: list[str]) -> None:
    done = _into_closed_pipe([HILUMCTL, "--coordinator", coordinator, "topology", *extra])
    assert (done.returncode, done.stderr) == (BROKEN_PIPE_STATUS, "")


@pytest.mark.parametrize("extra", ["", " --json"], ids=["rich-table", "json-print"])
def test_hilumctl_topology_into_head_prints_one_line_and_ends_quietly(coordinator: str, extra: str) -> None:
    done = _into_head(f"{HILUMCTL} --coordinator {coordinator} topology{extra}")
    first = "{" if extra else "topology big (/etc/hilum/big.yaml): 500 domains, 4000 instances"
    assert (done.returncode, done.stdout.strip(), done.stderr) == (BROKEN_PIPE_STATUS, first, "")


def test_hilumctl_topology_into_a_file_prints_it_all(coordinator: str, tmp_path: Path) -> None:
    """The wrapper's flush changes nothing when the reader stays: every row arrives and the status is 0."""
    out = tmp_path / "topology.txt"
    with out.open("w") as f:
        done = subprocess.run(
            [HILUMCTL, "--coordinator", coordinator, "topology"], stdout=f, stderr=subprocess.PIPE, text=True
        )
    assert (done.returncode, done.stderr) == (0, "")
    text = out.read_text()
    assert "node-499-i7" in text and text.count("llama-2-7b") == 4000


def test_a_broken_pipe_elsewhere_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BrokenPipeError while stdout and stderr still have their readers (a socket's, a child's stdin) is
    raised as it was, and so is any SystemExit that no broken pipe caused."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())

    @quiet_on_broken_pipe
    def peer_went_away() -> int:
        raise BrokenPipeError(32, "Broken pipe (a socket)")

    @quiet_on_broken_pipe
    def exits_3() -> int:
        raise SystemExit(3)

    with pytest.raises(BrokenPipeError, match=r"a socket"):
        peer_went_away()
    with pytest.raises(SystemExit) as exited:
        exits_3()
    assert exited.value.code == 3


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_output_to_a_full_device_is_one_error_line() -> None:
    """``hilum sim > /dev/full``: every write fails with ENOSPC; it printed a traceback."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [HILUM, "sim", "--max-requests", "5", "--policy", "round-robin"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1
    assert "hilum: error: cannot write: [Errno 28] No space left on device" in done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("argv", [["hilum", "--help"], ["hilum", "sim", "size", "--help"], ["hilumctl", "--help"]])
def test_help_to_a_full_device_is_an_error_not_a_silent_success(argv: list[str]) -> None:
    """argparse drops a failed write's error: ``hilum --help > /dev/full`` wrote nothing and exited 0."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [HILUM if argv[0] == "hilum" else HILUMCTL, *argv[1:]],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert (done.returncode, done.stderr) == (
        1,
        f"{argv[0]}: error: cannot write: [Errno 28] No space left on device\n",
    )

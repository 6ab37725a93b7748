"""hilum sim against vidur 0.0.26 on the same work: simulated requests per CPU-second, side by side.

The workload of issue #12: Llama-2-70B at tensor parallelism 2 on A100-80GB, 16 instances (four 8-GPU
nodes), the first ``--requests`` (10,000) requests of the Azure LLM 2023 conversation trace at their recorded
rate. Each simulator runs as its own process and is charged its whole CPU time (user + system, of the
process and anything it waited for: ``getrusage(RUSAGE_CHILDREN)``), so start-up, trace loading and
output count for both. Runs alternate between the two (round-robin, then each one's load-aware policies)
and repeat ``--repeats`` times; the table gives the median requests per CPU-second and the ratio hilum /
vidur against vidur's ``round_robin`` for hilum's ``round-robin`` and against vidur's ``lor`` (least
outstanding requests) for hilum's load-aware policies (``least-loaded``, ``llumnix``, ``hilum``).

vidur is installed here, in a virtual environment of its own (``pip install vidur==0.0.26``, under
``--work-dir``); its code is never copied into this repository. vidur 0.0.26 downloads its profiles
from a Hugging Face hub that cannot be reached from this machine, so the script writes them into vidur's
cache in the hub's snapshot layout, from the copies of vidur's own profiling data in
``/work/shared/data/vidur_profiling`` (``--data``): the Llama-2-70B A100 operator profile, the A100 DGX
all-reduce profile and the A100 FlashAttention profile of the Llama-2-70B shape at TP2.

vidur's defaults this workload overrides, and why:

- trace replay: ``prefill_scale_factor`` 1 (default 0.3 shrinks every prompt to 30 %),
  ``time_scale_factor`` 1 (default 0.04 replays 25x faster than recorded), the ``date`` filter (the
  default keeps only rows dated 2023-08-21; the CSV written here carries one date), ``max_tokens`` 4096
  (Llama-2's context);
- prediction tables: ``prediction_max_tokens_per_request`` 8192 (default 2M tokens: tables for contexts
  this model never reaches, which cost minutes and gigabytes to build; vidur also looks its per-batch
  operators up in this table, so it must cover a whole batch, 8,192 tokens, not just one context),
  ``prediction_max_batch_size`` 256 and ``prediction_max_prefill_chunk_size`` 8192 (the batch limits below);
- replica scheduler ``sarathi`` with chunk 8192 and a batch cap of 256: chunked prefill within 8,192 tokens
  and 256 requests per step, the limits hilum's engine model uses (vLLM v1's defaults);
- execution-time predictor: random forest (vidur's default; its linear-regression predictor cannot be
  built in 0.0.26) trained with one grid point (250 trees, depth 16, min split 2) instead of a 27-point
  grid search; training runs once, before the timed runs (its result is cached), and only shapes the
  prediction tables, not what a simulation costs;
- metrics: the Chrome trace and the plots are off (hilum draws none either); request metrics stay on.

vidur runs under ``python -O``: in 0.0.26 ``Request.restart()`` (a preemption) does not reset the
request's stage counters, so the first preempted request fails an assertion (it happens under ``lor``
on this workload); without assertions vidur finishes the run, and only gets faster.

hilum's instances get the KV capacity vidur computes for the same GPUs (its memory planner: 3,328 blocks
of 16 tokens); vidur also caps each replica's batch at the requests whose full context fits (13), a
model difference the figures keep. Run:

    .venv/bin/python bench/bench_vs_vidur.py [--requests 10000] [--repeats 3] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import lzma
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml

import hilum_compiled

VIDUR_VERSION = "0.0.26"
HILUM_POLICIES = ("round-robin", "least-loaded", "llumnix", "hilum")
VIDUR_POLICY_OF = {"round-robin": "round_robin", "least-loaded": "lor", "llumnix": "lor", "hilum": "lor"}
COMPUTE_DATASET = "hilum-local/llama-2-70b-a100"  # names of the snapshots written into vidur's cache
NETWORK_DATASET = "hilum-local/a100-dgx"
TRACE_DATE = "azure-conv-2023-11-16"
NUM_NODES, INSTANCES_PER_NODE = 4, 4
MAX_TOKENS = 4096  # Llama-2's context
BATCH_TOKENS, BATCH_SEQS = 8192, 256
PREDICTOR = "random_forrest_execution_time_predictor_config"  # vidur's spelling


@dataclass(frozen=True, slots=True)
class Measured:
    """One run: which simulator and policy, its whole-process CPU seconds and wall seconds."""

    simulator: str
    policy: str
    cpu_s: float
    wall_s: float


def run_measured(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run ``cmd`` to completion; its (CPU seconds of it and its children, wall seconds).

    Raises RuntimeError naming the log file when it fails.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} ... exited with {proc.returncode}; see {log}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


# ------------------------------------------------------------------------------------------- vidur
def vidur_python(work: Path) -> Path:
    """The vidur venv's interpreter, creating the venv and installing vidur the first time."""
    env_dir = work / f"venv-vidur-{VIDUR_VERSION}"
    python = env_dir / "bin" / "python"
    stamp = env_dir / ".installed"
    if not stamp.exists():
        print(f"installing vidur {VIDUR_VERSION} into {env_dir} (once) ...", file=sys.stderr, flush=True)
        venv.create(env_dir, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"vidur=={VIDUR_VERSION}"], check=True)
        stamp.touch()
    return python


def _snapshot(cache: Path, kind: str, repo: str, files: dict[str, Path], config: dict[str, str]) -> None:
    """Write one dataset in the Hugging Face hub cache layout (refs/main -> snapshots/<rev>/...)."""
    root = cache / "profiling_data" / kind / ("datasets--" + repo.replace("/", "--"))
    revision = "0" * 40
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(config))
    for name, src in files.items():
        opener = gzip.open if src.suffix == ".gz" else open
        with opener(src, "rb") as f, lzma.open(snapshot / name, "wb") as g:
            shutil.copyfileobj(f, g)


def build_vidur_cache(cache: Path, data: Path) -> None:
    """vidur's profile cache for Llama-2-70B TP2 on an A100 DGX, from the shared copies of its data."""
    profiling = data / "vidur_profiling"
    compute = {
        "mlp.csv.xz": profiling / "compute/a100/Llama-2-70b-hf/mlp.csv",
        "attention.csv.xz": profiling / "legacy/a100_attention_llama2-70b-shape_tp2.csv.gz",
    }
    network = {"all_reduce.csv.xz": profiling / "network/a100_dgx/all_reduce.csv"}
    for src in (*compute.values(), *network.values()):
        if not src.exists():
            raise FileNotFoundError(f"vidur profile {src} is missing (--data {data})")
    _snapshot(cache, "compute", COMPUTE_DATASET, compute, {"model": "meta-llama/Llama-2-70b-hf", "device_sku": "a100"})
    _snapshot(cache, "network", NETWORK_DATASET, network, {"sku": "a100_dgx"})


def write_vidur_trace(path: Path, data: Path, num_requests: int) -> int:
    """The first ``num_requests`` Azure conversation requests in vidur's trace format (seconds from the
    first arrival); returns how many were written."""
    source = data / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    written = 0
    start: datetime | None = None
    with source.open(newline="") as f, path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for row in csv.DictReader(f):
            if written == num_requests:
                break
            at = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")  # 7 digits of fraction
            start = start or at
            writer.writerow([TRACE_DATE, (at - start).total_seconds(), row["ContextTokens"], row["GeneratedTokens"]])
            written += 1
    return written


def vidur_command(python: Path, policy: str, cache: Path, trace: Path, out: Path) -> list[str]:
    args = {
        "cluster_config_num_replicas": NUM_NODES * INSTANCES_PER_NODE,
        "replica_config_model_name": "meta-llama/Llama-2-70b-hf",
        "replica_config_num_pipeline_stages": 1,
        "replica_config_tensor_parallel_size": 2,
        "replica_config_device": "a100",
        "replica_config_network_device": "a100_dgx",
        "global_scheduler_config_type": policy,
        "replica_scheduler_config_type": "sarathi",
        "sarathi_scheduler_config_batch_size_cap": BATCH_SEQS,
        "sarathi_scheduler_config_chunk_size": BATCH_TOKENS,
        "request_generator_config_type": "trace_replay",
        "trace_request_generator_config_trace_file": trace,
        "trace_request_generator_config_date": TRACE_DATE,
        "trace_request_generator_config_prefill_scale_factor": 1,
        "trace_request_generator_config_time_scale_factor": 1,
        "trace_request_generator_config_max_tokens": MAX_TOKENS,
        "execution_time_predictor_config_type": "random_forrest",
        f"{PREDICTOR}_model_profiling_dataset": COMPUTE_DATASET,
        f"{PREDICTOR}_network_profiling_dataset": NETWORK_DATASET,
        f"{PREDICTOR}_cache_dir": cache,
        f"{PREDICTOR}_prediction_max_tokens_per_request": BATCH_TOKENS,  # tables cover a whole batch
        f"{PREDICTOR}_prediction_max_batch_size": BATCH_SEQS,
        f"{PREDICTOR}_prediction_max_prefill_chunk_size": BATCH_TOKENS,
        f"{PREDICTOR}_num_estimators": 250,
        f"{PREDICTOR}_max_depth": 16,
        f"{PREDICTOR}_min_samples_split": 2,
        "metrics_config_output_dir": out,
    }
    cmd = [str(python), "-O", "-m", "vidur.main"]
    for key, value in args.items():
        cmd += [f"--{key}", str(value)]
    return [*cmd, "--no-metrics_config_enable_chrome_trace", "--no-metrics_config_store_plots"]


def vidur_kv_blocks(python: Path) -> int:
    """KV blocks per replica as vidur's memory planner computes them for this replica (same GPUs for hilum)."""
    code = (
        "from vidur.config import CacheConfig, ReplicaConfig\n"
        "from vidur.utils.memory_planner import MemoryPlanner\n"
        "r = ReplicaConfig(model_name='meta-llama/Llama-2-70b-hf', num_pipeline_stages=1, tensor_parallel_size=2,"
        " device='a100', network_device='a100_dgx')\n"
        f"tokens = MemoryPlanner(r, CacheConfig()).get_max_kv_cache_size_in_tokens()\n"
        f"print(int(tokens // {MAX_TOKENS}) * ({MAX_TOKENS} // CacheConfig().block_size))\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- hilum
def hilum_topology(path: Path, kv_blocks: int) -> None:
    """Four 8-GPU A100-80GB nodes, four TP2 Llama-2-70B instances each (16 instances, 4 NVLink domains)."""
    model = {
        "name": "llama-2-70b",  # meta-llama/Llama-2-70b-hf config.json (GQA: 8 KV heads)
        "num_layers": 80,
        "num_attention_heads": 64,
        "num_kv_heads": 8,
        "head_dim": 128,
        "hidden_size": 8192,
        "dtype": "float16",
        "block_size_tokens": 16,
        "num_params": 68976648192,
        "max_context_tokens": MAX_TOKENS,
    }
    domains = [
        {
            "id": f"node-{n}",
            "kind": "node",
            "gpu_type": "a100-80gb",
            "nodes": [{"id": f"node-{n}", "num_gpus": 8, "nic_gbit_per_s": 200}],
            "instances": [
                {
                    "id": f"node-{n}-i{k}",
                    "gpus": [2 * k, 2 * k + 1],
                    "tensor_parallel_size": 2,
                    "model": "llama-2-70b",
                    "kv_capacity_blocks": kv_blocks,
                }
                for k in range(INSTANCES_PER_NODE)
            ],
        }
        for n in range(NUM_NODES)
    ]
    doc = {
        "name": "4x8-a100-llama-2-70b-tp2",
        "models": [model],
        "gpu_types": [{"name": "a100-80gb", "memory_gib": 80, "hbm_gbyte_per_s": 2039, "nvlink_gbyte_per_s": 600}],
        "domains": domains,
        "fabric": {"oversubscription": 1.0, "racks": [{"id": "rack-0", "domains": [d["id"] for d in domains]}]},
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def hilum_command(policy: str, topology: Path, num_requests: int) -> list[str]:
    hilum = Path(sys.executable).with_name("hilum")
    return [
        str(hilum), "sim", "--topology", str(topology), "--trace", "azure-conv", "--rate-scale", "1",
        "--max-requests", str(num_requests), "--policy", policy, "--json",
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="first N Azure conversation requests")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of every run")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hilum-bench-vs-vidur")
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data"), help="the shared data folder")
    parser.add_argument("--policies", default=",".join(HILUM_POLICIES), help="hilum policies to run")
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in HILUM_POLICIES]
    if unknown or args.requests < 1 or args.repeats < 1:
        parser.error(f"--policies from {', '.join(HILUM_POLICIES)} (got {unknown}); --requests, --repeats >= 1")
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    python = vidur_python(work)
    cache = work / "vidur-cache"
    build_vidur_cache(cache, args.data)
    trace = work / f"azure-conv-{args.requests}.csv"
    written = write_vidur_trace(trace, args.data, args.requests)
    if written != args.requests:
        raise SystemExit(f"the Azure conversation trace has only {written} requests")
    kv_blocks = vidur_kv_blocks(python)
    topology = work / "hilum-topology.yaml"
    hilum_topology(topology, kv_blocks)
    vidur_env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    logs = Path(tempfile.mkdtemp(prefix="bench-vs-vidur-", dir=work))
    out = logs / "vidur-output"

    vidur_policies = sorted({VIDUR_POLICY_OF[p] for p in policies}, key=list(VIDUR_POLICY_OF.values()).index)
    print(f"vidur predictors (trained once, untimed; logs in {logs}) ...", file=sys.stderr, flush=True)
    run_measured(vidur_command(python, vidur_policies[0], cache, trace, out), vidur_env, logs / "vidur-warmup.log")

    hilum_compiled.install()  # what each `hilum sim` child finds (this process imports no simulator module)
    hilum_status = hilum_compiled.status()
    print(
        f"{args.requests} Azure conversation requests at the recorded rate, Llama-2-70B TP2 on A100-80GB, "
        f"{NUM_NODES * INSTANCES_PER_NODE} instances ({kv_blocks} KV blocks each); CPU = user + system of the "
        f"whole process; {args.repeats} alternating rounds; hilum: {hilum_status}",
        flush=True,
    )
    results: list[Measured] = []
    for rnd in range(args.repeats):
        order = [("vidur", p) for p in vidur_policies] + [("hilum", p) for p in policies]
        if rnd % 2:
            order.reverse()  # alternate which side goes first
        for simulator, policy in order:
            log = logs / f"{simulator}-{policy}-{rnd}.log"
            if simulator == "vidur":
                cmd, env = vidur_command(python, policy, cache, trace, out), vidur_env
            else:
                cmd, env = hilum_command(policy, topology, args.requests), dict(os.environ)
            cpu_s, wall_s = run_measured(cmd, env, log)
            results.append(Measured(simulator, policy, cpu_s, wall_s))
            print(
                f"  round {rnd + 1} {simulator:<5} {policy:<13} {cpu_s:8.2f} CPU s {wall_s:8.2f} wall s "
                f"{args.requests / cpu_s:8.0f} requests / CPU s",
                flush=True,
            )

    def median_rate(simulator: str, policy: str) -> float:
        cpu = [m.cpu_s for m in results if (m.simulator, m.policy) == (simulator, policy)]
        return float(statistics.median(args.requests / c for c in cpu))

    header = ("hilum policy", "hilum req/CPU s", "vidur policy", "vidur req/CPU s", "hilum / vidur")
    print("\n{:<14} {:>16} {:>13} {:>16} {:>14}".format(*header))
    for policy in policies:
        ours, theirs = median_rate("hilum", policy), median_rate("vidur", VIDUR_POLICY_OF[policy])
        print(f"{policy:<14} {ours:>16.0f} {VIDUR_POLICY_OF[policy]:>13} {theirs:>16.0f} {ours / theirs:>13.1f}x")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What CI can check of the cluster files without a container runtime, GPUs or Slurm.

- the Dockerfile (and the stand-in base's) passes hadolint and every shell script passes shellcheck (both from
  the Python package index, pinned in constraints.txt);
- docker/install.sh, the install step the Dockerfile runs, installs this package into
  the test environment and keeps its torch;
- the Slurm rank script's dry run, for the SLURM_* values of rank 13 of a 4-node job,
  prints the rendezvous and the exact command and checks it through Megatron's parser
  plus ours; a flag 2bw refuses makes it fail, naming the flag;
- the 10B MoE plan builds every stage on the meta device: its total parameter count
  equals the closed-form count of the configuration, and every stage fits in 80 GB
  (and not in 10 GB: the check can fail); it counts 2bw's held send buffers (the
  replay of megatron_async/planning/send_buffers.py for the configuration's p and m, x the tensor
  size from its flags) and the stash's clone during a save, and a GPU that holds the
  training peak but not the save's fails the check; the config sets
  --overlap-moe-expert-parallel-comm (its Slurm dry run passes the plugin's checks of it),
  and the plan counts the activations and sends of 2bw's combined-step lists, the deeper
  warm-up (control: more than the plain lists' p - s);
- the SmolLM-360M config (examples/smollm_360m): its plan's parameter count equals the
  closed form (361.82M, the published size), the tied copy counted once; the plan counts
  the tied-embedding link's buffers; its Slurm dry run passes our checks and Megatron's.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TIMEOUT_S = 300


def _shell_scripts():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in files.split() if f.endswith((".sh", ".sbatch"))]


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([str(BIN / "hadolint"), "Dockerfile", "docker/standin/Containerfile"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shell_scripts_pass_shellcheck():
    scripts = _shell_scripts()
    assert {"docker/install.sh", "examples/slurm/rank_command.sh", "examples/slurm/pretrain_2bw.sbatch",
            "examples/moe_10b/flags.sh", "examples/demo.sh"} <= set(scripts)
    proc = subprocess.run([str(BIN / "shellcheck"), "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_install_script_keeps_torch():
    import torch

    proc = subprocess.run(["bash", "docker/install.sh", "--editable"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"torch=={torch.__version__.split('+')[0]}" in proc.stdout, proc.stdout
    assert "plugin hooks in place" in proc.stdout


SLURM = {"SLURM_PROCID": "13", "SLURM_NTASKS": "32", "SLURM_LOCALID": "5", "SLURM_NTASKS_PER_NODE": "8(x4)",
         "SLURM_JOB_NODELIST": "gpu[003-006]", "SLURM_JOB_ID": "4242"}


def _dry_run(tmp_path, extra=""):
    env = dict(os.environ, **SLURM, CONFIG="examples/moe_10b/flags.sh", RUN_DIR=str(tmp_path), MOCK_DATA="1",
               PYTHON=sys.executable, DRY_RUN="1", EXTRA_ARGS=extra, PATH=f"{BIN}:{os.environ['PATH']}")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    return subprocess.run(["bash", "examples/slurm/rank_command.sh"], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=TIMEOUT_S)


def test_slurm_dry_run_prints_and_checks_the_rank_command(tmp_path):
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("rank 13 of 32 (local 5 of 8)") and "MASTER_ADDR=gpu003 MASTER_PORT=24242" in lines[0]
    command = lines[1]
    assert command.startswith(f"{sys.executable} /workspace/megatron-lm/pretrain_gpt.py ")
    for flag in ("--pipeline-schedule 2bw", "--optimizer muon", "--delay-correction ef", "--num-experts 64",
                 "--overlap-moe-expert-parallel-comm", f"--load {tmp_path}/checkpoints"):
        assert flag in command, flag
    assert lines[-1].startswith("ok: ") and "world size 32" in lines[-1]


def test_slurm_dry_run_fails_on_a_refused_flag(tmp_path):
    """The dry run exits 2 with the refusal's one line; here one of Megatron's own assertions,
    reported with its source line (the plugin's refusals go through the same check,
    megatron_async.check_flags: each of them in tests/test_refusals.py)."""
    proc = _dry_run(tmp_path, extra="--fp16")  # beside the config's --bf16
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(r"megatron-async: error: .*: assert .*\(megatron/training/arguments\.py:\d+\)", proc.stderr), \
        proc.stderr[-3000:]


def _closed_form_params():
    """examples/moe_10b/flags.sh counted by hand: untied embeddings, 24 layers of RMSNorm,
    QKV and output projection without biases, QK-norm over a 128-wide head, a router and
    64 SwiGLU experts of FFN 1024; the final RMSNorm."""
    h, layers, experts, ffn, head = 2048, 24, 64, 1024, 2048 // 16
    vocab = -(-(50304 + 1) // 128) * 128  # NullTokenizer's end of document, padded to 128
    per_layer = 2 * h + 4 * h * h + 2 * head + experts * h + experts * 3 * h * ffn
    return 2 * vocab * h + h + layers * per_layer


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    proc = subprocess.run(["bash", "examples/moe_10b/plan.sh", "--json", str(out)], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_moe_10b_plan_counts_the_configurations_parameters(moe_plan):
    plan, stdout = moe_plan
    assert plan["total_params"] == _closed_form_params()
    assert 10.0e9 < plan["total_params"] < 10.5e9 and 1.7e9 < plan["active_params"] < 1.9e9
    assert "10.28B parameters, 1.82B active per token" in stdout


def test_moe_10b_plan_fits_every_stage_in_80_gb(moe_plan, tmp_path):
    plan, _ = moe_plan
    assert plan["fits"] and len(plan["stages"]) == 4
    for stage in plan["stages"]:
        assert 0 < stage["total_gb"] <= 80 and stage["memory_gb"]["stash"] == stage["memory_gb"]["weights"]
    proc = subprocess.run(["bash", "examples/moe_10b/plan.sh", "--gpu-gb", "10"], cwd=REPO, capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=TIMEOUT_S)
    assert proc.returncode == 1 and "a stage exceeds 10 GB" in proc.stdout


def test_moe_10b_plan_counts_send_buffers_and_the_save(moe_plan):
    from megatron_async.planning.send_buffers import stage_peaks, stage_peaks_on_completion

    plan, stdout = moe_plan
    m = 512 // (1 * 8)  # flags.sh: global batch / (micro batch x data-parallel size)
    tensor = 4096 * 1 * 2048 * 2  # flags.sh: sequence x micro batch x hidden, bf16
    # --overlap-moe-expert-parallel-comm: the combined-step lists' sends
    peaks, timed_peaks = stage_peaks(4, m, paired=True), stage_peaks_on_completion(4, m, paired=True)
    for stage, peak, timed in zip(plan["stages"], peaks, timed_peaks, strict=True):
        assert stage["p2p"] == {**vars(peak), "tensor_bytes": tensor, "sends_on_completion": timed.sends}
        assert timed.sends < peak.sends  # NCCL's completed sends retire early; the budget keeps the bound
        assert stage["memory_gb"]["p2p_buffers"] == pytest.approx(peak.buffers * tensor / 2**30)
        assert stage["total_gb"] == pytest.approx(sum(stage["memory_gb"].values()))
        # a save streams the stash to the host (tests/test_stash_save.py): nothing more on the GPU
        assert stage["save_host_gb"] == stage["memory_gb"]["stash"] > 0 and stage["save_gpu_gb"] == 0
        assert stage["save_total_gb"] == pytest.approx(stage["total_gb"])
    sends = [stage["p2p"]["sends"] for stage in plan["stages"]]
    assert min(sends[1:3]) > max(sends[0], sends[3])  # middle stages hold both directions
    for column in ("p2p_buffers GB", "total GB (training peak)", "save_gpu GB", "save_host GB",
                   "total GB during a save"):
        assert column in stdout
    assert "stage 1 p2p_buffers: at most" in stdout


def test_moe_10b_plan_counts_the_deeper_warm_up(moe_plan):
    """With --overlap-moe-expert-parallel-comm the plan holds each stage's microbatches in flight
    as the validator's replay of 2bw's combined-step lists finds them, and prints them; control:
    more than the plain lists' p - s on every stage."""
    from megatron_async.schedules.gen_2bw_paired import two_bw_paired
    from megatron_async.schedules.validator import validate

    plan, stdout = moe_plan
    in_flight = [stage["in_flight"] for stage in plan["stages"]]
    assert in_flight == validate(two_bw_paired(4, 512 // 8, 2)).max_inflight_microbatches
    assert all(n > 4 - s for s, n in enumerate(in_flight)), in_flight
    assert (f"activations: {', '.join(map(str, in_flight))} microbatches in flight on stages 0..3 (2bw's deeper "
            "warm-up") in stdout


def test_moe_10b_plan_fits_a_gpu_that_holds_the_training_peak(moe_plan):
    """With no GPU copy at a save, the training peak is the budget (a device-side clone of
    the stash at the save would push it past a GPU of exactly this size)."""
    from megatron_async.planning.plan import fits_on_gpu

    plan, _ = moe_plan
    worst = max(stage["total_gb"] for stage in plan["stages"])
    assert fits_on_gpu(plan["stages"], worst)
    assert not fits_on_gpu(plan["stages"], worst * 0.99)  # control: a smaller GPU fails


def _smollm_closed_form_params():
    """examples/smollm_360m/flags.sh counted by hand: tied embeddings (counted once), 32
    layers of two RMSNorms, Q and output projections (h x h), K and V for 5 of 15 heads of
    64, a SwiGLU MLP of FFN 2560 (three h x f matrices), no biases; the final RMSNorm.
    SmolLM-360M's published size is 361.82M."""
    h, layers, ffn, heads, kv = 960, 32, 2560, 15, 5
    vocab = 49152  # NullTokenizer: 49,151 + end of document, a multiple of 128 already
    per_layer = 2 * h + 2 * h * h + 2 * h * (h // heads) * kv + 3 * h * ffn
    return vocab * h + h + layers * per_layer


@pytest.fixture(scope="module")
def smollm_plan(tmp_path_factory):
    """The plan and everything it printed, its warnings included (stderr into stdout)."""
    out = tmp_path_factory.mktemp("smollm") / "plan.json"
    proc = subprocess.run(["bash", "examples/smollm_360m/plan.sh", "--json", str(out)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_plan_prints_its_table_first(smollm_plan):
    """The notices Megatron and torch print on a machine without Transformer Engine, Apex or a
    CUDA runtime (about the fallbacks they take) are silenced by name: the plan's first line
    is its own."""
    _, printed = smollm_plan
    assert printed.startswith("model: "), printed[:3000]


def test_smollm_360m_plan_counts_the_published_shape(smollm_plan):
    """The config passes our flag checks and Megatron's (the plan parses it as the launcher
    does) and has SmolLM-360M's parameter count; the last stage's tied copy of the
    embeddings is counted once in the model's size and held in its memory."""
    plan, stdout = smollm_plan
    assert plan["total_params"] == _smollm_closed_form_params() == 361_821_120
    assert "0.36B parameters" in stdout and "PP=4 TP=1 EP=1 DP=2 on 8 GPUs" in stdout
    stages = plan["stages"]
    copy = 49152 * 960
    assert [s["tied_copy_params"] for s in stages] == [0, 0, 0, copy]
    assert sum(s["stage_params"] for s in stages) == plan["total_params"] + copy
    assert plan["fits"]


def test_smollm_360m_plan_counts_the_tied_link(smollm_plan, moe_plan):
    """The tied-embedding link's buffers (pipeline/tied_embeddings.py): a received fp32
    gradient on the first stage, a gradient copy and bf16 weights on the last; nothing
    between, and nothing for the untied 10B MoE (the count depends on the tie)."""
    plan, _ = smollm_plan
    shard = 49152 * 960
    link = [round(s["memory_gb"]["tied_link"] * 2**30) for s in plan["stages"]]
    assert link == [4 * shard, 0, 0, (4 + 2) * shard]
    assert all(s["memory_gb"]["tied_link"] == 0 for s in moe_plan[0]["stages"])


def test_smollm_360m_slurm_dry_run_checks_its_command(tmp_path):
    env = dict(os.environ, SLURM_PROCID="3", SLURM_NTASKS="8", SLURM_LOCALID="3", SLURM_NTASKS_PER_NODE="8",
               SLURM_JOB_NODELIST="gpu007", SLURM_JOB_ID="77", CONFIG="examples/smollm_360m/flags.sh",
               RUN_DIR=str(tmp_path), MOCK_DATA="1", PYTHON=sys.executable, DRY_RUN="1", EXTRA_ARGS="",
               PATH=f"{BIN}:{os.environ['PATH']}")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(["bash", "examples/slurm/rank_command.sh"], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    command = proc.stdout.splitlines()[1]
    assert "--pipeline-schedule 2bw" in command and "--untie-embeddings-and-output-weights" not in command
    assert proc.stdout.splitlines()[-1].startswith("ok: ") and "world size 8" in proc.stdout


def test_the_local_cluster_stops_only_what_it_started():
    """On a host that also runs a real Slurm, `local_cluster.sh stop` must not end its
    slurmstepds or munged: nothing is killed by a bare process name."""
    import re

    script = (REPO / "examples" / "slurm" / "local_cluster.sh").read_text()
    stop = script[script.index("stop() {"):script.index("\n}\n", script.index("stop() {"))]
    assert not re.search(r"pkill[^\n]*(slurmstepd|-x munged)", stop), stop
    assert re.search(r'pkill -9 -f "slurmd -f \$CONF"', stop)  # the daemons of this configuration only


def test_the_examples_run_the_planners_split(smollm_plan, moe_plan, tmp_path):
    """Both cluster configs carry the split the planner finds best for them, and the plan's
    memory is for that split (their dry runs above parse it as Megatron does). Control:
    SmolLM-360M at Megatron's even split is far from balanced, and the planner says so,
    naming the flag the config carries."""
    for plan, _ in (smollm_plan, moe_plan):
        found = plan["balance"]
        assert found["used"] == found["best"] == [s["layers"] for s in plan["stages"]], found
        assert found["predicted_gain"] == pytest.approx(1.0)
    assert smollm_plan[0]["balance"]["best_imbalance"] < 0.02  # 9, 9, 9, 5: within 2% of even
    out = tmp_path / "even.json"
    proc = subprocess.run(["bash", "examples/smollm_360m/plan.sh", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, PYTHON=sys.executable, EXTRA_ARGS="--decoder-last-pipeline-num-layers 8"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    even = json.loads(out.read_text())["balance"]
    assert even["used"] == [8, 8, 8, 8] and even["used_imbalance"] > 0.2 and even["predicted_gain"] > 1.2, even
    assert even["best"] == smollm_plan[0]["balance"]["best"]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("stage balance:"))
    assert line.endswith(" ".join(even["flags"])) and even["flags"][0] in (REPO / "examples/smollm_360m/flags.sh").read_text()

"""Every patch is declared: installing the tables (megatron_async/patch_table.py) changes
exactly the attributes they name and nothing else in torch.cuda, torch.distributed,
torch.autograd, torch.overrides, torch.Tensor, Megatron or the process (compared by identity, every
attribute of every loaded module there and of the classes they define), and restoring them
puts back the very objects that were there. In-process: the tables are installed and
restored here, as the launcher installs them before a plain 1F1B run. The collective audit
(tests/test_megatron_loop.py) proves what the delayed-run hooks do: under 2bw the MoE
metrics and the layer-wise optimizer's statistics stay inside a stage."""

import contextlib
import logging
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_async import cpu, launch, patch_table
from megatron_async.megatron_lm.adapter import hooks
from megatron_async.pipeline import delayed_run_patches, grad_stats
from megatron_async.pipeline.stale_global import StaleGlobalNorm
from megatron_async.pipeline.stop_agreement import StopAgreement

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("torch.cuda", "torch.distributed", "torch.autograd", "torch.overrides", "megatron")

# What a patch that is no attribute changes, as seen from outside (a new such patch needs its line)
OBSERVED = {
    "CudaToCpuMode (entered)": lambda: tuple(map(id, torch.overrides._get_current_function_mode_stack())),
    "environ[CUDA_DEVICE_MAX_CONNECTIONS]": lambda: os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    "getLogger(megatron.core.tensor_parallel.random).filters":
        lambda: tuple(logging.getLogger("megatron.core.tensor_parallel.random").filters),
    f"modules[{cpu.FUSED_WGRAD_MODULE}]": lambda: sys.modules.get(cpu.FUSED_WGRAD_MODULE),
}
# entries whose change depends on the machine (apex or TE present, the variable already set)
CONDITIONAL = {"environ[CUDA_DEVICE_MAX_CONNECTIONS]", "te_general_gemm", "state_dict", "load_state_dict",
               "_set_main_param_and_optimizer_states", "_grad_accum_fusion_available", "fused_weight_gradient_mlp_cuda",
               f"modules[{cpu.FUSED_WGRAD_MODULE}]"}


def _owners() -> list:
    owners = [torch.Tensor]  # the emulation replaces one of its methods (record_stream)
    for name, module in list(sys.modules.items()):
        if module is None or not any(name == p or name.startswith(p + ".") for p in PREFIXES):
            continue
        owners.append(module)
        owners += [value for value in list(vars(module).values())
                   if isinstance(value, type) and value.__module__ == name]
    return owners


def _snapshot(owners) -> dict:
    state = {(id(owner), attr): value for owner in owners for attr, value in list(vars(owner).items())}
    state[(id(sys), "excepthook")] = sys.excepthook
    state.update({("observed", name): look() for name, look in OBSERVED.items()})
    state[("sys.modules", "keys")] = frozenset(sys.modules)
    return state


def _changed(before: dict, after: dict) -> set:
    return {key for key in before.keys() | after.keys()
            if key[0] != "sys.modules" and (key not in before or key not in after or before[key] is not after[key])
            and not (key[0] == "observed" and before.get(key) == after.get(key))}


def _declared(applied, objects=None) -> set:
    """The keys of `_snapshot` that the applied patches change."""
    keys = set()
    for patch, owners in patch_table.check(applied, objects):
        if patch.restore is not None:
            assert patch.name in OBSERVED, f"{patch.target}: a patch that is no attribute, not observed here"
            keys.add(("observed", patch.name))
        else:
            keys |= {(id(owner), patch.name) for owner in owners}
    return keys


def _all_tables() -> tuple:
    return hooks.HOOKS + hooks.PROCESS + cpu.tables()


@contextlib.contextmanager
def _nothing_installed():
    """Whatever this process installed before (another test), taken off for the test and put back."""
    had_hooks, had_cpu = bool(hooks._INSTALLED), cpu.is_active()
    hooks.uninstall()
    cpu.deactivate()
    for table in (_all_tables(), delayed_run_patches.DELAYED_RUN_PATCHES):  # import every target first
        patch_table.check([p for p in table if not p.module.startswith("<")])
    try:
        yield
    finally:
        hooks.uninstall()
        cpu.deactivate()
        if had_cpu:
            cpu.activate()
        if had_hooks:
            hooks.install()


def test_the_tables_change_exactly_what_they_declare_and_restore_it():
    with _nothing_installed():
        owners = _owners()
        before = _snapshot(owners)
        assert cpu.activate()
        hooks.install()
        applied = [patch for patch, _owner, _undo in cpu._INSTALLED + hooks._INSTALLED]
        after = _snapshot(owners)
        assert _changed(before, after) == _declared(applied)
        skipped = {p.name for p in _all_tables() if p.target not in {a.target for a in applied}}
        assert skipped <= CONDITIONAL, skipped  # everything else in a table changed
        assert torch.overrides._get_current_function_mode_stack()  # the emulation's mode, entered
        hooks.uninstall()
        cpu.deactivate()
        assert not _changed(before, _snapshot(owners)), "restore put back other objects"
        assert not torch.overrides._get_current_function_mode_stack()  # and left it


def test_a_plain_1f1b_run_through_the_launcher_changes_what_its_scopes_say():
    """The launcher installs the Megatron hooks of every scope (a hook outside its scope calls
    Megatron's function unchanged), and the CPU tables where there is no CUDA; a delayed run's
    optimizer patches are not among them."""
    with _nothing_installed():
        owners = _owners()
        before = _snapshot(owners)
        on_cpu = launch.prepare()
        changed = _changed(before, _snapshot(owners))
        expected = {p.target for p in hooks.HOOKS + hooks.PROCESS}
        expected |= {p.target for p in cpu.tables() if on_cpu and p.name not in CONDITIONAL}
        applied = [patch for patch, _owner, _undo in hooks._INSTALLED + cpu._INSTALLED]
        possible = expected | ({p.target for p in cpu.tables()} if on_cpu else set())
        assert expected <= {p.target for p in applied} <= possible
        assert changed == _declared(applied)
        assert {p.scope for p in applied} == ({patch_table.Scope.EVERY_RUN, patch_table.Scope.DELAYED}
                                              | ({patch_table.Scope.CPU} if on_cpu else set()))
        optimizer = _declared([p for p in delayed_run_patches.DELAYED_RUN_PATCHES if not p.module.startswith("<")])
        assert optimizer and not optimizer & changed


def test_the_delayed_run_patches_last_as_long_as_their_run_needs_them():
    """The stale global norm replaces Megatron's norm function for one step only; the stage
    groups and the layer-wise optimizer's class are restored by what their installs return,
    Megatron's --exit-duration-in-mins when the stop agreement settles."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    with _nothing_installed():
        owners = _owners()
        before = _snapshot(owners)
        with StaleGlobalNorm(pipeline_group=None).step():
            inside = _snapshot(owners)
        assert _changed(before, inside) == _declared([delayed_run_patches.STALE_GLOBAL_NORM])
        assert not _changed(before, _snapshot(owners))

        installed = grad_stats.clip_like_pipeline_stages([], num_layers=4, num_stages=3)
        assert mcore_optimizer.SEPARATE_GRAD_NORM_GROUPS[-2:] == ("pipeline-stage-1", "pipeline-stage-2")
        assert _changed(before, _snapshot(owners)) == _declared([delayed_run_patches.STAGE_NORM_GROUPS])
        patch_table.restore(installed)
        assert not _changed(before, _snapshot(owners))

        class Optimizer:  # stands for Megatron's layer-wise optimizer: only its class changes
            pass

        optimizer, installed = Optimizer(), []
        patch_table.install((delayed_run_patches.STAGE_LOCAL_STATISTICS,), installed, {"<optimizer>": optimizer})
        assert type(optimizer).__bases__ == (Optimizer,) and isinstance(optimizer, Optimizer)
        assert not _changed(before, _snapshot(owners))
        patch_table.restore(installed)
        assert type(optimizer) is Optimizer

        args = SimpleNamespace(exit_duration_in_mins=5.0, exit_signal_handler=False)
        agreement = StopAgreement(group=None, device=torch.device("cpu"))
        agreement.take_over(args)
        assert args.exit_duration_in_mins is None and agreement.duration_mins == 5.0
        assert not _changed(before, _snapshot(owners))
        agreement.settle()
        assert args.exit_duration_in_mins == 5.0


# a call of each hook that acts only in delayed runs or on the CPU, as Megatron makes it
OUT_OF_SCOPE_CALLS = {
    "get_rng_state": ("torch_dist", None, None), "save": ({}, "/nowhere/iter_0000001"),
    "get_checkpoint_tracker_filename": ("/nowhere",), "logical_and_across_model_parallel_group": (True,),
    "reduce_max_stat_across_model_parallel_group": (1.5,), "_allreduce_word_embedding_grads": ("model", "config"),
    "checkpoint_and_decide_exit": ("model", "optimizer", "scheduler", 7, 1e12, {}, "iterator"),
    "signals_received": ("handler",), "_sync_metrics": ("tracker", ["load_balancing_loss"], "groups"),
    "build_train_valid_test_data_iterators": ("provider",), "initialize_megatron": (), "set_jit_fusion_options": (),
    # Megatron's 1F1B with the flag: its own config, which asks for virtual stages
    "core_transformer_config_from_args": (SimpleNamespace(pipeline_schedule="1f1b",
                                                          overlap_moe_expert_parallel_comm=True),),
}


def test_outside_their_scope_the_hooks_call_megatrons_function_unchanged(monkeypatch):
    """A 1F1B run on a GPU: every delayed-only and CPU-only hook hands Megatron's function the
    caller's arguments and returns its answer (for the exit decision: the same yes or no)."""
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(pipeline_schedule="1f1b", simulated_delay=0))
    with _nothing_installed():
        scoped = [h for h in hooks.HOOKS if h.scope is not patch_table.Scope.EVERY_RUN]
        assert {h.name for h in scoped} == set(OUT_OF_SCOPE_CALLS)
        for hook in scoped:
            for answer in (False, True, object()):
                calls = []

                def megatron(*args, **kwargs):
                    calls.append(list(args) + [v for v in kwargs.values() if v is not None])
                    return answer

                result = hook.wrap(megatron)(*OUT_OF_SCOPE_CALLS[hook.name])
                assert calls == [list(OUT_OF_SCOPE_CALLS[hook.name])], hook.name
                assert result is answer or hook.name == "checkpoint_and_decide_exit" and result is bool(answer)


def test_a_missing_target_changes_nothing():
    """The installer checks every target before it changes any (a control for the comparison:
    a table that names a missing attribute is refused whole)."""
    with _nothing_installed():
        owners = _owners()
        before = _snapshot(owners)
        missing = patch_table.Patch("torch.cuda", "no_such_function", "nowhere", lambda f: f,
                                    patch_table.Scope.CPU)
        installed = []
        try:
            patch_table.install(cpu.tables()[:3] + (missing,), installed)
        except patch_table.MissingTargetError as err:
            assert "torch.cuda.no_such_function" in str(err)
        else:
            raise AssertionError("a missing target was installed")
        assert not installed and not _changed(before, _snapshot(owners))
        # and the comparison sees a change nobody declared
        torch.cuda.synchronize, original = (lambda device=None: None), torch.cuda.synchronize
        try:
            assert _changed(before, _snapshot(owners)) == {(id(torch.cuda), "synchronize")}
        finally:
            torch.cuda.synchronize = original


DOC = ROOT / "docs" / "patches_table.md"
BEGIN, END = "<!-- generated from the tables: python -m tests.test_hook_scope -->", "<!-- end of the tables -->"


def _markdown() -> str:
    sections = [("Megatron hooks (megatron_lm/adapter/hooks.py `HOOKS`, `PROCESS`)", hooks.HOOKS + hooks.PROCESS),
                ("CUDA emulation (cpu.py `tables()`, without the NCCL part)",
                 tuple(p for p in cpu.tables() if p not in cpu._tables()[1])),
                ("NCCL emulation (cpu_nccl.py `patches()`)", cpu._tables()[1]),
                ("Patches a delayed run installs for its length (pipeline/delayed_run_patches.py)",
                 delayed_run_patches.DELAYED_RUN_PATCHES)]
    lines = [BEGIN]
    for title, table in sections:
        lines += ["", f"### {title}", "", "| target | scope | called at, and why | restore |", "| --- | --- | --- | --- |"]
        for patch, (target, scope, why) in zip(table, patch_table.rows(table)):
            undo = "the original put back" if patch.restore is None else f"`{patch.restore.__name__}`"
            lines.append(f"| `{target}` | {scope} | {why.replace('|', '/')} | {undo} |")
    return "\n".join(lines + ["", END])


def test_the_documented_tables_are_the_code_tables():
    text = DOC.read_text()
    assert text[text.index(BEGIN):text.index(END) + len(END)] == _markdown(), (
        "docs/patches_table.md differs from the tables: python -m tests.test_hook_scope")
    assert "(patches_table.md)" in (ROOT / "docs" / "README.md").read_text()


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*" + re.escape(END), lambda _m: _markdown(), text, flags=re.S))

"""README's "train on past its end" is what Megatron and the refusal do.

README's "Train on your own data" says how to resume its command with a larger
`--train-iters`: the flag to add, the learning rate the next iteration trains at, and
what the other flag keeps. Here Megatron's own scheduler (`get_optimizer_param_scheduler`,
from the flags of README's command as Megatron's parser reads them) saves at the first
run's end and loads into the longer run: without a flag the plugin's refusal must name
README's flags (the one to add first), with README's flag the learning rate must be
README's, and with the other `--min-lr` must hold. The end-to-end refusal and exit code
are tests/test_checkpoint_guard.py's.
"""

import argparse
import inspect
import re
import shlex
import types
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _section() -> str:
    return README.read_text().split("\n## Train on your own data\n", 1)[1].split("\n## ", 1)[0]


def readme_command() -> list[str]:
    """The flags of the section's training command."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", _section(), re.S) if "megatron-async-pretrain" in b)
    return shlex.split(block.replace("\\\n", " "))


def readme_resume() -> dict:
    """What the section's paragraph on training past the end says."""
    text = " ".join(_section().split())
    match = re.search(r"raise `--train-iters` \(say to (\d+)\) and add `(--[\w-]+)`.*?iteration (\d+) trains at "
                      r"([\d.e-]+), where the first run had come down to `--min-lr` ([\d.e-]+)\. `(--[\w-]+)` keeps "
                      r"the checkpoint's schedule instead, and with it `--min-lr` to the end", text)
    assert match, "README's paragraph on training past the end changed: update this test with it"
    iters, add, iteration, lr, min_lr, keep = match.groups()
    return {"iters": int(iters), "add": add, "iteration": int(iteration), "lr": lr, "min_lr": min_lr, "keep": keep}


@pytest.fixture
def scheduler(monkeypatch):
    """Megatron's scheduler for a command line, with the plugin's hook on its checkpoint check."""
    import megatron.training
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training import arguments, training

    from megatron_async.megatron_lm.adapter import hooks

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    original = inspect.unwrap(OptimizerParamScheduler._check_and_set)
    monkeypatch.setattr(OptimizerParamScheduler, "_check_and_set", hooks._check_scheduler_value(original))

    def build(argv):
        args, _ = parser.parse_known_args(argv)
        args.start_weight_decay = args.end_weight_decay = args.weight_decay  # as Megatron's validate_args
        monkeypatch.setattr(training, "get_args", lambda: args)
        monkeypatch.setattr(megatron.training, "get_args", lambda: args)
        optimizer = types.SimpleNamespace(param_groups=[{"default_config": True}])
        return training.get_optimizer_param_scheduler(optimizer), optimizer.param_groups[0], args

    return build


def _with_iters(argv: list[str], iters: int) -> list[str]:
    i = argv.index("--train-iters")
    return argv[:i + 1] + [str(iters)] + argv[i + 2:]


def test_readme_names_the_flag_the_refusal_names_and_the_rate_it_gives(scheduler):
    from megatron_async.megatron_lm.checkpoint.side_files import CheckpointStateError

    said = readme_resume()
    first_argv = readme_command()
    first, group, args = scheduler(first_argv)
    first.step(args.train_iters * args.global_batch_size)  # Megatron steps by samples, once per iteration
    assert said["iteration"] == args.train_iters + 1
    assert group["lr"] == float(said["min_lr"]) == args.min_lr
    saved = first.state_dict()
    longer = _with_iters(first_argv, said["iters"])

    plain, _, _ = scheduler(longer)
    with pytest.raises(CheckpointStateError) as refusal:
        plain.load_state_dict(saved)
    named = re.search(r"pass (--[\w-]+) to use this run's values, or (--[\w-]+) to keep the checkpoint's",
                      str(refusal.value))
    assert named and named.groups() == (said["add"], said["keep"]), str(refusal.value)

    added, group, _ = scheduler(longer + [said["add"]])
    added.load_state_dict(saved)
    assert float(f"{group['lr']:.2g}") == float(said["lr"])  # to the digits README gives

    kept, group, args = scheduler(longer + [said["keep"]])
    kept.load_state_dict(saved)
    lrs = [group["lr"]]
    for _ in range(said["iters"] - said["iteration"]):
        kept.step(args.global_batch_size)
        lrs.append(group["lr"])
    assert set(lrs) == {args.min_lr}

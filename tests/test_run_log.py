"""--metrics-json across runs: a fresh run replaces the file, a resumed run continues it."""

import json

from megatron_async.training.metrics import RunLog


def _write(path, iterations):
    with open(path, "w", encoding="utf-8") as f:
        for it in iterations:
            f.write(json.dumps({"iteration": it, "lm_loss": 10.0 - it}) + "\n")
            if it % 5 == 0:
                f.write(json.dumps({"iteration": it, "val_loss": 11.0 - it}) + "\n")
        f.write('{"iteration": 99, "lm_lo')  # cut short by a crash


def _iterations(path, key):
    with open(path, encoding="utf-8") as f:
        return [r["iteration"] for r in map(json.loads, f) if key in r]


def test_resumed_run_keeps_records_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    _write(path, range(1, 16))  # a run that checkpointed at 10 and crashed after 15
    log = RunLog(enabled=True, total_iters=20, tokens_per_iter=1, metrics_path=str(path))
    log.open_metrics(resumed_from=10)
    for it in range(11, 13):
        log.iteration(it, lm_loss=1.0, lr=0.1, grad_norm=1.0, seconds=0.1)
    log.close()
    assert _iterations(path, "lm_loss") == list(range(1, 13))
    assert _iterations(path, "val_loss") == [5, 10]
    assert [it for it, _ in log.train] == list(range(1, 13))  # the plot covers the whole run
    assert [it for it, _ in log.valid] == [5, 10]


def test_fresh_run_replaces_the_file(tmp_path):
    path = tmp_path / "m.jsonl"
    _write(path, range(1, 16))
    log = RunLog(enabled=True, total_iters=2, tokens_per_iter=1, metrics_path=str(path))
    log.open_metrics(resumed_from=0)
    log.iteration(1, lm_loss=1.0, lr=0.1, grad_norm=1.0, seconds=0.1)
    log.close()
    assert _iterations(path, "lm_loss") == [1]

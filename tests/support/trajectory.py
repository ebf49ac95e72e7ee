"""One comparison for every "this layout trains like that reference" test.

A multi-rank run returns, per rank, the losses it saw (the last stage's are real,
the others None) and the parameters it owns, by name. It matches a one-process
reference when the losses agree, every parameter agrees, and together the ranks
cover every reference parameter (a test that compared nothing must not pass).
"""

from __future__ import annotations

import torch


def assert_same_trajectory(ref: dict, results: list[dict], rtol: float, atol: float,
                           loss_rtol: float | None = None, exact: bool = False) -> None:
    """Losses within `loss_rtol` (default `rtol`), parameters within `rtol`/`atol`;
    `exact` asks for bitwise equality instead."""
    losses = [r["losses"] for r in results if r["losses"][0] is not None]
    assert losses, "no rank reported losses"
    if exact:
        assert losses[0] == ref["losses"], f"losses {losses[0]} differ from the reference's {ref['losses']}"
    else:
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref["losses"]),
                                   rtol=loss_rtol or rtol, atol=0.0)
    seen = set()
    for r in results:
        for name, value in r["params"].items():
            if exact:
                assert torch.equal(value, ref["params"][name]), f"rank {r['rank']} {name} differs"
            else:
                torch.testing.assert_close(value, ref["params"][name], rtol=rtol, atol=atol,
                                           msg=lambda m: f"rank {r['rank']} {name}: {m}")
            seen.add(name)
    assert seen == set(ref["params"]), "some reference parameters were not compared"

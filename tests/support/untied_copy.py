"""2bw with tied embeddings but the first-to-last link turned off: the negative control.

    torchrun ... -m tests.support.untied_copy --gpt ARGS...

Runs `megatron_async.launch` with every transfer of pipeline/tied_embeddings.py a
no-op, so the last stage trains its own copy of the output weight from its own
gradient, as an untied model would (from equal initial weights). An equivalence
test that cannot tell this run from the twin cannot see the link either.
"""

from __future__ import annotations

import sys


def main() -> int:
    from megatron_async import launch
    from megatron_async.pipeline.tied_embeddings import TiedEmbeddings

    for name in ("post_grad_recv", "exchange_grads", "before_step", "after_step", "install", "drain"):
        setattr(TiedEmbeddings, name, lambda self: None)
    return launch.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
